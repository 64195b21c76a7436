"""``ds-strategy config-table``: the README's strategy-name, ZeroConfig and DeepSpeed-key tables, generated so they
cannot drift.

The strategy table comes from ``PRESETS`` (the names every adapter registers) and the config table from
ZeroConfig's fields and the ``name (default ...): meaning`` entries of its docstring. ``tests/test_readme.py``
checks that the README holds exactly this output; ``ds-strategy config-table --update README.md`` rewrites the
README's marked blocks after a field, preset or DeepSpeed rule changes (the DeepSpeed table comes from
``ds_strategy.deepspeed.compat_table``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

HELP = "print the README's markdown tables of strategy names, ZeroConfig fields and DeepSpeed keys"

_ENTRY = re.compile(r"^    (\w+) \(default (.*?)\): (.*)$")
_BLOCKS = (
    "strategies",
    "config",
    "deepspeed",
)  # README markers: <!-- begin: NAME table --> ... <!-- end: NAME table -->


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--update", metavar="README", help="rewrite the marked tables in this file instead of printing")


def run(args: argparse.Namespace) -> int:
    tables = markdown_tables()
    if not args.update:
        print(tables)
        return 0
    path = Path(args.update)
    text = path.read_text(encoding="utf-8")
    for name, table in zip(_BLOCKS, tables.split("\n\n")):
        begin, end = f"<!-- begin: {name} table -->\n", f"\n<!-- end: {name} table -->"
        if begin not in text or end not in text:
            print(f"ds-strategy config-table: {path} has no {begin.strip()} ... {end.strip()} block")
            return 2
        head, rest = text.split(begin, 1)
        text = head + begin + table + end + rest.split(end, 1)[1]
    path.write_text(text, encoding="utf-8")
    return 0


def documented_fields() -> dict[str, tuple[str, str]]:
    """ZeroConfig's docstring entries: field name -> (default as documented, meaning)."""
    from ..config import ZeroConfig

    entries: dict[str, list[str]] = {}
    current = None
    for line in inspect.getdoc(ZeroConfig).splitlines():
        match = _ENTRY.match(line)
        if match:
            current = match.group(1)
            entries[current] = [match.group(2), match.group(3)]
        elif current and line.startswith(" " * 8):
            entries[current][1] += " " + line.strip()
        else:
            current = None
    return {name: (default, meaning) for name, (default, meaning) in entries.items()}


def markdown_tables() -> str:
    from ..config import ZeroConfig
    from ..deepspeed.compat_table import markdown_table
    from ..engine_owner import PRESETS

    lines = ["| strategy name | ZeroConfig fields it sets |", "| --- | --- |"]
    lines += [
        f"| `{name}` | " + ", ".join(f"`{k}={v!r}`" for k, v in fields.items()) + " |"
        for name, fields in PRESETS.items()
    ]
    documented = documented_fields()
    lines += ["", "| field | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(ZeroConfig):
        default, meaning = documented.get(field.name, ("", "(undocumented)"))
        lines.append(f"| `{field.name}` | {default} | {meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n\n" + markdown_table()
