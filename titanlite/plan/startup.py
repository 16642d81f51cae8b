"""The planner's prediction for the run being started, logged beside the run's own figures."""

from titanlite.config_sections import JobConfig
from titanlite.log import logger
from titanlite.parallel.dist import DistInfo
from titanlite.plan.fake_world import state_bytes
from titanlite.plan.job import JobPlan, predict


def predict_on_gpu(cfg: JobConfig, spec, args, dims, model, info: DistInfo) -> JobPlan | None:
    """The planner's memory and tps for this run, logged at start, on CUDA only: the activation tally
    of a CPU debug run would cost it about a second of start-up for a figure nobody needs there."""
    if info.device.type != "cuda":
        return None
    pp_rank = dims.mesh["pp"].get_local_rank() if dims.pp_enabled else 0
    planned = predict(cfg, spec, args, dims, {pp_rank: state_bytes(model, cfg.optimizer.name)})
    logger.info(f"plan on {cfg.plan.gpu}: predicted peak memory {planned.memory.peak / 2**30:.2f}GiB "
                f"({100 * planned.memory.share:.0f}% of the GPU with margin), {planned.speed.tps:,.0f} tps per GPU")
    return planned
