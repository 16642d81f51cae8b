"""Tokenizer files: Llama 3's tiktoken BPE, and the SentencePiece models of Llama 2, Mistral and Mixtral.

Both are called tokenizer.model; which one a file is shows in its bytes (tiktoken's is text,
SentencePiece's a binary protobuf), so no key says it.

A tiktoken file holds one `base64(token bytes) rank` per line. Llama 3's pre-tokenisation regex splits
text into pieces before BPE, and its 256 special tokens are numbered after the last rank, so a
real Llama 3 file gives 128000 ranks + 256 specials = 128256 ids, bos 128000 and eos 128001.

Text is handed to tiktoken whole: its BPE scales about linearly in piece length (measured with
tiktoken 0.14: a million letters without whitespace encode in 0.13 s), so unlike Llama 3's
reference code nothing is split up first, and the ids are exactly those of the whole text.
"""

import base64
import binascii
from pathlib import Path

import tiktoken

from titanlite.data.hf_tokenizer import HFTokenizer, is_hf_tokenizer
from titanlite.errors import UserError

PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer.model"  # the repository's assets/


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """The token -> rank table of a tiktoken BPE file; raises ValueError saying what is wrong."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"line {number} is not 'base64-token rank'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("its ranks are not the numbers 0..N-1, each on one distinct token")
    # tiktoken cannot encode a byte that has no rank of its own, so byte-level BPE needs all 256.
    if any(bytes([byte]) not in ranks for byte in range(256)):
        raise ValueError("it lacks some of the 256 single-byte tokens")
    return ranks


class Tokenizer:
    """Tiktoken BPE: encodes text to ids and back; `origin` is the config key the path came from, for errors."""

    def __init__(self, path: str | Path, origin: str = "model.tokenizer_path"):
        self.path = Path(path)
        try:
            ranks = read_bpe_ranks(self.path)
        except FileNotFoundError:
            raise UserError(f"the tokenizer file {self.path} does not exist; {fix_for(self.path, origin)}") from None
        except (OSError, ValueError) as error:
            reason = error.strerror if isinstance(error, OSError) else error
            raise UserError(
                f"cannot use the tokenizer file {self.path}: {reason}; {fix_for(self.path, origin)}"
            ) from None
        self.bos_id = len(ranks)
        self.eos_id = len(ranks) + 1
        self.vocab_size = len(ranks) + len(SPECIAL_TOKENS)
        self._encoding = tiktoken.Encoding(
            name=self.path.name,
            pat_str=PRETOKENIZE_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)},
        )

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Ids of `text`; text that looks like a special token is encoded as ordinary text."""
        ids = [self.bos_id] if bos else []
        ids += self._encoding.encode_ordinary(text)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)


class SentencePieceTokenizer:
    """A SentencePiece model (Llama 2, Mistral, Mixtral): its own bos and eos, no extra specials."""

    def __init__(self, path: Path, origin: str):
        import sentencepiece

        self.path = path
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:  # its parser says what is wrong in one line
            raise UserError(
                f"cannot use the tokenizer file {path}: {str(error).strip()}; {fix_for(path, origin)}"
            ) from None
        self.bos_id, self.eos_id = self._model.bos_id(), self._model.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise UserError(
                f"the SentencePiece tokenizer {path} has no bos or eos piece, which titanlite puts around every "
                f"document; {fix_for(path, origin)}"
            )
        self.vocab_size = self._model.vocab_size()

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Ids of `text`; "<s>" or "</s>" in the text are ordinary text, as in Tokenizer."""
        return ([self.bos_id] if bos else []) + self._model.encode(text) + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self._model.decode(ids)


def fix_for(path: Path, origin: str) -> str:
    """The second half of a tokenizer error: what to do about it."""
    if path == SHIPPED_TOKENIZER:
        return "run `python scripts/build_tokenizer.py` to create it, or set model.tokenizer_path"
    if origin == "model.hf_assets_path":
        return "put the model's tokenizer.json or tokenizer.model in model.hf_assets_path or set model.tokenizer_path"
    return f"set {origin} to the model's tokenizer.model (tiktoken BPE as Llama 3's, or SentencePiece as Llama 2's)"


def is_sentencepiece(path: Path) -> bool:
    """A SentencePiece model is a protobuf whose first field, the pieces, starts with tag byte 0x0a
    and holds binary scores; a tiktoken file is base64 text."""
    with path.open("rb") as file:
        head = file.read(4096)
    return head.startswith(b"\n") and (b"\0" in head or not head.isascii())


def load_tokenizer(
    path: str | Path, origin: str = "model.tokenizer_path"
) -> Tokenizer | SentencePieceTokenizer | HFTokenizer:
    """The tokenizer of a tokenizer.json (or a folder holding one), else of a tokenizer.model file."""
    path = Path(path)
    if is_hf_tokenizer(path):
        return HFTokenizer(path, origin)
    try:
        sentencepiece = is_sentencepiece(path)
    except OSError:  # missing or unreadable: Tokenizer words it
        sentencepiece = False
    return SentencePieceTokenizer(path, origin) if sentencepiece else Tokenizer(path, origin)


def build_tokenizer(model_cfg) -> Tokenizer | SentencePieceTokenizer | HFTokenizer:
    """model.tokenizer_path if set, else model.hf_assets_path, else the shipped one. A tokenizer.json (or a
    folder holding one) is a Hugging Face tokenizer; a folder without one is looked into for tokenizer.model."""
    if model_cfg.tokenizer_path:
        path, origin = Path(model_cfg.tokenizer_path), "model.tokenizer_path"
    elif model_cfg.hf_assets_path:
        path, origin = Path(model_cfg.hf_assets_path), "model.hf_assets_path"
    else:
        return load_tokenizer(SHIPPED_TOKENIZER)
    return load_tokenizer(
        path
        if is_hf_tokenizer(path) or not (path.is_dir() or origin == "model.hf_assets_path")
        else path / "tokenizer.model",
        origin,
    )
