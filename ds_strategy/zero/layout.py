"""The layout of a module's trainable parameters into units and flat buffers: a pure function of the module, the
units chosen, the optimizers and the plan, testable without process groups (the ranks are numbers here).

:func:`lay_out` decides which unit holds each parameter, how each unit's parameters split into flat buffers and what
each buffer is called and weighs in the gradient norm; :class:`~.engine.ZeroEngine` then builds a
:class:`~.unit.Unit` per entry over its process groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ..config.plan import ZeroPlan
from ..parallel.dtensor_params import spec_of
from .flat_param import FlatParam
from .model_part import ModelPart
from .param_types import check_shardable
from .sharded_optimizers import ShardedOptimizers


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This rank's place in a group the buffers are sharded over."""

    rank: int
    size: int


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """One unit to build: its name (``<root>`` first), module and flat buffers; ``expert``: sharded over the
    expert-data-parallel group (Note: [Expert units] in :mod:`.engine`)."""

    name: str
    module: nn.Module
    flat_params: list[FlatParam]
    expert: bool


@dataclasses.dataclass(frozen=True)
class Layout:
    """The units in order, and ``saved_as``: the trainable parameters saved under another part's name (by this
    module's name; Note: [Parameters another part saves] in :mod:`.model_part`)."""

    units: list[UnitLayout]
    saved_as: dict[str, str]


def _modules_outside(root: nn.Module, unit_names: list[str]) -> list[nn.Module]:
    """The modules of ``root`` (every registration of a shared one) inside no unit named in ``unit_names``."""
    return [
        module
        for name, module in root.named_modules(remove_duplicate=False)
        if not any(name == unit or name.startswith(unit + ".") for unit in unit_names)
    ]


def _unit_index(root: nn.Module, chosen: list[tuple[str, nn.Module]], expert_count: int) -> dict[int, list[int]]:
    """id(parameter) -> the indices in ``chosen`` of the units holding it (-1: a module outside every unit). The last
    ``expert_count`` of ``chosen`` are experts containers, each holding every parameter inside it (Note: [Expert
    units] in :mod:`.engine`)."""
    owners: dict[int, list[int]] = {}
    experts_from = len(chosen) - expert_count
    for i, (_, module) in enumerate(chosen):
        for p in module.parameters():
            if i >= experts_from:
                owners[id(p)] = [i]
            elif not (owners.get(id(p)) or [-2])[0] >= experts_from:
                owners.setdefault(id(p), []).append(i)
    for module in _modules_outside(root, [name for name, _ in chosen]):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(-1)
    return owners


def lay_out(
    root: nn.Module,
    chosen: list[tuple[str, nn.Module]],
    expert_count: int,
    optimizers: ShardedOptimizers,
    plan: ZeroPlan,
    part: ModelPart,
    ranks: Ranks,
    expert_ranks: Ranks | None,
    tp_size: int,
    device: torch.device,
    shard_store: Callable[[FlatParam, torch.Tensor], torch.Tensor] | None = None,
) -> Layout:
    """Root first, then the unit modules in module order; a parameter shared by two units, or by a unit and a
    module outside every unit (an LM head sharing the weight of an embeddings unit), goes to the root: a unit is
    gathered only for its own forward, the root for the whole step. ``tp_size``: the tensor-parallel group's size
    (1: none), whose replicated parameters each rank counts ``1 / tp_size`` of in the norm."""
    owners = _unit_index(root, chosen, expert_count)
    experts_from = len(chosen) - expert_count
    if expert_count and any(map(optimizers.is_whole_param, root.parameters())):
        raise ValueError(
            "an optimizer that updates parameters whole (Muon) does not compose with expert parallelism yet: "
            "give every parameter to an elementwise optimizer (AdamW), or use expert_parallel_size=1"
        )
    members: list[list[tuple[str, str, nn.Parameter]]] = [[] for _ in range(len(chosen) + 1)]
    saved_as = {}
    for name, p in root.named_parameters():
        if not p.requires_grad:
            continue
        check_shardable(name, p)
        if len(optimizers) and optimizers.where(p) is None:
            raise ValueError(
                f"parameter {name!r} requires grad but is in no optimizer param group; "
                f"freeze it (requires_grad=False) or add it to the optimizer"
            )
        where = owners.get(id(p), [])
        if name in part.saved_as:
            saved_as[name] = part.saved_as[name]
        members[where[0] + 1 if len(where) == 1 else 0].append((name, part.saved_as.get(name, name), p))
    whole_owners = (
        optimizers.owners([p for params in members for _, _, p in params], ranks.size)
        if plan.partitions_optimizer
        else {}
    )
    units, first = [], 0
    for i, (name, module) in enumerate([("<root>", root), *chosen]):
        expert = i > experts_from
        place = expert_ranks if expert and expert_ranks is not None else ranks
        flat = _flat_params_of(
            name, members[i], optimizers, plan, part, whole_owners, first, place, tp_size, device, shard_store
        )
        units.append(UnitLayout(name, module, flat, expert))
        first += len(flat)
    return Layout(units, saved_as)


def _replicated_over_tp(p: nn.Parameter, tp_size: int) -> bool:
    """Whether every tensor-parallel rank holds the whole of ``p`` (always False without tensor parallelism)."""
    if tp_size == 1:
        return False
    spec = spec_of(p)
    return spec is None or spec.replicated


def _flat_params_of(
    unit_name: str,
    params: list[tuple[str, str, nn.Parameter]],
    optimizers: ShardedOptimizers,
    plan: ZeroPlan,
    part: ModelPart,
    owners: dict[int, int],
    first_index: int,
    ranks: Ranks,
    tp_size: int,
    device: torch.device,
    shard_store,
) -> list[FlatParam]:
    """One flat buffer per (optimizer, param group, persistent?, replicated over tensor parallel?, the part's norm
    share) among ``params`` (name, saved name, parameter), in first-appearance order (the last two keep the norm's
    weighting per buffer: Note: [DTensor parameters as flat views]); a whole-tensor group's laid out by
    ``owners``."""
    buckets: dict[tuple[int, int, bool, bool, float], list[tuple[str, nn.Parameter]]] = {}
    for name, saved, p in params:
        where = optimizers.where(p) or (0, 0)
        share = part.norm_shares.get(name, 1.0)
        key = (*where, plan.is_persistent(p.numel()), _replicated_over_tp(p, tp_size), share)
        buckets.setdefault(key, []).append((saved, p))
    flat = []
    for (optimizer, group, persistent, replicated, share), members in buckets.items():
        policy = plan.persistent_sharding if persistent else plan.sharding
        whole = optimizers.is_whole_param(members[0][1])
        if whole:
            optimizers.check_whole(members)
        name = f"{unit_name}/{f'optimizer{optimizer}.' if optimizer else ''}group{group}"
        name += ("/persistent" if persistent else "") + ("/tp_replicated" if replicated else "")
        name += f"/norm_share={share:g}" if share != 1.0 else ""
        flat.append(
            FlatParam(
                first_index + len(flat),
                name,
                members,
                group,
                policy,
                ranks.rank,
                ranks.size,
                plan.dtypes(members[0][1].dtype),
                device,
                shard_store=shard_store,
                norm_share=share / tp_size if replicated else share,
                whole=whole,
                owners=[owners[id(p)] for _, p in members] if whole and owners else None,
                optimizer_index=optimizer,
            )
        )
    return flat
