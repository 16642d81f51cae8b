"""Byte-level BPE in the tiktoken file format of Llama 3's tokenizer.model.

The file holds one `base64(token bytes) rank` per line. Llama 3's pre-tokenisation regex splits
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

import titanlite
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

SHIPPED_TOKENIZER = Path(titanlite.__file__).parent.parent / "assets" / "tokenizer.model"


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
    """Encodes text to ids and back; `origin` is the config key the path came from, for errors."""

    def __init__(self, path: str | Path, origin: str = "model.tokenizer_path"):
        self.path = Path(path)
        try:
            ranks = read_bpe_ranks(self.path)
        except FileNotFoundError:
            raise UserError(f"the tokenizer file {self.path} does not exist; {self._fix(origin)}") from None
        except (OSError, ValueError) as error:
            reason = error.strerror if isinstance(error, OSError) else error
            raise UserError(f"cannot use the tokenizer file {self.path}: {reason}; {self._fix(origin)}") from None
        self.bos_id = len(ranks)
        self.eos_id = len(ranks) + 1
        self.vocab_size = len(ranks) + len(SPECIAL_TOKENS)
        self._encoding = tiktoken.Encoding(
            name=self.path.name,
            pat_str=PRETOKENIZE_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)},
        )

    def _fix(self, origin: str) -> str:
        if self.path == SHIPPED_TOKENIZER:
            return "run `python scripts/build_tokenizer.py` to create it, or set model.tokenizer_path"
        if origin == "model.hf_assets_path":
            return "put the model's tokenizer.model in model.hf_assets_path or set model.tokenizer_path"
        return f"set {origin} to a tiktoken BPE file such as Llama 3's tokenizer.model"

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Ids of `text`; text that looks like a special token is encoded as ordinary text."""
        ids = [self.bos_id] if bos else []
        ids += self._encoding.encode_ordinary(text)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(ids)


def build_tokenizer(model_cfg) -> Tokenizer:
    """model.tokenizer_path if set, else tokenizer.model in model.hf_assets_path, else the shipped one."""
    if model_cfg.tokenizer_path:
        return Tokenizer(model_cfg.tokenizer_path, origin="model.tokenizer_path")
    if model_cfg.hf_assets_path:
        return Tokenizer(Path(model_cfg.hf_assets_path) / "tokenizer.model", origin="model.hf_assets_path")
    return Tokenizer(SHIPPED_TOKENIZER)
