"""Set the test modules' import roots where importing this module runs (the test process, the ranks' forkserver, a
benchmark or script that uses the tests' helpers): the repository's root off ``sys.path``, every folder of the suite
on it.

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
top-level ``kernels`` at all. A test that puts the root back (the GPU suite once did, for its own imports) would hand it
to every later test's ranks, so ``conftest.py`` fails such a test by name.

Note: [Every folder of the suite is an import root]
The tests are grouped in folders by topic (``tests/README.md``), but they import each other's helpers by plain
module name (``from composition_runs import ...``), and a rank imports the module holding its function by the name
it was pickled under. So every folder holding a test module (and ``support/``) goes on ``sys.path`` here, before any
test module is imported, whichever tests a run selects; forked and spawned ranks get the test process's ``sys.path``,
and the forkserver imports this module first. The folders hold no ``__init__.py``, so a module's basename must be
unique across the suite (pytest's default import mode needs that too). ``data/`` and ``e2e/scripts/`` are not
import roots: they hold fixtures and programs run as scripts.
"""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
NOT_IMPORT_ROOTS = (TESTS / "data", TESTS / "e2e" / "scripts")
FOLDERS = sorted(
    {TESTS / "support"}
    | {
        path.parent
        for path in TESTS.rglob("test_*.py")
        if not any(path.is_relative_to(skipped) for skipped in NOT_IMPORT_ROOTS)
    }
)


def root_entries() -> list[str]:
    """The entries of ``sys.path`` that are the repository's root (``""`` is the current directory)."""
    return [entry for entry in sys.path if Path(entry or os.curdir).resolve() == ROOT]


_roots = root_entries()
sys.path[:] = [entry for entry in sys.path if entry not in _roots]
sys.path[:0] = [str(folder) for folder in FOLDERS if str(folder) not in sys.path]
