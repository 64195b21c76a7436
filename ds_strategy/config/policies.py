"""Each component's section of a ZeroConfig: small frozen policies, as FSDP2's ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy``.

``ZeroConfig`` stays the flat facade that users, DeepSpeed JSON and Hydra write, and the one place fields are
defaulted, documented and validated; a policy has no defaults and checks nothing. ``ZeroConfig`` builds each from
its validated fields (``config.precision_policy``, ``config.offload_policy``, ...), under the same field names, so a
component that takes its policy sees only the settings it acts on, and a reader of its constructor sees which.
Every ZeroConfig field belongs to exactly one policy or to the engine itself (stage, units, construction, the
optimizer step and batch sizes); ``tests/unit/test_config_policies.py`` holds that for every new field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from ..parallel.pipeline_schedules import stage_count


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes the engine computes, accumulates and communicates in, and fp16's loss scaling
    (``LossScaler`` takes it). One policy, as FSDP2's ``MixedPrecisionPolicy`` holds its ``reduce_dtype``:
    the automatic communication dtype follows ``precision``, and loss scaling exists only for "16-*"."""

    precision: str
    communication_dtype: str | None
    grad_accum_dtype: str | None
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float
    max_consecutive_min_scale_skips: int


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Where optimizer state and stage-3 parameter shards live off the device, and how NVMe streams them
    (``ds_strategy.offload``'s step runner takes it)."""

    offload_optimizer: str
    offload_params: str
    nvme_path: str | None
    pin_memory: bool
    offload_ratio: float
    buffer_count: int
    buffer_size: int
    sub_group_size: int


@dataclasses.dataclass(frozen=True)
class CommPolicy:
    """How the engine's collectives are batched, overlapped, compressed and timed: gradient reduction buckets,
    stage-3 gathering ahead of use and after forward, ZeRO++ (qwZ, qgZ, hpZ), the timeouts and the statistics
    an adapter logs. Each trades memory or precision against bytes sent and time waited; none changes what is
    sharded."""

    reduce_bucket_size: int | str
    allgather_bucket_size: int
    overlap_comm: bool
    gradient_reduction: str
    prefetch_bucket_size: int | str
    max_live_parameters: int
    reshard_after_forward: bool
    collective_timeout: float
    timeout: float
    zero_quantized_weights: bool
    zero_quantized_gradients: bool
    zero_quantized_gradients_bits: int
    zero_hpz_partition_size: int
    log_comm_stats: bool


@dataclasses.dataclass(frozen=True)
class ParallelismPolicy:
    """The model-parallel dimensions beside ZeRO's data parallelism: tensor parallelism (and its plan),
    Ulysses sequence parallelism, and pipeline stages with their schedule, split and gradient reduction: what
    the composition layer builds the mesh, the tensor-parallel plan and the pipeline runner from."""

    tensor_parallel_size: int
    tensor_parallel_plan: str | Mapping[str, Any] | None
    sequence_parallel: bool
    sequence_parallel_size: int
    pipeline_parallel_size: int
    pipeline_schedule: str
    pipeline_microbatches: int | None
    pipeline_split: str | tuple[str, ...]
    pipeline_grad_reduction: str
    pipeline_keep_gathered: bool
    expert_parallel_size: int

    @property
    def model_parallel(self) -> bool:
        """Whether a tensor-, sequence-, pipeline- or expert-parallel dimension is above 1: the run then needs a mesh
        beyond data parallelism, and ZeRO shards over its data-parallel part only (the experts over the ranks
        holding the same ones)."""
        sizes = (self.tensor_parallel_size, self.sequence_parallel_size, self.pipeline_parallel_size)
        return max(*sizes, self.expert_parallel_size) > 1

    @property
    def microbatch_count(self) -> int:
        """The micro-batches each framework batch is split into: ``pipeline_microbatches``, by default one per
        pipeline stage; 1 without pipelining."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_microbatches or stage_count(self.pipeline_parallel_size, self.pipeline_schedule)


@dataclasses.dataclass(frozen=True)
class ActivationPolicy:
    """Which units recompute their forward in backward, what a checkpoint keeps, and where it keeps its input
    (``apply_activation_checkpointing`` takes it; the units themselves are the engine's); and which per-token
    computations run over tiles of the sequence, recomputed in backward (``apply_sequence_tiling``)."""

    activation_checkpointing: str
    activation_checkpoint_interval: int
    partition_activations: bool
    cpu_checkpointing: bool
    tiled_mlp: bool
    tiled_loss: bool
    tile_tokens: int | str


Policy = TypeVar("Policy")


def policy_of(policy: type[Policy], config: Any) -> Policy:
    """``policy`` built from the fields of the same names in ``config`` (a validated ZeroConfig)."""
    return policy(**{field.name: getattr(config, field.name) for field in dataclasses.fields(policy)})
