"""ZeroConfig defaults and validation, "auto" resolution, and the DeepSpeed JSON front-end."""

import dataclasses
import inspect
import json

import pytest
import torch

from ds_strategy.config import ZeroConfig, ZeroConfigError, load_config
from ds_strategy.config.auto_values import hidden_size_of
from ds_strategy.config.sources import ENV_VAR, config_from_deepspeed


class Block(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attention = torch.nn.Linear(hidden, hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)


class TinyTransformer(torch.nn.Module):
    def __init__(self, hidden: int = 64, vocab: int = 100, layers: int = 2) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden) for _ in range(layers))


# ZeroConfig defaults and normalisation


def test_defaults_follow_deepspeed():
    config = ZeroConfig()
    assert config.stage == 2
    assert config.reduce_bucket_size == "units"  # the largest unit; DeepSpeed's 5e8 when given
    assert config.allgather_bucket_size == 500_000_000
    assert config.overlap_comm and config.contiguous_gradients
    assert config.communication_dtype is None
    assert config.gradient_reduction == "auto"
    assert config.prefetch_bucket_size == "units"
    assert config.param_persistence_threshold == 100_000
    assert config.max_live_parameters == 1_000_000_000
    assert config.gradient_clipping == 0.0
    assert config.gradient_accumulation_steps == 1
    assert config.train_micro_batch_size_per_gpu is None
    assert config.precision == "32-true"
    assert (config.loss_scale, config.initial_scale_power, config.loss_scale_window) == (0.0, 16, 1000)
    assert (config.hysteresis, config.min_loss_scale, config.max_consecutive_min_scale_skips) == (2, 1.0, 10)


def test_whole_number_float_bucket_size_becomes_int():
    config = ZeroConfig(reduce_bucket_size=5e7)
    assert config.reduce_bucket_size == 50_000_000
    assert type(config.reduce_bucket_size) is int


@pytest.mark.parametrize(
    ("alias", "precision"),
    [(32, "32-true"), ("32", "32-true"), ("bf16", "bf16-mixed"), (16, "16-mixed"), ("16", "16-mixed")],
)
def test_lightning_precision_aliases_normalise(alias, precision):
    assert ZeroConfig(precision=alias).precision == precision


@pytest.mark.parametrize(
    ("alias", "short"),
    [(torch.bfloat16, "bf16"), ("bfloat16", "bf16"), (torch.float16, "fp16"), ("float32", "fp32"), ("fp32", "fp32")],
)
def test_communication_dtype_aliases_normalise_to_short_names(alias, short):
    assert ZeroConfig(communication_dtype=alias).communication_dtype == short


def test_unit_modules_list_becomes_tuple():
    assert ZeroConfig(unit_modules=[Block, "GPT2Block"]).unit_modules == (Block, "GPT2Block")


def test_from_dict_builds_the_same_config_as_keywords():
    assert ZeroConfig.from_dict({"stage": 3, "overlap_comm": False}) == ZeroConfig(stage=3, overlap_comm=False)


# ZeroConfig validation


def test_stage_4_is_rejected_naming_field_value_and_choices():
    with pytest.raises(ValueError, match=r"ZeroConfig\.stage=4 is not allowed; expected one of 0, 1, 2, 3"):
        ZeroConfig(stage=4)


def test_negative_bucket_size_is_rejected():
    with pytest.raises(ValueError, match=r"ZeroConfig\.reduce_bucket_size=-5 .*integer >= 1"):
        ZeroConfig(reduce_bucket_size=-5)


def test_zero_bucket_size_is_rejected():
    with pytest.raises(ValueError, match=r"ZeroConfig\.allgather_bucket_size=0 "):
        ZeroConfig(allgather_bucket_size=0)


@pytest.mark.parametrize("value", [1.5, True, "big", None])
def test_non_integer_bucket_size_is_rejected(value):
    with pytest.raises(ValueError, match=r"ZeroConfig\.reduce_bucket_size="):
        ZeroConfig(reduce_bucket_size=value)


def test_bad_precision_is_rejected_listing_allowed_values():
    with pytest.raises(ValueError, match=r"ZeroConfig\.precision='fp8' is not allowed; expected .*'bf16-mixed'"):
        ZeroConfig(precision="fp8")


def test_bad_communication_dtype_is_rejected():
    with pytest.raises(ValueError, match=r"ZeroConfig\.communication_dtype=torch\.int8 .*'bf16'"):
        ZeroConfig(communication_dtype=torch.int8)


def test_auto_is_rejected_for_a_size_deepspeed_never_sets_to_auto():
    with pytest.raises(ValueError, match=r"ZeroConfig\.allgather_bucket_size='auto'"):
        ZeroConfig(allgather_bucket_size="auto")


def test_unknown_key_in_from_dict_is_rejected_naming_it():
    with pytest.raises(ValueError, match=r"ZeroConfig has no field 'offload'"):
        ZeroConfig.from_dict({"offload": True})


def test_misspelled_key_suggests_the_field_meant():
    with pytest.raises(ValueError, match=r"'reduce_bucket_sise'; did you mean 'reduce_bucket_size'\?"):
        ZeroConfig.from_dict({"reduce_bucket_sise": 10})


def test_replace_validates_the_new_value():
    with pytest.raises(ValueError, match=r"ZeroConfig\.hysteresis=0 "):
        ZeroConfig().replace(hysteresis=0)


# "auto" sizes


def test_auto_sizes_are_kept_until_resolved():
    config = ZeroConfig(reduce_bucket_size="auto", prefetch_bucket_size="auto", param_persistence_threshold="auto")
    assert config.has_auto_values
    assert config.reduce_bucket_size == "auto"


def test_resolve_auto_applies_deepspeed_formulas_to_the_hidden_size():
    config = ZeroConfig(reduce_bucket_size="auto", prefetch_bucket_size="auto", param_persistence_threshold="auto")
    resolved = config.resolve_auto(hidden_size_of(TinyTransformer(hidden=64)))
    assert resolved.reduce_bucket_size == 4096
    assert resolved.prefetch_bucket_size == 3686
    assert resolved.param_persistence_threshold == 640
    assert not resolved.has_auto_values


def test_resolve_auto_leaves_explicit_sizes_alone():
    resolved = ZeroConfig(reduce_bucket_size="auto", prefetch_bucket_size=123).resolve_auto(64)
    assert (resolved.reduce_bucket_size, resolved.prefetch_bucket_size) == (4096, 123)


def test_hidden_size_of_prefers_the_config_attribute():
    model = TinyTransformer(hidden=64)
    model.config = type("Config", (), {"hidden_size": 768})()
    assert hidden_size_of(model) == 768


def test_hidden_size_of_falls_back_to_the_most_common_parameter_width():
    assert hidden_size_of(TinyTransformer(hidden=64)) == 64


def test_hidden_size_of_breaks_ties_toward_the_larger_width():
    assert hidden_size_of(torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 32))) == 32


# Derived properties


@pytest.mark.parametrize(
    ("stage", "optimizer", "gradients", "parameters"),
    [(0, False, False, False), (1, True, False, False), (2, True, True, False), (3, True, True, True)],
)
def test_partition_properties_follow_stage(stage, optimizer, gradients, parameters):
    plan = ZeroConfig(stage=stage).plan
    assert (plan.partitions_optimizer, plan.partitions_gradients, plan.partitions_parameters) == (
        optimizer,
        gradients,
        parameters,
    )


@pytest.mark.parametrize(
    ("precision", "dtype", "separate_master", "scaled"),
    [
        ("32-true", torch.float32, False, False),
        ("bf16-mixed", torch.bfloat16, True, False),
        ("bf16-true", torch.bfloat16, False, False),
        ("16-mixed", torch.float16, True, True),
        ("16-true", torch.float16, False, True),
    ],
)
def test_precision_properties_follow_precision(precision, dtype, separate_master, scaled):
    plan = ZeroConfig(precision=precision).plan
    assert (plan.compute_dtype, plan.separate_master, plan.loss_scaling) == (
        dtype,
        separate_master,
        scaled,
    )


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", torch.float32), ("16-mixed", torch.float32), ("bf16-mixed", torch.bfloat16)]
)
def test_auto_communication_dtype_is_fp32_except_for_bf16_training(precision, dtype):
    assert ZeroConfig(precision=precision).plan.comm_dtype == dtype


def test_explicit_communication_dtype_overrides_auto():
    assert ZeroConfig(precision="bf16-mixed", communication_dtype="fp32").plan.comm_dtype == torch.float32


@pytest.mark.parametrize(("backend", "collective"), [("gloo", "all_reduce"), ("nccl", "reduce_scatter")])
def test_auto_gradient_reduction_picks_the_collective_per_backend(backend, collective):
    assert ZeroConfig().plan.gradient_collective(backend) == collective


def test_explicit_gradient_reduction_ignores_the_backend():
    assert ZeroConfig(gradient_reduction="reduce_scatter").plan.gradient_collective("gloo") == "reduce_scatter"


# DeepSpeed JSON front-end

REALISTIC_STAGE2 = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
}


def test_realistic_stage2_deepspeed_config_maps_to_zero_config():
    expected = ZeroConfig(
        stage=2,
        allgather_bucket_size=200_000_000,
        reduce_bucket_size=200_000_000,
        gradient_reduction="reduce_scatter",
        gradient_clipping=1.0,
        gradient_accumulation_steps=4,
        train_micro_batch_size_per_gpu=8,
        train_batch_size=64,
        prefetch_bucket_size=50_000_000,  # DeepSpeed's default, which a DeepSpeed config means
        precision="16-mixed",
        initial_scale_power=12,
        loss_scale_window=500,
    )
    assert config_from_deepspeed(REALISTIC_STAGE2) == expected


def test_deepspeed_config_loads_from_a_json_file_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(REALISTIC_STAGE2))
    assert config_from_deepspeed(path) == config_from_deepspeed(str(path)) == config_from_deepspeed(REALISTIC_STAGE2)


def test_deepspeed_stage3_keys_map_to_stage3_fields():
    config = config_from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_prefetch_bucket_size": 1e6,
                "stage3_param_persistence_threshold": 1e4,
                "stage3_max_live_parameters": 1e8,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        }
    )
    assert (config.prefetch_bucket_size, config.param_persistence_threshold, config.max_live_parameters) == (
        1_000_000,
        10_000,
        100_000_000,
    )


def test_deepspeed_reduce_scatter_false_selects_all_reduce():
    assert config_from_deepspeed({"zero_optimization": {"reduce_scatter": False}}).gradient_reduction == "all_reduce"


def test_deepspeed_bf16_section_selects_bf16_mixed():
    assert config_from_deepspeed({"bf16": {"enabled": True}}).precision == "bf16-mixed"


def test_deepspeed_auto_values_become_defaults_or_stay_auto_for_resolution():
    config = config_from_deepspeed(
        {
            "gradient_clipping": "auto",
            "gradient_accumulation_steps": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
        }
    )
    assert (config.gradient_clipping, config.gradient_accumulation_steps) == (0.0, 1)
    assert config.train_micro_batch_size_per_gpu is None
    assert (config.reduce_bucket_size, config.prefetch_bucket_size) == ("auto", "auto")


def test_rejected_top_level_deepspeed_key_fails_naming_it_and_why():
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed sparse_gradients=True is not supported: ds_strategy does not "
        r"implement sparse gradients",
    ):
        config_from_deepspeed({"sparse_gradients": True})


def test_unsupported_nested_deepspeed_key_is_rejected_with_dotted_name_and_suggestion():
    with pytest.raises(
        ValueError,
        match=r"zero_optimization\.stage3_prefetch_bucket is not a key DeepSpeed accepts.*"
        r"did you mean 'zero_optimization\.stage3_prefetch_bucket_size'\?",
    ):
        config_from_deepspeed({"zero_optimization": {"stage3_prefetch_bucket": 10}})


def test_deepspeed_offload_sections_map_to_offload_fields():
    config = config_from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 1e6,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": "/local_nvme",
                    "pin_memory": True,
                    "ratio": 0.5,
                    "buffer_count": 6,
                    "fast_init": False,
                    "pipeline_read": True,
                },
                "offload_param": {
                    "device": "cpu",
                    "nvme_path": "/local_nvme",
                    "pin_memory": True,
                    "buffer_count": 5,
                    "buffer_size": 1e7,
                    "max_in_cpu": 1e9,
                },
            },
            "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1},
        }
    )
    assert (config.offload_optimizer, config.offload_params, config.nvme_path) == ("nvme", "cpu", "/local_nvme")
    assert (config.pin_memory, config.offload_ratio, config.buffer_count) == (True, 0.5, 6)
    assert (config.buffer_size, config.sub_group_size) == (10_000_000, 1_000_000)


def test_deepspeed_offload_sections_with_different_nvme_paths_conflict():
    with pytest.raises(
        ValueError, match=r"offload_param\.nvme_path='/b' conflicts with .*offload_optimizer\.nvme_path"
    ):
        config_from_deepspeed(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                    "offload_param": {"device": "nvme", "nvme_path": "/b"},
                }
            }
        )


def test_deepspeed_param_offload_below_stage3_is_ignored_with_a_warning_as_deepspeed_does():
    with pytest.warns(UserWarning, match=r"offload_param\.device='cpu' \(DeepSpeed ignores it below stage 3\)"):
        config = config_from_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert (config.stage, config.offload_params) == (2, "none")


def test_offload_settings_are_validated_naming_the_field():
    with pytest.raises(ValueError, match=r"ZeroConfig\.nvme_path=None is not allowed with offload_optimizer='nvme'"):
        ZeroConfig(stage=2, offload_optimizer="nvme")
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_optimizer='cpu' is not allowed with stage=0"):
        ZeroConfig(stage=0, offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_ratio=1\.5 is not allowed"):
        ZeroConfig(offload_optimizer="cpu", offload_ratio=1.5)


def test_deepspeed_optimizer_we_do_not_implement_points_to_configure_optimizers():
    with pytest.raises(ValueError, match=r"DeepSpeed optimizer\.type='OneBitAdam' .*configure_optimizers"):
        config_from_deepspeed({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}})


def test_deepspeed_consecutive_hysteresis_sets_the_field():
    config = config_from_deepspeed({"fp16": {"enabled": True, "consecutive_hysteresis": True}})
    assert config.consecutive_hysteresis is True


def test_deepspeed_fp16_and_bf16_both_enabled_is_rejected():
    with pytest.raises(ValueError, match=r"bf16\.enabled=True conflicts with fp16\.enabled=True"):
        config_from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_deepspeed_bad_value_error_names_the_deepspeed_key_and_the_field():
    with pytest.raises(
        ValueError,
        match=r"zero_optimization\.stage3_prefetch_bucket_size=-1: ZeroConfig\.prefetch_bucket_size=-1 is not allowed",
    ):
        config_from_deepspeed({"zero_optimization": {"stage3_prefetch_bucket_size": -1}})


def test_deepspeed_section_that_is_not_an_object_is_rejected():
    with pytest.raises(ValueError, match=r"DeepSpeed zero_optimization must be a JSON object"):
        config_from_deepspeed({"zero_optimization": 2})


def test_grad_accum_dtype_defaults_to_the_compute_dtype_and_accepts_fp32():
    assert ZeroConfig(precision="bf16-mixed").plan.accumulation_dtype == torch.bfloat16
    assert ZeroConfig(precision="bf16-mixed", grad_accum_dtype="float32").plan.accumulation_dtype == torch.float32
    assert config_from_deepspeed({"data_types": {"grad_accum_dtype": "fp32"}}).grad_accum_dtype == "fp32"


def test_bad_grad_accum_dtype_names_the_key():
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        ZeroConfig(grad_accum_dtype="int8")


def test_contiguous_gradients_false_is_rejected_with_the_reason():
    with pytest.raises(ValueError, match="contiguous_gradients=False .*flat contiguous buffers"):
        ZeroConfig(contiguous_gradients=False)


def test_load_config_reads_every_source_the_adapters_accept_with_fields_on_top(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, '{"stage": 1}')
    assert load_config().zero == ZeroConfig()  # the environment only where the caller reads it
    assert load_config(environment=True).zero == ZeroConfig(stage=1)
    assert load_config({"stage": 1}, overlap_comm=False).zero == ZeroConfig(stage=1, overlap_comm=False)
    assert load_config(ZeroConfig(stage=3), stage=2).zero.stage == 2
    optimizer = {"type": "AdamW", "params": {"lr": 0.1}}
    loaded = load_config({"ds_strategy": {"zero_optimization": {"stage": 3}, "optimizer": optimizer}})
    assert (loaded.zero.stage, loaded.deepspeed, loaded.sections.optimizer) == (3, True, ("AdamW", {"lr": 0.1}))
    assert load_config({"gradient_clipping": 0.5}, deepspeed=True).zero.stage == 0  # DeepSpeed's absent stage
    path = tmp_path / "zero.yaml"
    path.write_text("stge: 1\n")
    with pytest.raises(ZeroConfigError, match=f"{path}: ZeroConfig has no field 'stge'; did you mean 'stage'"):
        load_config(path)


def test_every_field_declares_its_default_check_and_meaning_once_and_the_docstring_lists_them():
    doc = inspect.getdoc(ZeroConfig)
    for field in dataclasses.fields(ZeroConfig):
        assert callable(field.metadata["check"]) and field.metadata["doc"], field.name
        assert f"    {field.name} (default " in doc, field.name
