"""A rank that fails mid-step ends the job quickly and the survivors say which rank failed and why: rank 1 of a
2-rank Lightning fit raises, runs out of memory (``torch.OutOfMemoryError``) or is SIGKILLed in its training_step
while rank 0 goes on into the step's collectives (``e2e_scripts/lightning_faults.py``). The collective timeout is
300 s, so ending within seconds shows the failure was detected, not timed out; see
``ds_strategy/comm/rank_failure.py``, [How a failed rank ends the job]."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_runs import REPO, SCRIPTS, output

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

LEAVE_BOUND_S = 1.0 + 4.0  # POLL_S, plus scheduling noise on a loaded machine
EXIT_BOUND_S = 60.0  # the whole job gone: every process's teardown, far below the 300 s collective timeout


def run_timed(cmd: list, timeout: float = 240) -> tuple[subprocess.CompletedProcess, list[tuple[float, str]]]:
    """Run ``cmd``; return its result and every stderr line with the time.time() it arrived."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stderr))
    reader.start()
    stdout = proc.stdout.read()
    proc.wait(timeout=timeout)
    reader.join(timeout=10)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, "".join(line for _, line in lines)), lines


@pytest.fixture(scope="module", params=["raise", "oom", "sigkill"])
def failed_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    result, lines = run_timed([sys.executable, SCRIPTS / "lightning_faults.py", request.param, out])
    ended = time.time()
    failed_at = float(Path(out, "failed_at").read_text())
    said = [at for at, line in lines if line.startswith("[ds_strategy] rank 0: ")]
    return request.param, result, failed_at, said[0] if said else None, ended


EXPECTED = {
    "raise": "rank 1 failed first with ValueError: rank 1 broke its training_step on purpose",
    "oom": "rank 1 failed first with OutOfMemoryError: CUDA out of memory",
    "sigkill": "rank 1 died without raising",
}


def test_the_surviving_rank_leaves_its_collective_within_the_bound_naming_rank_1_and_its_error(failed_run):
    mode, result, failed_at, said_at, _ = failed_run
    assert said_at is not None, output(result)[-4000:]
    assert said_at - failed_at < LEAVE_BOUND_S, (said_at - failed_at, output(result)[-2000:])
    message = next(line for line in result.stderr.splitlines() if line.startswith("[ds_strategy] rank 0: "))
    assert EXPECTED[mode] in message, message
    assert "PeerFailedError" in result.stderr or mode == "sigkill", output(result)[-3000:]
    assert "did not complete within" not in result.stderr  # not diagnosed as mismatched collectives


def test_the_job_exits_non_zero_well_before_the_collective_timeout(failed_run):
    _, result, failed_at, _, ended = failed_run
    assert result.returncode != 0
    assert ended - failed_at < EXIT_BOUND_S, ended - failed_at
