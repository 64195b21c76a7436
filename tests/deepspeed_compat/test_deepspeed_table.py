"""The DeepSpeed compatibility table ``ds-strategy config-table`` generates has a row for every rule. (That the
documentation holds exactly this table: ``test_docs.py``.)"""

from ds_strategy.config.deepspeed.key_tables import DEEPSPEED, ZERO_OPTIMIZATION
from ds_strategy.deepspeed.compat_table import markdown_table


def test_table_has_a_row_for_every_rule():
    rows = markdown_table().splitlines()[3:]
    assert len(rows) == sum(len(section) if isinstance(section, dict) else 1 for section in DEEPSPEED.values()) + sum(
        len(section) - 1 for section in ZERO_OPTIMIZATION.values() if isinstance(section, dict)
    )
    assert "| `zero_optimization.offload_param.pin_memory` | `True` | mapped: `ZeroConfig.pin_memory` |" in rows
