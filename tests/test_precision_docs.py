"""docs/precision.md's example runs as written: under bf16-mixed the engine's export is the fp32 masters, which a
learning rate below a bf16 ulp moves everywhere, and the named 16-bit export is the bf16 compute copy."""

import re
from pathlib import Path

PAGE = Path(__file__).parent.parent / "docs" / "precision.md"


def test_precision_page_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(PAGE), "exec"), {})
