"""ZeroConfig: the one place ZeRO's settings are defaulted, validated and documented.

Each field is declared once, by ``setting``: its default, its check (``ds_strategy.config.checks``), its meaning,
the stages it acts at and its ``Section`` (a heading of the docs, belonging to one policy), from which the class
docstring, the documentation's configuration table (``ds-strategy config-table``), the policies' fields, Hydra's
groups and the autotuner's search are derived (``fields_of``). Front-ends (the DeepSpeed JSON reader in
``ds_strategy.config.deepspeed``, strategy constructor arguments, Hydra) translate into this dataclass and carry no
defaults of their own.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..parallel.pipeline_schedules import SCHEDULES
from .auto_values import deepspeed_auto_values
from .checks import (
    AUTO,
    UNITS,
    Check,
    ZeroConfigError,
    callable_or_none,
    choice,
    expert_parallel,
    flag,
    integer,
    needs_stage,
    needs_tensor_parallel,
    not_pipelined,
    nvme_path,
    offload_ratio,
    only_true,
    pipeline_split,
    real,
    seconds,
    tensor_parallel_plan,
    unit_modules,
)
from .plan import DTYPES, ZeroPlan
from .policies import (
    ActivationPolicy,
    CommPolicy,
    OffloadPolicy,
    ParallelismPolicy,
    PrecisionPolicy,
    Section,
    declare_policy_fields,
    policy_of,
)

__all__ = ["AUTO", "OFFLOAD_MODES", "UNITS", "ZeroConfig", "ZeroConfigError"]

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
PRECISIONS = tuple(dict.fromkeys(_PRECISIONS.values()))  # the canonical names, aliases dropped
_COMMUNICATION_DTYPES = {
    None: None,
    **{short: short for short in DTYPES},
    **{dtype: short for short, dtype in DTYPES.items()},
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
}
OFFLOAD_MODES = ("none", "cpu", "nvme")  # the values of offload_optimizer and offload_params


# The one grouping of the fields: each section is a heading of the docs and belongs to one policy (None: the engine's
# own); Hydra's ``precision`` group is PRECISION_SECTION.
SHARDING = Section("What is sharded, and in which units (the engine reads these itself):", None)
GRADIENT_COMMUNICATION = Section("Gradient communication:", CommPolicy)
GATHERING = Section("Stage 3 parameter gathering:", CommPolicy)
TIMEOUTS = Section("Timeouts:", CommPolicy)
ZERO_PLUS_PLUS = Section(
    "ZeRO++ (communication volume; names and defaults as in DeepSpeed; see ``ds_strategy.comm.quantized``):", CommPolicy
)
REPORTING = Section("Reporting:", CommPolicy)
CONSTRUCTION = Section(
    "Construction of a model built on the meta device (see ``ds_strategy.zero.sharded_init``):", None
)
OFFLOAD = Section(
    (
        "Offload (ZeRO-Offload and ZeRO-Infinity; DeepSpeed's ``offload_optimizer`` / ``offload_param`` sections, "
        "same defaults; see ``ds_strategy.offload``):"
    ),
    OffloadPolicy,
)
OPTIMIZER_STEP = Section("Optimizer step:", None)
PRECISION_SECTION = Section("Precision and dynamic loss scaling (DeepSpeed semantics):", PrecisionPolicy)
GRADIENT_DTYPES = Section("Gradient dtypes (of the precision policy, set beside the strategy):", PrecisionPolicy)
MESH = Section(
    (
        'Model parallelism on one device mesh ``("dp", "sp", "tp")``, outer to inner (see '
        "``ds_strategy.parallel``); ZeRO shards over every rank that holds the same weights, data x sequence "
        "parallel, so N above is world size / tensor_parallel_size:"
    ),
    ParallelismPolicy,
)
PIPELINE = Section(
    (
        "Pipeline parallelism (torch.distributed.pipelining; the outermost mesh dimension, ahead of dp; ZeRO "
        "shards each stage's units over the data x sequence parallel ranks holding that stage, so N above is also "
        "divided by pipeline_parallel_size):"
    ),
    ParallelismPolicy,
)
ACTIVATION_MEMORY = Section(
    (
        "Activation memory (DeepSpeed's ``activation_checkpointing`` section; see "
        "``ds_strategy.compose.activation_checkpointing``):"
    ),
    ActivationPolicy,
)
EXPERTS = Section(
    "Expert parallelism for mixture-of-experts models (``ds_strategy.parallel.expert_parallel``):", ParallelismPolicy
)
SEQUENCE_TILING = Section(
    "Sequence tiling (``ds_strategy.sequence_tiling``; ALST's tiled MLP and loss):", ActivationPolicy
)


def _names(*names: str) -> dict[str, str]:
    return {name: name for name in names}


STAGES = (0, 1, 2, 3)


def setting(
    default: Any,
    check: Check,
    *,
    section: Section,
    doc: str,
    default_note: str = "",
    acts_at: tuple[int, ...] = STAGES,
    bounds_elements: bool = False,
) -> Any:
    """A ZeroConfig field: its ``default``, the ``check`` construction runs on its value, the ``section`` it belongs
    to (its heading in the docs and its policy) and what it means (``doc``; ``default_note`` follows the default
    where the docs show it, as in "0.0 = off"). ``acts_at``: the stages at which its value changes anything;
    ``bounds_elements``: it caps a count of elements, so a value above the model's size acts as that size (the
    autotuner's search skips candidates these make identical)."""
    metadata = {
        "check": check,
        "doc": doc,
        "default_note": default_note,
        "section": section,
        "acts_at": acts_at,
        "bounds_elements": bounds_elements,
    }
    return dataclasses.field(default=default, metadata=metadata)


def shown_default(field: dataclasses.Field) -> str:
    """A field's default as the docs show it: ``5e8`` for 500_000_000, strings in double quotes, then its note."""
    value = field.default
    if isinstance(value, str):
        shown = f'"{value}"'
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 100_000:
        digits = str(value).rstrip("0")
        shown = f"{digits}e{len(str(value)) - len(digits)}"
    else:
        shown = repr(value)
    return shown + field.metadata["default_note"]


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """What ZeRO shards, how it batches communication, and how it scales the loss.

    N is the data-parallel world size; every size is a count of elements, not bytes. Fields named as in
    DeepSpeed keep DeepSpeed's default and meaning. Construction validates and normalises every field;
    ``from_dict`` and ``replace`` re-validate, and the instance is frozen so nothing skips that.

    The three sizes that accept "auto" keep the string until ``resolve_auto(hidden_size)`` substitutes
    DeepSpeed's formulas; engine code must resolve before reading them. "units" stays a string: the engine
    resolves it against its units (``ds_strategy.zero.memory_report.unit_bounded_sizes``).

    Each field's default and meaning follow (generated from the fields' declarations):
    """

    stage: int = setting(
        2,
        choice({s: s for s in range(4)}),
        doc=(
            "what each rank keeps only a 1/N shard of. 0 = nothing (plain data parallel, gradients all-reduced); 1 = "
            "optimizer state (Adam's two fp32 moments, plus fp32 master weights under mixed precision); 2 = also "
            "gradients, reduced straight into the owner's shard; 3 = also parameters, all-gathered per unit before "
            "its forward/backward and freed after."
        ),
        section=SHARDING,
    )
    contiguous_gradients: bool = setting(
        True,
        only_true("gradients always live in flat contiguous buffers"),
        default_note=", the only value",
        doc=(
            "gradients always live in flat contiguous buffers (one per unit and param group), so they never fragment "
            "memory. Accepted for DeepSpeed configs; False, which DeepSpeed uses to skip that copy, is rejected "
            "rather than silently ignored."
        ),
        section=SHARDING,
    )
    param_persistence_threshold: int | str = setting(
        100_000,
        integer(0, auto=True),
        default_note=', or "auto"',
        doc=(
            "parameters this small stay gathered on every rank; they cost little memory and would otherwise cost one "
            "latency-bound collective each."
        ),
        acts_at=(3,),
        section=SHARDING,
    )
    unit_modules: tuple[type[torch.nn.Module] | str, ...] = setting(
        (),
        unit_modules,
        doc=(
            "module classes, or class names, whose instances are the units that are gathered/freed together and that "
            "bound gradient buckets. Empty auto-detects the repeated child block type (e.g. a transformer layer)."
        ),
        section=SHARDING,
    )
    unit_min_params: int = setting(
        0,
        integer(0),
        doc=(
            "when > 0 and unit_modules is empty, form units by parameter count instead of by class, with this many "
            "elements as the threshold for a unit."
        ),
        section=SHARDING,
    )

    reduce_bucket_size: int | str = setting(
        "units",
        integer(1, auto=True, units=True),
        default_note=', or an element count, or "auto"',
        doc=(
            "elements of gradients reduced by one collective: consecutive flat buffers, across units, fill a bucket "
            "that launches when its last gradient is ready, and at most this many elements of gradient scratch "
            '(stage 2/3) are in flight; past it, launching waits for the oldest reductions. "units" is the largest '
            "unit's elements, at least 2**18 (DDP's first bucket): one bucket in flight while the next fills, about "
            "two units alive whatever the model size and however slow the reductions (FSDP2's bound), and a model of "
            "small units in a few buckets. DeepSpeed's 5e8 holds up to the whole model's gradients as scratch when "
            "reductions lag. Larger: fewer collectives, more memory."
        ),
        acts_at=(2, 3),
        bounds_elements=True,
        section=GRADIENT_COMMUNICATION,
    )
    allgather_bucket_size: int = setting(
        500_000_000,
        integer(1),
        doc=(
            "at most this many elements of the stage 1/2 all-gathers of updated parameters in flight after a step "
            "(buckets of reduce_bucket_size elements, across units, one coalesced all-gather each); past it, the "
            "step waits before launching more."
        ),
        acts_at=(1, 2),
        bounds_elements=True,
        section=GRADIENT_COMMUNICATION,
    )
    overlap_comm: bool = setting(
        True,
        flag,
        doc=(
            "launch each bucket's reduction as soon as it fills and wait for it only when the in-flight bound or the "
            "optimizer needs it, overlapping backward compute at the cost of keeping buckets alive until they finish; "
            "also prefetch stage-3 gathers ahead of use. False waits for every reduction as soon as it is launched "
            "and gathers stage-3 units on demand: the same collectives in the same order, so the same results, "
            "slower. (The stage 1/2 parameter all-gathers after a step are launched together and waited on inside the "
            "step either way.)"
        ),
        section=GRADIENT_COMMUNICATION,
    )
    gradient_reduction: str = setting(
        "auto",
        choice(_names("auto", "reduce_scatter", "all_reduce")),
        doc=(
            'the collective that reduces gradients. "reduce_scatter" sends (N-1)/N of the bucket and leaves each rank '
            'its shard; "all_reduce" sends twice that and each rank slices its shard, yet is faster on gloo; "auto" '
            "picks per backend (``plan.gradient_collective``)."
        ),
        section=GRADIENT_COMMUNICATION,
    )

    prefetch_bucket_size: int | str = setting(
        "units",
        integer(0, auto=True, units=True),
        default_note=', or an element count, or "auto"',
        doc=(
            "elements of upcoming units gathered ahead of use (while the current unit computes); 0 gathers each unit "
            'only when it is needed. "units" is the largest unit\'s elements: the next unit is gathered while one '
            "computes (FSDP2's prefetch). DeepSpeed's 5e7 covers every unit of a small model, so the whole model is "
            "then gathered during forward."
        ),
        acts_at=(3,),
        bounds_elements=True,
        section=GATHERING,
    )
    max_live_parameters: int = setting(
        1_000_000_000,
        integer(0),
        doc=(
            "cap on gathered elements alive at once; gathering waits for frees beyond it, trading speed for peak "
            "memory. The unit in use is always gathered: 0 prefetches nothing, as in DeepSpeed."
        ),
        acts_at=(3,),
        bounds_elements=True,
        section=GATHERING,
    )
    reshard_after_forward: bool = setting(
        True,
        flag,
        doc=(
            "free a unit's gathered parameters after its forward and gather again for backward. False keeps them "
            "until backward: one fewer all-gather, more memory."
        ),
        acts_at=(3,),
        section=GATHERING,
    )

    collective_timeout: float = setting(
        600.0,
        real(0.0, exclusive=True),
        default_note=" s",
        doc=(
            "how long a rank waits for one collective before raising an error that names it, instead of hanging "
            "forever when ranks issue different collectives (a rank that skipped a unit, or ran fewer forward calls "
            "under stage 3). Before each optimizer step the ranks also compare the collectives they issued (one tiny "
            "all-gather), which catches the mismatches that do not hang; see ``ds_strategy.comm.sequence_check``. On "
            "NCCL a wait never blocks the host, and the process group's ``timeout`` (NCCL's watchdog) bounds a "
            "collective instead."
        ),
        section=TIMEOUTS,
    )
    timeout: float = setting(
        1800.0,
        seconds,
        default_note=" s, torch's ``default_pg_timeout``; seconds or a ``datetime.timedelta``",
        doc=(
            "the process-group timeout the Lightning and Fabric strategies pass to ``init_process_group`` when they "
            "create the group, as DDP's, FSDP's and DeepSpeed's ``timeout=`` does."
        ),
        section=TIMEOUTS,
    )

    zero_quantized_weights: bool = setting(
        False,
        needs_stage(flag, 3),
        default_note="; stage 3",
        doc=(
            "qwZ, all-gather weights as block-wise int8 (one fp32 scale per 256 values) and dequantise: about 1/4 of "
            "the fp32 bytes (1/2 of bf16), at the cost of forward and backward seeing weights rounded to 1/254 of "
            "their block's largest magnitude. Checkpoints and ``full_state_dict`` still gather exactly."
        ),
        section=ZERO_PLUS_PLUS,
    )
    zero_quantized_gradients: bool = setting(
        False,
        needs_stage(flag, 2),
        default_note="; stage 2 or 3",
        doc=(
            "qgZ, reduce gradients with an all-to-all of block-wise quantised chunks (one fp32 scale per 256 values), "
            "dequantised and summed in fp32 by their owner. Each rank's gradient is rounded once, before the sum."
        ),
        section=ZERO_PLUS_PLUS,
    )
    zero_quantized_gradients_bits: int = setting(
        4,
        choice({4: 4, 8: 8}),
        default_note=", as DeepSpeed's qgZ; or 8",
        doc=(
            "qgZ's integer width. int4 sends about 1/8 of an fp32 reduce-scatter's bytes (1/4 of bf16's) and rounds "
            "each gradient to 1/14 of its block's largest magnitude; int8 sends about 1/4 of fp32's (1/2 of bf16's) "
            "and rounds to 1/254. DeepSpeed has no key for it (its qgZ is int4)."
        ),
        section=ZERO_PLUS_PLUS,
    )
    zero_hpz_partition_size: int = setting(
        1,
        needs_stage(integer(1), 3, off=1),
        default_note=" = off; stage 3",
        doc=(
            "hpZ, keep a secondary copy of each unit's weights partitioned over groups of this many consecutive ranks "
            "(e.g. one node's GPUs), cut from the forward gather, so backward all-gathers stay inside the group. "
            "Costs 1/size of a unit's weights per rank from its forward to its backward; needs "
            "``reshard_after_forward`` to matter, a size that divides the data-parallel world size (groups are "
            "consecutive data-parallel ranks)."
        ),
        section=ZERO_PLUS_PLUS,
    )

    log_comm_stats: bool = setting(
        True,
        flag,
        doc=(
            "the Lightning strategy logs each optimizer step's communication bytes (total and per collective kind) "
            "and time spent waiting to the Trainer's logger, as ``comm/bytes``, ``comm/<kind>_bytes`` and "
            "``comm/wait_seconds``."
        ),
        section=REPORTING,
    )

    param_init_fn: Callable[[torch.nn.Module], None] | None = setting(
        None,
        callable_or_none,
        doc=(
            "``param_init_fn(module)`` (FSDP's name) fills the parameters and buffers of one module in place; the "
            "engine calls it once per module that owns tensors, in module order, one unit at a time, ahead of Hugging "
            "Face's ``_init_weights`` and of ``reset_parameters()``."
        ),
        section=CONSTRUCTION,
    )
    sync_module_states: bool = setting(
        False,
        flag,
        default_note="; FSDP's name",
        doc=(
            "rank 0 holds the real model (e.g. built normally or loaded), the other ranks build it on the meta "
            "device; the engine streams rank 0's values unit by unit, so no other rank ever holds more than one unit. "
            "Every rank must pass the same value."
        ),
        section=CONSTRUCTION,
    )

    offload_optimizer: str = setting(
        "none",
        needs_stage(choice(_names(*OFFLOAD_MODES)), 1, off="none"),
        default_note="; stage >= 1",
        doc=(
            'where this rank\'s fp32 master shard and optimizer state live. "cpu": host memory; reduced gradient '
            "shards are copied to the host and the optimizer steps there (``CpuAdam`` for Adam/AdamW/Adagrad/SGD, "
            "torch's own step otherwise), then the updated parameters are copied back. Frees 12 bytes per parameter / "
            'N of device memory for Adam, costs host memory bandwidth and a host<->device copy per step. "nvme": '
            "files under ``nvme_path`` streamed through host buffers during the step: host memory holds only the "
            "buffers, the step is bounded by disk bandwidth."
        ),
        section=OFFLOAD,
    )
    offload_params: str = setting(
        "none",
        needs_stage(choice(_names(*OFFLOAD_MODES)), 3, off="none"),
        default_note="; stage 3",
        doc=(
            'where this rank\'s parameter shard lives between gathers: "cpu" (host memory) or "nvme" (a file under '
            "``nvme_path``); gathered units stay on the device."
        ),
        section=OFFLOAD,
    )
    nvme_path: str | None = setting(
        None,
        nvme_path,
        default_note='; required with "nvme"',
        doc=(
            "directory for the offload files. Each rank creates its own uniquely named subdirectory at setup (after "
            "checking space and permissions) and removes it at teardown."
        ),
        section=OFFLOAD,
    )
    pin_memory: bool = setting(
        False,
        flag,
        doc=(
            "page-lock host buffers when the device is CUDA, so host<->device copies run asynchronously and faster, "
            "at the cost of memory the OS cannot swap out. No effect on CPU."
        ),
        section=OFFLOAD,
    )
    offload_ratio: float = setting(
        1.0,
        offload_ratio,
        doc=(
            "fraction of the shard's elements (whole flat buffers, in order) whose optimizer work is offloaded; the "
            "rest steps on the device. Lower: more device memory, less host work."
        ),
        section=OFFLOAD,
    )
    buffer_count: int = setting(
        4,
        integer(2),
        default_note=", >= 2",
        doc=(
            "host buffers the NVMe step cycles through, so that the next sub-group is read and earlier ones are "
            "written while one is updated."
        ),
        section=OFFLOAD,
    )
    buffer_size: int = setting(
        100_000_000,
        integer(1),
        doc=(
            "elements per NVMe staging buffer (each holds a sub-group's master and state); host memory for NVMe "
            "offload is about buffer_count x buffer_size x 4 bytes x (1 + states)."
        ),
        section=OFFLOAD,
    )
    sub_group_size: int = setting(
        1_000_000_000,
        integer(1),
        doc=(
            "the optimizer steps each flat shard in pieces of at most this many elements (with NVMe, also at most "
            "``buffer_size``): the unit of IO and of host<->device overlap."
        ),
        section=OFFLOAD,
    )

    gradient_clipping: float = setting(
        0.0,
        real(0.0),
        default_note=" = off",
        doc=("clip the global gradient norm to this before the step."),
        section=OPTIMIZER_STEP,
    )
    gradient_accumulation_steps: int = setting(
        1,
        integer(1),
        doc=("micro-batches summed before each optimizer step."),
        section=OPTIMIZER_STEP,
    )
    train_micro_batch_size_per_gpu: int | None = setting(
        None,
        integer(1, none=True),
        default_note=" = whatever the data loader yields",
        doc=("per-rank batch."),
        section=OPTIMIZER_STEP,
    )
    train_batch_size: int | None = setting(
        None,
        integer(1, none=True),
        default_note=" = not checked",
        doc=(
            "the global batch, micro-batch x accumulation x world size, as in DeepSpeed; ``resolve_batch_sizes`` "
            "derives the missing one of the three at setup, or fails naming all three when they disagree."
        ),
        section=OPTIMIZER_STEP,
    )

    precision: str = setting(
        "32-true",
        choice(
            _PRECISIONS,
            "one of '32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true' (or 32, '32', 'bf16', 16, '16')",
        ),
        doc=(
            '"32-true", "bf16-mixed", "16-mixed", "bf16-true" or "16-true"; Lightning\'s 32, "32", "bf16", 16 and "16" '
            'are normalised. "-mixed" keeps fp32 master weights and optimizer state beside half-precision compute '
            'weights; "-true" keeps only the half copy.'
        ),
        section=PRECISION_SECTION,
    )
    loss_scale: float = setting(
        0.0,
        real(0.0),
        default_note=" = dynamic",
        doc=("a fixed loss scale, or 0 to scale dynamically (16-* only)."),
        section=PRECISION_SECTION,
    )
    initial_scale_power: int = setting(
        16,
        integer(0, maximum=64),
        doc=("dynamic scaling starts at 2**initial_scale_power."),
        section=PRECISION_SECTION,
    )
    loss_scale_window: int = setting(
        1000,
        integer(1),
        doc=("overflow-free steps before the scale doubles."),
        section=PRECISION_SECTION,
    )
    hysteresis: int = setting(
        2,
        integer(1),
        doc=("overflows tolerated before the scale halves."),
        section=PRECISION_SECTION,
    )
    consecutive_hysteresis: bool = setting(
        False,
        flag,
        doc=(
            "refill the hysteresis on every overflow-free step, so only ``hysteresis`` overflows in a row halve the "
            "scale; False refills it only when the scale grows."
        ),
        section=PRECISION_SECTION,
    )
    min_loss_scale: float = setting(
        1.0,
        real(0.0, exclusive=True),
        doc=("the scale never drops below this."),
        section=PRECISION_SECTION,
    )
    max_consecutive_min_scale_skips: int = setting(
        10,
        integer(1),
        doc=(
            "consecutive overflowing steps at the minimum scale after which training raises instead of silently "
            "skipping every step."
        ),
        section=PRECISION_SECTION,
    )

    communication_dtype: str | None = setting(
        None,
        choice(
            _COMMUNICATION_DTYPES,
            "None (auto), 'fp32', 'fp16', 'bf16', 'float32', 'float16', 'bfloat16' or that torch dtype",
        ),
        default_note=" = auto",
        doc=(
            "dtype gradients travel in. Auto is fp32 for fp32 and fp16 training (fp16 sums overflow) and bf16 for "
            'bf16 training. "fp16"/"bf16" halve the bytes sent but lose precision in the sum.'
        ),
        section=GRADIENT_DTYPES,
    )
    grad_accum_dtype: str | None = setting(
        None,
        choice(_COMMUNICATION_DTYPES, "None, 'fp32', 'fp16' or 'bf16'"),
        default_note=" = the compute dtype",
        doc=(
            "dtype of the reduced gradient shard (stage 1-3), where micro-batches accumulate between optimizer steps. "
            "The default keeps 16-bit gradients under mixed precision, 2 bytes per parameter as in the ZeRO paper and "
            "DeepSpeed; each step converts the shard to fp32 for unscaling, clipping and the optimizer (a transient 4 "
            'bytes per parameter / N). "fp32" accumulates in fp32 instead: 2 more bytes per parameter / N, exact sums '
            "over micro-batches. DeepSpeed's ``data_types.grad_accum_dtype``."
        ),
        section=GRADIENT_DTYPES,
    )

    tensor_parallel_size: int = setting(
        1,
        integer(1),
        default_note=" = off",
        doc=(
            "ranks that split each layer's weights (Megatron column/row parallelism with DTensor). Consecutive ranks "
            "form a group. DeepSpeed's ``tensor_parallel.autotp_size``."
        ),
        section=MESH,
    )
    tensor_parallel_plan: str | Mapping[str, Any] | None = setting(
        None,
        tensor_parallel_plan,
        doc=(
            "how the model is split. None: the user's own code does it (a LightningModule's ``configure_model`` "
            'calling ``parallelize_module`` on ``self.device_mesh ["tensor_parallel"]``, as for Lightning\'s '
            'ModelParallelStrategy, or Fabric\'s ``parallelize_fn``). "auto": ds_strategy picks column/row parallel '
            "styles per linear layer for the decoder families it knows (``ds_strategy.parallel.auto_plan``). A "
            'mapping: module name (fnmatch pattern) to a torch ``ParallelStyle`` or one of the names "colwise", '
            '"rowwise", "sequence_parallel", "replicate".'
        ),
        section=MESH,
    )
    sequence_parallel: bool = setting(
        False,
        needs_tensor_parallel,
        default_note="; needs tensor_parallel_size > 1",
        doc=(
            "Megatron sequence parallelism in the tensor-parallel group: the auto plan splits norms and dropout along "
            "the sequence, and replicated weights' partial gradients are summed over the group before ZeRO reduces "
            "them."
        ),
        section=MESH,
    )
    sequence_parallel_size: int = setting(
        1,
        integer(1),
        default_note=" = off",
        doc=(
            "DeepSpeed-Ulysses (``ds_strategy.parallel.ulysses``), unrelated to Megatron's ``sequence_parallel`` "
            "above: a group of this many consecutive ranks reads the same batch, each rank keeps one slice of every "
            "sequence and the full weights, and attention swaps the sequence split for a head split with all-to-alls. "
            "The framework's sampler splits batches over data-parallel ranks only (world size / this), and the engine "
            "multiplies the loss by this size for backward (Note: [Ulysses gradient scale]). DeepSpeed's "
            "``sequence_parallel_size``."
        ),
        section=MESH,
    )

    pipeline_parallel_size: int = setting(
        1,
        integer(1),
        default_note=" = off",
        doc=(
            "ranks that split the model's blocks into consecutive stages and pass activations from one to the next; "
            "with Ulysses every stage gives its slice's tokens their absolute positions. DeepSpeed's "
            "``pipeline.stages``."
        ),
        section=PIPELINE,
    )
    pipeline_schedule: str = setting(
        "1f1b",
        choice(_names(*SCHEDULES)),
        doc=(
            'the order micro-batches run forward and backward through the stages: "gpipe" (all forwards, then all '
            'backwards: activations of every micro-batch alive), "1f1b" (one forward, one backward: at most a stage '
            'count of micro-batches alive), "interleaved_1f1b", "zero_bubble" (backward split into input and weight '
            'gradients to fill the bubble) or "zbv" (zero bubble in a V shape). The last three place two stage chunks '
            "on every rank: smaller bubbles, more activation sends. torch's ScheduleGPipe, Schedule1F1B, "
            "ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble "
            "(``ds_strategy.parallel.pipeline_schedules``)."
        ),
        section=PIPELINE,
    )
    pipeline_microbatches: int | None = setting(
        None,
        integer(1, none=True),
        default_note=" = one per stage",
        doc=(
            "the micro-batches each training step's batch is split into; None is the stage count, "
            "pipeline_parallel_size x stages per rank. More: smaller bubbles (idle stages at the start and end of a "
            "step), smaller pieces per forward. DeepSpeed's PipelineEngine reads its ``gradient_accumulation_steps`` "
            "as this."
        ),
        section=PIPELINE,
    )
    pipeline_split: str | tuple[str, ...] = setting(
        "auto",
        pipeline_split(("auto", "parameters")),
        doc=(
            'where stages begin. "auto": the same number of blocks on every stage (the block count must be a multiple '
            'of the stage count); "parameters": consecutive blocks balanced by parameter count (DeepSpeed\'s '
            '``partition_method="parameters"``); or the module names (e.g. ["model.layers.2"]) where stages 2..n '
            "begin, checked against the model at setup."
        ),
        section=PIPELINE,
    )
    pipeline_grad_reduction: str = setting(
        "once",
        needs_stage(choice(_names("once", "per_microbatch")), 2, off="once"),
        doc=(
            '"once" accumulates a stage\'s full gradients over the micro-batches and reduces them once per optimizer '
            'step: the least traffic, a full gradient buffer per rank. "per_microbatch" (stage 2/3) reduce-scatters '
            "after every micro-batch's backward: ZeRO-2 gradient memory, pipeline_microbatches times the traffic."
        ),
        section=PIPELINE,
    )
    pipeline_keep_gathered: bool = setting(
        True,
        flag,
        default_note="; acts at stage 3",
        doc=(
            "True gathers each rank's units once per step and keeps them through the whole schedule: one all-gather "
            "per unit per step, the rank's stages whole in memory. False gathers them for each micro-batch's forward "
            "and backward and frees them after: at most one stage chunk gathered at a time, a gather per micro-batch "
            "pass."
        ),
        section=PIPELINE,
    )

    activation_checkpointing: str = setting(
        "none",
        choice(_names("none", "full", "selective")),
        doc=(
            '"none"; "full": each checkpointed unit (the outermost ZeRO units) keeps only its input and recomputes '
            'its forward in backward (non-reentrant), one more forward of compute; "selective": keeps matmul and '
            "attention outputs too and recomputes only the cheap ops between them (torchtitan's op-level policy). "
            "Parameter names and stage-3 gathers stay as they are."
        ),
        section=ACTIVATION_MEMORY,
    )
    activation_checkpoint_interval: int = setting(
        1,
        integer(1),
        doc=(
            "checkpoint only the k-th, 2k-th, ... unit, as torchtitan's layer-level option counts (DeepSpeed's "
            "pipeline uses the name for one checkpoint per k layers)."
        ),
        section=ACTIVATION_MEMORY,
    )
    partition_activations: bool = setting(
        False,
        flag,
        doc=(
            "keep 1/W of each checkpointed input on each rank of the tensor-parallel group and all-gather it for "
            "recomputation (DeepSpeed's name; a no-op without tensor parallelism, as in DeepSpeed without a "
            "model-parallel unit)."
        ),
        section=ACTIVATION_MEMORY,
    )
    cpu_checkpointing: bool = setting(
        False,
        flag,
        doc=(
            "keep checkpointed inputs (or their 1/W pieces) in pinned host memory until recomputation copies them "
            "back (DeepSpeed's name)."
        ),
        section=ACTIVATION_MEMORY,
    )

    expert_parallel_size: int = setting(
        1,
        expert_parallel,
        default_note=" = off",
        doc=(
            "expert parallelism for mixture-of-experts models (``ds_strategy.parallel.expert_parallel``): a group of "
            "this many consecutive ranks splits every MoE layer's experts, each holding num_experts / this of them, "
            "and tokens travel to their experts' ranks and back with all-to-alls (dropless: the results equal the "
            "unsharded model's). Every rank still reads its own batch. ZeRO shards the other parameters over all "
            "ranks and the experts over the ranks holding the same ones (world size / this). Stages 1-3, with offload, "
            "activation checkpointing and models built on the meta device; not yet with tensor, sequence or pipeline "
            "parallelism, ZeRO++ or whole-tensor optimizers."
        ),
        section=EXPERTS,
    )

    tiled_mlp: bool = setting(
        False,
        flag,
        doc=(
            "run every MLP (the submodules named ``mlp``) over tiles of ``tile_tokens`` tokens, each recomputed in "
            "backward: the MLP's intermediate activations exist for one tile at a time, at the cost of one more MLP "
            "forward."
        ),
        section=SEQUENCE_TILING,
    )
    tiled_loss: bool = setting(
        False,
        not_pipelined(flag),
        doc=(
            "a Hugging Face causal LM given ``labels`` computes its logits and cross-entropy over tiles of "
            "``tile_tokens`` tokens, each recomputed in backward, so the ``[tokens, vocab]`` logits never exist "
            "whole; such a forward returns no logits. Not with pipelining, whose last stage hands the logits to the "
            "loop's loss function."
        ),
        section=SEQUENCE_TILING,
    )
    tile_tokens: int | str = setting(
        AUTO,
        integer(1, auto=True),
        doc=(
            "tokens per tile; \"auto\" is the model's hidden size, which makes a tile's logits or MLP activations "
            "the size of the weight that computes them. Smaller: less memory, more kernel launches."
        ),
        section=SEQUENCE_TILING,
    )

    def __post_init__(self) -> None:
        """Each field's check, in declaration order: a check may read the fields declared before its own."""
        checked: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            checked[field.name] = field.metadata["check"](field.name, getattr(self, field.name), checked)
            object.__setattr__(self, field.name, checked[field.name])

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> ZeroConfig:
        """Build from field names to values; an unknown name raises, suggesting the closest field."""
        if not isinstance(options, Mapping):
            raise ValueError(f"ZeroConfig.from_dict expects a mapping of field names, got {type(options).__name__}")
        _check_field_names(options)
        return cls(**options)

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


def _docstring(intro: str) -> str:
    """``intro`` followed by every field's ``name (default ...): meaning`` entry, under its section."""
    lines = [inspect.cleandoc(intro)]
    section = None
    for field in dataclasses.fields(ZeroConfig):
        if field.metadata["section"] is not section:
            section = field.metadata["section"]
            lines += ["", *textwrap.wrap(section.title, 116)]
        entry = f"{field.name} (default {shown_default(field)}): {field.metadata['doc']}"
        lines += textwrap.wrap(entry, 116, initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)
    return "\n".join(lines)


def fields_of(*sections: Section) -> list[str]:
    """The names of the fields declared under ``sections``, in declaration order."""
    return [field.name for field in dataclasses.fields(ZeroConfig) if field.metadata["section"] in sections]


ZeroConfig.__doc__ = _docstring(ZeroConfig.__doc__)
declare_policy_fields(dataclasses.fields(ZeroConfig), ZeroConfig.__annotations__)
