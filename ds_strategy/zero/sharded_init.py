"""Materialise a model built on the meta device one unit at a time, keeping only this rank's shards.

Note: equal to a normal build. Initialisers run in module order, exactly the calls a normal build makes if the
model's modules initialise themselves through ``reset_parameters()`` (nanoGPT-style models, torchtitan's
convention). Each unit's full buffer exists from its first initialiser until its last; then rank 0's values are
broadcast (so ranks agree even without a common seed), the rank keeps its shard and the buffer is freed. Peak
memory is therefore about the units whose initialisers are interleaved (usually one, plus the root) above the
shards, never the full model.
"""
from __future__ import annotations

from torch import nn

from .unit import Unit


def initialiser_plan(root: nn.Module, units: list[Unit]) -> list[tuple[nn.Module, Unit]]:
    """(module, unit) pairs in module order: the outermost modules below the root whose ``reset_parameters``
    initialises parameters of exactly one unit, skipping modules whose parameters are already covered (a tied
    LM head whose weight the embedding already initialised)."""
    unit_of = {id(p): u for u in units for fp in u.flat_params for p in fp.params}
    covered: set[int] = set()
    plan: list[tuple[nn.Module, Unit]] = []

    def visit(module: nn.Module) -> None:
        params = [p for p in module.parameters() if id(p) in unit_of]
        owners = {id(unit_of[id(p)]) for p in params}
        fresh = [p for p in params if id(p) not in covered]
        if module is not root and callable(getattr(module, "reset_parameters", None)) and len(owners) == 1:
            if fresh:
                plan.append((module, unit_of[id(fresh[0])]))
                covered.update(id(p) for p in params)
            return
        for child in module.children():
            visit(child)

    visit(root)
    missing = [name for name, p in root.named_parameters() if id(p) in unit_of and id(p) not in covered]
    if missing:
        raise ValueError(f"cannot materialise parameters built on the meta device: no module with "
                         f"reset_parameters() initialises {missing[:5]}{' ...' if len(missing) > 5 else ''}. "
                         f"Give their modules a reset_parameters() method, or build the model normally.")
    return plan


def materialise_sharded(root: nn.Module, units: list[Unit], broadcast) -> None:
    """Run the initialisers unit by unit; ``broadcast(tensor)`` makes every rank hold rank 0's values."""
    plan = initialiser_plan(root, units)
    remaining = {id(u): sum(1 for _, owner in plan if owner is u) for u in units}
    started: set[int] = set()
    for module, unit in plan:
        if id(unit) not in started:
            started.add(id(unit))
            for fp in unit.flat_params:
                fp.adopt_meta_params()
        module.reset_parameters()
        remaining[id(unit)] -= 1
        if remaining[id(unit)] == 0:
            for fp in unit.flat_params:
                broadcast(fp.full)
                fp.finish_sharding()
