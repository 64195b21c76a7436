"""The README's DeepSpeed compatibility table is the one ``ds-strategy config-table`` generates from the rules."""

import re
from pathlib import Path

from ds_strategy.deepspeed.compat_table import markdown_table
from ds_strategy.deepspeed.key_tables import DEEPSPEED, ZERO_OPTIMIZATION

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_deepspeed_table_is_the_generated_one():
    (block,) = re.findall(r"<!-- begin: deepspeed table -->\n(.*?)\n<!-- end: deepspeed table -->", README, re.DOTALL)
    assert block == markdown_table()


def test_table_has_a_row_for_every_rule():
    rows = markdown_table().splitlines()[3:]
    assert len(rows) == sum(len(section) if isinstance(section, dict) else 1 for section in DEEPSPEED.values()) + sum(
        len(section) - 1 for section in ZERO_OPTIMIZATION.values() if isinstance(section, dict)
    )
    assert "| `zero_optimization.offload_param.pin_memory` | `True` | mapped: `ZeroConfig.pin_memory` |" in rows
