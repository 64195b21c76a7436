"""Record the random draws a model's construction makes, and replay them later without the model's memory.

A model built on the meta device draws no random numbers, but a normal build of the same model does (every
``nn.Linear`` runs ``kaiming_uniform_`` in its constructor even when a later initialiser overwrites it). To give a
meta-built model exactly the values of a normal build, the generator must stand where a normal build leaves it
before each initialiser runs. :class:`DrawRecorder` is a ``TorchFunctionMode`` (torch's documented interception
point; nothing is patched) that records each random operation as a :class:`Draw`: the function, its arguments with
every tensor replaced by its shape and dtype, and the tensor it writes. ``Draw.replay`` calls the same function on
a scratch tensor of that shape, which advances the generator exactly as the original call did; the scratch is
dropped at once, so replaying a whole model's draws holds one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# The torch operations that consume a generator; a mode sees only the outermost call, so ``kaiming_uniform_``
# is recorded as itself, not as the ``uniform_`` it calls.
RANDOM_OPS = frozenset(
    {
        "uniform_",
        "normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "trunc_normal_",
        "orthogonal_",
        "sparse_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "bernoulli_",
        "bernoulli",
        "rand",
        "randn",
        "randint",
        "randperm",
        "normal",
        "multinomial",
        "rand_like",
        "randn_like",
        "randint_like",
    }
)


@dataclass(frozen=True)
class TensorSpec:
    """What a scratch tensor standing in for a recorded argument needs: its shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype


@dataclass(frozen=True)
class Draw:
    """One recorded random operation; ``target`` is the tensor it wrote in place (None for a factory)."""

    func: Callable
    args: tuple
    kwargs: dict
    target: torch.Tensor | None

    def replay(self, device: torch.device) -> None:
        """Advance the generator of ``device`` as the original call advanced it, on scratch tensors."""

        def real(value: Any) -> Any:
            return (
                torch.empty(value.shape, dtype=value.dtype, device=device) if isinstance(value, TensorSpec) else value
            )

        kwargs = {key: real(value) for key, value in self.kwargs.items() if key != "device"}
        if self.func.__name__ in _FACTORIES:
            kwargs["device"] = device
        with torch.no_grad():
            self.func(*(real(a) for a in self.args), **kwargs)


_FACTORIES = frozenset({"rand", "randn", "randint", "randperm"})


class DrawRecorder(TorchFunctionMode):
    """Records every random operation run inside it, in order, into ``draws``."""

    def __init__(self):
        super().__init__()
        self.draws: list[Draw] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in RANDOM_OPS:
            inplace = func.__name__.endswith("_") and not func.__name__.endswith("_like")
            target = (args[0] if args else kwargs.get("tensor")) if inplace else None
            self.draws.append(
                Draw(func, tuple(_spec(a) for a in args), {k: _spec(v) for k, v in kwargs.items()}, target)
            )
        return func(*args, **kwargs)


def _spec(value: Any) -> Any:
    return TensorSpec(value.shape, value.dtype) if isinstance(value, torch.Tensor) else value


def generator_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for ``device`` (the CPU's, or that CUDA device's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
