"""The dataset registry and the stateful data loader the trainer iterates.

    sample      Python's help topics, shipped with every Python (training's default)
    sample_val  the held-out topics the sample split leaves out (validation's default)
    c4          allenai/c4 "en", streamed from the Hugging Face hub
    c4_val      the validation split of allenai/c4 "en"
    local       files at <section>.dataset_path (chosen whenever that path is set); a token store
                there (python -m titanlite.data.prepare) is read in one global order instead
    synthetic   seeded random tokens for benchmarks

`section` ("training" or "validation") names the config keys that error messages point at.
Token stores, training.dataset_mix and chat data are read in one global order, whatever the number of
ranks (global_order.py). For the others, each data-parallel rank reads a disjoint part of the documents (see
documents.py), packs them
into windows (packing.py) and gets batches of (inputs, labels), LongTensors [batch, seq_len].
"""

import dataclasses
import difflib
import functools
import warnings
from pathlib import Path

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.data.chat import ChatRenderer, Conversations, chat_record, conversation_store, tokenize_conversation
from titanlite.data.conversation_windows import ConversationWindows
from titanlite.data.documents import IndexedDocuments, StreamedDocuments
from titanlite.data.global_order import GlobalOrderLoader
from titanlite.data.local_files import load_local_documents
from titanlite.data.packing import PackedTokens, SyntheticTokens
from titanlite.data.preference import preference_loader
from titanlite.data.sample_corpus import SAMPLE_SPLITS, sample_split
from titanlite.data.sources import global_windows
from titanlite.data.store import is_store, open_store
from titanlite.errors import UserError
from titanlite.log import logger

# torchdata 0.11 calls torch.set_vital, which newer torch deprecates; the warning is about
# torchdata's internals, says nothing to a user, and would repeat once per rank.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

DATASETS = ("sample", "sample_val", "c4", "c4_val", "local", "synthetic")
C4_SPLITS = {"c4": "train", "c4_val": "validation"}


def resolve_dataset(dataset: str, dataset_path: str, section: str = "training") -> str:
    """The registry name to use: a dataset_path means local files (it overrides the sample defaults)."""
    if dataset not in DATASETS:
        close = difflib.get_close_matches(dataset, DATASETS, n=1)
        hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(DATASETS)}"
        raise UserError(f"{section}.dataset '{dataset}' is not a known dataset; {hint}")
    if dataset_path and dataset not in (*SAMPLE_SPLITS, "local"):
        raise UserError(
            f"{section}.dataset_path is set, which means local files, but {section}.dataset is '{dataset}'; "
            "clear one of the two"
        )
    if dataset == "local" and not dataset_path:
        raise UserError(
            f"{section}.dataset is 'local' but {section}.dataset_path is empty; set it to your data file or folder"
        )
    return "local" if dataset_path else dataset


def open_c4(split: str, section: str):
    """allenai/c4's split as a streamed datasets.IterableDataset, or one sentence when the hub is out of reach."""
    import datasets  # here: `datasets` is a second of start-up (local_files.py)

    try:
        return datasets.load_dataset("allenai/c4", "en", split=split, streaming=True)
    except OSError as error:  # ConnectionError and the hub's offline errors are all OSErrors
        sample = "sample" if split == "train" else "sample_val"
        raise UserError(
            f"could not reach the Hugging Face hub to stream allenai/c4 ({type(error).__name__}); check the "
            f"network, or use local files with {section}.dataset_path, or {section}.dataset {sample}"
        ) from None


def open_documents(
    name: str,
    dataset_path: str,
    text_field: str,
    dp_rank: int,
    dp_world: int,
    seed: int,
    num_workers: int,
    section: str,
):
    """The document source of one rank for a registry name other than synthetic."""
    if name in C4_SPLITS:
        return StreamedDocuments(open_c4(C4_SPLITS[name], section), "text", dp_rank, dp_world)
    if name in SAMPLE_SPLITS:
        texts = sample_split(SAMPLE_SPLITS[name])
    else:
        texts = load_local_documents(dataset_path, text_field, f"{section}.dataset_path")
    readers = dp_world * max(num_workers, 1)
    if len(texts) < readers:
        where = f"the {name} corpus" if name in SAMPLE_SPLITS else f"{section}.dataset_path {dataset_path}"
        who = f"data-parallel ranks x {section}.num_workers" if num_workers > 1 else "data-parallel ranks"
        raise UserError(
            f"{where} holds {len(texts)} documents, fewer than the {readers} readers ({who}) that each "
            "need one; use more documents or fewer readers"
        )
    return IndexedDocuments(texts, dp_rank, dp_world, seed)


class DataParallelLoader(StatefulDataLoader):
    """A StatefulDataLoader whose state records which reader it belongs to (a position per rank).

    A position in the data only means something for the same dataset, seed, data-parallel rank
    and world size and worker count; loading a state saved under any other layout stops the
    run instead of silently reading other data than the checkpoint expects.
    """

    def __init__(self, windows, *, batch_size: int, num_workers: int, layout: dict):
        # A generator of its own: each iter() draws its workers' base seed from it, not from the training's RNG,
        # which a resume restores exactly (checkpoint/state.py RngState). The data draws nothing random itself.
        super().__init__(windows, batch_size=batch_size, num_workers=num_workers, generator=torch.Generator())
        self.layout = layout

    def state_dict(self) -> dict:
        return {"layout": self.layout, "loader": super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["layout"] != self.layout:
            saved = ", ".join(f"{key}={value!r}" for key, value in state["layout"].items())
            now = ", ".join(f"{key}={value!r}" for key, value in self.layout.items())
            raise UserError(
                f"the checkpoint's data-loader state was saved with {saved} but this run has {now}; resume with "
                "the same training.dataset, job.seed, data-parallel degree and training.num_workers"
            )
        super().load_state_dict(state["loader"])


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What a loader reads and how it batches it: training's or validation's data keys (`section` names
    the config section that error messages point at)."""

    dataset: str
    dataset_path: str
    seq_len: int
    batch_size: int
    text_field: str = "text"
    num_workers: int = 0
    infinite: bool = True  # False: one pass over the data, and every new iter() starts it again from the beginning
    section: str = "training"
    dataset_mix: list = ()
    dataset_format: str = "text"  # chat / prompt_completion / preference: local records rendered with the chat template
    train_on: str = "assistant"
    chat_template: str = ""
    packing: bool = True  # chat / prompt_completion: several conversations per window (False: one each)


def training_data(cfg) -> DataSpec:
    """The [training] section's data keys, as the data loader takes them."""
    return DataSpec(
        cfg.dataset,
        cfg.dataset_path,
        cfg.seq_len,
        cfg.local_batch_size,
        text_field=cfg.dataset_text_field,
        num_workers=cfg.num_workers,
        dataset_mix=cfg.dataset_mix,
        dataset_format=cfg.dataset_format,
        train_on=cfg.train_on,
        chat_template=cfg.chat_template,
        packing=cfg.packing,
    )


def training_loader(run, dp_rank: int, dp_world: int):
    """The batches of the run's [training] data for one data-parallel rank (an objective's dataloader)."""
    return build_dataloader(training_data(run.cfg.training), run.tokenizer, dp_rank, dp_world, run.cfg.job.seed)


def build_dataloader(
    data: DataSpec, tokenizer, dp_rank: int, dp_world: int, seed: int
) -> StatefulDataLoader | GlobalOrderLoader:
    """Batches of (inputs, labels) for one data-parallel rank; the same arguments give the same data.

    A token store at dataset_path, or a dataset_mix, is read in one global order (global_order.py);
    the other datasets are split between the ranks and packed per rank (documents.py, packing.py).
    dataset_format chat / prompt_completion: local records (or a chat store) rendered with the chat template
    (chat.py) and packed whole in one global order, with labels IGNORED outside the trained tokens; their batches
    are (inputs, labels, {"document_ids"}), the conversations' starts carried with each window.
    """
    if data.dataset_format == "preference":
        return preference_loader(data, tokenizer, dp_rank, dp_world, seed)
    if data.dataset_format != "text":
        return conversation_loader(data, tokenizer, dp_rank, dp_world, seed)
    dataset, dataset_path, section = data.dataset, data.dataset_path, data.section
    if data.dataset_mix and (dataset_path or dataset != "sample"):
        raise UserError(
            f"training.dataset_mix is set together with training.dataset {dataset!r} / dataset_path {dataset_path!r}; "
            "a mix names its sources itself, so leave those two at their defaults"
        )
    name = resolve_dataset(dataset, dataset_path, section)
    if data.dataset_mix or (name == "local" and is_store(dataset_path, f"{section}.dataset_path")):
        windows, identity, names = global_windows(
            dataset_path, data.dataset_mix, tokenizer, data.text_field, data.seq_len, seed, section
        )
        return GlobalOrderLoader(
            windows,
            batch_size=data.batch_size,
            dp_rank=dp_rank,
            dp_world=dp_world,
            num_workers=data.num_workers,
            finite=not data.infinite,
            identity=identity,
            source_names=names,
            seq_len=data.seq_len,
        )
    if name == "synthetic":
        if not data.infinite:
            raise UserError(
                f"{section}.dataset synthetic is an endless stream; it cannot serve a finite pass such as validation"
            )
        windows = SyntheticTokens(tokenizer.vocab_size, data.seq_len, seed, dp_rank, dp_world)
    else:
        source = open_documents(name, dataset_path, data.text_field, dp_rank, dp_world, seed, data.num_workers, section)
        windows = PackedTokens(source, tokenizer, data.seq_len, data.infinite)
    layout = {"dataset": name, "seed": seed, "dp_rank": dp_rank, "dp_world": dp_world, "num_workers": data.num_workers}
    return DataParallelLoader(windows, batch_size=data.batch_size, num_workers=data.num_workers, layout=layout)


def conversation_loader(data: DataSpec, tokenizer, dp_rank: int, dp_world: int, seed: int) -> GlobalOrderLoader:
    """Chat or prompt/completion records at dataset_path (or a chat store prepared from them), whole conversations
    packed into windows in one global order (conversation_windows.py). The data position it saves names the
    packing: a position in another packing's windows is another stream's."""
    key, dataset_path, dataset_format = f"{data.section}.dataset_path", data.dataset_path, data.dataset_format
    if not dataset_path:
        raise UserError(
            f"training.dataset_format {dataset_format} reads local records; set {key} to your jsonl/json/parquet data"
        )
    renderer = ChatRenderer(tokenizer, data.chat_template)
    chat = chat_record(renderer, dataset_format, data.train_on)
    if is_store(dataset_path, key):
        store = open_store(dataset_path, tokenizer, key, chat)
    else:
        conversations = Conversations(dataset_path, dataset_format, key)
        store = conversation_store(
            conversations,
            functools.partial(tokenize_conversation, renderer, tokenizer, train_on=data.train_on),
            dataset_path,
        )
        logger.info(
            f"{key} {dataset_path}: tokenized its {len(conversations):,} conversations at start (prepare them into a "
            f"chat store with python -m titanlite.data.prepare --format {dataset_format} to skip this)"
        )
    windows = ConversationWindows(store, data.seq_len, seed, tokenizer.eos_id, key, packing=data.packing)
    identity = {
        "sources": [str(Path(dataset_path).resolve())],
        "seed": seed,
        "seq_len": data.seq_len,
        **chat,
        "packing": "best_fit" if data.packing else "none",
    }
    return GlobalOrderLoader(
        windows,
        batch_size=data.batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        num_workers=data.num_workers,
        finite=not data.infinite,
        identity=identity,
        source_names=[Path(dataset_path).name],
        seq_len=data.seq_len,
    )
