"""The suite's guard against tests that start a copy of the test run or leave processes running (Note: [A test
runner started as a rank] in ``process_guard.py``), run on a small test file in a pytest of its own: each way a test
can do it fails that test by name, what it left is killed, and nothing the inner run started outlives it."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from process_tree import carrying

SUPPORT = Path(__file__).parent  # process_guard.py and process_tree.py, beside this file

# What Lightning's subprocess launcher runs for a rank it is missing: the command that is running, again, with
# LOCAL_RANK set; started from the test, or from a rank that ends at once (as run_ranks' ranks do), so that nobody
# waits for it.
INNER_TESTS = """
import os
import signal
import subprocess
import sys

AGAIN = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
START_AND_END = "import subprocess, sys; subprocess.Popen(sys.argv[1:])"


def as_rank_1(**more):
    return {**os.environ, "LOCAL_RANK": "1", "WORLD_SIZE": "2", **more}


def test_starts_a_copy_of_the_run_and_waits_for_it():
    subprocess.run(AGAIN, env=as_rank_1())


def test_starts_a_copy_of_the_run_that_nobody_waits_for():
    subprocess.run([sys.executable, "-c", START_AND_END, *AGAIN], env=as_rank_1())


def test_leaves_a_process_that_nobody_waits_for():
    subprocess.run([sys.executable, "-c", START_AND_END, sys.executable, "-c", "import time; time.sleep(3600)"])


def test_starts_a_copy_of_the_run_as_a_rank_on_purpose():
    wanted = as_rank_1(DS_STRATEGY_TESTS_UNDER_A_LAUNCHER="1")
    assert subprocess.run([*AGAIN, "-k", "leaves_nothing"], env=wanted).returncode == 0


def test_leaves_nothing():
    pass
"""


@pytest.mark.slow  # a pytest of its own that starts four more, with a 5 s grace: not in the fast tier
def test_each_way_a_test_starts_a_copy_of_the_run_or_leaves_a_process_fails_it_by_name(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["process_guard"]\n')
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    mark = uuid.uuid4().hex
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "process_exit_grace_s=5", "-rA"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SUPPORT), "INNER_RUN_MARK": mark},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = inner.stdout + inner.stderr
    assert inner.returncode == 1, out
    assert "PASSED test_inner.py::test_leaves_nothing" in out, out
    assert "PASSED test_inner.py::test_starts_a_copy_of_the_run_as_a_rank_on_purpose" in out, out
    copy = "pytest/__main__.py -q -p no:cacheprovider -o process_exit_grace_s=5 -rA"
    reported = "a copy of the test run was started as a rank of a job, during test_inner.py::test_starts_a_copy"
    error = _teardown_error(out, "test_starts_a_copy_of_the_run_and_waits_for_it")
    assert reported in error and copy in error and "LOCAL_RANK=1 WORLD_SIZE=2" in error, error
    error = _teardown_error(out, "test_starts_a_copy_of_the_run_that_nobody_waits_for")
    # reported by the copy, or killed as a process nobody waits for should it not have reported within the grace
    assert copy in error and (reported in error or "still running with nobody waiting for them" in error), error
    error = _teardown_error(out, "test_leaves_a_process_that_nobody_waits_for")
    assert "still running with nobody waiting for them (killed now)" in error and "time.sleep(3600)" in error, error
    assert "3 errors" in out, out
    assert carrying("INNER_RUN_MARK", mark) == []  # everything the inner run started has ended


def _teardown_error(out: str, test: str) -> str:
    """The section pytest prints for an error at ``test``'s teardown."""
    start = out.index(f" ERROR at teardown of {test} ")
    end = out.find(" ERROR at teardown of ", start + 1)
    return out[start : end if end >= 0 else len(out)]


def test_the_ci_check_fails_naming_and_killing_what_the_run_left_running():
    """``.ci/run``'s check after the suite: every process with the run's variable in its environment."""
    env = {**os.environ, "CI_RUN_MARK": uuid.uuid4().hex}
    check = [sys.executable, str(SUPPORT / "process_tree.py"), "CI_RUN_MARK", "0.5"]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], env=env)
    found = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
    assert found.returncode == 1 and f"pid {sleeper.pid} " in found.stderr and "time.sleep(3600)" in found.stderr
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    assert subprocess.run(check, env=env, timeout=60).returncode == 0  # nothing left now
