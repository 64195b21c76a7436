"""The DeepSpeed compatibility table of docs/migrating-from-deepspeed.md, generated from the key tables so that it
cannot drift.

One row per key DeepSpeed accepts (``key_tables``): its dotted path, DeepSpeed's default, and what ds_strategy does
with it. ``ds-strategy config-table`` prints it after the ZeroConfig table, and ``--update docs`` rewrites its marked
block.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..config.deepspeed.key_tables import DEEPSPEED
from ..config.deepspeed.rule_kinds import NO_DEFAULT, Rule, Table


def _rows(table: Table, prefix: str = "") -> Iterator[tuple[str, Rule]]:
    for name, rule in table.items():
        if isinstance(rule, dict):
            yield from _rows(rule, prefix + name + ".")
        else:
            yield prefix + name, rule


def markdown_table() -> str:
    lines = [
        "| DeepSpeed key | DeepSpeed default | ds_strategy |",
        "| --- | --- | --- |",
        "| any other top-level key | | ignored, listed in one warning (DeepSpeed ignores them too) |",
    ]
    for key, rule in _rows(DEEPSPEED):
        default = "" if rule.default == NO_DEFAULT else f"`{rule.default!r}`"
        lines.append(f"| `{key}` | {default} | {rule.kind.value}: {rule.note.replace('|', '/')} |")
    return "\n".join(lines)
