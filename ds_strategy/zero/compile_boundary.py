"""The engine's hooks run eagerly inside a compiled module, as FSDP2's do (its ``_dynamo_disable``).

Note: [Hooks torch.compile must not trace]
``module.compile()`` compiles ``module._call_impl``, which runs the module's forward hooks, so dynamo would trace
every hook the engine registers on a unit or on the root: they resize flat buffers' storages, point parameters'
``.data`` at other tensors, launch and wait for collectives and read the autograd node that is running, none of
which a graph can hold (at best a graph break per hook and a recompilation per state, at worst a graph that replays
one step's gather). Each such hook is wrapped in :func:`eager_hook` (``torch.compiler.disable``): dynamo breaks the
graph around it and calls it as Python, so the compiled regions are the unit's own computation, and the compiled
model gathers, frees and reduces exactly as the eager one does. Outside compilation the wrapping costs about 1.5 us
per call (measured on the host), per unit hook and per parameter's gradient hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Hook = TypeVar("Hook", bound=Callable)


def eager_hook(hook: Hook) -> Hook:
    """``hook``, run as plain Python even when called from a compiled frame (see [Hooks torch.compile must not
    trace])."""
    return torch.compiler.disable(hook, recursive=True)
