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

from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer


def rebind_optimizer(
    module: nn.Module, optimizer: Optimizer | None, change: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """``change(module)``, the model it returns, with ``optimizer``'s param groups holding that model's parameters
    of the same names (see Note: [An optimizer built before composition])."""
    if optimizer is None:
        return change(module)
    if any(optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer has already stepped (it holds state); composition replaces the parameters it updates, "
            "so build it fresh before setup (see Note: [An optimizer built before composition])"
        )
    name_of = {id(p): name for name, p in module.named_parameters()}
    changed = change(module)
    # a parallelize_fn that compiles (the whole model or its blocks) puts "_orig_mod." into the names
    now = {name.replace("_orig_mod.", ""): p for name, p in changed.named_parameters()}
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None or name in now:  # not the model's (the engine names it), or still there
                kept.append(p if name is None else now[name])
        group["params"] = kept
    return changed
