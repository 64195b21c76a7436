"""Moving a module's parameters into the engine's flat buffers, or building them there from the meta device: the one
step of construction that decides where the values come from."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..comm.collectives import Collectives
from ..comm.group_collectives import waiting_as_long_as_the_group
from ..config import ZeroConfig
from .model_part import CutPiece
from .placement import place_units
from .sharded_init import materialise_sharded
from .unit import Unit


def device_of(module: nn.Module) -> torch.device:
    """Where the flat buffers go: the module's device, or the CPU for a module built on the meta device."""
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def materialise(
    module: nn.Module,
    units: list[Unit],
    device: torch.device,
    collectives: Collectives,
    config: ZeroConfig,
    cut_pieces: Sequence[CutPiece] = (),
) -> None:
    """Move the parameters into their flat buffers on the device one unit at a time, every rank starting from
    rank 0's values (as DDP does); see [Unit-by-unit placement] in :mod:`.placement`.

    A model built on the meta device is initialised unit by unit instead (see :mod:`.sharded_init`), unless
    ``sync_module_states`` says rank 0 holds the real model, whose values then stream to the others.
    """

    def broadcast(t: torch.Tensor, group: Collectives = collectives) -> None:
        if group.world_size > 1:  # the unit's group's first rank: experts differ by expert-parallel rank
            group.broadcast(t, src=0).wait()

    with torch.no_grad():
        built_on_meta = any(p.is_meta for unit in units for fp in unit.flat_params for p in fp.params)
        if not config.sync_module_states:
            _check_ranks_built_alike(collectives, built_on_meta, device)
        if built_on_meta and not config.sync_module_states:
            materialise_sharded(module, units, broadcast, device, config.param_init_fn, tuple(cut_pieces))
            return
        place_units(module, units, device, broadcast)


def _check_ranks_built_alike(collectives: Collectives, built_on_meta: bool, device: torch.device) -> None:
    """Every rank must take the same materialisation path (each issues different collectives). Setup
    plumbing, not training traffic, waited on as long as the process group waits (ranks build at their own
    pace), and counted apart from ``comm_stats``."""
    if collectives.world_size == 1:
        return
    count = torch.tensor([float(built_on_meta)], device=device)
    waiting_as_long_as_the_group(collectives.group).all_reduce(count, label="check: ranks built alike").wait()
    if 0 < count.item() < collectives.world_size:
        raise ValueError(
            f"{int(count.item())} of {collectives.world_size} ranks built the model on the meta device "
            f"and the others did not; build it alike on every rank, or pass "
            f"sync_module_states=True to stream rank 0's model to ranks that built it on meta"
        )
