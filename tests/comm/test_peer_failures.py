"""The seam around a library's collectives (``ds_strategy/comm/peer_failures.py``): a raw transport error becomes a
``PeerFailedError`` naming the failed rank, with the raw error as its cause; a rank's own error passes unchanged; a
consequence is never recorded as the job's first failure. The chaos matrix (``tests/e2e/test_rank_fault_matrix.py``)
shows it on real failures; here the failure record is written by hand, so each rule is seen alone."""

import io
import sys

import pytest
import torch.distributed as dist
from distributed import run_ranks

from ds_strategy.comm import rank_failure
from ds_strategy.comm.peer_failures import PeerFailedError, naming_failed_peers

GLOO_RESET = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41361: Connection reset by peer"


def _raised(error: BaseException, what: str = "saving the checkpoint /ckpt") -> BaseException:
    try:
        with naming_failed_peers(what):
            raise error
    except BaseException as raised:  # noqa: BLE001 - what the seam let through is the result
        return raised


def _seams(rank: int, world_size: int) -> dict:
    """Rank 1 records a failure (as its excepthook would) and stays alive; rank 0 reads errors through the seam."""
    if rank == 1:
        rank_failure.report_failure(ValueError("rank 1 broke on purpose"))
    dist.barrier()
    if rank == 1:
        return {}
    raw = RuntimeError(GLOO_RESET)
    converted = _raised(raw)
    rank_failure.report_failure(RuntimeError(GLOO_RESET))  # a consequence: must not replace rank 1's record
    own = _raised(ValueError("rank 0's own bug"))
    printed, sys.stderr = sys.stderr, io.StringIO()
    try:  # what an uncaught raw error prints, whatever entry point let it through
        sys.excepthook(RuntimeError, RuntimeError(GLOO_RESET), None)
    finally:
        printed, sys.stderr = sys.stderr.getvalue(), printed
    return {
        "uncaught": printed,
        "converted": (type(converted).__name__, str(converted), converted.__cause__ is raw),
        "own": (type(own).__name__, str(own)),
        "first": rank_failure.board().first().describe(),
    }


@pytest.fixture(scope="module")
def seams():
    return run_ranks(_seams, 2)[0]


def test_a_transport_error_becomes_peer_failed_naming_the_recorded_rank_with_the_raw_error_chained(seams):
    kind, message, chained = seams["converted"]
    assert kind == "PeerFailedError" and chained
    assert message.startswith("rank 0: saving the checkpoint /ckpt failed because rank 1 failed first with ValueError")


def test_an_uncaught_transport_error_is_printed_as_peer_failed_with_the_raw_error_chained(seams):
    printed = seams["uncaught"]
    assert "Connection reset by peer" in printed
    assert "The above exception was the direct cause of the following exception" in printed
    assert "PeerFailedError: rank 0: a collective a library issued failed because rank 1 failed first" in printed


def test_a_ranks_own_error_passes_the_seam_unchanged_while_a_peer_has_failed(seams):
    assert seams["own"] == ("ValueError", "rank 0's own bug")


def test_a_consequence_is_not_recorded_as_the_jobs_first_failure(seams):
    assert seams["first"] == "rank 1 failed first with ValueError: rank 1 broke on purpose"


def test_without_a_process_group_a_transport_error_passes_unchanged():
    raw = RuntimeError(GLOO_RESET)
    assert _raised(raw) is raw


def test_a_peer_failed_error_passes_the_next_seam_as_it_is():
    inner = PeerFailedError("rank 0: the forward failed because rank 1 died without raising")
    assert _raised(inner, "ZeroStrategy.training_step") is inner
