"""Per-parameter gradients of a sharded model: one parameter's whole gradient on demand, and every parameter's
gradient norm in one collective.

Note: [Per-parameter gradients]
At stage 2/3 (and stage 1 with reduce-scatter) ``param.grad`` is None: the averaged gradient exists only as each
rank's shard of a flat buffer (the table in docs/gradients.md). What the optimizer will read is that shard, in the
master's dtype and divided by the loss scale: the same values one process's ``param.grad`` holds after the same
backwards. So both accessors read it, after the step's last backward and before the step consumes it (Lightning's
``on_before_optimizer_step``, between ``fabric.backward`` and ``optimizer.step()``):

- :func:`full_grad` (DeepSpeed's ``safe_get_full_grad(param)``) all-gathers the flat buffer holding ``param`` and
  returns its piece shaped like the parameter; every rank must ask for the same parameters in the same order;
- :func:`grad_norms` sums ``|g| ** p`` over each parameter's pieces in this rank's shard and adds the vector of those
  sums over the ranks in one all-reduce (a max for the inf-norm), however many parameters there are: the
  replacement for Lightning's ``grad_norm(module)``, which reads ``param.grad`` (``ds_strategy.lightning.grad_norm``
  lays it out as that does).

Both are for data parallelism; under tensor or pipeline parallelism a parameter's gradient is spread over other
groups too and they are refused by name. A frozen parameter has no gradient: None, and no norm, as under torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..profiler_ranges import profiler_range

if TYPE_CHECKING:
    from .flat_param import FlatParam
    from .optimizer_step import OptimizerStep


def _refuse_model_parallel(step: OptimizerStep, what: str) -> None:
    if step.model_parallel:
        raise ValueError(
            f"{what} is for data parallelism: under tensor or pipeline parallelism a parameter's gradient is spread "
            f"over other groups too; use engine.grad_norm() for the global norm"
        )


def _optimizer_gradients(step: OptimizerStep) -> list[torch.Tensor]:
    """Each flat buffer's reduced gradient as the optimizer will read it: loss scale divided out."""
    if step.loss_scaler is not None:
        step.unscale_gradients()
    return step.optimizer_grads(step.flat_params)


def full_grad(step: OptimizerStep, param: nn.Parameter) -> torch.Tensor | None:
    """``param``'s whole averaged gradient (a new tensor shaped like it, in its master's dtype), or None for a
    parameter the engine does not train; a collective over the engine's group (see Note: [Per-parameter
    gradients])."""
    _refuse_model_parallel(step, "full_grad")
    for fp, grad in zip(step.flat_params, _optimizer_gradients(step)):
        for slot, p in zip(fp.slots, fp.params):
            if p is param:
                with profiler_range("full_grad"):
                    whole = _whole(step, fp, grad)
                return whole.narrow(0, slot.offset, slot.numel).view(slot.shape).clone()
    return None


def grad_norms(step: OptimizerStep, module: nn.Module, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
    """The ``norm_type``-norm of every trained parameter's gradient, by its name in the engine's module, in one
    collective over the engine's group (see Note: [Per-parameter gradients])."""
    _refuse_model_parallel(step, "grad_norms")
    norm_type = float(norm_type)
    names = {id(p): name for name, p in module.named_parameters()}
    index = {}
    for fp in step.flat_params:
        if not fp.norm_share:  # counted, and named, where another rank holds it
            continue
        for slot in fp.slots:
            index[fp.index, slot.name] = len(index)
    local = torch.zeros(len(index), dtype=torch.float64, device=step.device)
    grads = _optimizer_gradients(step)
    with profiler_range("grad_norms"):
        for fp, grad in zip(step.flat_params, grads):
            if not fp.norm_share:
                continue
            for slot, start, length in fp.master_slots() if fp.policy.optimizer else _whole_slots(fp):
                piece = grad.narrow(0, slot.offset + start - fp.master_base, length).double().abs()
                at = index[fp.index, slot.name]
                local[at] = (
                    max(local[at], piece.max()) if math.isinf(norm_type) else local[at] + piece.pow(norm_type).sum()
                )
        if any(fp.policy.optimizer for fp in step.flat_params):
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            step.collectives.all_reduce(local, op=op, label="grad_norms").wait()
    norms = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    result = {}
    for fp in step.flat_params:
        for slot, p in zip(fp.slots, fp.params):
            if (fp.index, slot.name) in index:
                result[names.get(id(p), slot.name)] = norms[index[fp.index, slot.name]].float()
    return result


def _whole_slots(fp: FlatParam) -> list[tuple[object, int, int]]:
    """Every parameter of ``fp`` whole (where this rank's gradient is the whole averaged one: the optimizer is not
    partitioned)."""
    return [(slot, 0, slot.numel) for slot in fp.slots]


def _whole(step: OptimizerStep, fp: FlatParam, grad: torch.Tensor) -> torch.Tensor:
    """``fp``'s gradient over the whole flat layout: gathered where each rank holds a shard of it."""
    if not fp.policy.optimizer:
        return grad
    whole = torch.empty(fp.padded_numel, dtype=grad.dtype, device=step.device)
    step.collectives.all_gather(whole, grad.to(step.device), label=f"full_grad {fp.name}", regions=fp.regions).wait()
    return whole
