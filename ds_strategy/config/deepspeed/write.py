"""The DeepSpeed config describing a ZeroConfig, written from the key tables, so that writing is never a second,
hand-kept inverse of reading.

Every rule that can say how its key's value follows from a ZeroConfig (``Rule.written_from``: each ``field`` rule,
and the mapped rules given one) is asked; a key whose value comes back None is left out, as is a key that repeats a
rule already written in its section (DeepSpeed's "stage3_" aliases) or a section already written (``bfloat16``).
A section with an on/off switch (``enabled``, an offload ``device``) is written only when the switch is on, so a
bf16 config carries no fp16 loss scaling and nothing offloaded carries no offload section.
``read_deepspeed_config`` reads what this writes back to the same ZeroConfig
(``tests/performance/test_autotune.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..zero_config import ZeroConfig
from .key_tables import DEEPSPEED
from .rule_kinds import Table

# A section's switch key -> whether the value written for it turns the section on.
_SWITCHES: dict[str, Callable[[Any], bool]] = {
    "enabled": lambda value: value is True,
    "device": lambda value: value not in (None, "none"),
}


def deepspeed_dict(config: ZeroConfig) -> dict[str, Any]:
    """A DeepSpeed config describing ``config``; ``config_from_deepspeed`` reads it back to the same fields."""
    return _section(DEEPSPEED, config, set())


def _section(table: Table, config: ZeroConfig, tables_written: set[int]) -> dict[str, Any]:
    written: dict[str, Any] = {}
    rules_written: set[int] = set()
    for key, rule in table.items():
        if isinstance(rule, dict):
            if id(rule) not in tables_written:
                tables_written.add(id(rule))
                section = _section(rule, config, tables_written)
                if section:
                    written[key] = section
        elif rule.written_from is not None and id(rule) not in rules_written:
            rules_written.add(id(rule))
            value = rule.written_from(config)
            if value is not None:
                written[key] = value
    switch = next((key for key in _SWITCHES if key in table), None)
    if switch is not None and not _SWITCHES[switch](written.get(switch)):
        return {}
    return written
