"""Local data at training.dataset_path (or validation.dataset_path), as a random-access sequence of document texts.

The path is one file or a folder searched recursively. .jsonl/.json/.parquet/.arrow files are
read with the Hugging Face `datasets` loaders (converted once into its memory-mapped Arrow
cache), one record per document, text in training.dataset_text_field; .txt files hold one
document each and are read only when their turn comes. Records whose every field matters as the file
holds it (GRPO's prompts, whose fields reach the reward functions) are read by json_records instead:
an Arrow schema casts a column that mixes strings and numbers to one type ("007" read as 7).

A fault in the files stops the run at start with one sentence naming the file: a file that is empty
or not what its suffix says, a record whose text field is missing or not a string (with its
number), text that is not UTF-8 (with its line). Undecodable bytes are refused, not replaced: a file
in another encoding would otherwise train on replacement characters without anyone noticing.
"""

from __future__ import annotations  # the datasets and pyarrow annotations name modules imported only where used

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from titanlite.errors import UserError

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

LOADER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "txt"}
KINDS = "a .jsonl/.json/.parquet/.arrow/.txt file or a folder of such files"


def read_errors() -> tuple[type[Exception], ...]:
    """What `datasets` and pyarrow raise for file contents they cannot parse; anything else is a bug. Both are
    imported where used, here and below: together they take about a second of every process's start-up,
    which a run on the shipped sample or a token store never needs."""
    import pyarrow as pa
    from datasets.exceptions import DatasetGenerationError

    # OSError: pyarrow's for a parquet file whose metadata does not decode ("Couldn't deserialize thrift").
    return (DatasetGenerationError, pa.ArrowInvalid, UnicodeDecodeError, OSError)


class TextFiles(Sequence):
    """One document per UTF-8 .txt file, in sorted path order (checked to be UTF-8 at start)."""

    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> str:
        return self.files[index].read_text(encoding="utf-8")


class RecordTexts(Sequence):
    """The text field of each record of a Hugging Face (Arrow) dataset."""

    def __init__(self, records: datasets.Dataset, text_field: str):
        self.records = records.select_columns([text_field])
        self.text_field = text_field

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> str:
        return self.records[index][self.text_field]


def find_data_files(root: Path, key: str) -> tuple[str, list[Path]]:
    """The loader name and the files for a file or folder; one kind of data per dataset, no empty file."""
    if not root.exists():
        raise UserError(f"{key} {root} does not exist; point it at {KINDS}")
    files = (
        [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in LOADER_BY_SUFFIX and p.is_file())
    )
    loaders = sorted({LOADER_BY_SUFFIX.get(path.suffix, "unknown") for path in files})
    if not files:
        raise UserError(
            f"{key} {root} is a folder without .jsonl/.json/.parquet/.arrow/.txt files; point it at {KINDS}"
        )
    if loaders == ["unknown"]:
        raise UserError(f"{key} {root} is not {KINDS}; point it at one")
    if len(loaders) > 1:
        raise UserError(f"{key} {root} mixes kinds of data files ({', '.join(loaders)}); keep one kind per dataset")
    empty = next((path for path in files if is_blank(path)), None)
    if empty is not None:
        raise UserError(f"{key}: {empty} is empty (or only whitespace); remove it or write the data into it")
    return loaders[0], files


def is_blank(path: Path) -> bool:
    """True for a file holding nothing but whitespace; reads no further than the first other byte."""
    with path.open("rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def utf8_fault(path: Path) -> str | None:
    """Where a file stops being UTF-8, or None when all of it is."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        return f"is not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}); re-encode it as UTF-8 or remove it"
    return None


def text_fault(records: datasets.Dataset, text_field: str) -> str | None:
    """Why some record has no string in text_field, or None when every record has one."""
    if text_field not in records.column_names:
        return (
            f"has no field '{text_field}' (its fields are {', '.join(records.column_names)}); "
            "set training.dataset_text_field to one of them"
        )
    import pyarrow as pa

    column = records.data.column(text_field)
    if column.null_count == 0 and (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        try:
            column.validate(full=True)  # pyarrow's json reader keeps bytes that are not UTF-8 as they are
            return None
        except pa.ArrowInvalid:
            row = next(i for i in range(len(column)) if not _decodes(column[i]))
            return (
                f"record {row + 1} (counting from 1) holds text in '{text_field}' that is not UTF-8; re-encode the "
                "file as UTF-8 or fix that record"
            )
    row, value = next(((i, v) for i, v in enumerate(records[text_field]) if not isinstance(v, str)), (None, None))
    if row is None:
        return None
    what = f"has no '{text_field}'" if value is None else f"holds {value!r} in '{text_field}', not text"
    return f"record {row + 1} (counting from 1) {what}; fix or remove that record"


def _decodes(text: pa.Scalar) -> bool:
    try:
        text.as_py()
        return True
    except UnicodeDecodeError:
        return False


def read_fault(path: Path, loader: str, error: Exception) -> str:
    cause = error.__cause__ or error
    # A json file in another encoding fails to parse; say why rather than where the parser stopped.
    if loader == "json" and (fault := utf8_fault(path)):
        return fault
    reason = str(cause).splitlines()[0].split(". ")[0].rstrip(".")
    return f"could not be read as {loader} ({reason}); fix or replace it"


def read_records(loader: str, files: list[Path]) -> datasets.Dataset:
    # datasets logs an error line of its own for a file it cannot parse; titanlite names the fault in one sentence.
    # Nor its progress bar, which would stand above a one-sentence error about the data.
    import datasets

    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(loader, data_files=[str(path) for path in files], split="train")
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def json_records(files: list[Path], key: str) -> list[tuple[str, object]]:
    """(where, value) of every record of .jsonl/.json files, each value as the file holds it (Python's json): a .json
    file holds one array of records (or one record, or JSON lines), a .jsonl file one record per line, blank lines
    skipped. A file that is not UTF-8 or a line that is not JSON ends in one sentence naming it."""
    records = []
    for path in files:
        if fault := utf8_fault(path):
            raise UserError(f"{key}: {path} {fault}")
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is no part of the first record
        whole = json_document_records(path, text) if path.suffix == ".json" else None
        records += whole if whole is not None else json_line_records(path, text, key)
    return records


def json_document_records(path: Path, text: str) -> list[tuple[str, object]] | None:
    """The records of a .json file holding one JSON array (or one object); None where it holds JSON lines."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(document, dict):
        return [(f"{path} record 1", document)]
    return (
        [(f"{path} record {number}", value) for number, value in enumerate(document, 1)]
        if isinstance(document, list)
        else None
    )


def json_line_records(path: Path, text: str, key: str) -> list[tuple[str, object]]:
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"{path} line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            raise UserError(f"{key} {path} line {number} is not JSON ({error.msg}); fix that line") from None
    return records


def parquet_records(files: list[Path], key: str) -> list[tuple[str, dict]]:
    """(where, record) of every record of parquet files, each field as the file's own schema types it."""
    records = []
    for path in files:
        try:
            table = read_records("parquet", [path])
        except read_errors() as error:
            raise UserError(f"{key}: {path} {read_fault(path, 'parquet', error)}") from None
        if fault := utf8_column_fault(table, table.column_names):
            raise UserError(f"{key}: {path} {fault}")
        records += [(f"{path} record {number}", record) for number, record in enumerate(table, 1)]
    return records


def utf8_column_fault(records, fields) -> str | None:
    """Why a field's text (nested in messages too) is not UTF-8, or None when all of it is."""
    import pyarrow as pa

    for field in fields:
        try:
            records.data.column(field).validate(full=True)
        except pa.ArrowInvalid as error:
            return (
                f"holds text in '{field}' that is not UTF-8 ({str(error).splitlines()[0]}); re-encode the file as "
                "UTF-8 "
                "or fix that record"
            )
    return None


def files_sha256(root: Path, files: list[Path]) -> str:
    """One checksum of the files' names (their order is the records' order) and contents."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(root) if path != root else path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def raise_for_the_faulty_file(loader: str, files: list[Path], text_field: str, key: str, error: Exception | None):
    """Read the files one by one to name the one at fault; called only after reading them all failed."""
    for path in files:
        try:
            fault = text_fault(read_records(loader, [path]), text_field)
        except read_errors() as one_error:
            fault = read_fault(path, loader, one_error)
        if fault:
            raise UserError(f"{key}: {path} {fault}") from None
    reason = str(error.__cause__ or error).splitlines()[0] if error else "their fields differ"
    raise UserError(
        f"{key} {files[0].parent}: its files read one by one but not as one dataset ({reason}); give them the same "
        "fields"
    )


def load_local_documents(dataset_path: str, text_field: str, key: str) -> Sequence[str]:
    loader, files = find_data_files(Path(dataset_path), key)
    if loader == "txt":
        fault = next(((path, f) for path in files if (f := utf8_fault(path))), None)
        if fault:
            raise UserError(f"{key}: {fault[0]} {fault[1]}")
        return TextFiles(files)
    try:
        records, error = read_records(loader, files), None
    except read_errors() as read_error:
        records, error = None, read_error
    except ValueError as no_data:  # how `datasets` says that every file held zero records (e.g. a json [])
        if "corresponds to no data" not in str(no_data):
            raise
        raise UserError(
            f"{key} {dataset_path} holds no records (a json file holding [] counts as empty); write the data into it"
        ) from None
    if records is None or text_fault(records, text_field):
        raise_for_the_faulty_file(loader, files, text_field, key, error)
    return RecordTexts(records, text_field)
