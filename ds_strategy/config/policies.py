"""Each component's section of a ZeroConfig: small frozen policies, as FSDP2's ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy``; and the one grouping of ZeroConfig's fields that they, the docs and the front-ends share.

``ZeroConfig`` stays the flat facade that users, DeepSpeed JSON and Hydra write, and the one place fields are
defaulted, documented and validated; a policy has no defaults and checks nothing. Its fields are not listed here:
each ZeroConfig field is declared under a :class:`Section` (a heading of the configuration's docs), and a section
belongs to one policy or to the engine itself (stage, units, construction, the optimizer step and batch sizes).
``declare_policy_fields`` gives every policy the fields of its sections, in declaration order, with ZeroConfig's
types, when ZeroConfig is defined; ``ZeroConfig`` builds each from its validated fields
(``config.precision_policy``, ...), so a component that takes its policy sees only the settings it acts on.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any, TypeVar

from ..parallel.pipeline_schedules import stage_count


class PrecisionPolicy:
    """The dtypes the engine computes, accumulates and communicates in, and fp16's loss scaling
    (``LossScaler`` takes it). One policy, as FSDP2's ``MixedPrecisionPolicy`` holds its ``reduce_dtype``:
    the automatic communication dtype follows ``precision``, and loss scaling exists only for "16-*"."""


class OffloadPolicy:
    """Where optimizer state and stage-3 parameter shards live off the device, and how NVMe streams them
    (``ds_strategy.offload``'s step runner takes it)."""


class CommPolicy:
    """How the engine's collectives are batched, overlapped, compressed and timed: gradient reduction buckets,
    stage-3 gathering ahead of use and after forward, ZeRO++ (qwZ, qgZ, hpZ), the timeouts and the statistics
    an adapter logs. Each trades memory or precision against bytes sent and time waited; none changes what is
    sharded."""


class ParallelismPolicy:
    """The model-parallel dimensions beside ZeRO's data parallelism: tensor parallelism (and its plan),
    Ulysses sequence parallelism, and pipeline stages with their schedule, split and gradient reduction: what
    the composition layer builds the mesh, the tensor-parallel plan and the pipeline runner from."""

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


class ActivationPolicy:
    """Which units recompute their forward in backward, what a checkpoint keeps, and where it keeps its input
    (``apply_activation_checkpointing`` takes it; the units themselves are the engine's); and which per-token
    computations run over tiles of the sequence, recomputed in backward (``apply_sequence_tiling``)."""


POLICIES = (PrecisionPolicy, OffloadPolicy, CommPolicy, ParallelismPolicy, ActivationPolicy)


@dataclasses.dataclass(frozen=True)
class Section:
    """A group of ZeroConfig fields: a heading of the docs' configuration table (``title``), and the policy that
    hands them to their component (``policy``; None: the engine reads them itself). Each section belongs to one
    policy, so the docs, the policies and the front-ends (Hydra's groups) group fields one way."""

    title: str
    policy: type | None = None


def declare_policy_fields(fields: Sequence[dataclasses.Field], annotations: dict[str, Any]) -> None:
    """Make each policy a frozen dataclass of the ``fields`` (ZeroConfig's, each with its ``section`` in
    ``metadata``) its sections hold, in declaration order, typed as ZeroConfig types them (``annotations``), and
    name them at the end of its docstring."""
    for policy in POLICIES:
        names = [field.name for field in fields if field.metadata["section"].policy is policy]
        policy.__annotations__ = {name: annotations[name] for name in names}
        listed = textwrap.fill("Its fields (declared in ZeroConfig): " + ", ".join(names) + ".", 112)
        policy.__doc__ = f"{policy.__doc__}\n\n" + textwrap.indent(listed, "    ")
        dataclasses.dataclass(frozen=True)(policy)


Policy = TypeVar("Policy")


def policy_of(policy: type[Policy], config: Any) -> Policy:
    """``policy`` built from the fields of the same names in ``config`` (a validated ZeroConfig)."""
    return policy(**{field.name: getattr(config, field.name) for field in dataclasses.fields(policy)})
