"""Which optimizers run on ZeRO's flat shards and which need their parameters whole, and how an optimizer says so.

Note: [Elementwise and whole-tensor optimizers]
ZeRO lays a unit's parameters end to end in a flat buffer and hands each rank a contiguous 1/N of it, cutting
tensors anywhere. An optimizer whose update of one element reads only that element's parameter, gradient and
state (SGD, Adam, AdamW, ...) computes the same on any cut: it is *elementwise* and runs on flat shards. One whose
update reads a whole tensor is wrong on a slice, silently: Muon orthogonalises each matrix's momentum
(Newton-Schulz on the whole matrix), Adafactor factors the second moment into row and column means, LAMB and LARS
scale each tensor by its norms. Such an optimizer runs *whole-tensor*: each of its parameters lives whole on one
owner rank, which receives that parameter's reduced gradient whole and steps it (Note: [Whole parameters on owner
ranks] in :mod:`.owner_layout`). Both kinds may train one model (Muon on the hidden matrices, AdamW on the rest).

The kind of each param group is decided by the first of:
  1. the group's own ``"elementwise"`` key (``{"params": ..., "elementwise": False}``), for one optimizer that
     holds both kinds (a Muon with auxiliary AdamW groups);
  2. the class's ``elementwise`` attribute, inherited by subclasses: ``class MyOpt(Optimizer): elementwise = True``,
     or :func:`declare_optimizer` for a class one does not own (it sets that attribute);
  3. torch's own optimizers, listed here;
  4. otherwise whole-tensor, warned once per class: correct for any optimizer that updates each parameter on its
     own, at some cost in balance across ranks; declare ``elementwise = True`` to shard it flat.
Refused whatever is declared: LBFGS (its two-loop recursion takes dot products over all parameters at once and its
step re-evaluates the loss through a closure, so no partition of the parameters preserves it) and SparseAdam (it
needs sparse gradients; the engine reduces dense ones).
"""

from __future__ import annotations

import warnings

import torch

ATTRIBUTE = "elementwise"  # the class attribute and param-group key an optimizer declares its kind by

# torch's optimizers whose update of an element reads only that element's parameter, gradient and state.
_TORCH_ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
)
# torch's optimizers that run correctly on whole tensors, each kept on one rank.
_TORCH_WHOLE_TENSOR = ("Muon", "Adafactor")
_REFUSED = {
    "LBFGS": (
        "its update of every parameter depends on all parameters at once (the two-loop recursion takes dot products "
        "over the whole model) and its step re-evaluates the loss through a closure, so no partition of the "
        "parameters, flat or whole-tensor, preserves it; train with it without ZeRO"
    ),
    "SparseAdam": "it needs sparse gradients (nn.Embedding(sparse=True)), and ZeRO's flat buffers reduce dense ones",
}
_KNOWN = {
    **{getattr(torch.optim, name): True for name in _TORCH_ELEMENTWISE if hasattr(torch.optim, name)},
    **{getattr(torch.optim, name): False for name in _TORCH_WHOLE_TENSOR if hasattr(torch.optim, name)},
}
_warned: set[type] = set()  # each unknown class is warned about once per process


def declare_optimizer(optimizer_class: type[torch.optim.Optimizer], *, elementwise: bool) -> None:
    """Declare an optimizer class (one you cannot edit) elementwise or whole-tensor: the same as writing
    ``elementwise = ...`` in its class body (see Note: [Elementwise and whole-tensor optimizers])."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"declare_optimizer takes a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if not isinstance(elementwise, bool):
        raise TypeError(f"declare_optimizer(elementwise={elementwise!r}): expected True or False")
    setattr(optimizer_class, ATTRIBUTE, elementwise)


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise, saying why, for an optimizer no partitioning can run (see the Note)."""
    for cls in type(optimizer).__mro__:
        reason = _REFUSED.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
        if reason is not None:
            raise ValueError(f"{type(optimizer).__name__} cannot run under ZeRO: {reason}")


def group_is_elementwise(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether ``group`` of ``optimizer`` may run on flat shards (else each of its parameters is kept whole)."""
    declared = group.get(ATTRIBUTE)
    if declared is not None:
        if not isinstance(declared, bool):
            raise ValueError(f"{type(optimizer).__name__} param group has elementwise={declared!r}; expected a bool")
        return declared
    return class_is_elementwise(type(optimizer))


def class_is_elementwise(cls: type) -> bool:
    """The class's declaration, or torch's known kind, walking the class's bases; unknown: whole-tensor (warned)."""
    for base in cls.__mro__:
        declared = base.__dict__.get(ATTRIBUTE)
        if isinstance(declared, bool):
            return declared
        if base in _KNOWN:
            return _KNOWN[base]
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"{cls.__name__} does not declare whether it is elementwise; ZeRO keeps each of its parameters whole on "
            f"one rank (right for any optimizer that updates each parameter on its own). Set `elementwise = True` on "
            f"the class (or ds_strategy.declare_optimizer({cls.__name__}, elementwise=True)) to shard it flat.",
            stacklevel=4,
        )
    return False
