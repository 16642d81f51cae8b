"""The planner's prediction for the run being started, logged beside the run's own figures."""

from titanlite.log import logger
from titanlite.plan.fake_world import state_bytes
from titanlite.plan.job import JobPlan, predict


def predict_on_gpu(run) -> JobPlan | None:
    """The planner's memory and tps for build.py's `run`, logged at start, on CUDA only: the activation
    tally of a CPU debug run would cost it about a second of start-up for a figure nobody needs there."""
    if run.device.type != "cuda":
        return None
    cfg, spec, args, dims, model = run.cfg, run.spec, run.args, run.dims, run.model
    pp_rank = dims.mesh["pp"].get_local_rank() if dims.pp_enabled else 0
    state = state_bytes(model, cfg.optimizer.name)
    if run.objective.reference is not None:  # DPO's frozen copy
        state["reference"] = state_bytes(run.objective.reference, cfg.optimizer.name)["params"]
    planned = predict(cfg, spec, args, dims, {pp_rank: state})
    logger.info(
        f"plan on {cfg.plan.gpu}: predicted peak memory {planned.memory.peak / 2**30:.2f}GiB "
        f"({100 * planned.memory.share:.0f}% of the GPU with margin), {planned.speed.tps:,.0f} tps per GPU"
    )
    return planned
