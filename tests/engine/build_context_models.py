"""Models whose parameters are tensor subclasses, built where ZeRO stage 3 builds on the meta device, for
``test_build_context_parameter_types``: each draws its values once, through ``reset_parameters``, so a build on meta
initialised by the engine equals a normal build under the same seed."""

import torch
from torch import nn
from torch.utils._pytree import tree_map


class Tagged(torch.Tensor):
    """A tensor subclass sharing storage with its data (no ``__torch_dispatch__`` of its own)."""


class TaggedParameter(nn.Parameter):
    """An ``nn.Parameter`` subclass with a constructor argument and an attribute of its own."""

    def __new__(cls, data, requires_grad=True, *, tag: str):
        param = super().__new__(cls, data, requires_grad)
        param.tag = tag
        return param


class Int8Weight(torch.Tensor):
    """A quantized weight, as torchao's and bitsandbytes' are: a wrapper subclass holding int8 values and a scale in
    inner tensors, dequantized for every operation."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor):
        self.qdata, self.scale = qdata, scale

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        scale = weight.abs().max() / 127
        return cls((weight / scale).round().to(torch.int8), scale)

    def dequantize(self) -> torch.Tensor:
        return self.qdata.float() * self.scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Weight(inner["qdata"], inner["scale"])

    def __repr__(self):
        return f"Int8Weight({self.dequantize()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return Int8Weight(func(args[0].qdata), func(args[0].scale))
        if func is torch.ops.aten._to_copy.default:
            moved = {key: value for key, value in kwargs.items() if key != "dtype"}
            return Int8Weight(func(args[0].qdata, **moved), func(args[0].scale, **moved))
        plain = tree_map(lambda t: t.dequantize() if isinstance(t, Int8Weight) else t, (args, kwargs))
        return func(*plain[0], **plain[1])


class SubclassLinear(nn.Module):
    """A linear layer whose weight is a ``Tagged`` tensor or a ``TaggedParameter``."""

    def __init__(self, fan_in: int, fan_out: int, kind: str):
        super().__init__()
        data = torch.empty(fan_out, fan_in)
        if kind == "parameter":
            self.weight = TaggedParameter(data, tag="kept")
        else:
            self.weight = nn.Parameter(data.as_subclass(Tagged))
        self.bias = nn.Parameter(torch.empty(fan_out))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.2)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.as_subclass(torch.Tensor).t() + self.bias


class FrozenQuantized(nn.Module):
    """A frozen int8 projection, as a quantized base model's, of fixed values (a loaded checkpoint's): built for
    real where the rest is built on meta, it must draw no random numbers, or the engine, initialising the rest
    later, would draw from where the generator stands after it, not where a single process does."""

    def __init__(self, width: int):
        super().__init__()
        weight = torch.linspace(-1.0, 1.0, width * width).reshape(width, width)
        self.weight = nn.Parameter(Int8Weight.quantize(weight), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.dequantize().t()


class SubclassNet(nn.Module):
    """Every kind at once: a ``Tagged`` and a ``TaggedParameter`` weight, a frozen ``Int8Weight``, an
    ``nn.Buffer``, and a head tied to an embedding."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.tagged = SubclassLinear(width, width, "tagged")
        self.parameter = SubclassLinear(width, width, "parameter")
        self.frozen = FrozenQuantized(width)
        self.scale = nn.Buffer(torch.full((width,), 0.5))
        self.embed = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, width, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.tagged(x)) * self.scale
        x = torch.tanh(self.parameter(x)) + self.frozen(x)
        return self.head(self.embed(x))


class BodyAndHead(nn.Module):
    """A body built before the stage-3 build context and a head built inside it, as a LightningModule whose
    ``__init__`` builds (or loads) a model and whose ``configure_model`` adds a head tied to its input layer."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def add_head(self, width: int = 8) -> None:
        self.head = nn.Linear(width, 2)
        self.unembed = nn.Linear(width, width, bias=False)
        self.unembed.weight = self.body[0].weight  # a weight of the model built before, shared into a new module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.unembed(self.body(x)))
