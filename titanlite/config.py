"""Load a job: defaults < TOML file < command-line flags, checked before anything runs.

    python -m titanlite.train --job.config_file X.toml --training.steps 100 --compile.enable

Every mistake (unknown key, wrong type, bad value, unreadable file) raises UserError with one
sentence that names the key or file and the fix; the sections themselves live in
config_sections/.
"""

import dataclasses
import difflib
import json
import math
import operator
import sys
import typing
from pathlib import Path
from typing import Any

from titanlite.config_rules import check_rules
from titanlite.config_sections import JobConfig
from titanlite.errors import UserError
from titanlite.models.hf_folder import start_from_folder

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is its twin.
    import tomli as tomllib

# Other spellings of a section, as used by torchtitan's newer configs.
SECTION_ALIASES = {"quantize.linear.float8": "float8"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(_sections()[section])}


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s in _sections() for k in _fields(s)]


def _closest(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.0)
    return f"; did you mean {match[0]}?" if match else ""


def _resolve_key(dotted: str, origin: str) -> tuple[str, str]:
    """Split 'section.key' (or an aliased section) and check both parts exist."""
    section, _, key = dotted.rpartition(".")
    section = SECTION_ALIASES.get(section, section)
    if section not in _sections():
        names = [f"[{name}]" for name in _sections()]
        raise UserError(f"unknown config section [{section or dotted}] in {origin}{_closest(f'[{section}]', names)}")
    if key not in _fields(section):
        raise UserError(f"unknown config key {section}.{key} in {origin}{_closest(f'{section}.{key}', _all_keys())}")
    return section, key


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return f"table {{{', '.join(f.name for f in dataclasses.fields(tp))}}}"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]


def _article(name: str) -> str:
    return "an" if name[0] in "aeiou" else "a"


def _from_text(text: str, tp: Any) -> Any:
    """Convert a command-line string to the field's type; ValueError when it does not fit."""
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        # A list of tables is written as on the right of a TOML `key =`: [{ path = "a", weight = 1 }]
        return _from_toml(tomllib.loads(f"value = {text}")["value"], tp)  # TOMLDecodeError is a ValueError
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return [_from_text(part.strip(), item) for part in text.split(",") if part.strip()]
    if tp is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(text)
    return tp(text)


def _from_toml(value: Any, tp: Any) -> Any:
    """Check a TOML value against the field's type; ValueError when it does not fit."""
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise ValueError(value)
        return [_from_toml(v, typing.get_args(tp)[0]) for v in value]
    if dataclasses.is_dataclass(tp):
        names = {f.name: f.type for f in dataclasses.fields(tp)}
        if not isinstance(value, dict) or not set(value) <= set(names):
            raise ValueError(value)
        return tp(**{key: _from_toml(v, names[key]) for key, v in value.items()})
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not tp:
        raise ValueError(value)
    return value


def _set(cfg: JobConfig, dotted: str, raw: Any, origin: str, from_cli: bool, origins: dict[str, str]) -> None:
    section, key = _resolve_key(dotted, origin)
    tp = _fields(section)[key].type
    try:
        value = _from_text(raw, tp) if from_cli else _from_toml(raw, tp)
    except ValueError:
        raise UserError(
            f"{section}.{key} expects {_article(_type_name(tp))} {_type_name(tp)}, got {raw!r} in {origin}"
        ) from None
    setattr(getattr(cfg, section), key, value)
    origins[f"{section}.{key}"] = origin


def _flatten_toml(table: dict, path: str, origin: str) -> list[tuple[str, Any]]:
    """[section] tables (possibly dotted, like [quantize.linear.float8]) -> ('section.key', value)."""
    items = []
    for name, value in table.items():
        dotted = f"{path}.{name}" if path else name
        if isinstance(value, dict) and SECTION_ALIASES.get(dotted, dotted) not in _sections():
            items += _flatten_toml(value, dotted, origin)
        elif isinstance(value, dict):
            items += [(f"{dotted}.{k}", v) for k, v in value.items()]
        elif not path:
            raise UserError(f"{origin}: key {name!r} must sit inside a [section] table, e.g. [training]")
        else:
            items.append((dotted, value))
    return items


def _read_toml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file {path} does not exist; check --job.config_file")
    try:
        return tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"config file {path} cannot be read ({e}); check --job.config_file") from None


def _parse_cli(argv: list[str]) -> list[tuple[str, str]]:
    """['--a.b', 'v', '--c.d=w', '--flag'] -> [('a.b', 'v'), ('c.d', 'w'), ('flag', 'true')]."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(f"unexpected command-line argument {arg!r}; flags look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            next_is_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if next_is_value else "true"
            i += next_is_value
        pairs.append((name, value))
        i += 1
    return pairs


def range_text(meta: dict) -> str:
    """A field's declared range in words, e.g. 'at least 0 and below 1, or -1'; '' when it has none."""
    words = {"at_least": "at least", "above": "above", "at_most": "at most", "below": "below"}
    bounds = " and ".join(f"{word} {meta[name]}" for name, word in words.items() if meta[name] is not None)
    if bounds and meta["sentinels"]:
        bounds += ", or " + ", or ".join(map(str, meta["sentinels"]))
    if meta["length"] is not None:
        return f"{meta['length']} items" + (f", each {bounds}" if bounds else "")
    return bounds


def _in_range(value: float, meta: dict) -> bool:
    # Written so that NaN, which fails every comparison, is out of range.
    if value in meta["sentinels"]:
        return True
    checks = {"at_least": operator.ge, "above": operator.gt, "at_most": operator.le, "below": operator.lt}
    return all(meta[name] is None or check(value, meta[name]) for name, check in checks.items())


def _check_range(name: str, value: Any, meta: dict, origin: str) -> None:
    """One sentence for a numeric value (or a list's length or item) outside the field's declared range."""
    if meta["length"] is not None and len(value) != meta["length"]:
        raise UserError(
            f"{name} must hold {meta['length']} items; got {value!r} in {origin}, give exactly {meta['length']}"
        )
    bounds = range_text({**meta, "length": None})
    for item in value if isinstance(value, list) else [value]:
        where = f"each item of {name}" if isinstance(value, list) else name
        if isinstance(item, float) and not math.isfinite(item):
            raise UserError(
                f"{where} must be a finite number{' ' + bounds if bounds else ''}; got {item!r} in {origin}"
            )
        if bounds and not _in_range(item, meta):
            raise UserError(f"{where} must be {bounds}; got {item!r} in {origin}; pick a value in that range")


def _check_values(cfg: JobConfig, origins: dict[str, str]) -> None:
    for section in _sections():
        for key, f in _fields(section).items():
            value = getattr(getattr(cfg, section), key)
            choices = f.metadata.get("choices", ())
            # A list field's choices apply to each of its items.
            outside = [v for v in (value if isinstance(value, list) else [value]) if v not in choices]
            if choices and outside:
                raise UserError(f"{section}.{key} must be one of {', '.join(choices)}; got {outside[0]!r}")
            origin = origins.get(f"{section}.{key}", "the defaults")
            _check_range(f"{section}.{key}", value, f.metadata, origin)
            for i, table in enumerate(value if isinstance(value, list) else []):
                for item in dataclasses.fields(table) if dataclasses.is_dataclass(table) else ():
                    _check_range(f"{section}.{key}[{i}].{item.name}", getattr(table, item.name), item.metadata, origin)


def load_config(argv: list[str]) -> JobConfig:
    """Build the JobConfig for these command-line arguments (without the program name)."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    cli = _parse_cli(argv)
    cfg = JobConfig()
    origins: dict[str, str] = {}  # 'section.key' -> where its value came from, for the error sentences
    config_file = next((v for k, v in cli if k == "job.config_file"), "")
    if config_file:
        for dotted, value in _flatten_toml(_read_toml(config_file), "", config_file):
            if dotted == "job.config_file":  # it would read as an include that never happens
                raise UserError(
                    f"{config_file} sets job.config_file, which only the command line can set (a config file "
                    "includes no other); remove that line and pass --job.config_file on the command line"
                )
            _set(cfg, dotted, value, config_file, from_cli=False, origins=origins)
    for dotted, value in cli:
        _set(cfg, dotted, value, "the command line", from_cli=True, origins=origins)
    _check_values(cfg, origins)
    start_from_folder(cfg.model, cfg.checkpoint, set(origins))  # a Hugging Face model folder names the model
    check_rules(cfg)
    return cfg


def field_doc(f: dataclasses.Field) -> str:
    """The field's doc with its choices or range, as --help and the README reference show it."""
    choices = f" (one of {', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else ""
    bounds = f" ({range_text(f.metadata)})" if range_text(f.metadata) else ""
    return f"{f.metadata['doc']}{choices}{bounds}"


def help_text() -> str:
    lines = ["usage: python -m titanlite.train --job.config_file X.toml [--section.key value ...]", ""]
    for section in _sections():
        lines.append(f"[{section}]")
        for key, f in _fields(section).items():
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"  --{section}.{key}  {_type_name(f.type)} = {default!r}\n      {field_doc(f)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return (
            "{ "
            + ", ".join(f"{f.name} = {_toml_value(getattr(value, f.name))}" for f in dataclasses.fields(value))
            + " }"
        )
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value) if isinstance(value, str) else str(value)


def to_toml(cfg: JobConfig) -> str:
    """The whole resolved config as TOML; loading it back gives the same config. The file it was read from is a
    comment: only the command line names a config file."""
    blocks = []
    for section in _sections():
        body = [
            ("# " if (section, k) == ("job", "config_file") else "")
            + f"{k} = {_toml_value(getattr(getattr(cfg, section), k))}"
            for k in _fields(section)
        ]
        blocks.append(f"[{section}]\n" + "\n".join(body))
    return "\n\n".join(blocks) + "\n"


def write_resolved_config(cfg: JobConfig, folder: Path) -> Path:
    """Write config.toml into the run folder so the exact run can be repeated."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(to_toml(cfg))
    return path
