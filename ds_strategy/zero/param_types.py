"""The Python types a parameter may have, and how the engine keeps a parameter's type when it gives it new storage.

Note: [Parameter types the engine shards]
A trainable parameter lives in a flat buffer (:mod:`.flat_param`): the parameter object stays, and its data becomes a
view of the buffer (``p.data = view``, or a DTensor's local shard, Note: [DTensor parameters as flat views]). That
keeps the type of an ``nn.Parameter`` subclass and of a ``torch.Tensor`` subclass that shares storage with its data
(no ``__torch_dispatch__`` of its own), with their attributes; a DTensor keeps mesh and placements. A wrapper
subclass with its own ``__torch_dispatch__`` (a quantized tensor, torchao's, an NF4 weight) holds its values in
inner tensors a flat buffer cannot view, and an optimizer step through it does not update them, so a trainable one
is refused by name. A frozen one is not flattened: every rank keeps it whole, its inner tensors (its
``__tensor_flatten__``) counted and broadcast as they are.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class UnsupportedParameterType(TypeError):
    """A trainable parameter whose type the engine cannot hold in a flat buffer."""


def has_own_dispatch(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s type is a wrapper subclass (its own ``__torch_dispatch__``: DTensor, quantized ones)."""
    return type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def check_shardable(name: str, param: torch.Tensor) -> None:
    """Refuse a trainable parameter the flat buffers cannot hold (Note: [Parameter types the engine shards])."""
    if not param.requires_grad or isinstance(param, DTensor) or not has_own_dispatch(param):
        return
    cls = type(param)
    raise UnsupportedParameterType(
        f"parameter {name!r} is a trainable {cls.__module__}.{cls.__qualname__}, a tensor subclass with its own "
        f"__torch_dispatch__: ZeRO holds trainable parameters in flat buffers of plain tensors (a DTensor's local "
        f"shard under tensor parallelism) and cannot keep this type or update its inner tensors. Freeze it "
        f"(requires_grad=False: frozen parameters stay whole on every rank), or train a plain tensor (for instance "
        f"a LoRA adapter beside it)"
    )


def parameter_like(param: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """A parameter of ``param``'s type, ``requires_grad`` and attributes over ``data`` (a plain tensor, or one of
    that type already: a DTensor), for ``swap_tensors`` to give ``param`` new storage without changing what it is.
    An ``nn.Parameter`` subclass is rebuilt without its constructor (whose arguments are its own)."""
    cls = type(param)
    if issubclass(cls, nn.Parameter):
        like = torch.Tensor._make_subclass(cls, data, param.requires_grad)
    else:
        like = nn.Parameter(data if type(data) is cls else data.as_subclass(cls), requires_grad=param.requires_grad)
    like.__dict__.update(param.__dict__)
    return like


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``tensor``'s values: itself, or a wrapper subclass's inner tensors."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in plain_tensors(getattr(tensor, name))]
