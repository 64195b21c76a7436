"""Every key DeepSpeed 0.19 accepts in its JSON config, each with one rule (see ``rule_kinds``).

The sections DeepSpeed validates strictly (``zero_optimization``, its offload sections, ``fp16``, ``bf16``) list
all their fields and aliases, as ``tests/deepspeed_compat/test_deepspeed_config_rules.py`` checks against DeepSpeed's
own models; an unknown key inside any section here fails. Unknown top-level keys are ignored with a warning, as
DeepSpeed ignores them. Defaults are DeepSpeed's, from its config models and ``runtime/constants.py``.
"""

from __future__ import annotations

import operator
from typing import Any

from .rule_kinds import (
    AUTO,
    NO_DEFAULT,
    Rule,
    Table,
    field,
    honoured,
    mapped,
    no_op,
    no_op_section,
    rejected,
    rejected_section,
)

_SPEED_ONLY = "changes how DeepSpeed schedules the same arithmetic; ds_strategy's own schedule gives equal results"
_LOGGING = "DeepSpeed's own logging/profiling; use Lightning's loggers and profilers"
_NOT_IMPLEMENTED = "ds_strategy does not implement {}; remove the key (or set it to DeepSpeed's default)"


def _reduce_scatter(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed {key}={value!r} is not allowed; expected true or false")
    return {"gradient_reduction": "reduce_scatter" if value else "all_reduce"}


def _enables(precision: str):
    """A section's ``enabled`` key: its reading (true sets ``precision``) and its writing (true when the config's
    precision is that one, else not written)."""

    def translate(key: str, value: Any) -> dict[str, Any]:
        if value is True:
            return {"precision": precision}
        if value is False or value == AUTO:
            return {}
        raise ValueError(f'DeepSpeed {key}={value!r} is not allowed; expected true, false or "auto"')

    return translate, lambda config: True if config.precision == precision else None


def _deprecated_offload(field_name: str):
    """DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_param`` booleans: true means device "cpu"."""

    def translate(key: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, bool):
            raise ValueError(f"DeepSpeed {key}={value!r} is not allowed; expected true or false")
        return {field_name: "cpu"} if value else {}

    return translate


def _sub_group_size(key: str, value: Any) -> dict[str, Any]:
    return {} if value in (0, AUTO) else {"sub_group_size": value}


def _clipping(key: str, value: Any) -> dict[str, Any]:
    """ "auto" is the framework's clipping (Hugging Face fills it from its arguments): off in the config."""
    return {"gradient_clipping": 0.0 if value == AUTO else value}


_OFFLOAD_COMMON: Table = {
    "nvme_path": field("nvme_path", None),
    "pin_memory": field("pin_memory", True),
}
OFFLOAD_OPTIMIZER: Table = {
    "device": field("offload_optimizer", "none"),
    **_OFFLOAD_COMMON,
    "buffer_count": field("buffer_count", 4),
    "ratio": field("offload_ratio", 1.0),
    "fast_init": no_op(False, "the NVMe step always creates its files at setup"),
    "pipeline_read": no_op(False, "the NVMe step always overlaps reads with the update"),
    "pipeline_write": no_op(False, "the NVMe step always overlaps writes with the update"),
    "super_offload": rejected(False, _NOT_IMPLEMENTED.format("SuperOffload")),
    "cpuadam_cores_perc": no_op(0.8, "CpuAdam uses torch's intra-op threads"),
}
OFFLOAD_PARAM: Table = {
    "device": field("offload_params", "none"),
    **_OFFLOAD_COMMON,
    "buffer_size": field("buffer_size", 100_000_000),
    "buffer_count": no_op(5, "parameter shards stream through the pool sized by offload_optimizer.buffer_count"),
    "max_in_cpu": no_op(1_000_000_000, "an offloaded parameter shard lives wholly where `device` says"),
}
_STAGE3_ALIASED: dict[str, Any] = {  # DeepSpeed accepts each both with and without the "stage3_" prefix
    "prefetch_bucket_size": field("prefetch_bucket_size", 50_000_000, keep_auto=True),
    "param_persistence_threshold": field("param_persistence_threshold", 100_000, keep_auto=True),
    "model_persistence_threshold": no_op(2**63 - 1, "no cap on the total of persistent parameters"),
    "max_live_parameters": field("max_live_parameters", 1_000_000_000),
    "max_reuse_distance": no_op(1_000_000_000, "gathered units are freed after use, whatever the reuse distance"),
    "gather_16bit_weights_on_model_save": honoured(
        "honoured: exports always gather full weights, from the fp32 masters in the model's dtype; the 16-bit "
        "copy is `ZeroEngine.full_compute_state_dict`",
        False,
    ),
    "module_granularity_threshold": no_op(0, "units are the repeated block type (see `ZeroConfig.unit_modules`)"),
    "use_all_reduce_for_fetch_params": no_op(False, _SPEED_ONLY),
    "allgather_sequential": no_op(False, _SPEED_ONLY),
}
ZERO_OPTIMIZATION: Table = {
    "stage": field("stage", 0),
    "contiguous_gradients": no_op(True, "gradients always live in flat contiguous buffers"),
    "reduce_scatter": mapped(
        "`ZeroConfig.gradient_reduction`: true = reduce_scatter, false = all_reduce",
        True,
        _reduce_scatter,
        lambda config: None if config.gradient_reduction == "auto" else config.gradient_reduction == "reduce_scatter",
    ),
    "reduce_bucket_size": field("reduce_bucket_size", 500_000_000, keep_auto=True),
    "use_multi_rank_bucket_allreduce": no_op(True, _SPEED_ONLY),
    "allgather_partitions": no_op(True, "updated partitions are always all-gathered after a step"),
    "allgather_bucket_size": field("allgather_bucket_size", 500_000_000),
    "overlap_comm": field("overlap_comm", None),
    "compute_grad_norm": no_op(True, "the gradient norm is computed when clipping needs it"),
    "load_from_fp32_weights": no_op(True, "checkpoints always restore the fp32 master weights"),
    "elastic_checkpoint": no_op(False, "checkpoints always reload at any world size"),
    "offload_param": OFFLOAD_PARAM,
    "offload_optimizer": OFFLOAD_OPTIMIZER,
    "zenflow": rejected(None, _NOT_IMPLEMENTED.format("ZenFlow")),
    "sub_group_size": mapped(
        "`ZeroConfig.sub_group_size` (0, DeepSpeed's one sub-group per parameter: the default; "
        "the update's arithmetic is the same)",
        1_000_000_000,
        _sub_group_size,
        operator.attrgetter("sub_group_size"),
    ),
    "cpu_offload": mapped(
        "deprecated: true = `offload_optimizer.device: cpu`", None, _deprecated_offload("offload_optimizer")
    ),
    "cpu_offload_param": mapped(
        "deprecated: true = `offload_param.device: cpu`", None, _deprecated_offload("offload_params")
    ),
    "cpu_offload_use_pin_memory": field("pin_memory", None, written=False),
    **{f"stage3_{name}": rule for name, rule in _STAGE3_ALIASED.items()},  # DeepSpeed's documented names first
    **_STAGE3_ALIASED,
    "stage3_gather_fp16_weights_on_model_save": _STAGE3_ALIASED["gather_16bit_weights_on_model_save"],
    "ignore_unused_parameters": no_op(True, "parameters without gradients are skipped in any case"),
    "legacy_stage1": no_op(False, "one stage-1 implementation"),
    "round_robin_gradients": no_op(False, _SPEED_ONLY),
    "parameter_alignment": no_op(False, "flat buffers are aligned by ds_strategy"),
    "zero_hpz_partition_size": field("zero_hpz_partition_size", 1),
    "zero_quantized_weights": field("zero_quantized_weights", False),
    "zero_quantized_nontrainable_weights": rejected(False, _NOT_IMPLEMENTED.format("quantised frozen weights")),
    "zero_quantized_gradients": field("zero_quantized_gradients", False),
    "memory_efficient_linear": no_op(True, "torch's own linear is used"),
    "pipeline_loading_checkpoint": no_op(
        False, "loads stage-3 checkpoints one local rank at a time; here each rank reads only its own shards"
    ),
    "override_module_apply": no_op(True, "stage 3 builds on the meta device instead of patching Module.apply"),
    "log_trace_cache_warnings": no_op(False, _LOGGING),
    "enable_sanity_checks": no_op(False, "collective sequences are always checked (`ds_strategy.comm.sequence_check`)"),
    "save_muon_momentum_buffer_in_memory": no_op(False, "no Muon optimizer"),
    "leaf_module": rejected(
        None, "use `ZeroConfig.unit_modules` to choose the modules gathered as one unit", quiet=lambda value: not value
    ),
}
FP16: Table = {
    "enabled": mapped(
        '`ZeroConfig.precision="16-mixed"` ("auto": the framework\'s precision)', False, *_enables("16-mixed")
    ),
    "auto_cast": no_op(False, "the precision plugin decides what runs in half precision"),
    "loss_scale": field("loss_scale", 0.0),
    "initial_scale_power": field("initial_scale_power", 16),
    "loss_scale_window": field("loss_scale_window", 1000),
    "hysteresis": field("hysteresis", 2),
    "consecutive_hysteresis": field("consecutive_hysteresis", False),
    "min_loss_scale": field("min_loss_scale", 1.0),
    "fp16_master_weights_and_grads": rejected(False, "master weights are always fp32"),
}
BF16: Table = {
    "enabled": mapped(
        '`ZeroConfig.precision="bf16-mixed"` ("auto": the framework\'s precision)', False, *_enables("bf16-mixed")
    ),
    "immediate_grad_update": no_op(False, "gradients are reduced into their shard as backward produces them"),
    "check_grad_overflow": no_op(True, "bf16 has fp32's range; no overflow check is needed"),
    "bf16_master_weights_and_grads": rejected(False, "master weights are always fp32"),
    "bf16_optimizer_states": rejected(False, "optimizer state is always fp32"),
}
DATA_TYPES: Table = {
    "grad_accum_dtype": field("grad_accum_dtype", None),
    "param_dtype": rejected(None, "parameter dtypes follow `ZeroConfig.precision`"),
    "buffer_dtype": rejected(None, "buffer dtypes follow `ZeroConfig.precision`"),
    "keep_in_fp32_modules": rejected(AUTO, "every module computes in the precision's dtype"),
}
AIO: Table = {
    "block_size": no_op(1_048_576, "NVMe IO is os.pread/os.pwrite on a thread pool, not libaio"),
    "queue_depth": no_op(8, "NVMe IO is os.pread/os.pwrite on a thread pool, not libaio"),
    "intra_op_parallelism": no_op(1, "NVMe IO is os.pread/os.pwrite on a thread pool, not libaio"),
    "thread_count": no_op(1, "older name of intra_op_parallelism"),
    "single_submit": no_op(False, "NVMe IO is os.pread/os.pwrite on a thread pool, not libaio"),
    "overlap_events": no_op(True, "NVMe IO is os.pread/os.pwrite on a thread pool, not libaio"),
    "use_gds": rejected(False, _NOT_IMPLEMENTED.format("GPUDirect Storage")),
}
_DEEPCOMPILE_ONLY = "only acts under compile.deepcompile"
COMPILE: Table = {
    "deepcompile": rejected(False, "DeepCompile is not implemented; call torch.compile on the model yourself"),
    **{
        name: no_op(default, _DEEPCOMPILE_ONLY)
        for name, default in (
            ("autoep_non_moe", False),
            ("free_activation", False),
            ("free_activation_threshold", 10 * 1024 * 1024),
            ("offload_activation", False),
            ("offload_activation_pin_memory", True),
            ("offload_opt_states", False),
            ("double_buffer", True),
            ("symmetric_memory", False),
            ("debug_log", False),
            ("offload_parameters", False),
            ("sync_before_reduce", False),
            ("sync_after_reduce", False),
            ("sync_before_allgather", False),
            ("sync_after_allgather", False),
            ("keep_int_input_tensors", True),
            ("keep_all_input_tensors", False),
            ("passes", None),
        )
    },
}


def _checkpoint_input(name: str, what: str) -> Rule:
    """A key saying what an activation checkpoint keeps of its input; see Note: [DeepSpeed's
    activation_checkpointing section]."""
    note = f"`ZeroConfig.{name}` ({what}), applied once `ZeroConfig.activation_checkpointing` is on"
    return mapped(note, False, lambda key, value: {name: value})


# Note: [DeepSpeed's activation_checkpointing section]
#   In DeepSpeed the section checkpoints nothing: it configures ``deepspeed.checkpointing.checkpoint`` for model
#   code that calls it (Megatron's layers). So here too it only says what a checkpoint keeps of its input, and
#   checkpointing is turned on by ``ZeroConfig.activation_checkpointing`` (e.g. ``from_deepspeed_config(path,
#   activation_checkpointing="full")``). Turning it on whenever the section appears would recompute models that
#   never asked for it (Hugging Face configs carry the section with every value false) and checkpoint twice the
#   ones that checkpoint themselves (``gradient_checkpointing_enable()``).
ACTIVATION_CHECKPOINTING: Table = {
    "partition_activations": _checkpoint_input("partition_activations", "split over the tensor-parallel group"),
    "cpu_checkpointing": _checkpoint_input("cpu_checkpointing", "kept in host memory"),
    "number_checkpoints": no_op(None, "sizes DeepSpeed's contiguous buffer for partitioned checkpoint inputs"),
    "contiguous_memory_optimization": no_op(
        False, "DeepSpeed copies partitioned inputs into one preallocated buffer; here each is its own tensor"
    ),
    "synchronize_checkpoint_boundary": no_op(False, "a device synchronize around each checkpoint, for its timers"),
    "profile": no_op(False, _LOGGING + " (recomputation shows as `ds_strategy::activation.recompute` ranges)"),
}


def _autotp_size(key: str, value: Any) -> dict[str, Any]:
    """AutoTP needs no plan from the user, so neither does this: the auto plan splits the model (0 or 1: off)."""
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return {}
    return {"tensor_parallel_size": value, "tensor_parallel_plan": "auto"}


_TP_GROUP_KEYS = {"tp_size", "tp_grain_size"}  # DeepSpeed checks tp_size against autotp_size; grain: inference only
TENSOR_PARALLEL: Table = {
    "autotp_size": mapped(
        '`ZeroConfig.tensor_parallel_size`, with `tensor_parallel_plan="auto"` (`ds_strategy.parallel.auto_plan`) '
        "when above 1",
        0,
        _autotp_size,
    ),
    "dtype": no_op("torch.float16", "the compute dtype follows the fp16/bf16 sections", quiet=lambda value: True),
    "tp_overlap_comm": no_op(False, "overlaps DeepSpeed's row-parallel all-reduce with compute; " + _SPEED_ONLY),
    "vocab_parallel_lm_head": rejected(
        None,
        "the auto plan keeps lm_head whole; pass ZeroConfig.tensor_parallel_plan with an lm_head entry",
        quiet=lambda value: value is not True,
    ),
    "vocab_parallel_ce_backend": no_op("torch", "picks DeepSpeed's vocabulary-parallel cross-entropy kernel"),
    **{
        name: rejected(
            {},
            "the tensor-parallel group comes from autotp_size (ds_strategy builds the mesh); tp_size and "
            "tp_grain_size are accepted, mpu and tp_group are not",
            quiet=lambda value: isinstance(value, dict) and set(value) <= _TP_GROUP_KEYS,
        )
        for name in ("tensor_parallel", "tp")
    },
    "injection_policy_tuple": rejected(
        None, "DeepSpeed's injection policies are not read; pass ZeroConfig.tensor_parallel_plan"
    ),
    "partition_config": rejected(
        None,
        "DeepSpeed's regex layer specs are not translated; pass ZeroConfig.tensor_parallel_plan (module name "
        'patterns to "colwise"/"rowwise")',
    ),
    "preset_model": honoured(
        "the auto plan recognises the model's family itself (one it does not know fails at setup, naming it)", None
    ),
    "keep_module_on_host": no_op(
        False, "where DeepSpeed loads checkpoints; `load_pretrained` reads each rank's shards only"
    ),
    **{
        name: rejected(False, _NOT_IMPLEMENTED.format("inference kernel injection"))
        for name in ("replace_with_kernel_inject", "kernel_inject")
    },
}


def _stages(key: str, value: Any) -> dict[str, Any]:
    """ "auto": DeepSpeed takes the stage count from ``PipelineModule(num_stages=...)`` in model code, so here too
    it is left to the strategy's arguments."""
    return {} if value == AUTO else {"pipeline_parallel_size": value}


_PARTITIONS = {"parameters": {"pipeline_split": "parameters"}, "uniform": {"pipeline_split": "auto"}, "best": {}}


def _partition(key: str, value: Any) -> dict[str, Any]:
    """DeepSpeed's partition methods ("best", its default, is one its engine never reads)."""
    method = value.lower() if isinstance(value, str) else value
    if isinstance(method, str) and method.startswith("type:"):
        raise ValueError(
            f"DeepSpeed {key}={value!r} is not supported: layer-type regexes are not translated; pass "
            "ZeroConfig.pipeline_split (the module names where stages 2..n begin)"
        )
    if not isinstance(method, str) or method not in _PARTITIONS:
        raise ValueError(f'DeepSpeed {key}={value!r} is not allowed; expected "parameters", "uniform" or "best"')
    return _PARTITIONS[method]


def _checkpoint_interval(key: str, value: Any) -> dict[str, Any]:
    """0 is DeepSpeed's "no checkpointing"; any interval only takes effect once checkpointing is on."""
    return {} if value == 0 else {"activation_checkpoint_interval": value}


_WHOLE_SENDS = "stages send whole activations and gradients, not pieces split over the tensor-parallel group"
PIPELINE: Table = {
    "stages": mapped(
        '`ZeroConfig.pipeline_parallel_size` ("auto": from the strategy\'s arguments, as DeepSpeed takes it from '
        "the PipelineModule); a stage count here makes `gradient_accumulation_steps` the micro-batch count "
        "(`ZeroConfig.pipeline_microbatches`), as in DeepSpeed's PipelineEngine",
        AUTO,
        _stages,
    ),
    "partition": mapped(
        '`ZeroConfig.pipeline_split`: "parameters" = "parameters", "uniform" = "auto"; "best" sets nothing; '
        '"type:" regexes are refused',
        "best",
        _partition,
    ),
    "seed_layers": no_op(False, "the model's own code builds and seeds every layer before the split"),
    "activation_checkpoint_interval": mapped(
        "`ZeroConfig.activation_checkpoint_interval` (0: unset), applied once `ZeroConfig.activation_checkpointing` "
        "is on",
        0,
        _checkpoint_interval,
    ),
    "pipe_partitioned": no_op(True, _WHOLE_SENDS),
    "grad_partitioned": no_op(True, _WHOLE_SENDS),
    "use_reentrant": no_op(True, "activation checkpointing is always non-reentrant; gradients are the same"),
}
_SECTION_BUILT = "built by `ds_strategy.config.deepspeed.optimizer_section` when the program defines no {}"
DEEPSPEED: Table = {
    "train_batch_size": field("train_batch_size", NO_DEFAULT),
    "train_micro_batch_size_per_gpu": field("train_micro_batch_size_per_gpu", NO_DEFAULT),
    "gradient_accumulation_steps": field("gradient_accumulation_steps", NO_DEFAULT),
    "gradient_clipping": mapped(
        '`ZeroConfig.gradient_clipping` ("auto": the framework\'s clipping)',
        1.0,
        _clipping,
        operator.attrgetter("gradient_clipping"),
    ),
    "communication_data_type": field("communication_dtype", None),
    "zero_optimization": ZERO_OPTIMIZATION,
    "fp16": FP16,
    "bf16": BF16,
    "bfloat16": BF16,
    "data_types": DATA_TYPES,
    "aio": AIO,
    "optimizer": honoured(_SECTION_BUILT.format("optimizer"), None),
    "scheduler": honoured(_SECTION_BUILT.format("LR scheduler"), None),
    "zero_allow_untested_optimizer": honoured("honoured: any torch optimizer is sharded", False),
    "zero_force_ds_cpu_optimizer": no_op(True, "offloaded Adam/AdamW/Adagrad/SGD always step with CpuAdam"),
    "prescale_gradients": no_op(False, "gradients are averaged in fp32 either way"),
    "gradient_predivide_factor": no_op(1.0, "gradients are averaged in fp32 either way"),
    "gradient_allreduce_op": rejected("mean", "gradients are always averaged over ranks"),
    "sparse_gradients": rejected(False, _NOT_IMPLEMENTED.format("sparse gradients")),
    "disable_allgather": no_op(False, _SPEED_ONLY),
    "managed_gradient_accumulation": no_op(True, "the framework's loop runs accumulation"),
    "steps_per_print": no_op(None, _LOGGING),
    "wall_clock_breakdown": no_op(False, _LOGGING),
    "memory_breakdown": no_op(False, _LOGGING + " (or `ZeroEngine.memory_report`)"),
    "dump_state": no_op(False, _LOGGING),
    "log_level": no_op(None, _LOGGING),
    "timers": no_op_section(_LOGGING),
    "flops_profiler": no_op_section(_LOGGING),
    "comms_logger": no_op_section(_LOGGING + " (communication is logged as `comm/*` metrics)"),
    "tensorboard": no_op_section(_LOGGING),
    "wandb": no_op_section(_LOGGING),
    "csv_monitor": no_op_section(_LOGGING),
    "comet": no_op_section(_LOGGING),
    "autotuning": no_op_section("DeepSpeed's autotuner; use `ds-strategy autotune`"),
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "checkpoint": no_op(
        NO_DEFAULT,
        "checkpoint tags, universal checkpoints and write pipelines are DeepSpeed's "
        "own; ds_strategy checkpoints reload at any world size",
        quiet=lambda v: not v,
    ),
    "dataloader_drop_last": no_op(False, "DeepSpeed's own data loader; the framework's loader is used"),
    "vocabulary_size": no_op(None, "only used by DeepSpeed's sparse embeddings"),
    "seq_parallel_communication_data_type": no_op(
        "fp32", "Ulysses all-to-alls move activations in their own dtype; gradients reduce in `communication_dtype`"
    ),
    "use_data_before_expert_parallelism": no_op(False, "no expert parallelism"),
    "disable_python_gc": no_op(False, "garbage collection is left to Python"),
    "torch_autocast": rejected_section("use the framework's precision flag (or `ZeroConfig.precision`)"),
    "compile": COMPILE,
    "pipeline": PIPELINE,
    "tensor_parallel": TENSOR_PARALLEL,
    "expert_parallel": rejected_section(
        "ds_strategy's expert parallelism is `ZeroConfig.expert_parallel_size` (a top-level key here too, e.g. "
        '`"expert_parallel_size": 2`); DeepSpeed\'s section is not read: remove it'
    ),
    "expert_parallel_size": field("expert_parallel_size", 1),
    "sequence_parallel_size": field("sequence_parallel_size", 1),
    "hybrid_engine": rejected_section(_NOT_IMPLEMENTED.format("the RLHF hybrid engine")),
    "sparse_attention": rejected_section(_NOT_IMPLEMENTED.format("sparse attention")),
    "compression_training": rejected_section(_NOT_IMPLEMENTED.format("compression training")),
    "weight_quantization": rejected_section(_NOT_IMPLEMENTED.format("weight quantization")),
    "quantize_training": rejected_section(_NOT_IMPLEMENTED.format("quantize-aware training")),
    "data_efficiency": rejected_section(_NOT_IMPLEMENTED.format("data efficiency (curriculum, random-LTD)")),
    "curriculum_learning": rejected_section(_NOT_IMPLEMENTED.format("curriculum learning")),
    "progressive_layer_drop": rejected_section(_NOT_IMPLEMENTED.format("progressive layer drop")),
    "eigenvalue": rejected_section(_NOT_IMPLEMENTED.format("eigenvalue computation")),
    "elasticity": rejected_section(_NOT_IMPLEMENTED.format("elastic training")),
    "amp": rejected_section("NVIDIA apex AMP is not used; use the framework's precision flag"),
    "nebula": rejected_section(_NOT_IMPLEMENTED.format("the Nebula checkpoint service")),
    "datastates_ckpt": rejected_section(_NOT_IMPLEMENTED.format("DataStates checkpointing")),
}
