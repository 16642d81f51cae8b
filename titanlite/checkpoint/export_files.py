"""What an exported Hugging Face folder needs to generate as the run was trained: config.json's bos and eos
ids, and generation_config.json with every id generation stops at, the tokenizer's eos and the chat template's
end of turn (<|im_end|>, <|eot_id|>): transformers' and vLLM's generate read them, and without the end of turn
a chat model talks past its answer."""

import json
from pathlib import Path

from titanlite.data.chat import ChatRenderer
from titanlite.data.chat_spans import find_content
from titanlite.data.hf_tokenizer import HFTokenizer
from titanlite.data.tokenizer import load_tokenizer
from titanlite.errors import UserError

PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]


def end_of_turn(tokenizer, chat_template: str) -> int | None:
    """The id of the special token the chat template closes an assistant turn with; None without a template
    (or one that cannot render a plain two-turn chat: then generation stops at eos alone)."""
    if not isinstance(tokenizer, HFTokenizer) or not (chat_template or tokenizer.chat_template):
        return None
    try:
        renderer = ChatRenderer(tokenizer, chat_template)
        text = renderer.render(PROBE)
    except UserError:
        return None
    content = find_content(text, PROBE[1]["content"], 0)
    close = renderer.specials.search(text, content[1]) if content and renderer.specials else None
    return tokenizer.token_id(close.group(), tokenizer.path.parent) if close else None


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # the base folder's own file is unreadable: written anew from the tokenizer
    return value if isinstance(value, dict) else {}


def as_list(ids) -> list:
    return list(ids) if isinstance(ids, list) else [] if ids is None else [ids]


def write_generation_ids(source: Path, folder: Path, chat_template: str = "") -> None:
    """config.json's bos_token_id and eos_token_id (the base folder's where it sets them), and
    generation_config.json (the base folder's, if any) stopping at the end of turn and every eos."""
    tokenizer_path = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else folder / "tokenizer.model"
    tokenizer = load_tokenizer(tokenizer_path)
    has_bos = not isinstance(tokenizer, HFTokenizer) or "bos_token" in tokenizer.special_tokens
    base_config = read_json(source / "config.json")
    ours = {"bos_token_id": tokenizer.bos_id if has_bos else None, "eos_token_id": tokenizer.eos_id}
    ids = {key: value if base_config.get(key) is None else base_config[key] for key, value in ours.items()}
    config = read_json(folder / "config.json")
    config.update({key: value for key, value in ids.items() if value is not None})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    generation = read_json(source / "generation_config.json")
    stops = [
        end_of_turn(tokenizer, chat_template),
        *as_list(generation.get("eos_token_id")),
        *as_list(ids["eos_token_id"]),
    ]
    stops = list(dict.fromkeys(i for i in stops if i is not None))
    generation.update({"eos_token_id": stops if len(stops) > 1 else stops[0]})
    if ids["bos_token_id"] is not None:
        generation.setdefault("bos_token_id", ids["bos_token_id"])
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
