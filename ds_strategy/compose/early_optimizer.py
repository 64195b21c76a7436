"""An optimizer built before composition, rebound to the parameters composition leaves.

Note: [An optimizer built before composition]
Fabric's ``fabric.setup(model, optimizer)`` and Accelerate's ``prepare(model, optimizer)`` receive an optimizer built
over the model's ordinary parameters. Tensor parallelism (``parallelize_module``, a ``parallelize_fn``, a plan)
registers a new DTensor ``Parameter`` in place of each planned weight, and the pipeline cut deletes the pieces other
ranks' stages own. The optimizer would then hold tensors the model no longer has, so its param groups are pointed at
the replacements by parameter name, and parameters whose name is gone are dropped, before the engine retargets it
onto the flat shards. That is only sound while the optimizer holds no state (nothing has stepped yet): state kept
for an old tensor would not fit the local shard that replaced it, so such an optimizer is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.optim import Optimizer

# Each of a model's parameters (by id) under every name it has (a tied weight has several), before composition.
ParameterNames = dict[int, list[str]]


def names_of_parameters(module: nn.Module, optimizers: Sequence[Optimizer]) -> ParameterNames:
    """Every name of each of ``module``'s parameters, taken before composition replaces or deletes any, so that
    ``optimizers`` can be rebound afterwards (:func:`rebind_optimizers`); nothing when there is no optimizer. An
    optimizer that has stepped is refused here, before anything changes (Note: [An optimizer built before
    composition])."""
    if not optimizers:
        return {}
    if any(o.state.get(p) for o in optimizers for group in o.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer has already stepped (it holds state); setup may replace the parameters it updates "
            "(tensor parallelism, the pipeline cut), so build it fresh before setup (see Note: [An optimizer built "
            "before composition])"
        )
    names: ParameterNames = {}
    for name, p in module.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
        names.setdefault(id(p), []).append(_plain(name))
    return names


def rebind_optimizers(optimizers: Sequence[Optimizer], names: ParameterNames, module: nn.Module) -> None:
    """Point every one of ``optimizers``' param groups at ``module``'s parameters now: each parameter still in it,
    or else the one now under any of the ``names`` it had (see Note: [An optimizer built before composition]); a
    parameter none of whose names is left was cut away and is dropped."""
    if not optimizers:
        return
    now = {_plain(name): p for name, p in module.named_parameters(remove_duplicate=False)}
    kept = {id(p) for p in now.values()}
    for group in (group for optimizer in optimizers for group in optimizer.param_groups):
        rebound = []
        for p in group["params"]:
            had = names.get(id(p))
            if id(p) in kept or had is None:  # unchanged, or not the model's (the engine names it)
                rebound.append(p)
                continue
            replacement = next((now[name] for name in had if name in now), None)
            if replacement is not None:
                rebound.append(replacement)
        group["params"] = rebound


def _plain(name: str) -> str:
    """A parameter's name without the ``_orig_mod.`` a compiled model or block puts into it."""
    return name.replace("_orig_mod.", "")
