"""DeepSpeed configs mean here what they mean in DeepSpeed: a corpus of real configs from public projects
(``tests/data/deepspeed_configs``, provenance in its SOURCES file) is read by both, field by field."""

import importlib
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from ds_strategy.adapters.micro_batch import check_micro_batch
from ds_strategy.config import ZeroConfig
from ds_strategy.config.deepspeed.key_tables import (
    BF16,
    FP16,
    OFFLOAD_OPTIMIZER,
    OFFLOAD_PARAM,
    TENSOR_PARALLEL,
    ZERO_OPTIMIZATION,
)
from ds_strategy.config.deepspeed.translate import DeepSpeedConfigWarning
from ds_strategy.config.sources import config_from_deepspeed, read_deepspeed_config

CORPUS = Path(__file__).resolve().parents[1] / "data" / "deepspeed_configs"
CONFIGS = sorted(CORPUS.glob("*.json"))
# Configs DeepSpeed accepts that need a feature ds_strategy lacks: file -> the key the error must name.
NEEDS_MISSING_FEATURE: dict[str, str] = {}
HIDDEN = 64  # the hidden size "auto" bucket sizes are resolved for, by both sides
# What Hugging Face's integration substitutes for "auto" (its trainer arguments), so DeepSpeed can read a config.
HF_FILLS = {
    "train_micro_batch_size_per_gpu": 4,
    "train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "enabled": False,
    "reduce_bucket_size": HIDDEN * HIDDEN,
    "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
    "stage3_param_persistence_threshold": 10 * HIDDEN,
    "lr": 1e-3,
    "weight_decay": 0.0,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "warmup_min_lr": 0.0,
    "warmup_max_lr": 1e-3,
    "warmup_num_steps": 10,
    "total_num_steps": 100,
}


def _deepspeed():
    """DeepSpeed's config module, the oracle: the test extra installs DeepSpeed, so it is never skipped; on its CPU
    accelerator, which needs no CUDA (chosen when DeepSpeed is first imported)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return importlib.import_module("deepspeed.runtime.config")


def _hf_filled(node, key=None):
    if isinstance(node, dict):
        return {k: _hf_filled(v, k) for k, v in node.items()}
    return HF_FILLS.get(key, node) if node == "auto" else node


def _read_quietly(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return read_deepspeed_config(path)


def test_corpus_holds_25_real_configs_each_with_its_source():
    sources = [line.split("\t") for line in (CORPUS / "SOURCES").read_text().splitlines() if not line.startswith("#")]
    assert len(CONFIGS) >= 25
    assert sorted(name for name, *_ in sources) == [path.name for path in CONFIGS]
    assert all(len(repo.split("/")) == 2 and len(commit) == 40 for _, repo, _, commit in sources)


def _device(offload) -> str:
    return "none" if offload is None else str(getattr(offload.device, "value", offload.device))


def _expected_zero_fields(ds, raw) -> dict:
    """What DeepSpeed's parsed config says, in ZeroConfig's terms (the offloads DeepSpeed ignores left out)."""
    zero, stage = ds.zero_config, ds.zero_optimization_stage
    optimizer_device = _device(zero.offload_optimizer) if stage >= 1 else "none"
    param_device = _device(zero.offload_param) if stage == 3 else "none"
    expected = {
        "stage": stage,
        "offload_optimizer": optimizer_device,
        "offload_params": param_device,
        "reduce_bucket_size": zero.reduce_bucket_size,
        "allgather_bucket_size": zero.allgather_bucket_size,
        "prefetch_bucket_size": zero.prefetch_bucket_size,
        "max_live_parameters": zero.max_live_parameters,
        "param_persistence_threshold": zero.param_persistence_threshold,
        "gradient_accumulation_steps": ds.gradient_accumulation_steps,
        "tensor_parallel_size": max(ds.tensor_parallel_config.autotp_size, 1),
    }
    if zero.sub_group_size:
        expected["sub_group_size"] = zero.sub_group_size
    if optimizer_device != "none":
        expected["pin_memory"] = zero.offload_optimizer.pin_memory
    elif param_device != "none":
        expected["pin_memory"] = zero.offload_param.pin_memory
    if raw.get("gradient_clipping") != "auto":
        expected["gradient_clipping"] = ds.gradient_clipping
    if "reduce_scatter" in raw.get("zero_optimization", {}):
        expected["gradient_reduction"] = "reduce_scatter" if zero.reduce_scatter else "all_reduce"
    if raw.get("zero_optimization", {}).get("overlap_comm") not in (None, "auto"):
        expected["overlap_comm"] = zero.overlap_comm
    precision_given = [section for section in ("fp16", "bf16") if raw.get(section, {}).get("enabled") != "auto"]
    if precision_given:
        expected["precision"] = (
            "16-mixed" if ds.float16_config.enabled else "bf16-mixed" if ds.bfloat16_config.enabled else "32-true"
        )
    if ds.float16_config.enabled:
        fp16 = ds.float16_config
        expected.update(
            loss_scale=fp16.loss_scale,
            initial_scale_power=fp16.initial_scale_power,
            loss_scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            min_loss_scale=fp16.min_loss_scale,
        )
    return expected


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_corpus_config_means_what_it_means_in_deepspeed(path):
    runtime_config = _deepspeed()
    raw = json.loads(path.read_text())
    try:
        ds = runtime_config.DeepSpeedConfig(_hf_filled(raw))
    except Exception as error:  # DeepSpeed rejects it: so must we, naming a key of the section it rejected
        with pytest.raises(ValueError, match=r"DeepSpeed \w+") as ours:
            _read_quietly(path)
        section = re.search(r"DeepSpeed (\S+)", str(ours.value)).group(1).split(".")[0].split("=")[0]
        assert section in str(error) or section.lower() in str(error).lower()
        return
    if path.name in NEEDS_MISSING_FEATURE:
        with pytest.raises(ValueError, match=rf"DeepSpeed {NEEDS_MISSING_FEATURE[path.name]}\b.* is not supported"):
            _read_quietly(path)
        return
    config = _read_quietly(path).zero.resolve_auto(HIDDEN)
    expected = _expected_zero_fields(ds, raw)
    assert {name: getattr(config, name) for name in expected} == expected
    if raw.get("gradient_clipping") == "auto":
        assert config.gradient_clipping == 0.0  # the framework's clipping applies


def test_tables_have_a_rule_for_every_field_and_alias_of_deepspeeds_strict_sections():
    _deepspeed()
    from deepspeed.runtime.precision_config import (
        DeepSpeedBF16Config,
        DeepSpeedFP16Config,
    )
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    for model, table in (
        (DeepSpeedZeroConfig, ZERO_OPTIMIZATION),
        (DeepSpeedFP16Config, FP16),
        (DeepSpeedBF16Config, BF16),
        (DeepSpeedZeroOffloadOptimizerConfig, OFFLOAD_OPTIMIZER),
        (DeepSpeedZeroOffloadParamConfig, OFFLOAD_PARAM),
        (TPTrainingConfig, TENSOR_PARALLEL),
    ):
        names = {name for name, info in model.model_fields.items()} | {
            info.alias for info in model.model_fields.values() if info.alias
        }
        assert names == set(table), model.__name__


def test_unknown_top_level_keys_are_ignored_with_one_warning_naming_them():
    with pytest.warns(DeepSpeedConfigWarning) as caught:
        config = config_from_deepspeed({"_comment": "tuned", "my_notes": 1, "zero_optimization": {"stage": 1}})
    assert config.stage == 1
    assert [str(w.message) for w in caught] == [
        "DeepSpeed config keys ignored (DeepSpeed does not know them either): _comment, my_notes"
    ]


def test_unknown_key_inside_a_section_fails_naming_its_dotted_path():
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed zero_optimization\.offload_param\.devise is not a key DeepSpeed "
        r"accepts; did you mean 'zero_optimization\.offload_param\.device'\?",
    ):
        config_from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}})


def test_no_op_keys_warn_once_only_when_they_differ_from_deepspeeds_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_from_deepspeed({"zero_optimization": {"round_robin_gradients": False, "contiguous_gradients": True}})
    with pytest.warns(DeepSpeedConfigWarning) as caught:
        config_from_deepspeed({"prescale_gradients": True, "zero_optimization": {"round_robin_gradients": True}})
    (message,) = [str(w.message) for w in caught]
    assert "zero_optimization.round_robin_gradients=True" in message and "prescale_gradients=True" in message


def test_absent_keys_mean_deepspeeds_defaults_not_zero_configs():
    config = config_from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "stage": 2}})
    assert (config.gradient_clipping, config.pin_memory) == (1.0, True)
    assert config_from_deepspeed({"fp16": {"enabled": True}}).stage == 0
    assert ZeroConfig().stage == 2 and ZeroConfig().gradient_clipping == 0.0  # ZeroConfig's own stay as they are


def test_auto_means_deepspeeds_default_or_the_frameworks_value():
    config = config_from_deepspeed(
        {
            "gradient_clipping": "auto",
            "zero_optimization": {
                "stage": 3,
                "stage3_max_live_parameters": "auto",
                "offload_param": {"device": "cpu", "buffer_size": "auto"},
            },
        }
    )
    assert (config.gradient_clipping, config.max_live_parameters, config.buffer_size) == (0.0, 10**9, 10**8)


def test_rejected_feature_names_the_key_and_what_to_do():
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed torch_autocast=\{'enabled': True\} is not supported: use the "
        r"framework's precision flag",
    ):
        config_from_deepspeed({"torch_autocast": {"enabled": True}})


def test_train_batch_size_is_checked_at_setup_naming_the_three_numbers():
    config = config_from_deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert config.resolve_batch_sizes(world_size=2).gradient_accumulation_steps == 4  # DeepSpeed derives it
    assert config_from_deepspeed({"train_batch_size": 32}).resolve_batch_sizes(4).train_micro_batch_size_per_gpu == 8
    inconsistent = config_from_deepspeed(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    )
    with pytest.raises(
        ValueError,
        match=r"train_batch_size=32 is not train_micro_batch_size_per_gpu=4 x "
        r"gradient_accumulation_steps=2 x world size 2",
    ):
        inconsistent.resolve_batch_sizes(world_size=2)


def test_micro_batch_is_checked_against_the_first_batch():
    config = ZeroConfig(train_micro_batch_size_per_gpu=4)
    check_micro_batch(config, {"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)})
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=4 but the data loader's first batch holds 3"):
        check_micro_batch(config, (torch.zeros(3, 2), torch.zeros(3)))


def test_autotp_size_turns_on_tensor_parallelism_with_the_auto_plan_as_deepspeeds_autotp_does():
    config = config_from_deepspeed({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}}})
    assert (config.tensor_parallel_size, config.tensor_parallel_plan) == (2, "auto")
    assert config_from_deepspeed({"tensor_parallel": {"autotp_size": 0}}).tensor_parallel_size == 1


def test_autotp_layer_specs_are_refused_naming_the_plan_to_use_instead():
    specs = {"layer_specs": [{"patterns": [".*o_proj.weight$"], "partition_type": "row"}]}
    with pytest.raises(ValueError, match=r"tensor_parallel\.partition_config=.* ZeroConfig\.tensor_parallel_plan"):
        config_from_deepspeed({"tensor_parallel": {"autotp_size": 2, "partition_config": specs}})
