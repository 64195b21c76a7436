"""Build a model for sharded materialisation: its parameters on the meta device, every other tensor real.

Note: [Only parameters go to the meta device]
A model built under ``torch.device("meta")`` loses the values of every tensor it creates, and the engine can
recreate only parameters (and buffers of modules with an initialiser, see :mod:`.sharded_init`): a plain buffer
(``register_buffer("scale", torch.tensor(2.0))``) or a torchmetrics state (``Accuracy()``'s counters, which are
neither parameters nor buffers) would stay on meta with its value lost, and fail at first use with "Cannot copy out
of meta tensor". So, as Accelerate's ``init_empty_weights(include_buffers=False)`` does, the build runs on the real
device and each parameter is moved to meta as it is registered on its module (torch's global parameter
registration hook): its initialiser (a ``nn.Linear``'s ``reset_parameters`` at construction) then runs on meta at no
cost, while buffers and other tensors keep their values. The move swaps the Parameter object's contents in place
(``torch.utils.swap_tensors``), so a parameter registered under two names (shared weights) stays one object. A
parameter's tensor briefly exists on the real device before it is moved: ``torch.empty`` for the usual
``nn.Parameter(torch.empty(...))``, one parameter at a time.

Note: [What the build context moves to meta]
Only what the block *builds* goes to meta, because the engine recreates a meta parameter by running its module's
initialiser, and values made before the block (a model built in ``LightningModule.__init__``, weights loaded from a
checkpoint) are not what an initialiser would draw now. Lightning runs ``configure_model`` inside this context
whether or not it builds anything, so a registration keeps its parameter as it is when the parameter

- replaces a real one under the same name: torch's ``parallelize_module`` re-registers each weight it distributes
  as a DTensor, and any re-wrap of a weight does the same; or
- is one of the parameters of ``existing`` at entry (the LightningModule as ``configure_model`` finds it): a
  weight of the model built before, shared into a new module (a new head sharing the old embedding's weight) or
  moved under one (``torch.nn.utils.parametrize``).

A parameter the block builds keeps its type on meta (Note: [Parameter types the engine shards]): an
``nn.Parameter`` subclass with its attributes, a ``DTensor`` with its mesh, placements and global shape (the engine
initialises it whole and keeps this rank's piece), a ``torch.Tensor`` subclass that shares storage with its data.
A wrapper subclass with its own ``__torch_dispatch__`` (a quantized weight) holds values no initialiser recreates:
frozen, it is left real (every rank keeps frozen parameters whole anyway, so building it for real costs what it
costs); trainable, it is refused by name, as the engine refuses it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_parameter_registration_hook

from .param_types import check_shardable, has_own_dispatch, parameter_like


@contextlib.contextmanager
def parameters_on_meta(existing: nn.Module | None = None) -> Iterator[None]:
    """Within the block, every parameter the block builds is moved to the meta device as it is registered on a
    module; see Note: [Only parameters go to the meta device] and Note: [What the build context moves to meta].
    ``existing``: a module built before the block, whose parameters at entry keep their values. Not reentrant
    across threads (torch's registration hooks are global)."""
    before: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
    for p in existing.parameters() if existing is not None else ():
        before[id(p)] = p

    def on_register(module: nn.Module, name: str, param: nn.Parameter) -> None:
        replaced = module._parameters.get(name)
        kept = (replaced is not None and not replaced.is_meta) or before.get(id(param)) is param
        if param.is_meta or kept:
            return
        check_shardable(f"{type(module).__name__}.{name}", param)
        if has_own_dispatch(param) and not isinstance(param, DTensor):
            return  # a frozen wrapper subclass: its values stay
        with torch.no_grad():
            meta = parameter_like(param, param.detach().to("meta"))
        torch.utils.swap_tensors(param, meta)

    handle = register_module_parameter_registration_hook(on_register)
    try:
        yield
    finally:
        handle.remove()
