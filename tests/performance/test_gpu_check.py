"""benchmarks/gpu_check.py's logic, run on the host (``--device cpu``): every check runs, measures a peak under its
formula and, where it compares values, finds them equal. Its CUDA path needs a GPU and has not run yet."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check

        yield gpu_check
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_gpu_check_on_the_host_passes_every_check_within_its_formula(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # see test_stage3's Note: [glibc's mmap threshold]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--size", "host", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    checks = json.loads(out.read_text())
    assert [c["name"] for c in checks] == ["placement", "construction", "loading", "offload"], done.stderr
    for check in checks:
        assert check["passed"] and check["values_equal"], done.stdout
    assert done.returncode == 0


def test_gpu_check_bounds_follow_the_formulas(gpu_check):
    engine = gpu_check.ZeroEngine(gpu_check.llama("tiny"), None, gpu_check._stage3())
    s = gpu_check.sizes(engine)
    assert s["psi"] == sum(p.numel() for p in gpu_check.llama("tiny").parameters())
    assert s["root"] > s["unit"] > 0 and s["tensor"] == 2048 * 64 and s["ranks"] == 1
    failed = gpu_check.Check("x", measured=2, bound=1, formula="f")
    assert not failed.passed and "FAIL" in gpu_check.table([failed])
