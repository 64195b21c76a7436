"""Unit-by-unit placement: a model built on the CPU reaches the device one unit at a time, as it is flattened.

Note: [Unit-by-unit placement]
Under stage 3 no adapter moves the whole model to the device (that is an out-of-memory for exactly the models
ZeRO-3 is for). The engine takes the module where it was built and, unit by unit in order: allocates the unit's
flat buffers on the device, copies the parameters in (they become views of the buffers, so the host copies are
freed as the last reference goes), broadcasts rank 0's values, keeps this rank's shard and frees the full buffer;
then moves the buffers and frozen parameters of the unit's own modules (those not inside a nested unit). Device
memory therefore peaks at one unit above the shards. Stage 0-2 keep every full buffer, as they must. With
``sync_module_states`` the ranks that built the model on the meta device allocate instead of copying and receive
rank 0's values in the same broadcasts. Under mixed precision the values travel in the master's dtype (Note:
[Masters start from the model's own values] in :mod:`.flat_param`), one more unit-sized buffer meanwhile.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import record_function

from .param_types import plain_tensors
from .sharded_init import give_loose_tensors_storage
from .unit import Unit


def modules_by_unit(root: nn.Module, units: list[Unit]) -> list[list[nn.Module]]:
    """For each unit (root unit first), the modules it owns: those inside it and inside no nested unit."""
    index = {id(unit.module): i for i, unit in enumerate(units) if i}
    owned: list[list[nn.Module]] = [[] for _ in units]

    def visit(module: nn.Module, current: int) -> None:
        current = index.get(id(module), current)
        owned[current].append(module)
        for child in module.children():
            visit(child, current)

    visit(root, 0)
    return owned


def place_units(root: nn.Module, units: list[Unit], device: torch.device, broadcast) -> None:
    """Flatten, place and shard each unit in turn; ``broadcast(tensor, collectives)`` gives every rank of the unit's
    group that group's first rank's values."""
    for unit, modules in zip(units, modules_by_unit(root, units)):
        with record_function(f"ZeRO::place {unit.name}"):
            for fp in unit.flat_params:
                if any(p.is_meta for p in fp.params):
                    fp.adopt_meta_params()
                    values = fp.held_values()  # receives rank 0's values
                else:
                    values = fp.adopt_params()
                broadcast(values, unit.collectives)
                fp.finish_sharding(values)
            for module in modules:
                place_loose_tensors(module, device, broadcast)


def place_loose_tensors(module: nn.Module, device: torch.device, broadcast) -> None:
    """Move ``module``'s own buffers and frozen parameters to ``device`` (storage for meta ones) and broadcast."""
    give_loose_tensors_storage(module, device, recurse=False)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer.to(device)
            broadcast(module._buffers[name])
    for p in module._parameters.values():
        if p is not None and not p.requires_grad:
            p.data = p.data.to(device)
            for plain in plain_tensors(p.data):
                broadcast(plain)
