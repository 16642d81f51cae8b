"""Hugging Face tokenizer folders: tokenizer.json (read with the `tokenizers` library) and
tokenizer_config.json (its bos and eos tokens and its chat template).

The ids of a text are those of `transformers.AutoTokenizer(text, add_special_tokens=False)` for the
same folder: special tokens written in the text (<|im_start|>, <|eot_id|>...) are matched as the
tokenizers library matches them, since a rendered chat template spells its turn markers as text.
bos and eos are then added by the caller (`encode(text, bos, eos)`), not by tokenizer.json's
post-processor, so every tokenizer puts the same delimiters around a document.

A folder without a bos token (Qwen, GPT-2's config written without one) uses its eos as bos, as GPT-2
does: the packed stream then has two eos between documents, which models/attention.py's document_ids
reads as a document boundary.
"""

import json
from pathlib import Path

import tokenizers

from titanlite.errors import UserError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_config(path: Path, origin: str) -> dict:
    """tokenizer_config.json beside tokenizer.json, {} where there is none."""
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read {path}: {error}; fix the file or remove it from {origin}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object; fix the file or remove it from {origin}")
    return config


def read_chat_template(folder: Path, config: dict, origin: str) -> tuple[str | None, Path]:
    """(the folder's chat template, the file it came from): chat_template.jinja, where transformers 5 saves it,
    else tokenizer_config.json's "chat_template"; (None, tokenizer_config.json) where there is none."""
    path = folder / "chat_template.jinja"
    if not path.is_file():
        return config.get("chat_template"), folder / "tokenizer_config.json"
    try:
        return path.read_text(), path
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {path}: {error}; fix the file or remove it from {origin}") from None


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json: encodes text to ids and back, and carries the chat template."""

    def __init__(self, path: str | Path, origin: str = "model.hf_assets_path"):
        path = Path(path)
        self.path = path / "tokenizer.json" if path.is_dir() else path
        folder = self.path.parent
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # the Rust parser raises plain Exception with one line saying what
            reason = "it does not exist" if not self.path.exists() else str(error).strip().splitlines()[0]
            raise UserError(
                f"cannot use the tokenizer file {self.path}: {reason}; set {origin} to a Hugging Face "
                "folder holding a valid tokenizer.json"
            ) from None
        config = read_config(folder / "tokenizer_config.json", origin)
        self.chat_template, self.chat_template_path = read_chat_template(folder, config, origin)
        # What transformers hands a chat template as variables (its special_tokens_map): the named ones set.
        self.special_tokens = {
            name: token_text(config.get(name))
            for name in SPECIAL_TOKEN_NAMES
            if token_text(config.get(name)) is not None
        }
        eos = self.special_tokens.get("eos_token")
        if eos is None:
            raise UserError(
                f"{folder / 'tokenizer_config.json'} names no eos_token, which titanlite puts after every "
                f'document; add "eos_token" to it or set {origin} to a folder that has one'
            )
        self.eos_id = self.token_id(eos, folder)
        bos = self.special_tokens.get("bos_token")
        self.bos_id = self.eos_id if bos is None else self.token_id(bos, folder)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        # The turn markers a chat template writes (<|im_end|>...); added tokens that are not special (<think>) are text.
        self.special_texts = [
            token.content for token in self._tokenizer.get_added_tokens_decoder().values() if token.special
        ]

    def token_id(self, token: str, folder: Path) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise UserError(
                f"the special token {token!r} of {folder / 'tokenizer_config.json'} is not in "
                f"{self.path}; make the two files agree (they come from the same model folder)"
            )
        return token_id

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        """Ids of `text` (special tokens in it recognised), with bos before and eos after where asked."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_with_offsets(
        self, text: str, literal: list[tuple[int, int]] = ()
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` as encode gives them (no bos, no eos) and each token's (start, end) character offsets;
        within the `literal` character spans (in order) special tokens are not recognised: they are text there."""
        ids, offsets, begin = [], [], 0
        for start, end in [*literal, (len(text), len(text))]:
            for piece_start, piece_end, as_text in ((begin, start, False), (start, end, True)):
                if piece_end > piece_start:
                    self._tokenizer.encode_special_tokens = as_text
                    encoding = self._tokenizer.encode(text[piece_start:piece_end], add_special_tokens=False)
                    ids += encoding.ids
                    offsets += [(piece_start + a, piece_start + b) for a, b in encoding.offsets]
            begin = end
        self._tokenizer.encode_special_tokens = False
        return ids, offsets

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def is_hf_tokenizer(path: Path) -> bool:
    """A tokenizer.json file, or a folder holding one."""
    return path.name == "tokenizer.json" or (path / "tokenizer.json").is_file()
