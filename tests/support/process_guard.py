"""A pytest plugin (``conftest.py`` loads it): the test run starts no copy of itself and leaves no process behind.

Note: [A test runner started as a rank]
Lightning (Trainer and Fabric) and torchrun start the ranks of a job that do not exist yet by running a command again
with ``LOCAL_RANK`` set, and Lightning runs ``sys.argv``: inside the suite, the test command. So a test that creates
``Fabric(devices=2)`` or a ``Trainer`` in ranks it started itself, without telling Lightning that they exist
(``distributed.set_lightning_environment``), starts a copy of the whole test run from each rank. The test passes all
the same (the ranks have their process group already), and the copies, re-parented to init, outlive the run. Three
checks make that a failure that names the test:

1. a pytest started with ``LOCAL_RANK`` set refuses to run, unless ``DS_STRATEGY_TESTS_UNDER_A_LAUNCHER=1`` says
   that is wanted, and reports itself to the run that started it, which it finds through ``DS_STRATEGY_TEST_SESSION``
   (every process the run starts inherits that variable);
2. after each test, and at the end of the session, such a report fails the test, and so does a process that the run
   started and that is no longer in its process tree (its parent ended without waiting for it) once it has had
   ``EXIT_GRACE_S`` to end by itself; such a process is killed;
3. ``run_ranks`` waits for what each rank started to end before it returns (``distributed.py``, Note: [What a rank
   leaves behind]), so what a test's ranks started is reported by that test.

``.ci/run`` checks the same way, with its own variable, that nothing the run started is still running after it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from process_tree import EXIT_GRACE_S, carrying, is_below, kill, still_running

SESSION_VARIABLE = "DS_STRATEGY_TEST_SESSION"
WANTED_VARIABLE = "DS_STRATEGY_TESTS_UNDER_A_LAUNCHER"
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")  # LOCAL_RANK decides
_SESSION = pytest.StashKey[Path]()
_PROBLEM = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "process_exit_grace_s",
        "seconds a process the run started and no longer waits for may take to end by itself",
        default=str(EXIT_GRACE_S),
    )


def pytest_configure(config: pytest.Config) -> None:
    session = Path(tempfile.mkdtemp(prefix="ds_strategy_test_session_"))
    os.environ[SESSION_VARIABLE] = str(session)  # before the first process is started: they all inherit it
    config.stash[_SESSION] = session


@pytest.fixture(autouse=True)
def _starts_no_copy_of_the_run_and_leaves_nothing_running(request: pytest.FixtureRequest):
    yield
    problem = _what_was_left(request.config)
    if problem:
        pytest.fail(problem, pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    problem = _what_was_left(session.config)
    if problem:
        session.config.stash[_PROBLEM] = problem
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    problem = config.stash.get(_PROBLEM, None)
    if problem:
        terminalreporter.section("processes started and left by the run", red=True)
        terminalreporter.line(problem)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is not None:
        shutil.rmtree(session, ignore_errors=True)


def _refuse_to_run_as_a_rank() -> str | None:
    """Why this pytest must not run (Note: [A test runner started as a rank]), having told the run that started it."""
    if LAUNCHER_VARIABLES[0] not in os.environ or os.environ.get(WANTED_VARIABLE) == "1":
        return None
    launcher = {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}
    command = _own_command()
    started_by = os.environ.get(SESSION_VARIABLE)
    if started_by and Path(started_by).is_dir():
        report = {"command": command, "launcher": launcher, "during": os.environ.get("PYTEST_CURRENT_TEST", "")}
        written = Path(started_by, f"copy-{os.getpid()}.json")
        written.with_suffix(".tmp").write_text(json.dumps(report))
        written.with_suffix(".tmp").rename(written)  # whole, or not there
    return (
        f"pytest was started with {_assignments(launcher)}, as Lightning's launcher or torchrun starts a rank of a job "
        f"({command}). The test suite starts the ranks it needs itself and does not run as one of them: this is a "
        f"copy of the test command that a test started by mistake (see Note: [A test runner started as a rank] in "
        f"tests/support/process_guard.py). To run the suite under a launcher on purpose, set {WANTED_VARIABLE}=1."
    )


def _what_was_left(config: pytest.Config) -> str | None:
    """Copies of the run that reported themselves, and processes the run started whose parent no longer waits for
    them (killed); ``None`` when there are none."""
    session = config.stash.get(_SESSION, None)
    if session is None:
        return None

    def orphans():
        return [found for found in carrying(SESSION_VARIABLE, str(session)) if not is_below(found, os.getpid())]

    left = still_running(orphans, float(config.getini("process_exit_grace_s")))
    problems = [_copy_started(report) for report in _take_reports(session)]
    if left:
        problems.append(
            f"{len(left)} process(es) that this run started were still running with nobody waiting for them "
            f"(killed now):\n{kill(left)}"
        )
    return "\n\n".join(problems) or None


def _take_reports(session: Path) -> list[dict]:
    reports = []
    for path in sorted(session.glob("copy-*.json")):
        reports.append(json.loads(path.read_text()))
        path.unlink()
    return reports


def _copy_started(report: dict) -> str:
    during = f", during {report['during']}" if report["during"] else ""
    return (
        f"a copy of the test run was started as a rank of a job{during}: {report['command']} with "
        f"{_assignments(report['launcher'])}. Lightning and Fabric launch the ranks they are missing by re-running "
        "sys.argv, which here is the test command: in ranks the test started itself, call "
        "distributed.set_lightning_environment(rank) before creating a Trainer or Fabric (see Note: [A test runner "
        "started as a rank] in tests/support/process_guard.py)."
    )


def _own_command() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return " ".join([sys.executable, *sys.argv])


def _assignments(variables: dict) -> str:
    return " ".join(f"{name}={value}" for name, value in variables.items())


_refusal = _refuse_to_run_as_a_rank()
if _refusal:  # on import, which conftest.py does before importing torch: a refused copy ends within a second or two
    raise pytest.UsageError(_refusal)
