"""Take the repository's root off ``sys.path`` where importing this module runs: the test process and the ranks'
forkserver.

Note: [The repository root is not an import root]
``python -m pytest`` puts the current directory first on ``sys.path``, and from the repository's root that makes
our top-level ``kernels/`` folder (installed as ``ds_strategy.kernels``) importable as ``kernels``, ahead of the
PyPI package of that name, which transformers imports since 5.25 (``from kernels import CUDAProperties`` fails on
ours). Every package the tests use is installed, ``ds_strategy`` included, so the root is taken off ``sys.path``
before anything imports transformers. Two processes need it: the test process (``conftest.py`` imports this module
first), and the ranks' forkserver, which Python 3.11 starts as ``python -c`` from the current directory without
applying the parent's ``sys.path``; it imports transformers for its ranks, so a ``kernels`` it found in the root
would be in every forked rank's ``sys.modules``. ``distributed.py`` starts it with this folder on ``PYTHONPATH`` and
this module first in its preload list. Spawned ranks take the test process's ``sys.path`` before importing anything.
A script run as ``python path/to/script.py`` has its own folder first instead, and an installed wheel has no
top-level ``kernels`` at all.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != ROOT]
