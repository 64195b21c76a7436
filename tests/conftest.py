"""Session-wide test setup; pytest imports this before any test module.

Triton decides interpret-or-compile when its ``triton.language`` module is first imported (see
``ds_strategy.kernels.dispatch``), and Lightning or ``torch._dynamo`` import it early, so the interpreter has to
be requested here, before any of them. Without a GPU that lets ``unit/test_kernels.py`` run the Triton kernels on CPU
tensors by forcing ``backend="triton"``; every other test keeps the fast reference path, because production
dispatch never sends CPU tensors to Triton whatever the environment says. Spawned ranks inherit the variable,
harmlessly for the same reason. With a GPU the kernels are compiled and tested on CUDA tensors instead.

``process_guard`` fails a test that starts a copy of the test run or leaves a process running (Note: [A test runner
started as a rank] there).

The repository's root is taken off ``sys.path`` first, and every folder of the suite put on it (Notes: [The
repository root is not an import root] and [Every folder of the suite is an import root] in
``support/import_root.py``, which pyproject.toml's ``pythonpath`` makes importable here).
"""

import os

import import_root  # first: see Note: [The repository root is not an import root]
import pytest

pytest.register_assert_rewrite("process_guard")
import process_guard  # noqa: E402, F401 - before torch: a copy of the run started as a rank stops at once
import torch  # noqa: E402

pytest_plugins = ["process_guard"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _root_stays_off_sys_path():
    """Note: [The repository root is not an import root] in ``import_root.py``: a test that put it back fails."""
    yield
    assert not import_root.root_entries(), f"the repository root is back on sys.path: {import_root.root_entries()}"
