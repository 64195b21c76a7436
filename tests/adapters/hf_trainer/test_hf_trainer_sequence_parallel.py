"""DeepSpeed-Ulysses under the Hugging Face Trainer: ``ZeroTrainer`` (and TRL's ``ZeroSFTTrainer``) with
``sequence_parallel_size=2`` on 2 real gloo ranks logs the losses, gradient norms and evaluation loss, and saves the
weights, of ``transformers.Trainer`` (``trl.SFTTrainer``) in one process on the same data, in fp32 (relative 1e-5):
at every ZeRO stage (TRL's at stage 1), from the ZeRO config and from ``TrainingArguments.parallelism_config.
sp_size``, on whole rows and on right-padded rows of an odd length with prompts masked (so the two slices of a row
hold different numbers of labelled tokens), and with tiled MLP, tiled loss and host-offloaded activation checkpoints
on top. The runs: ``hf_trainer_sp_runs``. The token counts the Trainer uses are followed in Note: [The Trainer's
loss over a sequence-parallel group] (``ds_strategy/transformers/sequence_parallel.py``).
"""

import math
import types

import hf_trainer_sp_runs as sp_runs
import pytest
import torch
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.transformers import ZeroTrainerMixin
from ds_strategy.transformers.trainer_config import TrainerZeroConfig

RTOL = 1e-5


def _assert_logged_equal(got: dict, want: dict) -> None:
    for key, values in want.items():
        assert sorted(got[key]) == sorted(values), key
        for step, value in values.items():
            assert math.isclose(got[key][step], value, rel_tol=RTOL), (key, step, got[key][step], value)


def _assert_weights_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert (got[key] - value).norm() <= RTOL * value.norm(), key


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf_trainer_sp"))
    references = run_ranks(sp_runs.one_process_references, 1, tmp, timeout=600)[0]
    ranks = run_ranks(sp_runs.sequence_parallel_runs, 2, tmp, timeout=900)
    return references, ranks


@pytest.mark.slow
@pytest.mark.parametrize("name", sp_runs.SEQUENCE_PARALLEL_RUNS)
def test_zero_trainer_under_ulysses_logs_and_saves_what_one_process_does(trainer_runs, name):
    references, ranks = trainer_runs
    data = sp_runs.SEQUENCE_PARALLEL_RUNS[name][0]
    want = references[data]
    for rank in ranks:  # the ranks of the group log the same figures
        _assert_logged_equal(rank[name]["logged"], want["logged"])
    assert sorted(want["logged"]["loss"]) == list(range(1, sp_runs.STEPS + 1))
    assert list(want["logged"]["eval_loss"]) == [sp_runs.STEPS]
    _assert_weights_close(ranks[0][name]["saved"], want["saved"])


@pytest.mark.slow
def test_zero_sft_trainer_under_ulysses_logs_and_saves_what_trl_does_in_one_process(trainer_runs):
    """TRL computes its loss itself, through its fused LM head, from the same token count."""
    references, ranks = trainer_runs
    for rank in ranks:
        _assert_logged_equal(rank["sft"]["logged"], references["sft"]["logged"])
    _assert_weights_close(ranks[0]["sft"]["saved"], references["sft"]["saved"])


@pytest.mark.parametrize(
    ("supports", "smoothing", "words"),
    [
        (False, 0.0, "its loss compares whole sequences"),
        (True, 0.1, "label_smoothing_factor=0.1 with sequence_parallel_size=2"),
    ],
)
def test_losses_a_ulysses_group_cannot_split_are_refused(supports, smoothing, words):
    """DPO and GRPO compare whole sequences; the label smoother shifts labels within a slice."""
    trainer = types.SimpleNamespace(
        zero_settings=TrainerZeroConfig(ZeroConfig(sequence_parallel_size=2)),
        args=types.SimpleNamespace(parallelism_config=None, label_smoothing_factor=smoothing),
        supports_sequence_parallel=supports,
    )
    with pytest.raises(ValueError, match=words):
        ZeroTrainerMixin._refuse_unsliceable_loss(trainer)


def test_dpo_and_grpo_say_they_cannot_split_their_loss_and_sft_can():
    from ds_strategy.transformers import ZeroDPOTrainer, ZeroGRPOTrainer, ZeroSFTTrainer

    assert not ZeroDPOTrainer.supports_sequence_parallel and not ZeroGRPOTrainer.supports_sequence_parallel
    assert ZeroSFTTrainer.supports_sequence_parallel


def test_packed_rows_and_left_padding_are_refused_before_any_collective():
    from ds_strategy.transformers.sequence_parallel import slice_for_rank

    ids = torch.ones(1, 8, dtype=torch.long)
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}
    with pytest.raises(ValueError, match="position_ids restart within a row"):
        slice_for_rank(packed, group=None)
    left = {"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])}
    with pytest.raises(ValueError, match="exact for padding on the right only"):
        slice_for_rank(left, group=None)
