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

from dataclasses import dataclass
from pathlib import Path

from titanlite.data.documents import seeded_rng
from titanlite.data.local_files import find_data_files, read_errors, read_records
from titanlite.errors import UserError
from titanlite.inference.prompts import PromptRecord, checked_record, render_prompts


@dataclass(frozen=True)
class PromptItem:
    index: int  # the prompt's place in the global stream (over all epochs)
    prompt: object  # as the record holds it: text or messages (what the reward functions get as `prompts`)
    ids: list[int]  # rendered, what the model is given
    fields: dict  # the record's other fields


class PromptSet:
    """The checked, rendered prompts of local records at `dataset_path`."""

    def __init__(self, dataset_path: str, tokenizer, chat_template: str, key: str = "training.dataset_path"):
        if not dataset_path:
            raise UserError(f"training.dataset_format prompts reads local records; set {key} to your jsonl/json/parquet prompts")
        loader, files = find_data_files(Path(dataset_path), key)
        if loader not in ("json", "parquet"):
            raise UserError(f"{key} {dataset_path} holds {loader} files; training.dataset_format prompts reads jsonl/json/parquet records")
        try:
            records = read_records(loader, files)
        except read_errors() as error:
            raise UserError(f"{key} {dataset_path} could not be read as {loader} ({str(error).splitlines()[0]}); fix the files") from None
        if "prompt" not in records.column_names:
            raise UserError(f"{key} {dataset_path} has no field 'prompt' (its fields are {', '.join(records.column_names)}), "
                            "which training.dataset_format prompts reads; fix the data or the format")
        if not len(records):
            raise UserError(f"{key} {dataset_path} holds no records; add prompts")
        checked = [prompt_record(record["prompt"], f"{key} {dataset_path} record {number}")
                   for number, record in enumerate(records, start=1)]
        self.prompts = [record.value for record in checked]
        self.ids = [prompt.ids for prompt in render_prompts(checked, tokenizer, chat_template)]
        self.fields = [{name: value for name, value in record.items() if name != "prompt"} for record in records]

    def __len__(self) -> int:
        return len(self.prompts)


def prompt_record(value, where: str) -> PromptRecord:
    """A record's prompt as generation checks it: text, or a non-empty list of messages."""
    if isinstance(value, str):
        return checked_record({"prompt": value}, where)
    if isinstance(value, list):
        return checked_record({"messages": value}, where)
    raise UserError(f"{where}: \"prompt\" is neither text nor a list of messages; fix or remove it")


class PromptOrder:
    """This rank's prompts of each step, from the global stream; its state is the prompts all ranks consumed."""

    def __init__(self, prompts: PromptSet, per_step: int, dp_rank: int, dp_world: int, seed: int, identity: dict):
        if per_step % dp_world:
            raise UserError(f"a step's {per_step} prompts (training.global_batch_size / rl.num_generations) cannot be shared "
                            f"equally by {dp_world} data-parallel ranks; make the prompts per step a multiple of {dp_world}")
        self.prompts, self.per_step, self.dp_rank, self.dp_world, self.seed = prompts, per_step, dp_rank, dp_world, seed
        self.identity, self.consumed = identity, 0
        self.orders: dict[int, object] = {}

    def state_dict(self) -> dict:
        return {"identity": self.identity, "prompts_consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        if state["identity"] != self.identity:
            raise UserError(f"the checkpoint's data position belongs to {state['identity']} but this run reads {self.identity}; "
                            "resume with the same training.dataset_path, job.seed and rl.num_generations")
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
