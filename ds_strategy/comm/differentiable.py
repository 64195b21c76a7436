"""Collectives that autograd differentiates, for the model parallelism that exchanges activations: the all-to-all
Ulysses swaps a sequence split for a head split with, the uneven one expert parallelism sends tokens to their
experts' ranks and back with, and the two sums over ranks tensor and sequence parallelism
need (Megatron's f and g). Each runs through the ``Collectives`` it is given (:func:`~.group_collectives.
collectives_for`), in forward and in backward, so it is timed out, names a failed rank and is counted by kind
("all_to_all", "all_reduce").

``group`` is a :class:`~.collectives.Collectives` (the mesh's, which composition hands the model: counted in
``comm_stats``), or a bare process group, or None for the default one (a ``Collectives`` is then made for the call:
code that issues many holds one); ``label`` names the collective in profiler ranges, counters and errors.

They are ``autograd.Function``s that wait on the collective in Python, where torch's functional collectives
(``all_to_all_single_autograd``) would be traced: a model compiled by ``torch.compile`` breaks its graph at each of
them (correct, slower). That is the price of one path with timeouts and failure naming for every collective; no
test compiles a Ulysses or tensor-parallel model through them yet.
"""

from __future__ import annotations

import torch

from .group_collectives import collectives_for


def _summed(tensor: torch.Tensor, group, label: str) -> torch.Tensor:
    total = tensor.detach().clone()
    collectives_for(group).all_reduce(total, label=label).wait()
    return total


def _exchanged(tensor: torch.Tensor, group, label: str) -> torch.Tensor:
    send = tensor.detach().contiguous()
    received = torch.empty_like(send)
    collectives_for(group).all_to_all(received, send, label=label).wait()
    return received


class SumOverRanks(torch.autograd.Function):
    """Forward: the sum of each rank's ``tensor`` (partial outputs, partial loss sums). Backward: the gradient,
    unchanged, to this rank's own term, which is the whole derivative of a sum with respect to one of its terms."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, label: str = "sum_over_ranks") -> torch.Tensor:
        return _summed(tensor, group, label)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class SumGradOverRanks(torch.autograd.Function):
    """Forward: a replicated input passes through. Backward: the sum of the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, label: str = "sum_grad_over_ranks") -> torch.Tensor:
        ctx.group, ctx.label = collectives_for(group), label
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _summed(grad, ctx.group, ctx.label), None, None


class AllToAll(torch.autograd.Function):
    """Chunk r of ``tensor``'s first dimension (``world_size`` equal chunks) goes to rank r, and chunk r of the
    result came from rank r. Backward sends each gradient chunk back where its value came from, which is the same
    all-to-all: the exchange is a permutation that is its own transpose."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, label: str = "all_to_all") -> torch.Tensor:
        ctx.group, ctx.label = collectives_for(group), label
        return _exchanged(tensor, ctx.group, label)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchanged(grad, ctx.group, f"{ctx.label}.backward"), None, None


def _exchanged_uneven(tensor: torch.Tensor, group, label: str, sent: list[int], received: list[int]) -> torch.Tensor:
    send = tensor.detach().contiguous()
    out = send.new_empty((sum(received), *send.shape[1:]))
    collectives_for(group).all_to_all(out, send, label=label, output_splits=received, input_splits=sent).wait()
    return out


class AllToAllUneven(torch.autograd.Function):
    """The first ``sent[r]`` rows after those for lower ranks go to rank r, and the result holds ``received[r]`` rows
    from each rank r in rank order. Backward is the same exchange with the two lists swapped: every gradient row
    returns to the rank its value came from."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, sent: list[int], received: list[int], label: str = "all_to_all"):
        ctx.group, ctx.label, ctx.sent, ctx.received = collectives_for(group), label, sent, received
        return _exchanged_uneven(tensor, ctx.group, label, sent, received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _exchanged_uneven(grad, ctx.group, f"{ctx.label}.backward", ctx.received, ctx.sent)
        return back, None, None, None, None
