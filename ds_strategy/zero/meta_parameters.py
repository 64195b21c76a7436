"""Build a model for sharded materialisation: its parameters on the meta device, every other tensor real.

Note: [Only parameters go to the meta device]
A model built under ``torch.device("meta")`` loses the values of every tensor it creates, and the engine can
recreate only parameters (and buffers of modules with an initialiser, see :mod:`.sharded_init`): a plain buffer
(``register_buffer("scale", torch.tensor(2.0))``) or a torchmetrics state (``Accuracy()``'s counters, which are
neither parameters nor buffers) would stay on meta with its value lost, and fail at first use with "Cannot copy out
of meta tensor". So, as Accelerate's ``init_empty_weights(include_buffers=False)`` does, the build runs on the real
device and each parameter is moved to meta as it is registered on its module: its initialiser (a ``nn.Linear``'s
``reset_parameters`` at construction) then runs on meta at no cost, while buffers and other tensors keep their
values. The move swaps the Parameter object's contents in place (``torch.utils.swap_tensors``), so a parameter
registered under two names (tied weights) stays one object. A parameter's tensor briefly exists on the real device
before it is moved: ``torch.empty`` for the usual ``nn.Parameter(torch.empty(...))``, one parameter at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, every parameter registered on a module is moved to the meta device; see Note: [Only
    parameters go to the meta device]. Not reentrant across threads (it patches ``nn.Module.register_parameter``)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            with torch.no_grad():
                meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # swap_tensors swaps the attribute dicts too
            torch.utils.swap_tensors(param, meta)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
