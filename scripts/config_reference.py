"""Regenerate docs/configuration.md's "Configuration reference" from titanlite/config_sections/ (the same text
as `python -m titanlite.train --help`): python scripts/config_reference.py [--check]."""

import dataclasses
import sys
import typing
from pathlib import Path

from titanlite.config import SECTION_ALIASES, _sections, _type_name, field_doc

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
HEADING = "## Configuration reference"


def shown_default(f: dataclasses.Field) -> str:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(default, list):
        default = ",".join(map(str, default))
    if default == "":
        return ""
    return f"`{str(default).lower() if isinstance(default, bool) else default}`"


def item_fields(f: dataclasses.Field) -> str:
    """A list of tables: what each table's keys mean."""
    item = typing.get_args(f.type)[0] if typing.get_origin(f.type) is list else None
    if not dataclasses.is_dataclass(item):
        return ""
    return "; each item: " + ", ".join(
        f"`{g.name}` ({field_doc(g)}; default {shown_default(g) or 'empty'})" for g in dataclasses.fields(item)
    )


def reference() -> str:
    aliases = {section: alias for alias, section in SECTION_ALIASES.items()}
    lines = [
        HEADING,
        "",
        "Generated from `titanlite/config_sections/` by `scripts/config_reference.py`; "
        "`python -m titanlite.train --help` prints the same.",
        "",
    ]
    for name, section in _sections().items():
        also = f" (also `[{aliases[name]}]`)" if name in aliases else ""
        lines += [f"**`[{name}]`**{also}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(section):
            doc = (field_doc(f) + item_fields(f)).replace("|", "\\|")
            lines.append(f"| `{f.name}` | {_type_name(f.type)} | {shown_default(f)} | {doc} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = PAGE.read_text()
    before = text.split(HEADING, 1)[0]
    updated = before + reference()
    if "--check" in sys.argv[1:]:
        return 0 if updated == text else 1
    PAGE.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
