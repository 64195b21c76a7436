"""Point the user's optimizer at this rank's flat shards, keeping its class, hyperparameters and groups."""

from __future__ import annotations

import warnings

import torch

from .flat_param import FlatParam

# Optimizers whose update of one element reads only that element's own parameter, gradient and state: running
# them on a flat shard is the same as running them on the whole tensors.
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)
# Optimizers that need whole tensors (matrix factorisation, line search, sparse rows).
WHOLE_TENSOR = tuple(
    getattr(torch.optim, name) for name in ("LBFGS", "SparseAdam", "Adafactor", "Muon") if hasattr(torch.optim, name)
)


def check_optimizer_is_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Raise for optimizers that cannot run on flat shards; warn once for ones we do not know."""
    if isinstance(optimizer, WHOLE_TENSOR):
        raise ValueError(
            f"{type(optimizer).__name__} needs whole parameter tensors (it is not elementwise), so it cannot run "
            f"on ZeRO's flat shards. Use an elementwise optimizer ({', '.join(c.__name__ for c in ELEMENTWISE)})."
        )
    if not isinstance(optimizer, ELEMENTWISE):
        warnings.warn(
            f"{type(optimizer).__name__} is assumed to be elementwise (each element's update reads only "
            f"its own parameter, gradient and state); ZeRO runs it on flat shards.",
            stacklevel=3,
        )


def param_group_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Map ``id(param)`` to the index of the optimizer param group holding it."""
    index: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in index and index[id(p)] != gi:
                raise ValueError("a parameter appears in two optimizer param groups")
            index[id(p)] = gi
    return index


def retarget_optimizer(optimizer: torch.optim.Optimizer, flat_params: list[FlatParam]) -> None:
    """Replace each param group's parameters by the fp32 master shards of that group, in place.

    In place, so that LR schedulers and the host framework, which hold this very optimizer object, keep working.
    The state is cleared: it is created lazily on the first step, shaped like the shards. The caller has checked
    the optimizer (``check_optimizer_is_elementwise``) before laying anything out for it.
    """
    for gi, group in enumerate(optimizer.param_groups):
        group["params"] = [fp.master for fp in flat_params if fp.group_index == gi]
    optimizer.state.clear()
