"""The two differentiable sums over a process group that tensor and sequence parallelism need (Megatron's f and g):
one sums in forward and passes the gradient through, the other passes forward and sums the gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist


class SumOverRanks(torch.autograd.Function):
    """Forward: the sum of each rank's ``tensor`` (partial outputs, partial loss sums). Backward: the gradient,
    unchanged, to this rank's own term, which is the whole derivative of a sum with respect to one of its terms."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = tensor.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SumGradOverRanks(torch.autograd.Function):
    """Forward: a replicated input passes through. Backward: the sum of the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
