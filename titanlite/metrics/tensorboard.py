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
    "step time (s)": ["Multiline", [r"^time/step_seconds$"]],
}
# The sections of tag groups that only some runs write (an objective's, [eval]'s per task), by the tag's first path
# part: a chart per tag, each quantity on an axis of its own (a reward in [0, 1] beside completion lengths in tokens
# and seconds draws flat), added to the layout when the tag is first written, so a run shows exactly the charts it
# has data for.
GROUP_SECTIONS = {"rl": "RL", "dpo": "DPO", "eval": "eval"}
# What a known tag measures, after the tag in its chart's title.
TAG_MEANINGS = {
    "rl/reward": "mean reward (the weighted sum of the reward functions)",
    "rl/reward_std": "mean std of the rewards within a group",
    "rl/frac_reward_zero_std": "share of groups whose rewards are all equal (every advantage 0)",
    "rl/completion_length": "mean completion length (tokens)",
    "rl/clip_ratio": "share of trained tokens whose ratio the clip held",
    "rl/entropy": "mean entropy of the policy per trained token (nats)",
    "rl/kl": "mean k3 KL to the reference per trained token",
    "rl/generate_seconds": "seconds generating the step's rollouts",
    "rl/score_seconds": "seconds scoring the step's rollouts",
    "dpo/reward_accuracy": "share of pairs whose chosen reward beats the rejected",
    "dpo/margin": "mean chosen minus rejected reward",
    "dpo/chosen_reward": "mean implicit reward of the chosen answers",
    "dpo/rejected_reward": "mean implicit reward of the rejected answers",
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
    no_mfu = (
        f"no MFU: {device_type} has no known peak FLOP/s (set metrics.peak_tflops); achieved TFLOP/s per device",
        ["Multiline", [r"^throughput/tflops$"]],
    )
    return dict(no_mfu if title == "MFU (%)" else (title, chart) for title, chart in CHARTS.items())


def group_chart(tag: str) -> tuple[str, str, list] | None:
    """(the section, the title, the chart that draws `tag` alone) for a tag of GROUP_SECTIONS, None for a tag of the
    fixed charts. A reward function's rl/reward/<name> and an eval metric eval/<task>/<metric> are titled by their
    parts."""
    head = tag.partition("/")[0]
    if head not in GROUP_SECTIONS:
        return None
    meaning = TAG_MEANINGS.get(tag)
    if meaning is None and tag.startswith("rl/reward/"):
        meaning = f"mean reward of the function {tag.removeprefix('rl/reward/')}"
    return GROUP_SECTIONS[head], tag if meaning is None else f"{tag}: {meaning}", ["Multiline", [f"^{re.escape(tag)}$"]]


def chart_place(tag: str) -> tuple[float, str]:
    """Where a tag's chart sits in its section: TAG_MEANINGS' order (the reward first), each reward function's after
    the reward, other tags after those, by name."""
    known = list(TAG_MEANINGS)
    if tag in TAG_MEANINGS:
        return known.index(tag), tag
    return (known.index("rl/reward") + 0.5 if tag.startswith("rl/reward/") else len(known)), tag


class Dashboard:
    """The CUSTOM SCALARS layout of rank 0's run: the fixed charts from the start, and a chart for each tag of
    GROUP_SECTIONS from its first value on. TensorBoard draws the last layout a run wrote, so the layout is written
    again whenever a chart joins it."""

    def __init__(self, writer, peak_known: bool, device_type: str):
        self.writer = writer
        self.layout = {"titanlite": titanlite_charts(peak_known, device_type)}
        self.charted: dict[str, tuple[str, str, list]] = {}  # tag -> its group_chart
        self.writer.add_custom_scalars(self.layout)

    def saw(self, tags) -> None:
        new = {tag: chart for tag in tags if tag not in self.charted and (chart := group_chart(tag)) is not None}
        if not new:
            return
        self.charted |= new
        for tag in sorted(self.charted, key=chart_place):
            section, title, chart = self.charted[tag]
            self.layout.setdefault(section, {}).pop(title, None)
            self.layout[section][title] = chart  # moved to the end: the section ends up in chart_place's order
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
        "family": cfg.model.name,
        "flavor": cfg.model.flavor,
        "world_size": world_size,
        "mesh": mesh,
        **speed,
        "batch": batch,
        "seq_len": cfg.training.seq_len,
        "lr": cfg.optimizer.lr,
        "dataset": cfg.training.dataset_path or cfg.training.dataset,
    }
