"""A sharded optimizer's state as one process's ``optimizer.state_dict()``, and such a state cut back into shards.

Note: [A whole optimizer state]
FSDP's ``state_dict_type="full"`` hands out the optimizer state whole on rank 0, and DDP's or one device's file holds
it whole: ``{"state": {key: {name: tensor shaped like the parameter, "step": scalar}}, "param_groups": [{...,
"params": [keys]}]}``. The key of a parameter is its position among the optimizer's parameters in the order the
user's optimizer listed them (torch's, DDP's, Lightning's layout), or its name (FSDP's full optimizer state, and
``consolidate``'s). The engine keeps that order from the moment it was given the optimizer (``ShardedOptimizers.
given_order``), frozen parameters included, so a position means the same parameter here as in one process: a frozen
one has a position and no state, as under torch, which steps no parameter without a gradient.

:func:`full_optimizer_state` gathers each flat buffer's elementwise states one buffer at a time (rank 0 holds the
result, the others an empty dict), and :func:`load_full_optimizer_state` takes from a whole state the pieces of this
rank's shard, at any stage and world size, as a sharded checkpoint's load does. Both are for data parallelism: a
whole-tensor optimizer (its parameters on owner ranks), tensor parallelism (parameters split over ranks) and
pipelining (each stage holds its own) are refused by name; their checkpoints stay sharded (``consolidate`` makes one
file of them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..zero.engine import ZeroEngine
from ..zero.flat_param import FlatParam
from .errors import CheckpointError
from .manifest import StateKind
from .rank_state import saved_elsewhere, state_kind, stored_names


def why_not_whole(engine: ZeroEngine) -> str | None:
    """Why a whole optimizer state cannot describe ``engine``'s (see the module's Note), or None when it can."""
    if engine.model_parallel:
        return "it is gathered over data-parallel ranks only, not under tensor or pipeline parallelism"
    if any(fp.whole for fp in engine.flat_params):
        return "a whole-tensor optimizer keeps its parameters on owner ranks"
    if engine.plan.offloads_optimizer:
        return "the optimizer's state is offloaded"
    return None


def check_gatherable(engine: ZeroEngine, action: str) -> None:
    """A ValueError saying :func:`why_not_whole`, and what to do instead, where there is a reason."""
    reason = why_not_whole(engine)
    if reason is not None:
        raise ValueError(
            f"{action}: {reason}; keep state_dict_type='sharded' (ds-strategy consolidate makes one file of the "
            f"checkpoint)"
        )


def full_optimizer_state(engine: ZeroEngine, optimizer_index: int = 0, by_name: bool = False) -> dict[str, Any]:
    """The state of the engine's ``optimizer_index``-th optimizer as one process's ``state_dict()`` on rank 0 (keyed
    by position in the order it was given, or ``by_name``), an empty dict on the others; a collective over the
    engine's group."""
    check_gatherable(engine, "the whole optimizer state")
    optimizer = engine.optimizers[optimizer_index]
    names = stored_names(engine)
    state: dict[str, dict[str, Any]] = {}
    for fp in engine.flat_params:
        if fp.optimizer_index != optimizer_index or saved_elsewhere(engine, fp):
            continue
        held = optimizer.state.get(fp.master, {})
        whole = {key: _whole(engine, fp, value) for key, value in held.items()}
        for slot in fp.slots:
            state[names[id(fp), slot.name]] = {
                key: value.narrow(0, slot.offset, slot.numel).view(slot.shape).clone()
                if state_kind(key, held[key], fp.master, fp) is StateKind.ELEMENTWISE
                else _copy(value)
                for key, value in whole.items()
            }
    if engine.rank != 0:
        return {}
    order = engine.sharded_optimizers.given_order(optimizer_index, engine.module)
    position = {name: i for i, name in enumerate(name for group in order for name in group)}
    key = (lambda name: name) if by_name else position.__getitem__
    groups, first = [], 0
    for group, names_in_group in zip(optimizer.param_groups, order):
        params = names_in_group if by_name else list(range(first, first + len(names_in_group)))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        first += len(names_in_group)
    return {"state": {key(name): value for name, value in state.items() if value}, "param_groups": groups}


def load_full_optimizer_state(engine: ZeroEngine, saved: dict[str, Any], optimizer_index: int = 0) -> None:
    """Load a whole optimizer state (keyed by position or by name: see the module's Note) into the engine's
    ``optimizer_index``-th optimizer, each rank taking its shard's pieces; checked before anything changes."""
    check_gatherable(engine, "loading a whole optimizer state")
    optimizer = engine.optimizers[optimizer_index]
    order = engine.sharded_optimizers.given_order(optimizer_index, engine.module)
    by_name = _by_name(saved, order)
    names = stored_names(engine)
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups) or [len(g["params"]) for g in groups] != [len(g) for g in order]:
        raise CheckpointError(
            f"the saved optimizer state has param groups of {[len(g['params']) for g in groups]} parameters; this "
            f"optimizer was given groups of {[len(g) for g in order]}"
        )
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = {}
    for fp in engine.flat_params:
        if fp.optimizer_index != optimizer_index:
            continue
        first = by_name.get(names[id(fp), fp.slots[0].name])
        if not first:
            continue  # not stepped yet when saved: no state, as in one process
        values = {}
        for key, value in first.items():
            if not (torch.is_tensor(value) and value.numel() == fp.slots[0].numel and value.dim() > 0):
                values[key] = value
                continue
            staged = torch.zeros_like(fp.master, dtype=value.dtype)
            for slot, start, length in fp.master_slots():
                whole = by_name.get(names[id(fp), slot.name], {}).get(key)
                if whole is None or whole.numel() != slot.numel:
                    raise CheckpointError(
                        f"the saved optimizer state has no {key!r} shaped like {names[id(fp), slot.name]} "
                        f"{tuple(slot.shape)}"
                    )
                piece = whole.reshape(-1).narrow(0, start, length)
                staged.narrow(0, slot.offset + start - fp.master_base, length).copy_(piece)
            values[key] = staged
        state[index[id(fp.master)]] = values
    hyper = [
        {**saved_group, "params": [index[id(p)] for p in group["params"]]}
        for group, saved_group in zip(optimizer.param_groups, groups)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": hyper})


def _by_name(saved: dict[str, Any], order: list[list[str]]) -> dict[str, dict[str, Any]]:
    """The saved per-parameter states by parameter name: as they are, or from positions in the given order."""
    state = saved.get("state", {})
    if all(isinstance(key, str) for key in state):
        return state
    names = [name for group in order for name in group]
    return {names[position]: value for position, value in state.items() if position < len(names)}


def _whole(engine: ZeroEngine, fp: FlatParam, value: Any) -> Any:
    """An elementwise state over the whole padded flat layout (gathered where the optimizer is partitioned), or a
    scalar as it is."""
    if not (torch.is_tensor(value) and value.shape == fp.master.shape) or not fp.policy.optimizer:
        return value
    whole = torch.empty(fp.padded_numel, dtype=value.dtype, device=engine.device)
    engine.collectives.all_gather(whole, value.to(engine.device), label=f"export state {fp.name}").wait()
    return whole


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value
