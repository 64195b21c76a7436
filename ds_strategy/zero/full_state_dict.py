"""The whole ``state_dict`` of a module a :class:`~ds_strategy.zero.engine.ZeroEngine` shards, gathered one flat
buffer at a time: from the masters (what every export returns) or from the compute copies (a 16-bit export).

Note: [What an export returns]
Every API that hands out "the model's weights" returns the weights the optimizer updates: each trainable
parameter's master, in the dtype the parameter had when the engine took it (``ParamSlot.dtype``). That is
``ZeroEngine.full_state_dict`` and everything built on it (Lightning's ``lightning_module_state_dict``, Fabric's
``get_module_state_dict``, Accelerate's ``get_state_dict``, the Hugging Face Trainer's ``save_model``), and
``ds_strategy.checkpoint.consolidate`` and the Hugging Face export, which read the masters a checkpoint stores and
write them in the dtype its manifest records. Under "-mixed" precision the module's own parameters are 16-bit
compute copies, rounded from the fp32 masters after every step (Note: [What each precision keeps] in
``ds_strategy.config.plan``); an export reads the masters, so an fp32 model trained in bf16-mixed exports fp32
weights that carry every update, also those below a bf16 ulp that never reach the compute copy: the weights DDP,
which keeps fp32 weights under autocast, would hold, and the file ``consolidate`` writes. A model given in 16 bits
exports 16-bit weights rounded from its masters, as DDP would save it; under "-true" there is no separate master
and the 16-bit weights are what trained. Frozen parameters and buffers are not sharded and come as the module
holds them. The compute copies themselves are a separate, named call, ``ZeroEngine.full_compute_state_dict``
(DeepSpeed's ``save_16bit_model``): what the forward computes with, in half the bytes under mixed precision.

Masters are gathered from every rank's shard (on the device, the host or an NVMe file's map) into one buffer of the
flat layout at a time, so beyond the result a rank holds one flat buffer in the master's dtype; stage 0 holds its
whole master already, and where the master is this rank's slice of a whole buffer every rank keeps current (stages
1-2 in one dtype) that buffer is read in place. Every rank of the engine's group takes part; with ``rank0_only``
the others return an empty dict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.dtensor_params import local_tensor
from .flat_param import FlatParam, ParamSlot
from .unit import Unit

if TYPE_CHECKING:
    from ..comm.collectives import Collectives
    from .groups import ExpertShards


class ShardedModule(Protocol):
    """What an export reads of an engine (:class:`~.engine.ZeroEngine` is one), which itself exports through this
    module: typed here, so that no file of ``zero/`` imports the engine back."""

    module: nn.Module
    units: list[Unit]
    device: torch.device
    experts: ExpertShards | None
    expert_collectives: Collectives | None

    def adopt_replaced_parameters(self) -> None: ...

    def reshard(self) -> None: ...

    def gathered(self, unit: Unit) -> contextlib.AbstractContextManager: ...


# (parameter, its whole value, the dtype an export returns it in) for each trainable parameter of a unit
Weights = Callable[[ShardedModule, Unit], Iterator[tuple[nn.Parameter, torch.Tensor, torch.dtype]]]


def master_weights(engine: ShardedModule, unit: Unit) -> Iterator[tuple[nn.Parameter, torch.Tensor, torch.dtype]]:
    """Each trainable parameter of ``unit`` from its master, to be returned in the dtype the model gave it."""
    for fp in unit.flat_params:
        whole = _whole_master(engine, unit, fp)
        for slot, p in zip(fp.slots, fp.params):
            yield p, _global(engine, unit, slot, whole.narrow(0, slot.offset, slot.numel).view(slot.shape)), slot.dtype


def compute_weights(engine: ShardedModule, unit: Unit) -> Iterator[tuple[nn.Parameter, torch.Tensor, torch.dtype]]:
    """Each trainable parameter of ``unit`` as the forward reads it (gathered, exactly, under stage 3)."""
    with engine.gathered(unit):
        for fp in unit.flat_params:
            for slot, p in zip(fp.slots, fp.params):
                value = local_tensor(p).detach()
                yield p, _global(engine, unit, slot, value), value.dtype


def gathered_state_dict(engine: ShardedModule, weights: Weights, rank0_only: bool) -> dict[str, torch.Tensor]:
    """The module's whole ``state_dict`` in its order, its trainable parameters from ``weights``, every tensor a
    copy of its own (the parameters are views of flat buffers, which safetensors would take for shared tensors)."""
    engine.adopt_replaced_parameters()
    engine.reshard()
    keep = not rank0_only or (dist.get_rank() if dist.is_initialized() else 0) == 0
    keys_of: dict[int, list[str]] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        keys_of.setdefault(id(value), []).append(key)
    result: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        for p, value, dtype in weights(engine, unit):
            for key in keys_of.pop(id(p), []) if keep else ():
                result[key] = value.to(dtype, copy=True)
    if not keep:
        return {}
    state = engine.module.state_dict()
    for key, value in state.items():
        result.setdefault(key, value.detach().clone())
    return {key: result[key] for key in state}


def _whole_master(engine: ShardedModule, unit: Unit, fp: FlatParam) -> torch.Tensor:
    """``fp``'s master over the whole padded flat layout, on the engine's device (see the module's Note)."""
    if not fp.policy.optimizer:
        return fp.master
    if not fp.policy.params and _same_storage(fp.master, fp.full):
        return fp.full
    whole = torch.empty(fp.padded_numel, dtype=fp.master.dtype, device=engine.device)
    shard = fp.master.to(engine.device)
    unit.collectives.all_gather(whole, shard, label=f"export {fp.name}", regions=fp.regions).wait()
    return whole


def _global(engine: ShardedModule, unit: Unit, slot: ParamSlot, local: torch.Tensor) -> torch.Tensor:
    """The whole parameter: ``local`` itself, or for a tensor-parallel one its global tensor, which every
    tensor-parallel rank takes part in gathering, or for an experts container's its rows from every rank of the
    expert-parallel group, in rank order (Note: [Expert units] in :mod:`.engine`)."""
    experts = engine.experts
    if experts is not None and unit.collectives is engine.expert_collectives:
        rows = local.new_empty((experts.parallel.world_size * local.shape[0], *local.shape[1:]))
        experts.parallel.all_gather(rows.view(-1), local.reshape(-1), label=f"export {slot.name}").wait()
        return rows
    return local if slot.tp is None else slot.tp.as_dtensor(local).full_tensor()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
