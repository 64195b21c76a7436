"""ZeroConfig: the one place ZeRO's settings are defaulted and validated.

Front-ends (the DeepSpeed JSON reader in ``ds_strategy.config.deepspeed``, strategy constructor arguments) translate
into this dataclass and carry no defaults of their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_strategy.config.auto_values import deepspeed_auto_values
from ds_strategy.config.plan import DTYPES, ZeroPlan
from ds_strategy.config.policies import (
    ActivationPolicy,
    CommPolicy,
    OffloadPolicy,
    ParallelismPolicy,
    PrecisionPolicy,
    policy_of,
)
from ds_strategy.parallel.pipeline_schedules import SCHEDULES

AUTO = "auto"
UNITS = "units"  # a bucket or prefetch size bounded by the model's largest unit rather than by an element count

_PRECISIONS = {
    "32-true": "32-true",
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "16-mixed",
    "bf16-true": "bf16-true",
    "16-true": "16-true",
    32: "32-true",
    "32": "32-true",
    "bf16": "bf16-mixed",
    16: "16-mixed",
    "16": "16-mixed",
}
_COMMUNICATION_DTYPES = {
    None: None,
    **{short: short for short in DTYPES},
    **{dtype: short for short, dtype in DTYPES.items()},
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
}
_GRADIENT_REDUCTIONS = {name: name for name in ("auto", "reduce_scatter", "all_reduce")}
OFFLOAD_MODES = ("none", "cpu", "nvme")  # the values of offload_optimizer and offload_params
_OFFLOAD_PLACES = {name: name for name in OFFLOAD_MODES}
_ACTIVATION_CHECKPOINTING = {name: name for name in ("none", "full", "selective")}
_PIPELINE_GRAD_REDUCTIONS = {name: name for name in ("once", "per_microbatch")}
_PIPELINE_SPLITS = ("auto", "parameters")


class ZeroConfigError(ValueError):
    """A ZeroConfig field got a value it does not allow; ``field`` names it so front-ends can say which
    of their own keys produced it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """What ZeRO shards, how it batches communication, and how it scales the loss.

    N is the data-parallel world size; every size is a count of elements, not bytes. Fields named as in
    DeepSpeed keep DeepSpeed's default and meaning. Construction validates and normalises every field;
    ``from_dict`` and ``replace`` re-validate, and the instance is frozen so nothing skips that.

    Partitioning and gradient communication:
        stage (default 2): what each rank keeps only a 1/N shard of. 0 = nothing (plain data parallel,
            gradients all-reduced); 1 = optimizer state (Adam's two fp32 moments, plus fp32 master weights
            under mixed precision); 2 = also gradients, reduced straight into the owner's shard; 3 = also
            parameters, all-gathered per unit before its forward/backward and freed after.
        reduce_bucket_size (default "units", or an element count, or "auto"): at most this many elements of
            gradient scratch (stage 2/3: each flat buffer's gradients, copied out as autograd finishes them) in
            flight in reductions; past it, launching waits for the oldest reductions. "units" is the largest
            unit's elements: one unit's scratch in flight while the next fills, about two units alive whatever
            the model size and however slow the reductions (FSDP2's bound). DeepSpeed's 5e8 holds up to the
            whole model's gradients as scratch when reductions lag. Larger: more overlap, more memory.
        allgather_bucket_size (default 5e8): at most this many elements of the stage 1/2 all-gathers of
            updated parameters in flight after a step; past it, the step waits before launching more.
        overlap_comm (default True): launch each bucket's reduction as soon as it fills and wait for it only
            when the in-flight bound or the optimizer needs it, overlapping backward compute at the cost of
            keeping buckets alive until they finish; also prefetch stage-3 gathers ahead of use. False waits
            for every reduction as soon as it is launched and gathers stage-3 units on demand: the same
            collectives in the same order, so the same results, slower. (The stage 1/2 parameter all-gathers
            after a step are launched together and waited on inside the step either way.)
        contiguous_gradients (default True, the only value): gradients always live in flat contiguous
            buffers (one per unit and param group), so they never fragment memory. Accepted for DeepSpeed
            configs; False, which DeepSpeed uses to skip that copy, is rejected rather than silently ignored.
        communication_dtype (default None = auto): dtype gradients travel in. Auto is fp32 for fp32 and
            fp16 training (fp16 sums overflow) and bf16 for bf16 training. "fp16"/"bf16" halve the bytes
            sent but lose precision in the sum.
        grad_accum_dtype (default None = the compute dtype): dtype of the reduced gradient shard (stage 1-3),
            where micro-batches accumulate between optimizer steps. The default keeps 16-bit gradients under
            mixed precision, 2 bytes per parameter as in the ZeRO paper and DeepSpeed; each step converts the
            shard to fp32 for unscaling, clipping and the optimizer (a transient 4 bytes per parameter / N).
            "fp32" accumulates in fp32 instead: 2 more bytes per parameter / N, exact sums over micro-batches.
            DeepSpeed's ``data_types.grad_accum_dtype``.
        gradient_reduction (default "auto"): the collective that reduces gradients. "reduce_scatter" sends
            (N-1)/N of the bucket and leaves each rank its shard; "all_reduce" sends twice that and each rank
            slices its shard, yet is faster on gloo; "auto" picks per backend (``plan.gradient_collective``).

    Stage 3 parameter gathering:
        prefetch_bucket_size (default "units", or an element count, or "auto"): elements of upcoming units
            gathered ahead of use (while the current unit computes); 0 gathers each unit only when it is needed.
            "units" is the largest unit's elements: the next unit is gathered while one computes (FSDP2's
            prefetch). DeepSpeed's 5e7 covers every unit of a small model, so the whole model is then gathered
            during forward.
        param_persistence_threshold (default 1e5, or "auto"): parameters this small stay gathered on every
            rank; they cost little memory and would otherwise cost one latency-bound collective each.
        max_live_parameters (default 1e9): cap on gathered elements alive at once; gathering waits for
            frees beyond it, trading speed for peak memory. The unit in use is always gathered: 0 prefetches
            nothing, as in DeepSpeed.
        reshard_after_forward (default True): free a unit's gathered parameters after its forward and
            gather again for backward. False keeps them until backward: one fewer all-gather, more memory.
        collective_timeout (default 600 s): how long a rank waits for one collective before raising an error
            that names it, instead of hanging forever when ranks issue different collectives (a rank that
            skipped a unit, or ran fewer forward calls under stage 3). Before each optimizer step the ranks
            also compare the collectives they issued (one tiny all-gather), which catches the mismatches that
            do not hang; see ``ds_strategy.comm.sequence_check``. On NCCL a wait never blocks the host, and the
            process group's ``timeout`` (NCCL's watchdog) bounds a collective instead.
        timeout (default 1800 s, torch's ``default_pg_timeout``; seconds or a ``datetime.timedelta``): the
            process-group timeout the Lightning and Fabric strategies pass to ``init_process_group`` when they
            create the group, as DDP's, FSDP's and DeepSpeed's ``timeout=`` does.
        unit_modules (default ()): module classes, or class names, whose instances are the units that are
            gathered/freed together and that bound gradient buckets. Empty auto-detects the repeated
            child block type (e.g. a transformer layer).
        unit_min_params (default 0): when > 0 and unit_modules is empty, form units by parameter count
            instead of by class, with this many elements as the threshold for a unit.

    Construction of a model built on the meta device (see ``ds_strategy.zero.sharded_init``):
        param_init_fn (default None): ``param_init_fn(module)`` (FSDP's name) fills the parameters and buffers
            of one module in place; the engine calls it once per module that owns tensors, in module order,
            one unit at a time, ahead of Hugging Face's ``_init_weights`` and of ``reset_parameters()``.
        sync_module_states (default False; FSDP's name): rank 0 holds the real model (e.g. built normally or
            loaded), the other ranks build it on the meta device; the engine streams rank 0's values unit by
            unit, so no other rank ever holds more than one unit. Every rank must pass the same value.

    ZeRO++ (communication volume; names and defaults as in DeepSpeed; see ``ds_strategy.comm.quantized``):
        zero_quantized_weights (default False; stage 3): qwZ, all-gather weights as block-wise int8 (one
            fp32 scale per 256 values) and dequantise: about 1/4 of the fp32 bytes (1/2 of bf16), at the cost
            of forward and backward seeing weights rounded to 1/254 of their block's largest magnitude.
            Checkpoints and ``full_state_dict`` still gather exactly.
        zero_quantized_gradients (default False; stage 2 or 3): qgZ, reduce gradients with an all-to-all of
            block-wise quantised chunks (one fp32 scale per 256 values), dequantised and summed in fp32 by
            their owner. Each rank's gradient is rounded once, before the sum.
        zero_quantized_gradients_bits (default 4, as DeepSpeed's qgZ; or 8): qgZ's integer width. int4 sends
            about 1/8 of an fp32 reduce-scatter's bytes (1/4 of bf16's) and rounds each gradient to 1/14 of its
            block's largest magnitude; int8 sends about 1/4 of fp32's (1/2 of bf16's) and rounds to 1/254.
            DeepSpeed has no key for it (its qgZ is int4).
        zero_hpz_partition_size (default 1 = off; stage 3): hpZ, keep a secondary copy of each unit's
            weights partitioned over groups of this many consecutive ranks (e.g. one node's GPUs), cut from
            the forward gather, so backward all-gathers stay inside the group. Costs 1/size of a unit's
            weights per rank from its forward to its backward; needs ``reshard_after_forward`` to matter, a
            size that divides the data-parallel world size (groups are consecutive data-parallel ranks).

    Reporting:
        log_comm_stats (default True): the Lightning strategy logs each optimizer step's communication
            bytes (total and per collective kind) and time spent waiting to the Trainer's logger, as
            ``comm/bytes``, ``comm/<kind>_bytes`` and ``comm/wait_seconds``.

    Offload (ZeRO-Offload and ZeRO-Infinity; DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections,
    same defaults; see ``ds_strategy.offload``):
        offload_optimizer (default "none"; stage >= 1): where this rank's fp32 master shard and optimizer
            state live. "cpu": host memory; reduced gradient shards are copied to the host and the optimizer
            steps there (``CpuAdam`` for Adam/AdamW/Adagrad/SGD, torch's own step otherwise), then the updated
            parameters are copied back. Frees 12 bytes per parameter / N of device memory for Adam, costs
            host memory bandwidth and a host<->device copy per step. "nvme": files under ``nvme_path``
            streamed through host buffers during the step: host memory holds only the buffers, the step is
            bounded by disk bandwidth.
        offload_params (default "none"; stage 3): where this rank's parameter shard lives between gathers:
            "cpu" (host memory) or "nvme" (a file under ``nvme_path``); gathered units stay on the device.
        nvme_path (default None; required with "nvme"): directory for the offload files. Each rank creates
            its own uniquely named subdirectory at setup (after checking space and permissions) and removes
            it at teardown.
        pin_memory (default False): page-lock host buffers when the device is CUDA, so host<->device copies
            run asynchronously and faster, at the cost of memory the OS cannot swap out. No effect on CPU.
        offload_ratio (default 1.0): fraction of the shard's elements (whole flat buffers, in order) whose
            optimizer work is offloaded; the rest steps on the device. Lower: more device memory, less host work.
        buffer_count (default 4, >= 2): host buffers the NVMe step cycles through, so that the next
            sub-group is read and earlier ones are written while one is updated.
        buffer_size (default 1e8): elements per NVMe staging buffer (each holds a sub-group's master and
            state); host memory for NVMe offload is about buffer_count x buffer_size x 4 bytes x (1 + states).
        sub_group_size (default 1e9): the optimizer steps each flat shard in pieces of at most this many
            elements (with NVMe, also at most ``buffer_size``): the unit of IO and of host<->device overlap.

    Optimizer step:
        gradient_clipping (default 0.0 = off): clip the global gradient norm to this before the step.
        gradient_accumulation_steps (default 1): micro-batches summed before each optimizer step.
        train_micro_batch_size_per_gpu (default None = whatever the data loader yields): per-rank batch.
        train_batch_size (default None = not checked): the global batch, micro-batch x accumulation x
            world size, as in DeepSpeed; ``resolve_batch_sizes`` derives the missing one of the three at setup,
            or fails naming all three when they disagree.

    Precision and dynamic loss scaling (DeepSpeed semantics):
        precision (default "32-true"): "32-true", "bf16-mixed", "16-mixed", "bf16-true" or "16-true";
            Lightning's 32, "32", "bf16", 16 and "16" are normalised. "-mixed" keeps fp32 master weights
            and optimizer state beside half-precision compute weights; "-true" keeps only the half copy.
        loss_scale (default 0.0 = dynamic): a fixed loss scale, or 0 to scale dynamically (16-* only).
        initial_scale_power (default 16): dynamic scaling starts at 2**initial_scale_power.
        loss_scale_window (default 1000): overflow-free steps before the scale doubles.
        hysteresis (default 2): overflows tolerated before the scale halves.
        consecutive_hysteresis (default False): refill the hysteresis on every overflow-free step, so only
            ``hysteresis`` overflows in a row halve the scale; False refills it only when the scale grows.
        min_loss_scale (default 1.0): the scale never drops below this.
        max_consecutive_min_scale_skips (default 10): consecutive overflowing steps at the minimum scale
            after which training raises instead of silently skipping every step.

    Model parallelism on one device mesh ``("dp", "sp", "tp")``, outer to inner (see ``ds_strategy.parallel``);
    ZeRO shards over every rank that holds the same weights, data x sequence parallel, so N above is world size /
    tensor_parallel_size:
        tensor_parallel_size (default 1 = off): ranks that split each layer's weights (Megatron column/row
            parallelism with DTensor). Consecutive ranks form a group. DeepSpeed's ``tensor_parallel.autotp_size``.
        tensor_parallel_plan (default None): how the model is split. None: the user's own code does it (a
            LightningModule's ``configure_model`` calling ``parallelize_module`` on ``self.device_mesh
            ["tensor_parallel"]``, as for Lightning's ModelParallelStrategy, or Fabric's ``parallelize_fn``).
            "auto": ds_strategy picks column/row parallel styles per linear layer for the decoder families it
            knows (``ds_strategy.parallel.auto_plan``). A mapping: module name (fnmatch pattern) to a torch
            ``ParallelStyle`` or one of the names "colwise", "rowwise", "sequence_parallel", "replicate".
        sequence_parallel (default False; needs tensor_parallel_size > 1): Megatron sequence parallelism in the
            tensor-parallel group: the auto plan splits norms and dropout along the sequence, and replicated
            weights' partial gradients are summed over the group before ZeRO reduces them.
        sequence_parallel_size (default 1 = off): DeepSpeed-Ulysses
            (``ds_strategy.parallel.ulysses``), unrelated to Megatron's ``sequence_parallel`` above: a group of
            this many consecutive ranks reads the same batch, each rank keeps one slice of every sequence and the
            full weights, and attention swaps the sequence split for a head split with all-to-alls. The
            framework's sampler splits batches over data-parallel ranks only (world size / this), and the engine
            multiplies the loss by this size for backward (Note: [Ulysses gradient scale]). DeepSpeed's
            ``sequence_parallel_size``.

    Pipeline parallelism (torch.distributed.pipelining; the outermost mesh dimension, ahead of dp; ZeRO shards
    each stage's units over the data x sequence parallel ranks holding that stage, so N above is also divided
    by pipeline_parallel_size):
        pipeline_parallel_size (default 1 = off; not yet with sequence_parallel_size > 1): ranks that split the
            model's blocks into consecutive stages and pass activations from one to the next. DeepSpeed's
            ``pipeline.stages``.
        pipeline_schedule (default "1f1b"): the order micro-batches run forward and backward through the stages:
            "gpipe" (all forwards, then all backwards: activations of every micro-batch alive), "1f1b" (one
            forward, one backward: at most a stage count of micro-batches alive), "interleaved_1f1b",
            "zero_bubble" (backward split into input and weight gradients to fill the bubble) or "zbv" (zero
            bubble in a V shape). The last three place two stage chunks on every rank: smaller bubbles, more
            activation sends. torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble (``ds_strategy.parallel.pipeline_schedules``).
        pipeline_microbatches (default None = one per stage): the micro-batches each training step's batch is
            split into; None is the stage count, pipeline_parallel_size x stages per rank. More: smaller bubbles
            (idle stages at the start and end of a step), smaller pieces per forward. DeepSpeed's PipelineEngine
            reads its ``gradient_accumulation_steps`` as this.
        pipeline_split (default "auto"): where stages begin. "auto": the same number of blocks on every stage (the
            block count must be a multiple of the stage count); "parameters": consecutive blocks balanced by parameter
            count (DeepSpeed's ``partition_method="parameters"``); or the module names (e.g. ["model.layers.2"])
            where stages 2..n begin, checked against the model at setup.
        pipeline_grad_reduction (default "once"): "once" accumulates a stage's full gradients over the
            micro-batches and reduces them once per optimizer step: the least traffic, a full gradient buffer
            per rank. "per_microbatch" (stage 2/3) reduce-scatters after every micro-batch's backward: ZeRO-2
            gradient memory, pipeline_microbatches times the traffic.
        pipeline_keep_gathered (default True; acts at stage 3): True gathers each rank's units once per step and
            keeps them through the whole schedule: one all-gather per unit per step, the rank's stages whole in
            memory. False gathers them for each micro-batch's forward and backward and frees them after: at most
            one stage chunk gathered at a time, a gather per micro-batch pass.

    Activation memory (DeepSpeed's ``activation_checkpointing``; ``ds_strategy.compose.activation_checkpointing``):
        activation_checkpointing (default "none"): "none"; "full": each checkpointed unit (the outermost ZeRO
            units) keeps only its input and recomputes its forward in backward (non-reentrant), one more forward
            of compute; "selective": keeps matmul and attention outputs too and recomputes only the cheap ops
            between them (torchtitan's op-level policy). Parameter names and stage-3 gathers stay as they are.
        activation_checkpoint_interval (default 1): checkpoint only the k-th, 2k-th, ... unit, as torchtitan's
            layer-level option counts (DeepSpeed's pipeline uses the name for one checkpoint per k layers).
        partition_activations (default False): keep 1/W of each checkpointed input on each rank of the
            tensor-parallel group and all-gather it for recomputation (DeepSpeed's name; a no-op without
            tensor parallelism, as in DeepSpeed without a model-parallel unit).
        cpu_checkpointing (default False): keep checkpointed inputs (or their 1/W pieces) in pinned host memory
            until recomputation copies them back (DeepSpeed's name).

    The three sizes that accept "auto" keep the string until ``resolve_auto(hidden_size)`` substitutes
    DeepSpeed's formulas; engine code must resolve before reading them. "units" stays a string: the engine
    resolves it against its units (``ds_strategy.zero.memory_report.unit_bounded_sizes``).
    """

    stage: int = 2
    reduce_bucket_size: int | str = UNITS
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    communication_dtype: str | None = None
    grad_accum_dtype: str | None = None
    gradient_reduction: str = "auto"
    prefetch_bucket_size: int | str = UNITS
    param_persistence_threshold: int | str = 100_000
    max_live_parameters: int = 1_000_000_000
    reshard_after_forward: bool = True
    collective_timeout: float = 600.0
    timeout: float = 1800.0
    unit_modules: tuple[type[torch.nn.Module] | str, ...] = ()
    unit_min_params: int = 0
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    sync_module_states: bool = False
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_quantized_gradients_bits: int = 4
    zero_hpz_partition_size: int = 1
    log_comm_stats: bool = True
    offload_optimizer: str = "none"
    offload_params: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    offload_ratio: float = 1.0
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    sub_group_size: int = 1_000_000_000
    gradient_clipping: float = 0.0
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    precision: str = "32-true"
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    max_consecutive_min_scale_skips: int = 10
    tensor_parallel_size: int = 1
    tensor_parallel_plan: str | Mapping[str, Any] | None = None
    sequence_parallel: bool = False
    sequence_parallel_size: int = 1
    activation_checkpointing: str = "none"
    activation_checkpoint_interval: int = 1
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    pipeline_parallel_size: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_microbatches: int | None = None
    pipeline_split: str | tuple[str, ...] = "auto"
    pipeline_grad_reduction: str = "once"
    pipeline_keep_gathered: bool = True

    def __post_init__(self) -> None:
        checked = {
            "stage": _choice("stage", self.stage, {s: s for s in range(4)}),
            "reduce_bucket_size": _integer("reduce_bucket_size", self.reduce_bucket_size, 1, auto=True, units=True),
            "allgather_bucket_size": _integer("allgather_bucket_size", self.allgather_bucket_size, 1),
            "overlap_comm": _flag("overlap_comm", self.overlap_comm),
            "contiguous_gradients": _only_true(
                "contiguous_gradients", self.contiguous_gradients, "gradients always live in flat contiguous buffers"
            ),
            "grad_accum_dtype": _choice(
                "grad_accum_dtype", self.grad_accum_dtype, _COMMUNICATION_DTYPES, "None, 'fp32', 'fp16' or 'bf16'"
            ),
            "communication_dtype": _choice(
                "communication_dtype",
                self.communication_dtype,
                _COMMUNICATION_DTYPES,
                "None (auto), 'fp32', 'fp16', 'bf16', 'float32', 'float16', 'bfloat16' or that torch dtype",
            ),
            "gradient_reduction": _choice("gradient_reduction", self.gradient_reduction, _GRADIENT_REDUCTIONS),
            "prefetch_bucket_size": _integer(
                "prefetch_bucket_size", self.prefetch_bucket_size, 0, auto=True, units=True
            ),
            "param_persistence_threshold": _integer(
                "param_persistence_threshold", self.param_persistence_threshold, 0, auto=True
            ),
            "max_live_parameters": _integer("max_live_parameters", self.max_live_parameters, 0),
            "reshard_after_forward": _flag("reshard_after_forward", self.reshard_after_forward),
            "collective_timeout": _real("collective_timeout", self.collective_timeout, 0.0, exclusive=True),
            "timeout": _real(
                "timeout",
                self.timeout.total_seconds() if isinstance(self.timeout, datetime.timedelta) else self.timeout,
                0.0,
                exclusive=True,
            ),
            "unit_modules": _unit_modules(self.unit_modules),
            "unit_min_params": _integer("unit_min_params", self.unit_min_params, 0),
            "param_init_fn": _callable_or_none("param_init_fn", self.param_init_fn),
            "sync_module_states": _flag("sync_module_states", self.sync_module_states),
            "zero_quantized_weights": _needs_stage(
                "zero_quantized_weights", _flag("zero_quantized_weights", self.zero_quantized_weights), self.stage, 3
            ),
            "zero_quantized_gradients": _needs_stage(
                "zero_quantized_gradients",
                _flag("zero_quantized_gradients", self.zero_quantized_gradients),
                self.stage,
                2,
            ),
            "zero_quantized_gradients_bits": _choice(
                "zero_quantized_gradients_bits", self.zero_quantized_gradients_bits, {4: 4, 8: 8}
            ),
            "zero_hpz_partition_size": _needs_stage(
                "zero_hpz_partition_size",
                _integer("zero_hpz_partition_size", self.zero_hpz_partition_size, 1),
                self.stage,
                3,
                off=1,
            ),
            "log_comm_stats": _flag("log_comm_stats", self.log_comm_stats),
            "offload_optimizer": _needs_stage(
                "offload_optimizer",
                _choice("offload_optimizer", self.offload_optimizer, _OFFLOAD_PLACES),
                self.stage,
                1,
                off="none",
            ),
            "offload_params": _needs_stage(
                "offload_params",
                _choice("offload_params", self.offload_params, _OFFLOAD_PLACES),
                self.stage,
                3,
                off="none",
            ),
            "nvme_path": _nvme_path(self.nvme_path, self.offload_optimizer, self.offload_params),
            "pin_memory": _flag("pin_memory", self.pin_memory),
            "offload_ratio": _offload_ratio(self.offload_ratio, self.offload_optimizer),
            "buffer_count": _integer("buffer_count", self.buffer_count, 2),
            "buffer_size": _integer("buffer_size", self.buffer_size, 1),
            "sub_group_size": _integer("sub_group_size", self.sub_group_size, 1),
            "gradient_clipping": _real("gradient_clipping", self.gradient_clipping, 0.0),
            "gradient_accumulation_steps": _integer("gradient_accumulation_steps", self.gradient_accumulation_steps, 1),
            "train_micro_batch_size_per_gpu": _integer(
                "train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu, 1, none=True
            ),
            "train_batch_size": _integer("train_batch_size", self.train_batch_size, 1, none=True),
            "precision": _choice(
                "precision",
                self.precision,
                _PRECISIONS,
                "one of '32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true' (or 32, '32', 'bf16', 16, '16')",
            ),
            "loss_scale": _real("loss_scale", self.loss_scale, 0.0),
            "initial_scale_power": _integer("initial_scale_power", self.initial_scale_power, 0, maximum=64),
            "loss_scale_window": _integer("loss_scale_window", self.loss_scale_window, 1),
            "hysteresis": _integer("hysteresis", self.hysteresis, 1),
            "consecutive_hysteresis": _flag("consecutive_hysteresis", self.consecutive_hysteresis),
            "min_loss_scale": _real("min_loss_scale", self.min_loss_scale, 0.0, exclusive=True),
            "max_consecutive_min_scale_skips": _integer(
                "max_consecutive_min_scale_skips", self.max_consecutive_min_scale_skips, 1
            ),
            "tensor_parallel_size": _integer("tensor_parallel_size", self.tensor_parallel_size, 1),
            "tensor_parallel_plan": _tensor_parallel_plan(self.tensor_parallel_plan),
            "sequence_parallel": _needs_tensor_parallel(
                "sequence_parallel", _flag("sequence_parallel", self.sequence_parallel), self.tensor_parallel_size
            ),
            "sequence_parallel_size": _integer("sequence_parallel_size", self.sequence_parallel_size, 1),
            "activation_checkpointing": _choice(
                "activation_checkpointing", self.activation_checkpointing, _ACTIVATION_CHECKPOINTING
            ),
            "activation_checkpoint_interval": _integer(
                "activation_checkpoint_interval", self.activation_checkpoint_interval, 1
            ),
            "partition_activations": _flag("partition_activations", self.partition_activations),
            "cpu_checkpointing": _flag("cpu_checkpointing", self.cpu_checkpointing),
            "pipeline_parallel_size": _size_without(
                "pipeline_parallel_size",
                self.pipeline_parallel_size,
                "sequence_parallel_size",
                self.sequence_parallel_size,
            ),
            "pipeline_schedule": _choice("pipeline_schedule", self.pipeline_schedule, {n: n for n in SCHEDULES}),
            "pipeline_microbatches": _integer("pipeline_microbatches", self.pipeline_microbatches, 1, none=True),
            "pipeline_split": _pipeline_split(self.pipeline_split),
            "pipeline_grad_reduction": _needs_stage(
                "pipeline_grad_reduction",
                _choice("pipeline_grad_reduction", self.pipeline_grad_reduction, _PIPELINE_GRAD_REDUCTIONS),
                self.stage,
                2,
                off="once",
            ),
            "pipeline_keep_gathered": _flag("pipeline_keep_gathered", self.pipeline_keep_gathered),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> ZeroConfig:
        """Build from field names to values; an unknown name raises, suggesting the closest field."""
        if not isinstance(options, Mapping):
            raise ValueError(f"ZeroConfig.from_dict expects a mapping of field names, got {type(options).__name__}")
        _check_field_names(options)
        return cls(**options)

    @classmethod
    def build(cls, config: ZeroConfig | Mapping[str, Any] | None = None, **fields: Any) -> ZeroConfig:
        """What adapters accept: a ZeroConfig, a mapping of its fields, or None (the defaults), with ``fields``
        on top; every path validates."""
        if isinstance(config, Mapping):
            config = cls.from_dict(config)
        config = config or cls()
        return config.replace(**fields) if fields else config

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied and every field validated again."""
        _check_field_names(changes)
        return dataclasses.replace(self, **changes)

    def resolve_batch_sizes(self, world_size: int) -> ZeroConfig:
        """A copy whose micro-batch and accumulation follow from ``train_batch_size`` at this world size, as
        DeepSpeed derives them: the micro-batch when unset, else the accumulation when it is 1 (its default).
        Raises, naming the three numbers, when train_batch_size != micro-batch x accumulation x world size."""
        if self.train_batch_size is None:
            return self
        total, accumulation, micro = (
            self.train_batch_size,
            self.gradient_accumulation_steps,
            self.train_micro_batch_size_per_gpu,
        )
        world = world_size * self.pipeline_microbatch_count  # under pipelining each batch is that many micro-batches
        if micro is None and total % (accumulation * world) == 0:
            micro = total // (accumulation * world)
        elif micro is not None and accumulation == 1 and total % (micro * world) == 0:
            accumulation = total // (micro * world)
        if micro is None or total != micro * accumulation * world:
            pipelined = f" x pipeline micro-batches {self.pipeline_microbatch_count}" if world != world_size else ""
            raise ZeroConfigError(
                "train_batch_size",
                (
                    f"ZeroConfig.train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                    f"gradient_accumulation_steps={accumulation}{pipelined} x world size {world_size}; change one "
                    f"of them"
                ),
            )
        return self.replace(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)

    def resolve_auto(self, hidden_size: int) -> ZeroConfig:
        """A copy whose "auto" sizes are DeepSpeed's values for this hidden size (see ``hidden_size_of``)."""
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"resolve_auto(hidden_size={hidden_size!r}) is not allowed; expected an integer >= 1")
        values = deepspeed_auto_values(hidden_size)
        return self.replace(**{name: value for name, value in values.items() if getattr(self, name) == AUTO})

    @property
    def pipeline_microbatch_count(self) -> int:
        """See ``ParallelismPolicy.microbatch_count``."""
        return self.parallelism_policy.microbatch_count

    @property
    def has_auto_values(self) -> bool:
        """Whether some size is still "auto" and ``resolve_auto`` must run before the engine reads it."""
        return AUTO in (self.reduce_bucket_size, self.prefetch_bucket_size, self.param_persistence_threshold)

    @functools.cached_property
    def plan(self) -> ZeroPlan:
        """What these settings mean for sharding, dtypes and communication, derived once (see ``ZeroPlan``)."""
        return ZeroPlan.of(
            self.stage, self.param_persistence_threshold, self.precision_policy, self.comm_policy, self.offload_policy
        )

    # -- each component's section (see ``ds_strategy.config.policies``), built from the validated fields -------
    @functools.cached_property
    def precision_policy(self) -> PrecisionPolicy:
        return policy_of(PrecisionPolicy, self)

    @functools.cached_property
    def offload_policy(self) -> OffloadPolicy:
        return policy_of(OffloadPolicy, self)

    @functools.cached_property
    def comm_policy(self) -> CommPolicy:
        return policy_of(CommPolicy, self)

    @functools.cached_property
    def parallelism_policy(self) -> ParallelismPolicy:
        return policy_of(ParallelismPolicy, self)

    @functools.cached_property
    def activation_policy(self) -> ActivationPolicy:
        return policy_of(ActivationPolicy, self)


def _check_field_names(options: Mapping[str, Any]) -> None:
    names = [field.name for field in dataclasses.fields(ZeroConfig)]
    for key in options:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(names)}"
            raise ZeroConfigError(str(key), f"ZeroConfig has no field {key!r}; {hint}")


def _reject(name: str, value: Any, expected: str) -> ZeroConfigError:
    return ZeroConfigError(name, f"ZeroConfig.{name}={value!r} is not allowed; expected {expected}")


def _choice(name: str, value: Any, aliases: Mapping[Any, Any], expected: str | None = None) -> Any:
    try:
        known = not isinstance(value, bool) and value in aliases
    except TypeError:  # unhashable
        known = False
    if not known:
        raise _reject(name, value, expected or "one of " + ", ".join(map(repr, dict.fromkeys(aliases.values()))))
    return aliases[value]


def _only_true(name: str, value: Any, why: str) -> bool:
    if value is not True:
        raise _reject(name, value, f"True ({why})")
    return True


def _integer(
    name: str,
    value: Any,
    minimum: int,
    *,
    maximum: int | None = None,
    auto: bool = False,
    none: bool = False,
    units: bool = False,
) -> int | str:
    words = (AUTO,) * auto + (UNITS,) * units
    if (isinstance(value, str) and value in words) or (none and value is None):
        return value
    expected = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    expected += "".join(f' or "{word}"' for word in words)
    expected += " or None" if none else ""
    whole = isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer()
    if not whole or int(value) < minimum or (maximum is not None and int(value) > maximum):
        raise _reject(name, value, expected)
    return int(value)


def _real(name: str, value: Any, minimum: float, *, exclusive: bool = False) -> float:
    in_range = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    in_range = in_range and (value > minimum if exclusive else value >= minimum)
    if not in_range:
        raise _reject(name, value, f"a finite number {'>' if exclusive else '>='} {minimum}")
    return float(value)


def _needs_stage(name: str, value: Any, stage: Any, minimum: int, off: Any = False) -> Any:
    """``value`` unless it turns on a feature that ``stage`` (already validated or not) does not have."""
    if value != off and (not isinstance(stage, int) or stage < minimum):
        raise ZeroConfigError(
            name,
            f"ZeroConfig.{name}={value!r} is not allowed with stage={stage!r}; "
            f"it needs stage >= {minimum} (or {name}={off!r})",
        )
    return value


def _nvme_path(value: Any, offload_optimizer: Any, offload_params: Any) -> str | None:
    """A non-empty path, required when anything is offloaded to NVMe."""
    if value is not None and not (isinstance(value, (str, os.PathLike)) and str(value)):
        raise _reject("nvme_path", value, "a directory path or None")
    if value is None and "nvme" in (offload_optimizer, offload_params):
        raise ZeroConfigError(
            "nvme_path",
            f"ZeroConfig.nvme_path=None is not allowed with offload_optimizer="
            f"{offload_optimizer!r}, offload_params={offload_params!r}; NVMe offload "
            f"needs a directory for its files",
        )
    return None if value is None else os.fspath(value)


def _offload_ratio(value: Any, offload_optimizer: Any) -> float:
    ratio = _real("offload_ratio", value, 0.0)
    if ratio > 1.0:
        raise _reject("offload_ratio", value, "a number between 0 and 1")
    if ratio != 1.0 and offload_optimizer == "none":
        raise ZeroConfigError(
            "offload_ratio",
            f"ZeroConfig.offload_ratio={value!r} is not allowed with "
            f"offload_optimizer='none'; it needs offload_optimizer 'cpu' or 'nvme'",
        )
    return ratio


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _reject(name, value, "True or False")
    return value


def _callable_or_none(name: str, value: Any) -> Callable | None:
    if value is not None and not callable(value):
        raise _reject(name, value, "None or a callable taking one module")
    return value


def _unit_modules(value: Any) -> tuple[type[torch.nn.Module] | str, ...]:
    units = (value,) if isinstance(value, (str, type)) else value
    expected = "a tuple of torch.nn.Module subclasses or class-name strings"
    if not isinstance(units, (list, tuple)):
        raise _reject("unit_modules", value, expected)
    for unit in units:
        is_module_class = isinstance(unit, type) and issubclass(unit, torch.nn.Module)
        if not (is_module_class or (isinstance(unit, str) and unit)):
            raise _reject("unit_modules", value, expected)
    return tuple(units)


def _tensor_parallel_plan(value: Any) -> str | dict[str, Any] | None:
    if value is None or value == AUTO:
        return value
    if isinstance(value, Mapping) and all(isinstance(key, str) and key for key in value):
        return dict(value)
    raise _reject(
        "tensor_parallel_plan", value, 'None (the model parallelizes itself), "auto" or a mapping of module names'
    )


def _needs_tensor_parallel(name: str, value: bool, tensor_parallel_size: Any) -> bool:
    if value and (not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 2):
        raise ZeroConfigError(
            name,
            f"ZeroConfig.{name}=True is not allowed with tensor_parallel_size={tensor_parallel_size!r}; "
            f"it needs tensor_parallel_size >= 2",
        )
    return value


_FEATURES = {
    "tensor_parallel_size": "tensor parallelism",
    "sequence_parallel_size": "Ulysses",
    "pipeline_parallel_size": "pipelining",
}


def _size_without(name: str, value: Any, other: str, other_value: Any) -> int:
    """A parallel size >= 1 that must stay 1 while ``other`` (validated first) is above 1."""
    size = _integer(name, value, 1)
    if size > 1 and other_value != 1:
        raise ZeroConfigError(
            name,
            f"ZeroConfig.{name}={size} is not allowed with {other}={other_value!r}; {_FEATURES[name]} and "
            f"{_FEATURES[other]} do not combine yet, set one of them to 1",
        )
    return size


def _pipeline_split(value: Any) -> str | tuple[str, ...]:
    """A split method's name, or distinct module names as a tuple; whether the names exist is checked at setup."""
    if isinstance(value, str) and value in _PIPELINE_SPLITS:
        return value
    names = tuple(value) if isinstance(value, (list, tuple)) else ()
    if names and all(isinstance(name, str) and name for name in names) and len(set(names)) == len(names):
        return names
    raise _reject(
        "pipeline_split", value, '"auto", "parameters" or a list of distinct module names where stages 2..n begin'
    )
