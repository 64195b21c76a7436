"""Activation checkpointing of the engine's units, as an ``ActivationPolicy`` asks: which units, what they keep, where.

A checkpointed unit runs its forward under torch's non-reentrant ``checkpoint``: it keeps its input (and, when
"selective", the outputs of its matmuls and attention) instead of every intermediate, and recomputes the rest in
backward. The unit's ``forward`` is replaced on the instance, so no wrapper module is inserted: parameter names,
state-dict keys and the engine's module hooks stay what they were, and the unit's own hooks do not fire again
when it recomputes (see Note: [Activation checkpointing under stage 3] in ``ds_strategy.zero.param_gatherer``).

``partition_activations`` and ``cpu_checkpointing`` act on the one thing a checkpoint keeps whole: its input,
which torch saves through the saved-tensor hooks that are current when ``checkpoint`` is called (the ops inside
are saved by the checkpoint's own hooks, which take precedence). Both follow DeepSpeed's
``deepspeed.checkpointing`` (``partition_activations``, ``checkpoint_in_cpu``).

Note: [Partitioned checkpoint inputs]
  Across a tensor-parallel group every rank computes the same activations, so each rank keeps only its 1/W piece
  of a checkpointed floating-point input (flattened, padded to a multiple of W) and the recomputation all-gathers
  the W pieces back, in the same order on every rank of the group because they run the same backward. The
  values are the stored ones bit for bit, so gradients are exactly those without partitioning. The group must
  be one whose ranks hold identical inputs (tensor parallelism); the data-parallel group would mix different
  batches. Integer inputs (token ids, masks) and keyword arguments are kept whole, as DeepSpeed keeps
  non-float arguments; a model that passes its hidden states positionally, as Hugging Face decoders do, has
  them partitioned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from ..comm.group_collectives import collectives_for
from ..config.policies import ActivationPolicy
from ..profiler_ranges import profiler_range
from ..zero.param_gatherer import is_recomputation

_aten = torch.ops.aten
# What "selective" keeps (torchtitan's op-level policy, less its "every second mm"): the outputs of the ops that
# cost FLOPs, so that backward recomputes only norms, activations, adds and views.
SAVED_BY_SELECTIVE = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    }
)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


@dataclasses.dataclass
class SavedInputCounts:
    """What the saved-input hooks did (partitioning or host copies only): how many checkpoint inputs they took,
    the bytes they keep for them (1/W of each partitioned one), how many of those bytes sit in host memory, and
    how many inputs a recomputation restored."""

    saved: int = 0
    kept_bytes: int = 0
    host_bytes: int = 0
    restored: int = 0


class _SavedInput(NamedTuple):
    """A floating-point checkpoint input between forward and recomputation (see Note: [Partitioned checkpoint
    inputs])."""

    kept: torch.Tensor  # the whole flattened input, or this rank's padded 1/W piece; on the host if offloaded
    shape: torch.Size
    device: torch.device
    partitioned: bool


class SavedInputHooks:
    """The pack/unpack pair that partitions a unit's checkpoint input over ``group`` (the mesh's tensor-parallel
    ``Collectives``, or a process group) and/or keeps it on the host."""

    def __init__(self, unit_name: str, group: Any, to_host: bool, counts: SavedInputCounts):
        self.unit_name = unit_name
        self.collectives = collectives_for(group) if group is not None else None
        self.world = self.collectives.world_size if group is not None else 1
        self.rank = self.collectives.rank if group is not None else 0
        self.to_host = to_host
        self.counts = counts

    def installed(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _SavedInput:
        if not tensor.is_floating_point():
            return tensor
        with profiler_range("activation.save_input", self.unit_name):
            kept = tensor.detach().reshape(-1)
            partitioned = self.world > 1
            if partitioned:
                piece = -(-kept.numel() // self.world)
                if kept.numel() % self.world:
                    kept = nn.functional.pad(kept, (0, piece * self.world - kept.numel()))
                kept = kept.narrow(0, self.rank * piece, piece).clone()
            if self.to_host and kept.device.type != "cpu":  # already in host memory: a copy would only add one
                host = torch.empty(kept.shape, dtype=kept.dtype, pin_memory=True)
                kept = host.copy_(kept, non_blocking=True)
            nbytes = kept.numel() * kept.element_size()
            self.counts.saved += 1
            self.counts.kept_bytes += nbytes
            self.counts.host_bytes += nbytes if kept.device.type == "cpu" else 0
            return _SavedInput(kept, tensor.shape, tensor.device, partitioned)

    def unpack(self, saved: torch.Tensor | _SavedInput) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        with profiler_range("activation.load_input", self.unit_name):
            kept = saved.kept.to(saved.device, non_blocking=True)
            if saved.partitioned:
                whole = kept.new_empty(kept.numel() * self.world)
                self.collectives.all_gather(whole, kept, label=self.unit_name).wait()
                kept = whole.narrow(0, 0, saved.shape.numel())
            self.counts.restored += 1
            return kept.view(saved.shape)


class CheckpointedForward:
    """A unit's forward under non-reentrant checkpointing; set as the module's instance ``forward``."""

    def __init__(self, name: str, unit: nn.Module, selective: bool, input_hooks: SavedInputHooks | None):
        self.name = name
        self.original = unit.forward
        self.original_was_set_on_instance = "forward" in unit.__dict__  # by a framework (autocast) or the user
        self.context_fn = _selective_contexts if selective else noop_context_fn
        self.input_hooks = input_hooks

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved, so there is nothing to recompute
            return self.original(*args, **kwargs)
        hooks = self.input_hooks.installed() if self.input_hooks is not None else contextlib.nullcontext()
        with hooks:
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)

    def _run(self, *args, **kwargs):
        """The original forward inside a range; forward and recomputation both open one, because selective
        checkpointing requires the two to dispatch the same ops (a range is one)."""
        with profiler_range("activation.recompute" if is_recomputation() else "activation.forward", self.name):
            return self.original(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class CheckpointedUnits:
    """The units ``apply_activation_checkpointing`` checkpointed (by module name) and its hooks' counts."""

    names: tuple[str, ...]
    counts: SavedInputCounts


def checkpointed_units(
    module: nn.Module, policy: ActivationPolicy, units: Sequence[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """Every ``activation_checkpoint_interval``-th of the outermost of ``units`` (the k-th, 2k-th, ... as
    torchtitan counts); a unit inside another is recomputed with it. Raises when the policy finds nothing to
    checkpoint."""
    outermost = [(name, unit) for name, unit in units if not any(name.startswith(o + ".") for o, _ in units)]
    if not outermost:
        raise ValueError(
            f"activation_checkpointing={policy.activation_checkpointing!r} found no units in "
            f"{type(module).__name__}: it has no repeated block class; name one in ZeroConfig.unit_modules "
            f"or set unit_min_params"
        )
    interval = policy.activation_checkpoint_interval
    if interval > len(outermost):
        raise ValueError(
            f"activation_checkpoint_interval={interval} checkpoints none of the {len(outermost)} units of "
            f"{type(module).__name__}; use at most {len(outermost)}"
        )
    for name, unit in outermost:
        if getattr(unit, "gradient_checkpointing", False) is True:
            raise ValueError(
                f"unit {name} ({type(unit).__name__}) already checkpoints itself (Hugging Face's "
                f"activation_checkpointing_enable() or gradient_checkpointing_enable()); use either that or "
                f"ZeroConfig.activation_checkpointing"
            )
    return outermost[interval - 1 :: interval]


def apply_activation_checkpointing(
    module: nn.Module, policy: ActivationPolicy, units: Sequence[tuple[str, nn.Module]], group: Any = None
) -> CheckpointedUnits:
    """Checkpoint ``module``'s ``units`` as ``policy`` says, replacing any checkpointing applied before.

    ``units``: (name, module) of the units the engine will build, ``select_unit_modules`` under the config's unit
    policy, chosen before stage 3 shards the module: the checkpointed units must be the engine's own.
    ``group``: the collectives (or process group) to partition checkpoint inputs over when
    ``policy.partition_activations`` (the mesh's tensor-parallel ones; see Note: [Partitioned checkpoint inputs]);
    None or a group of one rank keeps them whole, as DeepSpeed does without a model-parallel unit.
    """
    remove_activation_checkpointing(module)
    counts = SavedInputCounts()
    if policy.activation_checkpointing == "none":
        return CheckpointedUnits((), counts)
    if getattr(getattr(module, "config", None), "use_cache", False) is True:
        warnings.warn(
            f"{type(module).__name__} has config.use_cache=True: a recomputation appends to its KV cache a second "
            f"time; set model.config.use_cache = False for training (Hugging Face's own checkpointing forces it)",
            stacklevel=2,
        )
    group = collectives_for(group) if policy.partition_activations and group is not None else None
    if group is not None and group.world_size == 1:
        group = None
    names = []
    for name, unit in checkpointed_units(module, policy, units):
        moves_inputs = group is not None or policy.cpu_checkpointing
        hooks = SavedInputHooks(name, group, policy.cpu_checkpointing, counts) if moves_inputs else None
        unit.forward = CheckpointedForward(name, unit, policy.activation_checkpointing == "selective", hooks)
        names.append(name)
    return CheckpointedUnits(tuple(names), counts)


def remove_activation_checkpointing(module: nn.Module) -> None:
    """Give every checkpointed submodule of ``module`` back the forward it had (at teardown, or before
    checkpointing it anew)."""
    for sub in module.modules():
        patched = sub.__dict__.get("forward")
        if isinstance(patched, CheckpointedForward):
            del sub.forward
            if patched.original_was_set_on_instance:
                sub.forward = patched.original
