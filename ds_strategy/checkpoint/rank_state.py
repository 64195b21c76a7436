"""What one rank contributes to a checkpoint, read from the module and its :class:`ZeroEngine` without gathering.

For every flat parameter a rank writes the pieces of each named parameter inside its shard range
(``FlatParam.shard_slots()``), taken from the ``master`` the optimizer updates (fp32 unless the precision is
"-true" 16-bit), and the same pieces of each elementwise optimizer state. Shard ranges partition the flat
layout, so every element is written exactly once whatever the stage (at stage 0 each rank holds everything but
still writes only its shard range). Rank 0 also writes the replicated tensors: frozen parameters and buffers.

Several optimizers store their states side by side: each parameter belongs to one, and states are keyed by the
parameter's name. A whole-tensor optimizer (Muon) keeps a state per whole parameter, on its owner rank (Note:
[Whole parameters on owner ranks]); a state shaped like the parameter is stored as pieces like any other (so it
reshards to another world size or stage), and one of another shape (Adafactor's row and column statistics) whole,
by the rank holding the parameter's first element, which is read back whole by the rank owning it then.

Under tensor parallelism a piece is stored in global coordinates (Note: [Tensor-parallel pieces in global
coordinates]), and of a parameter every tensor-parallel rank holds whole, only tensor-parallel rank 0 writes it.
Under pipeline parallelism each stage's data- and tensor-parallel rank 0 writes its replicated tensors, and a tied
copy another stage owns is written by that stage alone (Note: [Pipeline stages in one checkpoint]).

Note: [Experts by their global index]
Under expert parallelism a rank holds rows ``first`` to ``first + local - 1`` of each experts container's stacked
parameters (``[num_experts, ...]``), and its pieces are stored at those rows of the whole tensor, whose shape the
manifest records: expert e is stored at row e whichever rank held it, so a checkpoint saved at one
``expert_parallel_size`` (or world size, or stage) loads at another, each rank reading the rows it holds now. A
range of whole rows is one contiguous range of the global flattening, so a piece stays one piece.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.expert_parallel import expert_rows
from ..zero.engine import ZeroEngine
from ..zero.flat_param import FlatParam, ParamSlot
from .flat_piece import FlatPiece, ScatteredPiece
from .global_layout import global_runs
from .manifest import Entry, Kind, StateKind

Rows = tuple[int, int]  # an expert-parallel slot's (first row held, rows in all): Note: [Experts by their global index]


def rows_of(engine: ZeroEngine | None) -> dict[str, Rows]:
    """Slot name -> (first row, total rows) of every stacked parameter of the engine's expert-parallel containers."""
    if engine is None or engine.experts is None:
        return {}
    return {
        f"{name}.{param}": (module.first_expert, module.global_experts)
        for name, module in engine.experts.modules
        for param in expert_rows(module)
    }


def piece_of(
    tensor: torch.Tensor, fp: FlatParam, slot: ParamSlot, start: int, length: int, rows: Rows | None = None
) -> FlatPiece | ScatteredPiece:
    """The piece ``[start, start + length)`` of ``slot``'s parameter within ``tensor``, which is laid out like
    ``fp.master``, in the coordinates of the parameter's global flattening (at ``rows``, for an expert-parallel
    one)."""
    local = slot.offset - fp.master_base
    if rows is not None:
        row = slot.numel // slot.shape[0]
        return FlatPiece(tensor.narrow(0, local + start, length), rows[0] * row + start, rows[1] * row)
    if not slot.tp_sharded:
        return FlatPiece(tensor.narrow(0, local + start, length), start, slot.numel)
    numel = math.prod(slot.tp.shape)
    runs = global_runs(slot.tp, start, length)
    parts = tuple(FlatPiece(tensor.narrow(0, local + lo, n), at, numel) for lo, at, n in runs)
    return parts[0] if len(parts) == 1 else ScatteredPiece(parts)


def global_shape(slot: ParamSlot, rows: Rows | None = None) -> tuple[int, ...]:
    """The shape a checkpoint stores ``slot``'s parameter under: the DTensor's global shape, every expert's rows,
    else its own."""
    if rows is not None:
        return (rows[1], *slot.shape[1:])
    return tuple(slot.tp.shape if slot.tp is not None else slot.shape)


def writes_slot(engine: ZeroEngine, slot: ParamSlot) -> bool:
    """Whether this rank writes its pieces of ``slot``: always, unless every tensor-parallel rank holds the same
    ones (a replicated parameter), when tensor-parallel rank 0 alone does."""
    return slot.tp_sharded or _tensor_parallel_rank(engine) == 0


def _tensor_parallel_rank(engine: ZeroEngine) -> int:
    return engine.tp_collectives.rank if engine.tp_collectives is not None else 0


def saved_elsewhere(engine: ZeroEngine, fp: FlatParam) -> bool:
    """Whether another part of the model saves ``fp``'s parameters, under the names they have here (a pipeline
    stage's tied copy; Note: [Parameters another part saves] in :mod:`ds_strategy.zero.model_part`)."""
    names = set(engine.saved_as.values())
    return bool(names) and all(slot.name in names for slot in fp.slots)


def stored_names(engine: ZeroEngine) -> dict[tuple[int, str], str]:
    """``(id(fp), slot.name)`` -> the ``state_dict`` name the slot's parameter is stored under (its first one)."""
    first: dict[int, str] = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), name)
    return {(id(fp), slot.name): first[id(p)] for fp in engine.flat_params for p, slot in zip(fp.params, fp.slots)}


def global_group(engine: ZeroEngine, fp: FlatParam) -> int:
    """``fp``'s param group as a checkpoint counts them: every optimizer's groups listed one after another."""
    return engine.sharded_optimizers.global_group(fp.optimizer_index, fp.group_index)


def describe(module: nn.Module, engine: ZeroEngine | None = None) -> dict[str, Entry]:
    """Every ``state_dict`` entry of ``module`` as a manifest :class:`Entry`, in ``state_dict`` order; a tied copy
    that another pipeline stage owns is an alias of the owner's name."""
    flat = {id(p): (fp, slot) for fp in engine.flat_params for p, slot in zip(fp.params, fp.slots)} if engine else {}
    tied = engine.saved_as if engine is not None else {}
    rows = rows_of(engine)
    parameters = {id(p) for p in module.parameters()}
    first: dict[int, str] = {}
    entries: dict[str, Entry] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            entries[name] = Entry(Kind.ALIAS, alias_of=tied.get(first[id(tensor)], first[id(tensor)]))
            continue
        first[id(tensor)] = name
        if name in tied:
            entries[name] = Entry(Kind.ALIAS, alias_of=tied[name])
        elif id(tensor) in flat:
            fp, slot = flat[id(tensor)]
            dtype = str(slot.dtype).removeprefix("torch.")
            shape = global_shape(slot, rows.get(slot.name))
            entries[name] = Entry(Kind.PARAMETER, shape, group=global_group(engine, fp), dtype=dtype)
        elif id(tensor) in parameters:
            entries[name] = Entry(Kind.PARAMETER if tensor.requires_grad else Kind.FROZEN, tuple(tensor.shape))
        else:
            entries[name] = Entry(Kind.BUFFER, tuple(tensor.shape))
    return entries


def describe_optimizer(engine: ZeroEngine) -> dict[str, dict[str, StateKind]]:
    """Each trainable parameter's optimizer state keys that this rank can see (of tied copies: the owner's). Every
    flat parameter's first element lives on rank 0, so rank 0's optimizer holds state for every flat parameter of
    an elementwise optimizer and can describe them all (every stage's rank 0 under pipeline parallelism: Note:
    [Pipeline stages in one checkpoint]); a whole-tensor optimizer's parameters are described by their owners,
    whose descriptions are gathered (:func:`.pipeline_manifest.described`)."""
    names = stored_names(engine)
    described = {}
    for fp in engine.flat_params:
        if saved_elsewhere(engine, fp):
            continue
        for slot, state, like in slot_states(engine, fp):
            kinds = {key: state_kind(key, value, like, fp) for key, value in state.items()}
            if kinds or not fp.whole:
                described[names[id(fp), slot.name]] = kinds
    return described


def slot_states(engine: ZeroEngine, fp: FlatParam) -> list[tuple[ParamSlot, dict, torch.Tensor]]:
    """(slot, its optimizer state, the tensor its states are laid out like) for each parameter of ``fp`` whose state
    this rank holds: every slot with the flat master's state, or for a whole-tensor optimizer each parameter it
    steps here with the state of its own view."""
    optimizer = engine.optimizers[fp.optimizer_index]
    if not fp.whole:
        state = optimizer.state.get(fp.master, {})
        return [(slot, state, fp.master) for slot in fp.slots]
    held = [slot for slot, _, _ in fp.master_slots()]
    return [(slot, optimizer.state.get(view, {}), view) for slot, view in zip(held, fp.optimizer_params())]


def state_kind(key: str, value: Any, like: torch.Tensor, fp: FlatParam) -> StateKind:
    """How a state is stored: pieces when laid out like ``like`` (the flat master, or a whole parameter's view),
    one value when scalar, whole when a whole-tensor optimizer keeps it in another shape."""
    if torch.is_tensor(value) and value.shape == like.shape:
        return StateKind.ELEMENTWISE
    if not torch.is_tensor(value) or value.dim() == 0:
        return StateKind.SCALAR
    if fp.whole:
        return StateKind.WHOLE
    raise NotImplementedError(
        f"optimizer state {key!r} of {fp.name} has shape {tuple(value.shape)}, neither the "
        f"flat shard's {tuple(fp.master.shape)} nor a scalar; it cannot be checkpointed by "
        f"parameter name (an optimizer keeping such states must keep its parameters whole: declare it "
        f"elementwise = False)"
    )


def model_state(module: nn.Module, engine: ZeroEngine | None = None) -> dict[str, FlatPiece | torch.Tensor]:
    """This rank's share of the module's ``state_dict``, by stored name: pieces of trainable parameters in its
    shard (not of tied copies), and (rank 0) every replicated tensor flattened to 1-D."""
    state: dict[str, FlatPiece | torch.Tensor] = {}
    if engine is not None:
        names, rows = stored_names(engine), rows_of(engine)
        for fp in engine.flat_params:
            if saved_elsewhere(engine, fp):  # the owning stage writes it: Note: [Pipeline stages in one checkpoint]
                continue
            for slot, start, length in fp.shard_slots():
                if writes_slot(engine, slot):
                    piece = piece_of(fp.master, fp, slot, start, length, rows.get(slot.name))
                    state[names[id(fp), slot.name]] = piece
    if writes_replicated(engine):
        for name, tensor in replicated_tensors(module, engine).items():
            state[name] = tensor.detach().reshape(-1)
    return state


def replicated_tensors(module: nn.Module, engine: ZeroEngine | None) -> dict[str, torch.Tensor]:
    """Stored name -> tensor for every entry not in the engine's flat buffers (all of them without an engine)."""
    tensors = {}
    for name, entry in describe(module, engine).items():
        if entry.kind is Kind.ALIAS or (entry.kind is Kind.PARAMETER and engine is not None):
            continue
        tensors[name] = module.get_buffer(name) if entry.kind is Kind.BUFFER else module.get_parameter(name)
    return tensors


def optimizer_state(engine: ZeroEngine) -> dict[str, Any]:
    """This rank's share of the optimizer step's state: ``{"state": {name: {key: value}}, "param_groups":
    [hyperparameters], "loss_scaler": its state or None}``.

    Elementwise states are pieces like the parameters'; a scalar state is written by the rank holding its
    parameter's first element. The loss scaler decides whether a step happens, so it travels with the optimizer.
    """
    names, rows = stored_names(engine), rows_of(engine)
    state: dict[str, dict[str, Any]] = {}
    for fp in engine.flat_params:
        if saved_elsewhere(engine, fp):
            continue
        held = {slot.name: (slot_state, like) for slot, slot_state, like in slot_states(engine, fp)}
        for slot, start, length in fp.shard_slots():
            if not writes_slot(engine, slot):
                continue
            slot_state, like = held[slot.name]
            entries = {}
            for key, value in slot_state.items():
                if state_kind(key, value, like, fp) is StateKind.ELEMENTWISE:
                    entries[key] = _state_piece(value, like, fp, slot, start, length, rows.get(slot.name))
                elif start == 0 and _tensor_parallel_rank(engine) == 0:
                    entries[key] = value
            state[names[id(fp), slot.name]] = entries
    groups = [
        {k: v for k, v in group.items() if k != "params"}
        for optimizer in engine.optimizers
        for group in optimizer.param_groups
    ]
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None
    return {
        "state": state,
        "param_groups": groups,
        "optimizer_param_groups": [len(optimizer.param_groups) for optimizer in engine.optimizers],
        "loss_scaler": scaler,
    }


def _state_piece(
    value: torch.Tensor,
    like: torch.Tensor,
    fp: FlatParam,
    slot: ParamSlot,
    start: int,
    length: int,
    rows: Rows | None = None,
) -> FlatPiece | ScatteredPiece:
    """The piece ``[start, start + length)`` of ``slot``'s state ``value``, laid out like ``like``: the flat
    master (cut like the parameter's piece), or the whole parameter's view (whole-tensor parameters are never split
    by tensor parallelism, so their local flattening is the global one)."""
    if like is fp.master:
        return piece_of(value, fp, slot, start, length, rows)
    return FlatPiece(value.reshape(-1).narrow(0, start, length), start, slot.numel)


def writes_replicated(engine: ZeroEngine | None) -> bool:
    """Whether this rank writes the replicated tensors of its part of the model: data- and tensor-parallel rank 0
    of the engine (one rank per pipeline stage), or without an engine rank 0."""
    if engine is not None:
        return engine.rank == 0 and _tensor_parallel_rank(engine) == 0
    return not dist.is_initialized() or dist.get_rank() == 0
