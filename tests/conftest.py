"""Session-wide test setup; pytest imports this before any test module.

Triton decides interpret-or-compile when its ``triton.language`` module is first imported (see
``ds_strategy.kernels.dispatch``), and Lightning or ``torch._dynamo`` import it early, so the interpreter has to
be requested here, before any of them. Without a GPU that lets ``test_kernels.py`` run the Triton kernels on CPU
tensors by forcing ``backend="triton"``; every other test keeps the fast reference path, because production
dispatch never sends CPU tensors to Triton whatever the environment says. Spawned ranks inherit the variable,
harmlessly for the same reason. With a GPU the kernels are compiled and tested on CUDA tensors instead.

``process_guard`` fails a test that starts a copy of the test run or leaves a process running (Note: [A test runner
started as a rank] there).

Note: [The repository root is not an import root]
``python -m pytest`` puts the current directory first on ``sys.path``, and from the repository's root that makes
our top-level ``kernels/`` folder (installed as ``ds_strategy.kernels``) importable as ``kernels``, ahead of the
PyPI package of that name, which transformers imports since 5.25 (``from kernels import CUDAProperties`` fails on
ours). Every package the tests use is installed, ``ds_strategy`` included (editable), so the root is taken off
``sys.path`` here, before anything imports transformers; spawned ranks start from this ``sys.path``. A script run
as ``python path/to/script.py`` has its own folder first instead, and a user's installed wheel has no top-level
``kernels`` at all.
"""

import os
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != _ROOT]

pytest.register_assert_rewrite("process_guard")
import process_guard  # noqa: E402, F401 - before torch: a copy of the run started as a rank stops at once
import torch  # noqa: E402

pytest_plugins = ["process_guard"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
