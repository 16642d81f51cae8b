"""Prompts for reinforcement learning (training.dataset_format prompts), in one global order at any scale.

A record is {"prompt": text or a list of {role, content} messages, ...any other fields}; the other fields (an
`answer`, `tests`, ...) reach the reward functions as keyword arguments, one value per completion, as TRL passes
them. A prompt is rendered as generation renders it (inference/prompts.py): text after the tokenizer's bos, messages
through the chat template with the generation prompt.

Epoch e visits the prompts in the order of a permutation drawn from (seed, e); the epochs follow one another.
Optimizer step s reads prompts [s P, (s + 1) P) of that stream, P = training.global_batch_size / rl.num_generations,
and data-parallel rank r of D takes the P / D from s P + r P / D: every layout reads the same prompts, and a
prompt's place in the stream (its global index) seeds its completions (rollout.py).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from titanlite.data.documents import seeded_rng
from titanlite.data.local_files import files_sha256, find_data_files, json_records, parquet_records
from titanlite.errors import UserError
from titanlite.inference.prompts import PromptRecord, checked_record, render_prompts


@dataclass(frozen=True)
class PromptItem:
    index: int  # the prompt's place in the global stream (over all epochs)
    prompt: object  # as the record holds it: text or messages (what the reward functions get as `prompts`)
    ids: list[int]  # rendered, what the model is given
    fields: dict  # the record's other fields


class PromptSet:
    """The checked, rendered prompts of local records at `dataset_path`, each field as the file holds it, and their
    identity: how many, and a checksum of the files (a resume on other prompts would read another order)."""

    def __init__(self, dataset_path: str, tokenizer, chat_template: str, key: str = "training.dataset_path"):
        if not dataset_path:
            raise UserError(
                f"training.dataset_format prompts reads local records; set {key} to your jsonl/json/parquet prompts"
            )
        root = Path(dataset_path)
        loader, files = find_data_files(root, key)
        if loader not in ("json", "parquet"):
            raise UserError(
                f"{key} {dataset_path} holds {loader} files; training.dataset_format prompts reads jsonl/json/parquet "
                "records"
            )
        records = json_records(files, key) if loader == "json" else parquet_records(files, key)
        if not records:
            raise UserError(f"{key} {dataset_path} holds no records; add prompts")
        checked = [prompt_record(record, f"{key} {where}") for where, record in records]
        self.key, self.path = key, dataset_path
        self.prompts = [record.value for record in checked]
        self.ids = [prompt.ids for prompt in render_prompts(checked, tokenizer, chat_template)]
        # every record gets every field (None where it has none), as a column of a table would
        names = list(dict.fromkeys(name for _, record in records for name in record if name != "prompt"))
        self.fields = [{name: record.get(name) for name in names} for _, record in records]
        self.identity = {"records": len(records), "sha256": files_sha256(root, files)}

    def __len__(self) -> int:
        return len(self.prompts)


def prompt_record(record, where: str) -> PromptRecord:
    """A record's prompt as generation checks it: text, or a non-empty list of messages."""
    if not isinstance(record, dict):
        raise UserError(
            f'{where} is {json.dumps(record)[:60]}, not a record {{"prompt": ..., other fields}}; fix or remove it'
        )
    if "prompt" not in record:
        raise UserError(
            f'{where} has no field "prompt" (its fields are {", ".join(record) or "none"}), which '
            "training.dataset_format prompts reads; fix the data or the format"
        )
    value = record["prompt"]
    if isinstance(value, str):
        return checked_record({"prompt": value}, where)
    if isinstance(value, list):
        return checked_record({"messages": value}, where)
    raise UserError(f'{where}: "prompt" is neither text nor a list of messages; fix or remove it')


class PromptOrder:
    """This rank's prompts of each step, from the global stream; its state is the prompts all ranks consumed."""

    def __init__(self, prompts: PromptSet, per_step: int, dp_rank: int, dp_world: int, seed: int, identity: dict):
        if per_step % dp_world:
            raise UserError(
                f"a step's {per_step} prompts (training.global_batch_size / rl.num_generations) cannot be shared "
                f"equally by {dp_world} data-parallel ranks; make the prompts per step a multiple of {dp_world}"
            )
        self.prompts, self.per_step, self.dp_rank, self.dp_world, self.seed = prompts, per_step, dp_rank, dp_world, seed
        self.identity, self.consumed = identity | prompts.identity, 0  # no layout: the order is the same on any
        self.orders: dict[int, object] = {}

    def state_dict(self) -> dict:
        return {"identity": self.identity, "prompts_consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        """The position of a checkpoint of the same prompts, saved on any number of data-parallel ranks."""
        # Older checkpoints named the data-parallel ranks (which the global order does not depend on) and held no
        # count or checksum of the prompts: what they hold is compared.
        saved = {key: value for key, value in state["identity"].items() if key != "dp_world"}
        ours = {key: value for key, value in self.identity.items() if key in saved}
        prompts = self.prompts
        if saved.get("prompts") == ours.get("prompts") and saved.get("sha256") != ours.get("sha256"):
            raise UserError(
                f"{prompts.key} {prompts.path} changed since the checkpoint was saved ({saved['records']} records "
                f"then, {len(prompts)} now, other contents): the run would resume on another order of prompts; "
                "resume with the prompts it was saved with, or start a new run in another job.dump_folder"
            )
        if saved != ours:
            raise UserError(
                f"the checkpoint's data position belongs to {saved} but this run reads {ours}; resume with the "
                "same training.dataset_path, job.seed and rl.num_generations"
            )
        self.consumed = state["prompts_consumed"]

    def item(self, g: int) -> PromptItem:
        epoch, within = divmod(g, len(self.prompts))
        if epoch not in self.orders:
            self.orders = {epoch: seeded_rng(self.seed, epoch).permutation(len(self.prompts))}
        i = int(self.orders[epoch][within])
        return PromptItem(g, self.prompts.prompts[i], self.prompts.ids[i], self.prompts.fields[i])

    def next_step(self) -> list[PromptItem]:
        """This rank's prompts of the next step; the count moves on by the whole step's."""
        share = self.per_step // self.dp_world
        first = self.consumed + self.dp_rank * share
        self.consumed += self.per_step
        return [self.item(g) for g in range(first, first + share)]
