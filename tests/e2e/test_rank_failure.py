"""A rank that fails mid-step ends the job quickly and the survivors say which rank failed and why: rank 1 of a
2-rank Lightning fit raises, runs out of memory (``torch.OutOfMemoryError``) or is SIGKILLed in its training_step
while rank 0 goes on into the step's collectives (``scripts/lightning_faults.py``). The collective timeout is
300 s, so ending before it shows the failure was detected, not timed out (how soon is a benchmark's business, not a
test's: ``benchmarks/failure_detection.py`` measures it); see ``ds_strategy/comm/rank_failure.py``, [How a failed rank
ends the job]."""

import pytest
from e2e_runs import output, run_lightning_fault

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

COLLECTIVE_TIMEOUT_S = 300.0  # lightning_faults.py's collective_timeout: a job that waited it out was not told


@pytest.fixture(scope="module", params=["raise", "oom", "sigkill"])
def failed_run(request, tmp_path_factory):
    return request.param, *run_lightning_fault(request.param, tmp_path_factory.mktemp(request.param))


EXPECTED = {
    "raise": "rank 1 failed first with ValueError: rank 1 broke its training_step on purpose",
    "oom": "rank 1 failed first with OutOfMemoryError: CUDA out of memory",
    "sigkill": "rank 1 died without raising",
}


def test_the_surviving_rank_leaves_its_collective_before_the_timeout_naming_rank_1_and_its_error(failed_run):
    mode, result, failed_at, said_at, _ = failed_run
    assert said_at is not None, output(result)[-4000:]
    assert said_at - failed_at < COLLECTIVE_TIMEOUT_S, (said_at - failed_at, output(result)[-2000:])
    message = next(line for line in result.stderr.splitlines() if line.startswith("[ds_strategy] rank 0: "))
    assert EXPECTED[mode] in message, message
    assert "PeerFailedError" in result.stderr or mode == "sigkill", output(result)[-3000:]
    assert "did not complete within" not in result.stderr  # not diagnosed as mismatched collectives


def test_the_job_exits_non_zero_before_the_collective_timeout(failed_run):
    _, result, failed_at, _, ended = failed_run
    assert result.returncode != 0
    assert ended - failed_at < COLLECTIVE_TIMEOUT_S, ended - failed_at
