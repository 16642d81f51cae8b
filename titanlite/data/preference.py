"""Preference pairs for DPO (training.dataset_format preference), in one global order at any scale.

A record is TRL's preference form: conversational, {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
(the completions usually one assistant message each), or plain text, {"prompt": str, "chosen": str, "rejected": str},
which is read as one user turn answered by one assistant turn; one file holds one form (TRL reads the form of the
first record for all). Each completion is rendered after its prompt with the chat template, and its trained tokens
are those TRL's DPOTrainer scores: everything the completion adds to the prompt rendered with the generation prompt
(`Yes.<|im_end|>\n` after `...<|im_start|>assistant\n` in ChatML: the end of turn and the newline the template writes
after it), found as TRL finds it, where the tokens of the prompt alone and of the prompt with each completion first
differ. The prompt, its assistant turns included, is context, never trained.

Layout: pair g of the stream is two rows, chosen then rejected, each one whole sequence padded with eos to
seq_len + 1 tokens (labels IGNORED outside the completion). A pair is never packed with another: the DPO loss needs
each sequence's log-probability on its own, and one sequence per row gives it from the plain causal forward with
no document bookkeeping; the two rows of a pair sit in the same micro-batch, so the loss of every pair is computed
where both its halves are. Each micro-batch is then cut to its longest sequence rounded up to a multiple of
64 (packing.py's padded_width, at most seq_len), as TRL pads a batch to its longest: what is cut off is padding after
every row's
last trained token, which a causal forward never lets change a log-probability. Epoch e visits the pairs in the
order of a permutation drawn from (seed, e), and global_order.py deals pair g to the ranks as it deals window g:
any split of the global batch reads the same pairs.
training.local_batch_size counts pairs, so a micro-batch holds 2 x local_batch_size rows. The pair is the unit of
training.epochs too: E passes are round(E x pairs) pairs, and the steps they make are rounded up, as for chat data.
"""

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlite.data.chat import ChatRenderer, Conversations, chat_record, checked_message
from titanlite.data.chat_spans import literal_contents
from titanlite.data.documents import seeded_rng
from titanlite.data.global_order import GlobalOrderLoader
from titanlite.data.packing import padded_width, split_window
from titanlite.errors import UserError
from titanlite.log import logger
from titanlite.loss import IGNORED

HALVES = ("chosen", "rejected")
# The trained tokens as a store or a resume records them: what each completion adds to its prompt (tokenize_pair).
TRAIN_ON = "completion"


class Pair(NamedTuple):
    """One checked record: the prompt's messages, the chosen and the rejected completion's, and its form."""

    prompt: list[dict]
    completions: tuple[list[dict], list[dict]]  # chosen, rejected
    conversational: bool  # message lists, not plain text


def messages_of(value, field: str, number: int, where: str) -> list[dict]:
    """A conversational record's prompt or completion: a non-empty list of messages, each checked as SFT checks it."""
    if not isinstance(value, list) or not value:
        raise UserError(
            f"{where}: record {number} (counting from 1) has a {field} that is neither text nor a non-empty "
            "list of messages; fix or remove it"
        )
    messages = [checked_message(message, f"{where}: record {number} (counting from 1)") for message in value]
    if any("train" in message for message in messages):
        raise UserError(
            f"{where}: record {number} (counting from 1) has a {field} message with a train flag, which "
            "preference data does not read (every token of a completion trains, none of the prompt); remove it"
        )
    return messages


def preference_pair(record: dict, dataset_format: str, number: int, where: str) -> Pair:
    """The prompt and completions of one record, checked."""
    at = f"{where}: record {number} (counting from 1)"
    for field in ("prompt", *HALVES):
        if record[field] is None:
            raise UserError(f"{at} has no {field}; give every record a prompt, a chosen and a rejected completion")
    if all(isinstance(record[field], str) for field in ("prompt", *HALVES)):
        prompt = [{"role": "user", "content": record["prompt"]}]
        completions = tuple([{"role": "assistant", "content": record[half]}] for half in HALVES)
        return Pair(prompt, completions, conversational=False)
    if any(isinstance(record[field], str) for field in ("prompt", *HALVES)):
        raise UserError(
            f"{at} mixes text and message lists among prompt, chosen and rejected; use one form for all three"
        )
    completions = tuple(messages_of(record[half], half, number, where) for half in HALVES)
    for half, completion in zip(HALVES, completions):
        if not any(message["role"] == "assistant" for message in completion):
            raise UserError(
                f"{at} has a {half} completion without an assistant message, so nothing of it would be "
                "trained; fix or remove the record"
            )
    return Pair(messages_of(record["prompt"], "prompt", number, where), completions, conversational=True)


def check_one_form(pairs: list[Pair], where: str) -> None:
    """Every record plain text or every record message lists: TRL takes the first record's form for the whole file."""
    forms = [pair.conversational for pair in pairs]
    if len(set(forms)) > 1:
        number = forms.index(not forms[0]) + 1
        name = {True: "message lists", False: "plain text"}
        raise UserError(
            f"{where}: record {number} (counting from 1) is {name[forms[number - 1]]} where record 1 is "
            f"{name[forms[0]]}; write every record of the file in one form"
        )


def is_empty(completion: list[dict]) -> bool:
    return all(not message["content"].strip() and not message.get("tool_calls") for message in completion)


def check_pairs(pairs: list[Pair], encoded: list[tuple], where: str) -> None:
    """A pair whose chosen and rejected are the same sequence has a constant loss (ln 2 for sigmoid) and no gradient:
    a file of nothing else is refused, since nothing would train. Some such pairs, or one half empty in every pair
    (a field missing its answers, say), do train, though likely not as meant, so the log says so."""
    same = sum(chosen[0] == rejected[0] for chosen, rejected in encoded)
    if same == len(encoded):
        raise UserError(
            f"{where}: every pair's chosen and rejected completions are the same, so the DPO loss is constant "
            "with no gradient and nothing would train; give each pair a different rejected completion"
        )
    if same:
        logger.warning(
            f"{where}: {same:,} of {len(encoded):,} pairs have the same chosen and rejected completion; they "
            "add a constant to the loss and nothing to its gradient"
        )
    for index, half in enumerate(HALVES):
        if all(is_empty(pair.completions[index]) for pair in pairs):
            logger.warning(
                f"{where}: every {half} completion is empty, so DPO only teaches the model "
                f"{'to end its turn at once' if half == 'chosen' else 'not to end its turn at once'}; "
                f"check that the {half} field holds the answers"
            )


def rendered_ids(
    renderer: ChatRenderer, tokenizer, messages: list[dict], add_generation_prompt: bool = False
) -> list[int]:
    """The ids of the conversation rendered with the template (as chat.py tokenizes a rendering)."""
    text = renderer.render(messages, add_generation_prompt)
    return tokenizer.encode_with_offsets(text, literal_contents(text, messages, renderer.specials))[0]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tokenize_pair(renderer: ChatRenderer, tokenizer, pair: Pair) -> tuple[tuple[list[int], list[bool]], ...]:
    """(ids, trained flags) of the prompt followed by each completion. As TRL's DPOTrainer finds it, a completion
    starts where the ids of the prompt rendered alone with the generation prompt and of the prompt with the
    completion first differ (the earlier of the two halves), and runs to the end of the rendering."""
    prompt = rendered_ids(renderer, tokenizer, pair.prompt, add_generation_prompt=True)
    wholes = [rendered_ids(renderer, tokenizer, pair.prompt + completion) for completion in pair.completions]
    start = min(common_prefix(prompt, ids) for ids in wholes)
    return tuple((ids, [i >= start for i in range(len(ids))]) for ids in wholes)


class PreferencePairs(Dataset):
    """Pair g of the global stream as (inputs [2, seq_len], labels [2, seq_len]): chosen, then rejected."""

    unit = "pairs"  # what global_order.py's steps_for_epochs calls this data's windows in its log

    def __init__(self, pairs: list[tuple], seq_len: int, seed: int, pad_id: int, where: str):
        self.window_len, self.seed, self.pad_id = seq_len + 1, seed, pad_id
        truncated = sum(len(ids) > self.window_len for pair in pairs for ids, _ in pair)
        kept = [pair for pair in pairs if all(any(trained[1 : self.window_len]) for _, trained in pair)]
        if not kept:
            raise UserError(
                f"{where}: no pair has a trained token of both completions within training.seq_len + 1 = "
                f"{self.window_len} tokens; raise training.seq_len"
            )
        if truncated:
            logger.info(
                f"{where}: {truncated:,} of {2 * len(pairs):,} sequences are longer than training.seq_len + 1 = "
                f"{self.window_len} tokens and are truncated"
            )
        if len(kept) < len(pairs):
            logger.info(
                f"{where}: {len(pairs) - len(kept):,} pairs have a completion cut off before any trained token "
                "and are left out"
            )
        self.pairs = kept
        trained = sum(int(np.sum(flags[1 : self.window_len])) for pair in kept for _, flags in pair)
        logger.info(
            f"{where}: an epoch is {len(kept):,} preference pairs, {trained:,} trained tokens in their completions"
        )
        self.orders: dict[int, np.ndarray] = {}

    def windows_per_epoch(self) -> int:
        return len(self.pairs)

    def windows_in(self, epochs: float) -> int:
        """The pairs of the first `epochs` passes (a pair is this data's window: every epoch holds all of them), the
        fraction of the last pass rounded to whole pairs as chat data rounds it to whole windows."""
        whole = int(epochs)
        return whole * len(self.pairs) + round((epochs - whole) * len(self.pairs))

    def epochs_at(self, windows: int) -> float:
        """Passes over the pairs that the first `windows` pairs make."""
        return windows / len(self.pairs)

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self.orders:
            self.orders = {epoch: seeded_rng(self.seed, epoch).permutation(len(self.pairs))}
        return self.orders[epoch]

    def row(self, ids: list[int], trained: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        length = min(len(ids), self.window_len)
        tokens = np.full(self.window_len, self.pad_id, dtype=np.int64)
        flags = np.zeros(self.window_len, dtype=bool)
        tokens[:length], flags[:length] = ids[:length], trained[:length]
        inputs, labels = split_window(torch.from_numpy(tokens))
        return inputs, labels.masked_fill(~torch.from_numpy(flags[1:]), IGNORED)

    def __getitem__(self, g: int):
        epoch, index = divmod(g, len(self.pairs))
        rows = [self.row(*half) for half in self.pairs[int(self.order(epoch)[index])]]
        return torch.stack([inputs for inputs, _ in rows]), torch.stack([labels for _, labels in rows])


def cut_to_longest(inputs: torch.Tensor, labels: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a micro-batch up to its longest sequence (packing.py's padded_width).
    A completion runs to the end of its sequence (tokenize_pair), so a row's last trained label is its last real
    token, whatever the token (eos, the pad id, may be one of the template's): read from the labels, not the ids.
    Every kept pair has a trained token in both rows (PreferencePairs), so the longest is at least 1."""
    trained = (labels != IGNORED).any(dim=0)
    longest = int(trained.nonzero().max()) + 1
    width = padded_width(longest, seq_len)
    return inputs[:, :width].contiguous(), labels[:, :width].contiguous()


class PairLoader(GlobalOrderLoader):
    """A GlobalOrderLoader of pairs whose batches are [2 x pairs, width]: rows 2i and 2i + 1 are pair i's chosen
    and rejected (dpo.py reads them so), cut to the micro-batch's longest sequence (cut_to_longest)."""

    def __iter__(self):
        for inputs, labels in super().__iter__():
            yield cut_to_longest(inputs.flatten(0, 1), labels.flatten(0, 1), self.seq_len)

    def tokens_by_source(self) -> dict[str, int]:
        return {name: 2 * tokens for name, tokens in super().tokens_by_source().items()}


def preference_loader(data, tokenizer, dp_rank: int, dp_world: int, seed: int) -> PairLoader:
    """Preference records at data.dataset_path (datasets.py's DataSpec), rendered with the chat template."""
    key, path = f"{data.section}.dataset_path", data.dataset_path
    where = f"{key} {path}"
    renderer = ChatRenderer(tokenizer, data.chat_template)
    records = list(Conversations(path, "preference", key, parse=preference_pair))
    check_one_form(records, where)
    pairs = [tokenize_pair(renderer, tokenizer, pair) for pair in records]
    check_pairs(records, pairs, where)
    windows = PreferencePairs(pairs, data.seq_len, seed, tokenizer.eos_id, where)
    identity = {
        "sources": [str(Path(path).resolve())],
        "seed": seed,
        "seq_len": data.seq_len,
        **chat_record(renderer, "preference", TRAIN_ON),
    }
    return PairLoader(
        windows,
        batch_size=data.batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        num_workers=data.num_workers,
        finite=not data.infinite,
        identity=identity,
        source_names=[Path(path).name],
        seq_len=data.seq_len,
    )
