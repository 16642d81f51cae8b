"""The corruption fuzzer's damage and its verdict (tests/test_corruption_fuzz.py): a case copies an input's folder,
damages one file (truncate, flip bytes, change a JSON/TOML field's type, delete) or adds a stray one, runs the
input's reader on it and judges what came out against the undamaged read.

A case behaves when the reader refuses in one sentence naming the damaged file (or its folder), or reads exactly
what the undamaged files give. Files a user brings (records, templates, Hugging Face folders, TOML) carry no
checksum: a flip or cut that leaves a valid file of its kind (as the file's own library reads it) may also read
differently, or be refused by a sentence naming the key, since titanlite cannot know what the file held before; a
changed field type never may read differently. A traceback never behaves.
"""

import json
import os
import random
import re
import shutil
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tomllib

from titanlite.errors import UserError

STRAY_BYTES = 64
OUTCOMES = (
    "refused naming the file",
    "refused a valid user file's value",
    "read the same",
    "read a valid user file's other data",
)


@dataclass
class Target:
    """One input as a reader sees it: a folder (copied per case), the files to damage in it (relative), the reader
    (folder -> what it read), and which files are the user's (no checksum: see the module's docstring)."""

    name: str
    folder: Path
    files: list[str]
    read: Callable[[Path], object]
    user_files: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ("truncate", "flip", "retype", "delete")


# ---------------------------------------------------------------- damage
def rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # a new file: case folders share the big files with the fixture as hard links
    path.write_bytes(data)


def truncate(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    keep = rng.randrange(len(data)) if data else 0
    rewrite(path, data[:keep])
    return f"truncated to {keep} of {len(data)} bytes"


def flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5:  # a few scattered bytes
        spots = [rng.randrange(len(data)) for _ in range(rng.randint(1, 4))]
    else:  # a run, as the 400 bytes XORed into a .distcp
        start = rng.randrange(len(data))
        spots = list(range(start, min(len(data), start + rng.randint(1, 400))))
    high = rng.random() < 0.5  # any byte, or one that keeps ASCII text ASCII (a digit or a letter changed: valid JSON)
    for spot in spots:
        data[spot] ^= rng.randrange(1, 256 if high else 128)
    rewrite(path, bytes(data))
    return f"flipped {len(spots)} byte(s) from {spots[0]}"


def other_type(value, rng: random.Random):
    """A JSON value of another kind than value's (never null: config.json reads null as "not set")."""
    kinds = {"number": 7, "text": "seven", "bool": True, "list": [1], "object": {"x": 1}}
    kind = (
        "bool"
        if isinstance(value, bool)
        else "number"
        if isinstance(value, (int, float))
        else "text"
        if isinstance(value, str)
        else "list"
        if isinstance(value, list)
        else "object"
    )
    return kinds[rng.choice(sorted(set(kinds) - {kind}))]


def leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    if path:
        yield path


def retyped_json(document, rng: random.Random) -> tuple[object, str]:
    path = rng.choice(list(leaves(document)))
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = other_type(parent[path[-1]], rng)
    return document, f"{'.'.join(map(str, path))} -> {json.dumps(parent[path[-1]])}"


def retype(path: Path, rng: random.Random) -> str:
    text = path.read_text()
    if path.suffix == ".toml":  # one `key = value` line's value, as a TOML literal of another type
        lines = text.splitlines()
        number = rng.choice([i for i, line in enumerate(lines) if re.match(r"^\w+ = ", line)])
        key, value = lines[number].split(" = ", 1)
        lines[number] = f"{key} = {other_toml(tomllib.loads(lines[number])[key], rng)}"
        rewrite(path, ("\n".join(lines) + "\n").encode())
        return f"{key} = {value} -> {lines[number]}"
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines()]
        number = rng.randrange(len(records))
        records[number], what = retyped_json(records[number], rng)
        rewrite(path, "".join(json.dumps(r) + "\n" for r in records).encode())
        return f"record {number + 1}: {what}"
    document, what = retyped_json(json.loads(text), rng)
    rewrite(path, json.dumps(document, indent=1).encode())
    return what


def other_toml(value, rng: random.Random) -> str:
    literal = json.dumps(other_type(value, rng))
    return {"true": "true", '{"x": 1}': "{ x = 1 }"}.get(literal, literal)


def delete(path: Path, rng: random.Random) -> str:
    path.unlink()
    return "deleted"


DAMAGE = {"truncate": truncate, "flip": flip, "retype": retype, "delete": delete}
STRUCTURED = (".json", ".jsonl", ".toml")


def stray(folder: Path, rng: random.Random, names: list[str]) -> Path:
    """A file nobody wrote, named like the folder's own files or not."""
    path = folder / rng.choice(names)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rng.randbytes(STRAY_BYTES))
    return path


# ---------------------------------------------------------------- what is valid without titanlite
def valid_as_its_kind(path: Path) -> bool:
    """Whether a user's damaged file still reads with its own library (then it may hold other data)."""
    if not path.is_file():
        return False
    try:
        if path.suffix in (".json", ".jsonl"):
            text = path.read_bytes().decode("utf-8")
            if path.name == "tokenizer.json":
                import tokenizers

                tokenizers.Tokenizer.from_str(text)
            for line in text.splitlines() if path.suffix == ".jsonl" else [text]:
                json.loads(line)
        elif path.suffix == ".toml":
            tomllib.loads(path.read_bytes().decode("utf-8"))
        elif path.suffix == ".parquet":
            import pyarrow.parquet

            pyarrow.parquet.read_table(path)
        elif path.suffix == ".jinja":
            import jinja2

            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(path.read_bytes().decode("utf-8"))
        elif path.suffix == ".safetensors":
            from safetensors.torch import load_file

            load_file(path)
        return True
    except Exception:  # whatever the library raises: the file is not valid as its kind
        return False


# ---------------------------------------------------------------- one case
def copy_folder(source: Path, destination: Path) -> None:
    """Big files as hard links (damage rewrites a file, never edits it in place), small ones copied."""

    def link_or_copy(src, dst):
        if os.path.getsize(src) > 1 << 20:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(source, destination, copy_function=link_or_copy)


def outcome(read: Callable[[Path], object], folder: Path) -> tuple[str, object]:
    try:
        return "read", read(folder)
    except UserError as error:
        return "refused", str(error)
    except Exception:  # the defect this test exists to find
        return "traceback", traceback.format_exc(limit=-6)


def judge(target: Target, relative: str, kind: str, what: str, folder: Path, clean) -> tuple[str, str | None]:
    """(how the case ended, None when that is right or else what went wrong)."""
    result, value = outcome(target.read, folder)
    where = f"{target.name}: {relative} {what}"
    if result == "traceback":
        return result, f"{where}: a traceback\n{value}"
    if result == "refused":
        if "\n" in value:
            return result, f"{where}: not one sentence: {value}"
        if relative.split("/")[-1] in value or str(folder / Path(relative).parent) in value:
            return "refused naming the file", None
        if relative in target.user_files and valid_as_its_kind(folder / relative):
            return "refused a valid user file's value", None  # its sentence names the key or record
        return result, f"{where}: the sentence does not name the file: {value}"
    if value == clean:
        return "read the same", None
    if relative in target.user_files and kind in ("truncate", "flip") and valid_as_its_kind(folder / relative):
        return "read a valid user file's other data", None  # nothing to compare it with
    return "read differently", f"{where}: read silently, and differently from the undamaged files"


def run_cases(target: Target, tmp: Path, rng: random.Random, per_file: int, stray_names: list[str]) -> Counter:
    """per_file cases drawn for each file (kinds that apply to it), plus one stray file; returns how they ended, and
    the failures (under their sentences)."""
    clean = target.read(target.folder)
    ended = Counter()
    plans = []
    for relative in target.files:
        kinds = [k for k in target.kinds if k != "retype" or relative.endswith(STRUCTURED)]
        drawn = rng.sample(kinds, min(per_file, len(kinds))) + rng.choices(kinds, k=max(per_file - len(kinds), 0))
        plans += [(relative, kind) for kind in drawn]
    plans.append(("", "stray"))
    for relative, kind in plans:
        folder = tmp / f"{target.name}-{sum(ended.values())}"
        copy_folder(target.folder, folder)
        if kind == "stray":
            relative = str(stray(folder, rng, stray_names).relative_to(folder))
            what = "added"
        else:
            what = DAMAGE[kind](folder / relative, rng)
        how, problem = judge(target, relative, kind, what, folder, clean)
        ended[problem or how] += 1
        shutil.rmtree(folder, ignore_errors=True)
    return ended
