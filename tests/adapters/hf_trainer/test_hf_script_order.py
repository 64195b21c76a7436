"""A Hugging Face script in its own order (arguments, then ``from_pretrained``, then the trainer) at ZeRO stage 3
with transformers' stock ZeRO-3 JSON, on 2 gloo ranks, trains like DDP.

The script (tests/adapters/hf_trainer/hf_script_order_runs.py) loads a saved tiny Llama causal LM into
``AutoModelForSequenceClassification`` (a new ``score`` head, the checkpoint's ``lm_head`` unused) and adds two
tokens with ``resize_token_embeddings`` (mean resizing), the way ``run_glue.py``/``run_clm.py`` do. The JSON is
transformers' tests/deepspeed/ds_config_zero3.json byte for byte (tests/data/deepspeed_configs): ``"auto"`` batch
sizes, optimizer, schedule and ``stage3_param_persistence_threshold`` (10 x hidden size), CPU offload of the
optimizer and the parameters. With the deepspeed package installed the arguments are transformers' own
``TrainingArguments(deepspeed=...)``; without it (hidden from the ranks) they are ``ZeroTrainingArguments``. Either
way the model is built on the meta device (DeepSpeed's ``zero.Init`` never runs), its weights read shard by shard
when the trainer prepares it, and every logged loss equals DDP's on ``from_pretrained`` (whose new head and added
rows are drawn from the same generator state). An evaluation-only run (``evaluate()`` with no ``train()``) shards the
model for inference and evaluates as DDP's Trainer does.
"""

import hf_models
import hf_script_order_runs as runs
import pytest
from distributed import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_script_order") / "causal_lm"
    hf_models.build("llama", seed=5).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def installed(pretrained, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("installed")
    return run_ranks(runs.with_deepspeed_installed, 2, str(tmp), str(pretrained), timeout=600)


def _assert_trains_like_ddp(rank: dict, ddp: dict) -> None:
    zero = rank["zero"]
    assert rank["armed_by_arguments"]
    assert zero["all_meta"] and not zero["zero_init"]  # no rank held the model before the trainer sharded it
    assert not ddp["all_meta"]
    assert zero["missing"] == ddp["missing"] == ["score.weight"]  # reported as newly initialised
    assert zero["unexpected"] == ddp["unexpected"] == ["lm_head.weight"]
    assert (zero["stage"], zero["persistence_threshold"]) == (3, 10 * hf_models.config("llama").hidden_size)
    assert zero["partitioned_numel"] > 0
    assert sorted(zero["logged"]["loss"]) == list(range(1, 7))
    for step, loss in ddp["logged"]["loss"].items():
        assert zero["logged"]["loss"][step] == pytest.approx(loss, rel=1e-5, abs=0.0), step
    assert not zero["armed_after_trainer"] and rank["whole_after"]  # undone once the trainer took the config


def test_hf_order_at_stage_3_with_deepspeed_installed_trains_like_ddp(installed):
    for rank in installed:
        _assert_trains_like_ddp(rank, rank["ddp"])


def test_an_evaluation_only_run_shards_the_model_and_evaluates_as_ddp(installed):
    for rank in installed:
        evaluated = rank["evaluation_only"]  # train() after it was refused, naming evaluate()
        assert evaluated["all_meta"]
        assert evaluated["eval_loss"] == pytest.approx(evaluated["ddp_eval_loss"], rel=1e-5, abs=0.0)


def test_hf_order_at_stage_3_without_deepspeed_trains_like_ddp_through_zero_training_arguments(
    installed, pretrained, tmp_path
):
    results = run_ranks(runs.with_deepspeed_absent, 2, str(tmp_path), str(pretrained), timeout=600)
    for rank, reference in zip(results, installed):
        _assert_trains_like_ddp(rank, reference["ddp"])
        assert "deepspeed" in rank["refused_without_deepspeed"]  # transformers' own arguments need the package
        assert rank["deepspeed_imported"] == []
