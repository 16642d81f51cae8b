"""TensorBoard: one run per job across resumes, and what the run was, written at its start.

The run folder <dump_folder>/<metrics.save_tb_folder>/<job name>-<start time> is named once per
job: a run that resumes from a checkpoint continues in the newest run folder there, with
purge_step = resumed step + 1, so TensorBoard drops the events past the resumed step (the steps
a kill -9 or a rewind via checkpoint.load_step abandoned) and the job draws one unbroken line.
With metrics.save_for_all_ranks each rank writes its own run, <run folder>/rank<N>.

At start, rank 0's run receives the resolved config as text, the hyper-parameters (HPARAMS tab,
with the final loss, tps and MFU as metrics) and a custom-scalars layout (CUSTOM SCALARS tab,
Dashboard). Scalar tags are grouped by their first path part, which TensorBoard lays out as sections.
"""

import re
import time
from pathlib import Path

import torch.distributed as dist

from titanlite.config import to_toml
from titanlite.config_sections import JobConfig
from titanlite.log import logger
from titanlite.metrics.observers import observe

# The charts of the CUSTOM SCALARS tab; each lists the regular expressions of the tags it draws. The lr has a chart
# of its own: beside grad_norm (about 1) a peak of 1e-3 draws as a flat 0.
CHARTS = {
    "loss: train and validation": ["Multiline", [r"^loss/(train|validation)$"]],
    "tokens per second per device": ["Multiline", [r"^throughput/tps$"]],
    "MFU (%)": ["Multiline", [r"^throughput/mfu$"]],  # where the device's peak is known (titanlite_charts)
    "memory against the device's capacity (GiB)": ["Multiline", [r"^memory/(reserved|capacity)_gib$"]],
    "learning rate": ["Multiline", [r"^optim/lr$"]],
    "grad_norm (before clipping)": ["Multiline", [r"^optim/grad_norm$"]],
    "checkpoint: save time and training lost (s)": ["Multiline", [r"^checkpoint/"]],
}
# The charts of a tag group that only some runs write (an objective's, or [eval]'s per task), by its first path
# part: added to the layout when the group's first tag is written, so a run shows exactly the charts it has data for.
GROUP_CHARTS = {
    "dpo": ("DPO", {"DPO: reward accuracy": [r"^dpo/reward_accuracy$"],
                    "DPO: chosen and rejected rewards, margin": [r"^dpo/(chosen_reward|rejected_reward|margin)$"]}),
    "rl": ("RL", {"RL": [r"^rl/"]}),
}
# The HPARAMS tab's metrics: the last value of these tags in each run.
HPARAM_METRICS = ("loss/train", "throughput/tps", "throughput/mfu")
_START_TIME = re.compile(r"-\d{8}-\d{6}$")


def new_run_name(cfg: JobConfig) -> str:
    """<job.description, or the dump folder's name>-<start time>, safe as a folder name."""
    name = cfg.job.description or Path(cfg.job.dump_folder).resolve().name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:60] or "run"
    return f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"


def job_run_folder(cfg: JobConfig, resumed_step: int) -> Path:
    """The newest run folder when resuming (the job's own), a new one otherwise."""
    tb = Path(cfg.job.dump_folder) / cfg.metrics.save_tb_folder
    runs = [p for p in tb.glob("*") if p.is_dir() and _START_TIME.search(p.name)] if tb.is_dir() else []
    if resumed_step and runs:
        return max(runs, key=lambda p: _START_TIME.search(p.name).group())
    return tb / new_run_name(cfg)


def run_folder(cfg: JobConfig, rank: int, resumed_step: int) -> Path | None:
    """This rank's TensorBoard folder, None where it writes nothing. Every rank calls it, outside the
    observers: under save_for_all_ranks rank 0 names the run and broadcasts the name, so a failure naming
    it turns TensorBoard off on every rank alike and no rank is left waiting in the broadcast."""
    if not cfg.metrics.enable_tensorboard:
        return None
    folder = [observe("TensorBoard", job_run_folder, cfg, resumed_step) if rank == 0 else None]
    if cfg.metrics.save_for_all_ranks:  # rank 0 names the run, so every rank writes into the same one
        dist.broadcast_object_list(folder, src=0)
        return None if folder[0] is None else folder[0] / f"rank{rank}"
    return folder[0]


def open_writer(folder: Path, rank: int, resumed_step: int):
    """The SummaryWriter of this rank's folder (run_folder), purging past resumed_step."""
    from torch.utils.tensorboard import SummaryWriter

    resumed = f", continuing after step {resumed_step}" if resumed_step else ""
    if rank == 0:
        logger.info(f"TensorBoard run {folder}{resumed}")
    return SummaryWriter(str(folder), purge_step=resumed_step + 1 if resumed_step else None)


def titanlite_charts(peak_known: bool, device_type: str) -> dict:
    """CHARTS; where the device has no known peak, the MFU chart's place draws the achieved TFLOP/s under a title
    that says why, rather than an empty chart."""
    if peak_known:
        return dict(CHARTS)
    no_mfu = (f"no MFU: {device_type} has no known peak FLOP/s (set metrics.peak_tflops); achieved TFLOP/s per device",
              ["Multiline", [r"^throughput/tflops$"]])
    return dict(no_mfu if title == "MFU (%)" else (title, chart) for title, chart in CHARTS.items())


def group_charts(tag: str) -> tuple[str, dict] | None:
    """(the category, its charts) that draw `tag`'s group, or None for a tag of the fixed charts: eval/<task>/...
    has a chart per task."""
    head, _, rest = tag.partition("/")
    if head == "eval":
        task = rest.split("/")[0]
        return "eval", {f"eval: {task}": ["Multiline", [rf"^eval/{re.escape(task)}/"]]}
    if head in GROUP_CHARTS:
        category, charts = GROUP_CHARTS[head]
        return category, {title: ["Multiline", patterns] for title, patterns in charts.items()}
    return None


class Dashboard:
    """The CUSTOM SCALARS layout of rank 0's run: the fixed charts from the start, and each group's (GROUP_CHARTS,
    eval) from its first tag on. TensorBoard draws the last layout a run wrote, so the layout is written again
    whenever a chart joins it."""

    def __init__(self, writer, peak_known: bool, device_type: str):
        self.writer = writer
        self.layout = {"titanlite": titanlite_charts(peak_known, device_type)}
        self.writer.add_custom_scalars(self.layout)

    def saw(self, tags) -> None:
        added = False
        for tag in tags:
            found = group_charts(tag)
            if found and not found[1].keys() <= self.layout.get(found[0], {}).keys():
                self.layout.setdefault(found[0], {}).update(found[1])
                added = True
        if added:
            self.writer.add_custom_scalars(self.layout)


def describe_run(writer, cfg: JobConfig, hparams: dict, step: int, peak_known: bool, device_type: str) -> Dashboard:
    """The config as text, the hyper-parameters and the custom-scalars layout (rank 0's run), at
    the step the run starts from: a resumed run's config shows beside the first one's."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    # Indented four spaces: the text plugin renders Markdown, and this keeps the TOML verbatim.
    writer.add_text("config", "\n".join("    " + line for line in to_toml(cfg).splitlines()), step)
    for summary in hparams_summaries(hparams, dict.fromkeys(HPARAM_METRICS, 0.0)):
        writer.file_writer.add_summary(summary, step)
    return Dashboard(writer, peak_known, device_type)


def hyperparameters(cfg: JobConfig, world_size: int, mesh: str, batch: int, speed: dict[str, str]) -> dict:
    """What the HPARAMS tab compares runs by; batch is sequences per optimizer step over all ranks."""
    return {
        "family": cfg.model.name, "flavor": cfg.model.flavor, "world_size": world_size, "mesh": mesh, **speed,
        "batch": batch, "seq_len": cfg.training.seq_len, "lr": cfg.optimizer.lr,
        "dataset": cfg.training.dataset_path or cfg.training.dataset,
    }
