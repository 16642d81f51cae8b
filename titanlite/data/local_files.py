"""Local data at training.dataset_path (or validation.dataset_path), as a random-access sequence of document texts.

The path is one file or a folder searched recursively. .jsonl/.json/.parquet/.arrow files are
read with the Hugging Face `datasets` loaders (converted once into its memory-mapped Arrow
cache), one record per document, text in training.dataset_text_field; .txt files hold one
document each and are read only when their turn comes.
"""

from collections.abc import Sequence
from pathlib import Path

import datasets
from datasets.exceptions import DatasetGenerationError

from titanlite.errors import UserError

LOADER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "txt"}


class TextFiles(Sequence):
    """One document per UTF-8 .txt file, in sorted path order."""

    def __init__(self, files: list[Path], section: str):
        self.files = files
        self.section = section

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> str:
        try:
            return self.files[index].read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{self.files[index]} under {self.section}.dataset_path is not UTF-8 text; convert or remove it") from None


class RecordTexts(Sequence):
    """The text field of each record of a Hugging Face (Arrow) dataset."""

    def __init__(self, records: datasets.Dataset, text_field: str):
        self.records = records.select_columns([text_field])
        self.text_field = text_field

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> str:
        return self.records[index][self.text_field]


def find_data_files(root: Path, section: str) -> tuple[str, list[Path]]:
    """The loader name and the files for a file or folder; one kind of data per dataset."""
    kinds = "a .jsonl/.json/.parquet/.arrow/.txt file or a folder of such files"
    if not root.exists():
        raise UserError(f"{section}.dataset_path {root} does not exist; point it at {kinds}")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in LOADER_BY_SUFFIX and p.is_file())
    loaders = sorted({LOADER_BY_SUFFIX.get(path.suffix, "unknown") for path in files})
    if loaders in ([], ["unknown"]):
        raise UserError(f"{section}.dataset_path {root} is not {kinds}; point it at one")
    if len(loaders) > 1:
        raise UserError(f"{section}.dataset_path {root} mixes kinds of data files ({', '.join(loaders)}); keep one kind per dataset")
    return loaders[0], files


def load_local_documents(dataset_path: str, text_field: str, section: str) -> Sequence[str]:
    loader, files = find_data_files(Path(dataset_path), section)
    if loader == "txt":
        return TextFiles(files, section)
    try:
        records = datasets.load_dataset(loader, data_files=[str(path) for path in files], split="train")
    except DatasetGenerationError as error:
        cause = str(error.__cause__ or error).splitlines()[0]
        raise UserError(f"{section}.dataset_path {dataset_path} could not be read as {loader} ({cause}); fix or replace it") from None
    if text_field not in records.column_names:
        raise UserError(
            f"training.dataset_text_field '{text_field}' is not a field of {section}.dataset_path {dataset_path}; "
            f"its fields are {', '.join(records.column_names)}: set training.dataset_text_field to one of them"
        )
    return RecordTexts(records, text_field)
