"""The mutation gate: each deliberate breakage of ``mutations.MUTATIONS`` applied to a copy of the package, and the
tests that claim to catch it run against that copy; a mutation one of them passes is a survivor, and the gate fails
naming it.

``python tests/mutation/mutation_gate.py [NAME ...]`` runs the named mutations (all by default) and prints, for each,
whether it was killed and by which of its tests; it exits 1 when one survives or cannot be applied.
``test_mutation_gate.py`` runs it in the slow tier and checks, in the fast one, that every mutation still applies.

Note: [A mutant is a copy on PYTHONPATH]
The worktree is never edited. The installed package (editable or a wheel) is copied into a scratch folder in its
installed shape (``ds_strategy/`` with ``kernels/`` and ``configs/`` inside it, as ``setup.py`` maps them), the one
file is mutated there, and pytest runs this checkout's tests with that folder first on ``PYTHONPATH``. Python's path
finder, which ``PYTHONPATH`` feeds, comes before the editable install's finder (appended to ``sys.meta_path``) and
before ``site-packages``, so the test process, the ranks' forkserver (which keeps ``PYTHONPATH``: Note: [Every folder
of the suite is an import root]), spawned ranks and scripts all import the mutant. ``support/import_root.py`` takes
only the repository's root off ``sys.path``, and the scratch folder is not it. Before any test runs, the gate checks
that ``ds_strategy`` imports from the scratch folder; a mutant that is not imported would survive for nothing. Python
runs with ``-P``, so that the current directory (the repository's root, which holds ``ds_strategy/``) is not put
ahead of ``PYTHONPATH`` before ``import_root`` could take it off.

Note: [Killed, survived, broken]
pytest's exit status 1 (some test failed) is a catch; 0 (every test passed) is a pass. A mutation is killed when
every test listed for it catches it: a test that claims a mistake and lets it through is the defect the gate exists
to find. Any other status
(a collection error, no test selected, an interrupted run) says the gate itself is wrong, so it fails as "broken",
never as a kill: a mutation that only breaks an import would otherwise count as caught by tests that never ran.
Each test of a mutation runs in its own pytest, so the report names every test that catches it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parents[2]
# where each installed package's source lives in the checkout (setup.py's Note: [Where each package comes from])
INSTALLED_SHAPE = {
    "ds_strategy": ROOT / "ds_strategy",
    "ds_strategy/kernels": ROOT / "kernels",
    "ds_strategy/configs": ROOT / "configs",
}
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK")
TEST_TIMEOUT_S = 900


class MutationNotApplicable(Exception):
    """A mutation's snippet is not in its file exactly once: the code moved, and ``mutations.py`` needs updating."""


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    caught_by: tuple[str, ...]
    passed: tuple[str, ...]
    broken: tuple[str, ...]  # tests whose pytest neither passed nor failed (Note: [Killed, survived, broken])
    seconds: float

    @property
    def killed(self) -> bool:
        """Every test that claims the mutation failed against it."""
        return bool(self.caught_by) and not self.passed and not self.broken


def mutated_source(mutation: Mutation) -> str:
    """The mutated text of the mutation's file; raises :class:`MutationNotApplicable` unless its snippet occurs exactly
    once."""
    path = ROOT / mutation.path
    if not path.is_file():
        raise MutationNotApplicable(f"{mutation.name}: {mutation.path} is gone; update tests/mutation/mutations.py")
    text = path.read_text()
    count = text.count(mutation.find)
    if count != 1:
        raise MutationNotApplicable(
            f"{mutation.name}: the snippet {mutation.find!r} occurs {count} times in {mutation.path} (it must occur "
            f"once): the code it breaks has moved or changed; update tests/mutation/mutations.py"
        )
    return text.replace(mutation.find, mutation.replace)


def installed_copy(into: Path) -> Path:
    """The package copied into ``into`` in its installed shape; returns the folder to put on ``PYTHONPATH``."""
    site = into / "site"
    for target, source in INSTALLED_SHAPE.items():
        shutil.copytree(source, site / target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return site


def _installed_path(mutation: Mutation) -> Path:
    """Where the mutation's file lands in the installed shape."""
    for target, source in INSTALLED_SHAPE.items():  # the source folders do not nest
        if (ROOT / mutation.path).is_relative_to(source):
            return Path(target) / (ROOT / mutation.path).relative_to(source)
    raise MutationNotApplicable(f"{mutation.name}: {mutation.path} is not part of the installed package")


def _environment(site: Path) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    environment.pop("PYTEST_CURRENT_TEST", None)
    return environment


def _check_the_mutant_is_imported(site: Path, environment: dict[str, str]) -> None:
    found = subprocess.run(
        [sys.executable, "-P", "-c", "import ds_strategy, ds_strategy.kernels; print(ds_strategy.__file__)"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).is_relative_to(site):
        raise RuntimeError(f"the mutant is not what imports: ds_strategy comes from {found}, not {site}")


def run_mutation(mutation: Mutation, verbose: bool = False) -> Outcome:
    """Apply ``mutation`` to a scratch copy and run each of its tests against it."""
    source = mutated_source(mutation)
    started = time.monotonic()
    caught, passed, broken = [], [], []
    with tempfile.TemporaryDirectory(prefix="ds_strategy_mutant_") as scratch:
        site = installed_copy(Path(scratch))
        (site / _installed_path(mutation)).write_text(source)
        environment = _environment(site)
        _check_the_mutant_is_imported(site, environment)
        for test in mutation.tests:
            result = subprocess.run(
                [sys.executable, "-P", "-m", "pytest", test, "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore"],
                cwd=ROOT,
                env=environment,
                capture_output=True,
                text=True,
                timeout=TEST_TIMEOUT_S,
            )
            if verbose:
                print(result.stdout[-3000:], result.stderr[-2000:], sep="\n", flush=True)
            {0: passed, 1: caught}.get(result.returncode, broken).append(test)
            if result.returncode not in (0, 1):
                print(f"  {test}: pytest exit status {result.returncode}\n{result.stdout[-3000:]}", flush=True)
    return Outcome(mutation, tuple(caught), tuple(passed), tuple(broken), time.monotonic() - started)


def report(outcome: Outcome) -> str:
    verdict = "killed" if outcome.killed else "BROKEN" if outcome.broken else "SURVIVED"
    lines = [f"{verdict}: {outcome.mutation.name} ({outcome.seconds:.0f} s) - {outcome.mutation.why}"]
    lines += [f"    caught by {test}" for test in outcome.caught_by]
    lines += [f"    passed    {test}" for test in outcome.passed]
    lines += [f"    broken    {test}" for test in outcome.broken]
    return "\n".join(lines)


def main(names: list[str]) -> int:
    unknown = set(names) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutations: {sorted(unknown)}; known: {[m.name for m in MUTATIONS]}")
        return 2
    failed = False
    for mutation in [m for m in MUTATIONS if not names or m.name in names]:
        try:
            outcome = run_mutation(mutation, verbose=os.environ.get("MUTATION_GATE_VERBOSE") == "1")
        except MutationNotApplicable as error:
            print(f"NOT APPLICABLE: {error}", flush=True)
            failed = True
            continue
        print(report(outcome), flush=True)
        failed |= not outcome.killed
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
