"""``ds-strategy config-table``: the README's strategy-name and ZeroConfig tables, generated so they cannot drift.

The strategy table comes from ``PRESETS`` (the names every adapter registers) and the config table from
ZeroConfig's fields and the ``name (default ...): meaning`` entries of its docstring. ``tests/test_readme.py``
checks that the README holds exactly this output.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

HELP = "print the README's markdown tables of strategy names and ZeroConfig fields"

_ENTRY = re.compile(r"^    (\w+) \(default (.*?)\): (.*)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print(markdown_tables())
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
    from ..lightning.strategy import PRESETS

    lines = ["| strategy name | ZeroConfig fields it sets |", "| --- | --- |"]
    lines += [f"| `{name}` | " + ", ".join(f"`{k}={v!r}`" for k, v in fields.items()) + " |"
              for name, fields in PRESETS.items()]
    documented = documented_fields()
    lines += ["", "| field | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(ZeroConfig):
        default, meaning = documented.get(field.name, ("", "(undocumented)"))
        lines.append(f"| `{field.name}` | {default} | {meaning.replace('|', '/')} |")
    return "\n".join(lines)
