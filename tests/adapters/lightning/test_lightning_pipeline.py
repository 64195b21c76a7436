"""The Lightning Trainer trains a pipeline-parallel model on ZeroStrategy as one process would: the batch split into
micro-batches, Lightning's gradient accumulation on top, the loss the Trainer logs the same on every rank, validation
through the schedule's forward-only path, and the same LightningModule at pipeline size 1. (Fabric and Accelerate
pipelines: the composition matrix, ``test_composition_matrix``.)"""

import pytest
import torch
from distributed import run_ranks
from lightning_pipeline_runs import VAL_BATCHES, fit, reference
from pipeline_runs import merged_params

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def _assert_like_reference(ranks: list[dict], expected: dict) -> None:
    """Parameters within 1e-5 in norm (AdamW amplifies rounding in single entries, as training_loops explains),
    tied copies under their owner's name; training and validation losses within 1e-5."""
    _assert_params_match(ranks, expected)
    dp = len(ranks) // 2 if ranks[0]["mesh"] else len(ranks)
    for rank, run in enumerate(ranks):
        assert run["sampler"] == {"num_replicas": dp, "rank": rank % dp}
        torch.testing.assert_close(run["train"], expected["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(run["val"]["before"], expected["val_before"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(run["val"]["after"], expected["val_after"], rtol=1e-5, atol=1e-6)


def _assert_params_match(ranks: list[dict], expected: dict) -> None:
    merged = merged_params(ranks)
    assert set(merged) == set(expected["params"])
    for name, value in expected["params"].items():
        error = ((merged[name] - value).norm() / value.norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.2e}"


def test_trainer_pipeline_matches_single_process_with_accumulation():
    ranks = run_ranks(fit, 2, 2, timeout=300)
    expected = reference()
    _assert_like_reference(ranks, expected)
    assert ranks[0]["mesh"] == ("pipeline_parallel", "data_parallel", "tensor_parallel")
    assert len(ranks[0]["val"]["before"]) == VAL_BATCHES
    logged = [run["logged"] for run in ranks]
    assert logged[0] == logged[1], "every rank logs the last stage's loss"
    train_logged = [m["train_loss"] for m in logged[0] if "train_loss" in m]
    assert train_logged and all(value in ranks[0]["train"] for value in train_logged)
    torch.testing.assert_close(train_logged[-1], expected["losses"][-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        [m["val_loss"] for m in logged[0] if "val_loss" in m][-1], sum(expected["val_after"]) / VAL_BATCHES
    )


def test_trainer_pipeline_by_data_parallel_clips_through_the_engine():
    ranks = run_ranks(fit, 4, 2, stage=2, clip=0.3, timeout=300)
    expected = reference(clip=0.3)
    assert min(expected["norms"]) > 0.3, "every step clips"
    _assert_like_reference(ranks, expected)


def test_stage_3_regathering_survives_the_switches_between_training_and_validation():
    """torch re-infers the stages' shapes on every switch between training and evaluation, running every module:
    at stage 3 with ``pipeline_keep_gathered=False`` the runner must gather them all first, each time."""
    fields = dict(pipeline_keep_gathered=False, pipeline_schedule="zero_bubble", param_persistence_threshold=0)
    ranks = run_ranks(fit, 2, 2, stage=3, timeout=300, **fields)
    _assert_like_reference(ranks, reference())


def test_same_module_trains_without_pipelining():
    ranks = run_ranks(fit, 2, 1, timeout=300)
    _assert_like_reference(ranks, reference())
    assert ranks[0]["mesh"] is None


def test_trainer_checkpoint_at_pipeline_size_two_resumes_at_data_parallel_two(tmp_path):
    path = str(tmp_path / "pp2.ckpt")
    run_ranks(fit, 2, 2, save=path, timeout=300)
    resumed = run_ranks(fit, 2, 1, resume=path, timeout=300)  # max_steps already reached: the loaded state only
    expected = reference()
    _assert_params_match(resumed, expected)
    assert all(run["train"] == [] for run in resumed)
