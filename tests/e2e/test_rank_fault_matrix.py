"""The chaos matrix: rank 1 of two is SIGKILLed, or raises, at each moment where rank 0 waits on it (a stage-3
gather, a gradient reduction, the optimizer step, a sharded save and load, an NVMe swap-in, a pipeline send, a
Ulysses all-to-all, an evaluation loop's ``fabric.all_reduce``, ``fabric.barrier()``, a tensor-parallel forward's
DTensor redistribution, accelerate's ``save_state``, the HF Trainer's checkpoint, Fabric's single-file save under
``state_dict_type="full"``), in the engine's collectives and in
those the libraries issue (``rank_fault_runs.py``). In every cell the job ends non-zero well within the
configured timeout, rank 0 raises :class:`PeerFailedError` naming rank 1 and how it failed (Note: [Collectives a
library issues] in ``ds_strategy/comm/peer_failures.py``), and a save that was cut short is never published: resuming
from the last complete checkpoint equals the uninterrupted run."""

import re
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from e2e_runs import ANNOUNCED
from rank_fault_runs import (
    FAULT_STEP,
    FAULTS,
    MOMENTS,
    TIMEOUT_S,
    VICTIM,
    WORLD_SIZE,
    adapter_rank,
    reference_rank,
    resume_rank,
    run_cell,
)

from ds_strategy.checkpoint import directory, latest

pytestmark = pytest.mark.slow  # two dozen two-rank jobs

MARGIN_S = 30.0  # tearing two processes down on a loaded machine
SAID = {  # what rank 0's error says of rank 1 (a raise inside DCP's load is its CheckpointError, the ValueError inside)
    "sigkill": (f"rank {VICTIM} died without raising",),
    "raise": (f"rank {VICTIM} failed first with ", f"rank {VICTIM} failed at {{moment}} on purpose"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's checkpoints (loaded by the load cells) and final parameters."""
    root = tmp_path_factory.mktemp("reference")
    return root, run_ranks(reference_rank, WORLD_SIZE, root)[0]


@pytest.fixture(scope="module")
def cells(tmp_path_factory, reference):
    """Each cell run once, when a test first asks for it."""
    done = {}

    def cell(moment: str, fault: str) -> dict:
        if (moment, fault) not in done:
            out = tmp_path_factory.mktemp(f"{moment}-{fault}")
            done[moment, fault] = {**run_cell(moment, fault, out, reference[0]), "out": out}
        return done[moment, fault]

    return cell


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("moment", MOMENTS)
def test_rank_0_raises_peer_failed_naming_rank_1_and_how_it_failed(cells, moment, fault):
    result = cells(moment, fault)
    error = result["error"]
    assert error is not None, result["stderr0"][-3000:]
    assert error["type"] == "PeerFailedError", (error, result["stderr0"][-3000:])
    assert all(said.format(moment=moment) in error["message"] for said in SAID[fault]), error["message"]
    assert ANNOUNCED in result["stderr0"]  # said at once, before a launcher can kill it
    assert error["at"] - result["faulted_at"] < TIMEOUT_S, error


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("moment", MOMENTS)
def test_the_job_ends_non_zero_within_the_timeout(cells, moment, fault):
    result = cells(moment, fault)
    assert result["faulted_at"] is not None, result["stderr0"][-3000:]
    assert all(code != 0 for code in result["exit_codes"]), result["exit_codes"]
    assert result["ended_at"] - result["faulted_at"] < TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("moment", ["save", "accelerate_save", "hf_trainer_save"])
def test_the_save_cut_short_is_not_published_and_those_before_it_are(cells, moment, fault):
    """Rank 0's error names the checkpoint it was saving: not there, its ``.partial`` left unpublished, every
    earlier save of the run complete."""
    result = cells(moment, fault)
    cut_short = Path(re.search(r"saving the checkpoint (\S+) failed", result["error"]["message"]).group(1))
    assert not cut_short.exists() and directory.partial_path(cut_short).exists()
    _, step_dir, *inside = cut_short.relative_to(result["out"]).parts  # checkpoints/<step dir>[/zero_checkpoint]
    ordinal = int(re.search(r"\d+", step_dir).group())
    earlier = [Path(result["out"], "checkpoints", re.sub(r"\d+", str(k), step_dir), *inside) for k in range(1, ordinal)]
    assert earlier and all((path / directory.MANIFEST).is_file() for path in earlier), earlier


@pytest.mark.parametrize("fault", FAULTS)
def test_resuming_from_the_last_complete_checkpoint_equals_the_uninterrupted_run(cells, reference, fault):
    root = cells("save", fault)["out"] / "checkpoints"
    assert latest(root).name == f"step_{FAULT_STEP - 1}"
    resumed = run_ranks(resume_rank, WORLD_SIZE, root)[0]
    assert resumed["start"] == FAULT_STEP - 1
    uninterrupted = reference[1]
    assert resumed["final"].keys() == uninterrupted.keys()
    assert all(torch.equal(resumed["final"][name], value) for name, value in uninterrupted.items())


@pytest.mark.parametrize("moment", ["accelerate_save", "hf_trainer_save"])
def test_resuming_accelerate_and_the_hf_trainer_from_their_last_complete_save_equals_the_uninterrupted_run(
    cells, tmp_path, moment
):
    """Accelerate's ``load_state`` and the Trainer's ``resume_from_checkpoint`` of the save before the one cut short
    (by the SIGKILL) end where an uninterrupted run ends."""
    out = cells(moment, "sigkill")["out"]
    last = max((path.parent.parent for path in (out / "checkpoints").rglob(directory.MANIFEST)), key=_step)
    assert _step(last) == FAULT_STEP - 1
    uninterrupted = run_ranks(adapter_rank, WORLD_SIZE, moment, tmp_path / "uninterrupted")[0]
    resumed = run_ranks(adapter_rank, WORLD_SIZE, moment, tmp_path / "resumed", last)[0]
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())


@pytest.mark.parametrize("fault", FAULTS)
def test_a_full_save_is_published_whole_or_not_at_all(cells, fault):
    """Rank 1 failed as rank 0 wrote step FAULT_STEP's single file: rank 0 held all of it, so it is published whole
    (Note: [Atomic single files] in ``ds_strategy.checkpoint.directory``), as is every earlier one; no partial file
    is left."""
    root = cells("full_save", fault)["out"] / "checkpoints"
    assert sorted(path.name for path in root.iterdir()) == [f"step_{k}.pt" for k in range(1, FAULT_STEP + 1)]
    assert [torch.load(root / f"step_{k}.pt")["step"] for k in range(1, FAULT_STEP + 1)] == [1, FAULT_STEP]


def test_resuming_fabric_from_its_last_full_save_equals_the_uninterrupted_run(cells, tmp_path):
    """``fabric.load`` of the last single file the killed run published, then its remaining steps, ends where an
    uninterrupted run ends."""
    last = cells("full_save", "sigkill")["out"] / "checkpoints" / f"step_{FAULT_STEP}.pt"
    uninterrupted = run_ranks(adapter_rank, WORLD_SIZE, "full_save", tmp_path / "uninterrupted")[0]
    resumed = run_ranks(adapter_rank, WORLD_SIZE, "full_save", tmp_path / "resumed", last)[0]
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())


def _step(path: Path) -> int:
    return int(re.search(r"\d+$", path.name).group())
