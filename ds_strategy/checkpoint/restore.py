"""Reading a checkpoint back into a module and its :class:`ZeroEngine`, whatever world size and stage wrote it.

Each rank asks DCP for exactly what it holds now: for every flat parameter, the pieces of the named parameters
inside the range its ``master`` covers (its shard at stage >= 1, the whole buffer at stage 0), for the master
values and each optimizer state; plus every replicated tensor whole. Everything is read into freshly allocated
tensors (a :class:`Restore`), and only once the whole read has succeeded does :func:`apply_restore` copy it into
the engine, so a failed load changes nothing.

Note: [Refreshing compute parameters after a load]
A load writes only ``master``. What the forward pass reads is derived from it exactly as after an optimizer step,
by ``ZeroEngine.refresh_from_masters``: stage 3 units are released first, so none keeps a gathered copy of the old
values (their next gather reads the new shards); ``copy_master_to_params`` (a cast, under mixed precision) updates
the rank's compute region; then the stage 1/2 (and stage 3 persistent) buffers are all-gathered so every rank's
``full`` holds every shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..zero.engine import ZeroEngine
from ..zero.flat_param import FlatParam
from .errors import CheckpointError
from .flat_piece import FlatPiece
from .manifest import Manifest, StateKind, model_key, optimizer_key
from .pipeline_manifest import model_entries
from .rank_state import global_group, piece_of, replicated_tensors, rows_of, stored_names


@dataclass
class StagedOptimizerState:
    """The new optimizer state of one tensor an optimizer steps (``param``: a flat master, or a whole parameter's
    view of it): elementwise tensors being filled by their pieces, and scalars (and a whole-tensor optimizer's
    states of other shapes) given as the ``targets`` key DCP reads each into."""

    param: torch.Tensor
    elementwise: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, str] = field(default_factory=dict)


@dataclass
class Restore:
    """This rank's DCP read targets and where each goes once the read has succeeded."""

    targets: dict[str, FlatPiece | torch.Tensor | None] = field(default_factory=dict)
    masters: list[tuple[FlatParam, torch.Tensor]] = field(default_factory=list)
    optimizer_states: list[StagedOptimizerState] = field(default_factory=list)
    replicated: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    param_groups: list[dict[str, Any]] | None = None
    loss_scaler: dict[str, Any] | None = None


def plan_restore(
    module: nn.Module,
    engine: ZeroEngine | None,
    manifest: Manifest,
    metadata: Metadata,
    meta: dict[str, Any],
    where: Path,
    load_optimizer: bool = True,
    strict: bool = True,
) -> Restore:
    """Check the checkpoint fits and allocate this rank's targets; raises :class:`CheckpointError` otherwise.
    ``meta`` is rank 0's ``meta.pt`` (param-group hyperparameters, loss scaler state). Under pipeline parallelism
    a collective over the world: the checkpoint is checked against every stage's entries."""
    manifest.check_fits(model_entries(module, engine), where, strict)
    restore = Restore()
    for name, tensor in replicated_tensors(module, engine).items():
        source = manifest.source_of(name)
        if source is not None:
            key = model_key(source)
            restore.targets[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            restore.replicated.append((tensor, key))
    if engine is None:
        return restore
    names, rows = stored_names(engine), rows_of(engine)
    for fp in engine.flat_params:
        staged = fp.master.detach().clone()
        for slot, start, length in fp.master_slots():
            source = manifest.source_of(names[id(fp), slot.name])
            if source is not None:
                restore.targets[model_key(source)] = piece_of(staged, fp, slot, start, length, rows.get(slot.name))
        restore.masters.append((fp, staged))
    if load_optimizer and engine.optimizers and manifest.optimizer_state is not None:
        _check_param_groups(engine, manifest, meta, where)
        restore.param_groups = meta["param_groups"]
        restore.loss_scaler = meta["loss_scaler"]
        for fp in engine.flat_params:
            if fp.whole:
                restore.optimizer_states += _plan_whole_states(fp, names, manifest, metadata, restore)
            else:
                staged = _plan_optimizer_state(fp, names, manifest, metadata, restore, where, rows)
                restore.optimizer_states.append(staged)
    return restore


def _read_whole(dcp_key: str, metadata: Metadata, restore: Restore) -> None:
    """A target DCP reads a scalar (or a state of its own shape) into whole."""
    stored = metadata.state_dict_metadata.get(dcp_key)
    restore.targets[dcp_key] = (
        torch.empty(stored.size, dtype=stored.properties.dtype) if isinstance(stored, TensorStorageMetadata) else None
    )


def _plan_whole_states(
    fp: FlatParam, names: dict[tuple[int, str], str], manifest: Manifest, metadata: Metadata, restore: Restore
) -> list[StagedOptimizerState]:
    """Targets for the states of each whole parameter this rank steps in ``fp`` (a whole-tensor optimizer's): its
    own state, read whole, whichever rank owned the parameter when the checkpoint was written."""
    staged = []
    for (slot, _, _), view in zip(fp.master_slots(), fp.optimizer_params()):
        source = manifest.source_of(names[id(fp), slot.name])
        state = StagedOptimizerState(view)
        for key, kind in manifest.optimizer_state.get(source, {}).items():
            dcp_key = optimizer_key(source, key)
            if kind is StateKind.ELEMENTWISE:
                stored = metadata.state_dict_metadata.get(dcp_key)
                dtype = stored.properties.dtype if isinstance(stored, TensorStorageMetadata) else view.dtype
                value = state.elementwise[key] = torch.zeros_like(view, dtype=dtype)
                restore.targets[dcp_key] = FlatPiece(value.reshape(-1), 0, slot.numel)
            else:
                _read_whole(dcp_key, metadata, restore)
                state.scalars[key] = dcp_key
        staged.append(state)
    return staged


def _plan_optimizer_state(
    fp: FlatParam,
    names: dict[tuple[int, str], str],
    manifest: Manifest,
    metadata: Metadata,
    restore: Restore,
    where: Path,
    rows: dict[str, tuple[int, int]],
) -> StagedOptimizerState:
    """Targets for ``fp``'s optimizer state. Scalars are read from the first parameter of ``fp`` (every parameter
    of a flat buffer steps together), which need not lie in this rank's shard."""
    sources = [manifest.source_of(names[id(fp), slot.name]) for slot in fp.slots]
    staged_state = StagedOptimizerState(fp.master)
    for key, kind in manifest.optimizer_state.get(sources[0], {}).items():
        if kind is not StateKind.ELEMENTWISE:
            dcp_key = optimizer_key(sources[0], key)
            _read_whole(dcp_key, metadata, restore)
            staged_state.scalars[key] = dcp_key
            continue
        stored = metadata.state_dict_metadata.get(optimizer_key(sources[0], key))
        dtype = stored.properties.dtype if isinstance(stored, TensorStorageMetadata) else fp.master.dtype
        staged = torch.zeros_like(fp.master, dtype=dtype)
        for slot, start, length in fp.master_slots():
            source = manifest.source_of(names[id(fp), slot.name])
            if manifest.optimizer_state.get(source, {}).get(key) is not StateKind.ELEMENTWISE:
                raise CheckpointError(
                    f"{where}: parameter {source} has no elementwise optimizer state {key!r} but "
                    f"{sources[0]}, which shares its flat buffer now, does"
                )
            restore.targets[optimizer_key(source, key)] = piece_of(staged, fp, slot, start, length, rows.get(slot.name))
        staged_state.elementwise[key] = staged
    return staged_state


def _check_param_groups(engine: ZeroEngine, manifest: Manifest, meta: dict[str, Any], where: Path) -> None:
    """The checkpoint's optimizers must have the groups the engine's have, each parameter in the same one."""
    param_groups = meta["param_groups"]
    counts = [len(optimizer.param_groups) for optimizer in engine.optimizers]
    saved_counts = meta.get("optimizer_param_groups") or ([len(param_groups)] if param_groups is not None else None)
    if param_groups is None or saved_counts != counts:
        saved = "no" if param_groups is None else "+".join(map(str, saved_counts))
        raise CheckpointError(
            f"{where}: the checkpoint has {saved} optimizer param groups, the optimizers have "
            f"{'+'.join(map(str, counts))} (one number per optimizer)"
        )
    names = stored_names(engine)
    moved = [
        f"{names[id(fp), slot.name]} (group {manifest.entries[source].group} then, {global_group(engine, fp)} now)"
        for fp in engine.flat_params
        for slot in fp.slots
        if (source := manifest.source_of(names[id(fp), slot.name])) is not None
        and manifest.entries[source].group not in (None, global_group(engine, fp))
    ]
    if moved:
        raise CheckpointError(
            f"{where}: parameters are in different optimizer param groups than when saved: {', '.join(moved)}"
        )


def apply_restore(restore: Restore, engine: ZeroEngine | None) -> None:
    """Copy the staged values into the module, engine and optimizer (see [Refreshing compute parameters])."""
    with torch.no_grad():
        for tensor, key in restore.replicated:
            tensor.copy_(restore.targets[key].view(tensor.shape))
        if engine is None:
            return
        for fp, staged in restore.masters:
            fp.master.copy_(staged)
        if restore.param_groups is not None:
            first = 0
            for optimizer in engine.optimizers:
                count = len(optimizer.param_groups)
                _load_optimizer(optimizer, restore, restore.param_groups[first : first + count])
                first += count
        if restore.loss_scaler is not None and engine.loss_scaler is not None:
            engine.loss_scaler.load_state_dict(restore.loss_scaler)
        engine.refresh_from_masters()


def _load_optimizer(optimizer: torch.optim.Optimizer, restore: Restore, param_groups: list[dict[str, Any]]) -> None:
    """Through ``optimizer.load_state_dict``, which applies the optimizer's own dtype and device rules (e.g.
    where a fused optimizer keeps ``step``) and replaces every state and hyperparameter (``param_groups``: this
    optimizer's saved groups)."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = {}
    for staged in restore.optimizer_states:
        values = {**staged.elementwise, **{key: restore.targets[dcp_key] for key, dcp_key in staged.scalars.items()}}
        if values and id(staged.param) in index:
            state[index[id(staged.param)]] = values
    groups = [
        {**saved, "params": [index[id(p)] for p in group["params"]]}
        for group, saved in zip(optimizer.param_groups, param_groups)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
