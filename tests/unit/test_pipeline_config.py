"""Pipeline-parallel settings: ZeroConfig's pipeline fields, the schedule names behind them, and DeepSpeed's
``pipeline`` section read with DeepSpeed's meaning. No processes are started: every check here happens before any
process group exists."""

import re
import warnings

import pytest
import torch
import torch.distributed.pipelining.schedules as torch_schedules

from ds_strategy.adapters.micro_batch import check_micro_batch
from ds_strategy.config import ZeroConfig, ZeroConfigError
from ds_strategy.config.deepspeed.translate import DeepSpeedConfigWarning
from ds_strategy.config.sources import config_from_deepspeed
from ds_strategy.parallel.pipeline_schedules import SCHEDULES, schedule_class, stages_per_rank

# ZeroConfig fields


def test_pipelining_is_off_by_default_with_1f1b_and_one_reduction_per_step():
    config = ZeroConfig()
    assert config.pipeline_parallel_size == 1
    assert config.pipeline_schedule == "1f1b"
    assert config.pipeline_microbatches is None
    assert config.pipeline_split == "auto"
    assert config.pipeline_grad_reduction == "once"
    assert config.pipeline_keep_gathered is True


def test_good_values_are_kept():
    config = ZeroConfig(
        stage=3,
        pipeline_parallel_size=4,
        pipeline_schedule="zbv",
        pipeline_microbatches=8,
        pipeline_split="parameters",
        pipeline_grad_reduction="per_microbatch",
        pipeline_keep_gathered=False,
    )
    assert (config.pipeline_parallel_size, config.pipeline_schedule, config.pipeline_microbatches) == (4, "zbv", 8)
    assert (config.pipeline_split, config.pipeline_grad_reduction) == ("parameters", "per_microbatch")
    assert config.pipeline_keep_gathered is False


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("pipeline_parallel_size", 0, "an integer >= 1"),
        ("pipeline_parallel_size", 1.5, "an integer >= 1"),
        ("pipeline_parallel_size", True, "an integer >= 1"),
        ("pipeline_parallel_size", "2", "an integer >= 1"),
        ("pipeline_schedule", "1F1B", "one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble', 'zbv'"),
        ("pipeline_schedule", "looped_bfs", "one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble', 'zbv'"),
        ("pipeline_schedule", ["1f1b"], "one of 'gpipe'"),
        ("pipeline_microbatches", 0, "an integer >= 1 or None"),
        ("pipeline_microbatches", "auto", "an integer >= 1 or None"),
        ("pipeline_split", "uniform", '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_split", [], '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_split", ["model.layers.2", 3], '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_split", ["model.layers.2", ""], '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_split", ["model.layers.2", "model.layers.2"], '"auto", "parameters" or a list of distinct'),
        ("pipeline_split", [["model.layers.2"]], '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_split", {"model.layers.2": 1}, '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_split", None, '"auto", "parameters" or a list of distinct module names'),
        ("pipeline_grad_reduction", "per_step", "one of 'once', 'per_microbatch'"),
        ("pipeline_keep_gathered", 1, "True or False"),
        ("pipeline_keep_gathered", None, "True or False"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field_the_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(ZeroConfigError) as caught:
        ZeroConfig(**{name: value})
    assert caught.value.field == name
    assert str(caught.value).startswith(f"ZeroConfig.{name}={value!r} is not allowed; expected ")
    assert allowed in str(caught.value)


def test_a_list_of_split_points_is_stored_as_a_tuple():
    config = ZeroConfig(pipeline_split=["model.layers.2", "model.layers.4"])
    assert config.pipeline_split == ("model.layers.2", "model.layers.4")
    assert ZeroConfig.from_dict({"pipeline_split": ("model.layers.2",)}).pipeline_split == ("model.layers.2",)


@pytest.mark.parametrize("stage", [0, 1])
def test_per_microbatch_reduction_below_stage_2_is_refused_naming_both_keys(stage):
    with pytest.raises(ZeroConfigError, match=rf"pipeline_grad_reduction='per_microbatch' .* stage={stage}") as caught:
        ZeroConfig(stage=stage, pipeline_grad_reduction="per_microbatch")
    assert caught.value.field == "pipeline_grad_reduction"
    assert "needs stage >= 2" in str(caught.value)


def test_keep_gathered_false_is_accepted_below_stage_3():
    assert ZeroConfig(stage=1, pipeline_keep_gathered=False).pipeline_keep_gathered is False


def test_pipelining_with_ulysses_is_accepted_and_a_tiled_loss_with_it_refused():
    config = ZeroConfig(pipeline_parallel_size=2, sequence_parallel_size=2)
    assert (config.pipeline_parallel_size, config.sequence_parallel_size) == (2, 2)
    with pytest.raises(
        ZeroConfigError, match=re.escape("ZeroConfig.tiled_loss=True is not allowed with pipeline_parallel_size=2")
    ) as caught:
        ZeroConfig(pipeline_parallel_size=2, tiled_loss=True)
    assert caught.value.field == "tiled_loss"


# Schedule names


@pytest.mark.parametrize(
    ("schedule", "stages", "torch_class"),
    [
        ("gpipe", 1, torch_schedules.ScheduleGPipe),
        ("1f1b", 1, torch_schedules.Schedule1F1B),
        ("interleaved_1f1b", 2, torch_schedules.ScheduleInterleaved1F1B),
        ("zero_bubble", 2, torch_schedules.ScheduleInterleavedZeroBubble),
        ("zbv", 2, torch_schedules.ScheduleZBVZeroBubble),
    ],
)
def test_each_schedule_name_is_a_torch_schedule_with_its_stages_per_rank(schedule, stages, torch_class):
    assert stages_per_rank(schedule) == stages
    assert schedule_class(schedule) is torch_class
    single = issubclass(torch_class, torch_schedules.PipelineScheduleSingle)
    assert single == (stages == 1)


def test_the_config_accepts_exactly_the_known_schedules():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"}
    for schedule in SCHEDULES:
        assert ZeroConfig(pipeline_schedule=schedule).pipeline_schedule == schedule


def test_an_unknown_schedule_name_is_refused_by_the_helpers():
    with pytest.raises(ValueError, match="'looped_bfs' is not known; expected one of gpipe, 1f1b"):
        stages_per_rank("looped_bfs")
    with pytest.raises(ValueError, match="'looped_bfs' is not known"):
        schedule_class("looped_bfs")


# DeepSpeed's pipeline section


def _read(pipeline: dict) -> ZeroConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)  # keys at their defaults warn about nothing
        return config_from_deepspeed({"pipeline": pipeline})


def test_a_stage_count_sets_the_pipeline_size_and_auto_leaves_it():
    assert _read({"stages": 4}).pipeline_parallel_size == 4
    assert _read({"stages": "auto"}).pipeline_parallel_size == 1


def test_a_bad_stage_count_is_refused_naming_the_deepspeed_key():
    with pytest.raises(ValueError, match=r"DeepSpeed pipeline\.stages=0: ZeroConfig\.pipeline_parallel_size=0"):
        _read({"stages": 0})


@pytest.mark.parametrize(("partition", "split"), [("parameters", "parameters"), ("uniform", "auto"), ("best", "auto")])
def test_partition_methods_map_to_the_split(partition, split):
    assert _read({"partition": partition}).pipeline_split == split


def test_best_partition_sets_nothing_so_it_never_conflicts():
    config = config_from_deepspeed({"pipeline": {"partition": "best"}})
    assert config == config_from_deepspeed({})


def test_a_layer_type_regex_partition_is_refused_pointing_at_pipeline_split():
    with pytest.raises(ValueError, match=r"DeepSpeed pipeline\.partition='type:transformer' is not supported: .*"):
        _read({"partition": "type:transformer"})
    with pytest.raises(ValueError, match=r"ZeroConfig\.pipeline_split"):
        _read({"partition": "type:[Ll]ayer"})


@pytest.mark.parametrize("partition", ["profile", 3, ["uniform"]])
def test_an_unknown_partition_method_is_refused(partition):
    with pytest.raises(
        ValueError, match=r'DeepSpeed pipeline\.partition=.* expected "parameters", "uniform" or "best"'
    ):
        _read({"partition": partition})


def test_a_checkpoint_interval_maps_and_zero_sets_nothing():
    assert _read({"activation_checkpoint_interval": 3}).activation_checkpoint_interval == 3
    assert _read({"activation_checkpoint_interval": 0}).activation_checkpoint_interval == 1  # ZeroConfig's default
    assert _read({"activation_checkpoint_interval": 3}).activation_checkpointing == "none"  # still off


@pytest.mark.parametrize(
    ("key", "value"), [("seed_layers", False), ("pipe_partitioned", True), ("use_reentrant", True)]
)
def test_no_op_keys_at_their_defaults_are_silent(key, value):
    assert _read({key: value}) == config_from_deepspeed({})


@pytest.mark.parametrize(
    ("key", "value"),
    [("seed_layers", True), ("pipe_partitioned", False), ("grad_partitioned", False), ("use_reentrant", False)],
)
def test_no_op_keys_off_their_defaults_warn_with_their_reason(key, value):
    with pytest.warns(DeepSpeedConfigWarning, match=rf"pipeline\.{key}={value!r} \(\w.+\)"):
        config = config_from_deepspeed({"pipeline": {key: value}})
    assert config == config_from_deepspeed({})


def test_an_unknown_pipeline_key_fails_naming_its_dotted_path():
    with pytest.raises(ValueError, match=r"DeepSpeed pipeline\.stage is not a key .* did you mean 'pipeline\.stages'"):
        _read({"stage": 2})


def test_gradient_accumulation_steps_of_a_pipelined_config_is_the_micro_batch_count():
    """See Note: [DeepSpeed's gradient_accumulation_steps under pipelining]."""
    config = config_from_deepspeed({"pipeline": {"stages": 2}, "gradient_accumulation_steps": 8})
    assert (config.gradient_accumulation_steps, config.pipeline_microbatches) == (1, 8)
    unpipelined = config_from_deepspeed({"gradient_accumulation_steps": 8})
    assert (unpipelined.gradient_accumulation_steps, unpipelined.pipeline_microbatches) == (8, None)


def test_a_pipelined_train_batch_counts_micro_batches_as_deepspeed_does():
    """train_batch_size = micro-batch x micro-batches x data-parallel size (DeepSpeed's PipelineEngine)."""
    ds = {"pipeline": {"stages": 2}, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}
    config = config_from_deepspeed({**ds, "gradient_accumulation_steps": 8})
    assert config.resolve_batch_sizes(2).gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match=r"x pipeline micro-batches 8 x world size 4"):
        config.resolve_batch_sizes(4)
    derived = config_from_deepspeed(ds).resolve_batch_sizes(2)  # micro-batches default to the stage count, 2
    assert (derived.pipeline_microbatch_count, derived.gradient_accumulation_steps) == (2, 4)


def test_a_pipelined_loader_batch_holds_every_micro_batch():
    config = config_from_deepspeed(
        {"pipeline": {"stages": 2}, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    )
    check_micro_batch(config, torch.zeros(32, 7))
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=4 x 8 pipeline micro-batches .* 32"):
        check_micro_batch(config, torch.zeros(4, 7))
