"""The manifest of a model cut into pipeline stages: every rank describes its own stages, the manifest is the union.

Note: [Pipeline stages in one checkpoint]
Under pipeline parallelism each rank's module is cut to its stages in place, so every parameter keeps its global
name and each rank's ``state_dict`` is its stages' part of the whole model's. A checkpoint therefore works as under
tensor parallelism: DCP runs over the whole world (the stages' pieces are disjoint), each rank writes the pieces
of its own stages' shards, and one rank per stage (data- and tensor-parallel rank 0) its stages' replicated
tensors. What no single rank can do is describe the model: rank 0 holds stage 0 alone. So every rank describes
its part and the descriptions are all-gathered, on save to build the manifest rank 0 publishes, on load to check
the checkpoint against the whole model (a checkpoint lacking a stage's tensors fails there, on every rank alike).

A tied parameter (an LM head on the last stage tied to the first stage's embedding) is stored once, under its
canonical name, by the stage owning that name. The copy holder describes its local name as an alias of the
canonical one (as the uncut model does) and writes nothing of it, but loads it, weights and optimizer state,
from the owner's pieces: the copies train in lockstep (their gradients are summed over the pipeline group), so
the owner's state is the copy's too.
"""

from __future__ import annotations

from torch import nn

from ..comm.group_collectives import waiting_as_long_as_the_group
from ..comm.objects import all_gather_object
from ..zero.engine import ZeroEngine
from .manifest import Entry, Kind, StateKind
from .rank_state import describe, describe_optimizer, writes_replicated


def model_entries(module: nn.Module, engine: ZeroEngine | None) -> dict[str, Entry]:
    """The whole model's manifest entries: this rank's, or under pipeline parallelism every rank's (a
    collective over the world then)."""
    return described(module, engine, with_optimizer=False)[0]


def described(
    module: nn.Module, engine: ZeroEngine | None, with_optimizer: bool
) -> tuple[dict[str, Entry], dict[str, dict[str, StateKind]] | None]:
    """The whole model's entries and, ``with_optimizer``, each trainable parameter's optimizer state keys (see
    Note: [Pipeline stages in one checkpoint]). Every flat parameter's first element lives on data-parallel rank 0
    of its stage, whose optimizer therefore describes that stage's parameters; a whole-tensor optimizer's
    parameters are described by the ranks owning them (Note: [Whole parameters on owner ranks]), so with those
    every rank's descriptions are gathered (a collective over the engine's group, or the world under pipelining)."""
    entries = describe(module, engine)
    kinds = describe_optimizer(engine) if with_optimizer else None
    if engine is None:
        return entries, kinds
    owned = with_optimizer and any(fp.regions is not None for fp in engine.flat_params)
    if engine.part.pipeline_size == 1:
        if not owned:
            return entries, kinds
        group = waiting_as_long_as_the_group(engine.process_group)
        gathered = all_gather_object(kinds, group, label="checkpoint.owned_optimizer_state")
        return entries, _merged_kinds(gathered, _in_model_order(tuple(entries)))
    mine = (entries, kinds if owned or writes_replicated(engine) else None)
    gathered = all_gather_object(mine, waiting_as_long_as_the_group(), label="checkpoint.pipeline_manifest")
    order = _in_model_order(engine.whole_model_names)
    merged_kinds = _merged_kinds([k for _, k in gathered], order) if with_optimizer else None
    return _merged([e for e, _ in gathered], order), merged_kinds


def _in_model_order(names: tuple[str, ...]):
    """A sort key putting names in the uncut model's ``state_dict`` order (a rank holding the first and last stage
    lists them together; consolidated optimizer param groups must follow the model, as an uncut save's do)."""
    position = {name: i for i, name in enumerate(names)}
    return lambda name: position.get(name, len(position))


def _merged(per_rank: list[dict[str, Entry]], order) -> dict[str, Entry]:
    """Every rank's entries in model order, each name once; aliases after every tensor, so each follows what it
    aliases, as in an uncut model's ``state_dict``."""
    tensors: dict[str, Entry] = {}
    aliases: dict[str, Entry] = {}
    for entries in per_rank:
        for name, entry in entries.items():
            (aliases if entry.kind is Kind.ALIAS else tensors).setdefault(name, entry)
    return {
        name: entry for group in (tensors, aliases) for name, entry in sorted(group.items(), key=lambda e: order(e[0]))
    }


def _merged_kinds(per_rank: list[dict[str, dict[str, StateKind]] | None], order) -> dict[str, dict[str, StateKind]]:
    merged: dict[str, dict[str, StateKind]] = {}
    for kinds in per_rank:
        for name, keys in (kinds or {}).items():
            merged.setdefault(name, keys)
    return dict(sorted(merged.items(), key=lambda e: order(e[0])))
