"""``ds-strategy config-table``: the documentation's strategy-name, ZeroConfig and DeepSpeed-key tables, generated so
they cannot drift.

The strategy table comes from ``PRESETS`` (the names every adapter registers) and the config table from
ZeroConfig's field declarations (default, meaning); the DeepSpeed table comes from
``ds_strategy.deepspeed.compat_table``. In a page each table sits between ``<!-- begin: NAME table -->`` and
``<!-- end: NAME table -->``; ``ds-strategy config-table --update docs`` rewrites those blocks after a field, preset or
DeepSpeed rule changes, and ``tests/architecture/test_docs.py`` checks that the pages hold exactly this output.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

HELP = "print the documentation's markdown tables of strategy names, ZeroConfig fields and DeepSpeed keys"

_BLOCKS = ("strategies table", "config table", "deepspeed table")  # the markers' names, in the order printed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--update",
        nargs="+",
        metavar="PATH",
        help="rewrite the marked tables in these Markdown files (or the .md files under these folders) instead of "
        "printing",
    )


def run(args: argparse.Namespace) -> int:
    if not args.update:
        print(markdown_tables())
        return 0
    missing = update_blocks([Path(path) for path in args.update], blocks())
    for name in missing:
        print(f"ds-strategy config-table: no <!-- begin: {name} --> ... <!-- end: {name} --> block in {args.update}")
    return 2 if missing else 0


def blocks() -> dict[str, str]:
    """Each table by the name of the block that holds it."""
    return dict(zip(_BLOCKS, markdown_tables().split("\n\n")))


def update_blocks(paths: list[Path], tables: Mapping[str, str]) -> list[str]:
    """Rewrite every marked block of ``tables`` found in the Markdown files of ``paths`` (files, or folders searched
    for ``*.md``); return the names of the blocks found nowhere."""
    found = set()
    files = [file for path in paths for file in (sorted(path.rglob("*.md")) if path.is_dir() else [path])]
    for file in files:
        text = original = file.read_text(encoding="utf-8")
        for name, table in tables.items():
            block = re.compile(rf"<!-- begin: {re.escape(name)} -->\n(?:.*?\n)?<!-- end: {re.escape(name)} -->", re.S)
            marked = f"<!-- begin: {name} -->\n{table}\n<!-- end: {name} -->"
            text, count = block.subn(lambda _: marked, text)
            found.update([name] if count else [])
        if text != original:
            file.write_text(text, encoding="utf-8")
    return [name for name in tables if name not in found]


def documented_fields() -> dict[str, tuple[str, str]]:
    """Each ZeroConfig field's declaration: field name -> (default as the docs show it, meaning)."""
    from ..config import ZeroConfig
    from ..config.zero_config import shown_default

    return {field.name: (shown_default(field), field.metadata["doc"]) for field in dataclasses.fields(ZeroConfig)}


def markdown_tables() -> str:
    from ..adapters.engine_owner import PRESETS
    from ..config import ZeroConfig
    from ..deepspeed.compat_table import markdown_table

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
