"""Unscale, overflow check and squared norm of every rank's gradient shards: one pass, one all-reduce.

Note: [One pass, one collective per optimizer step]
Before an fp16 step the engine must divide the gradients by the loss scale, learn whether any rank saw an
inf/nan, and (for clipping) know the global gradient norm. ``ds_strategy.kernels.unscale_and_check`` does all
three in one read of each flat shard (a Triton kernel on GPUs, its PyTorch reference on CPUs); this module runs it
over the shards and packs the local ``[sum of squares, inf flag]`` into one two-element tensor that a single
all-reduce sums across ranks. With partitioned gradients the summed squares are the global norm squared; at
stage 0 every rank already holds the whole averaged gradient, so the local sum is the norm and only the flag
is summed. A rank sees a non-finite value only in its own shard, so without the all-reduce ranks would
disagree about skipping and their parameters would diverge.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..kernels import unscale_and_check


@dataclasses.dataclass(frozen=True)
class GradStats:
    """What the fused pass learned about one optimizer step's gradients, agreed across ranks.

    ``sq_norm``: the global squared L2 norm of the unscaled gradients (fp32 scalar tensor); meaningless when
    ``found_inf``. ``inf_count``: how many flat shards, summed over ranks, held an inf or nan (fp32 scalar tensor).
    Both stay on the device: only :attr:`found_inf` brings the count to the host, which waits for the device, so a
    step that does not skip on overflow (bf16, fp32: clipping only needs the norm) never asks.
    """

    sq_norm: torch.Tensor
    inf_count: torch.Tensor

    @property
    def norm(self) -> torch.Tensor:
        return self.sq_norm.sqrt()

    @property
    def found_inf(self) -> bool:
        """Some rank's gradient held an inf or nan (a host synchronisation: only fp16 loss scaling asks)."""
        return bool(self.inf_count.item() > 0)


def unscale_and_check_shards(
    grads: list[torch.Tensor],
    inv_scale: float | list[float],
    collectives,
    sharded: bool,
    weights: list[float] | None = None,
    model_parallel: tuple = (),
    device: torch.device | None = None,
) -> GradStats:
    """Multiply each flat gradient in ``grads`` by ``inv_scale`` (one for all, or one each: 1.0 for a gradient
    unscaled already) in place and return the agreed statistics.

    ``sharded``: each rank holds different gradient elements (ZeRO stage >= 1), so squared norms are summed
    across ranks; otherwise (stage 0) they are identical on every rank and only the inf flag is combined.
    ``weights``: each gradient's weight in the squared norm, and ``model_parallel`` the groups whose ranks hold
    different parts of the model (tensor parallel, pipeline stages): their sums are added by one more all-reduce
    each, a buffer replicated over the tensor-parallel group weighted ``1 / tp_size`` so that it counts once (Note:
    [DTensor parameters as flat views]), a tied copy another stage owns weighted 0. ``device``: where the
    statistics are summed and all-reduced (the engine's device; by default the first gradient's), so that
    gradients an offload keeps on the host are counted beside those on the device.
    """
    device = device or (grads[0].device if grads else torch.device("cpu"))
    local = torch.zeros(2, dtype=torch.float32, device=device)
    scales = inv_scale if isinstance(inv_scale, list) else [inv_scale] * len(grads)
    for grad, scale, weight in zip(grads, scales, weights or [1.0] * len(grads)):
        sq_norm, found_inf = unscale_and_check(grad, scale)
        local[0] += (sq_norm * weight).to(device)
        local[1] += found_inf.to(device)
    agreed = local.clone()
    if not sharded:
        agreed[0] = 0.0
    if collectives.world_size > 1:
        collectives.all_reduce(agreed, op=dist.ReduceOp.SUM).wait()
    if not sharded:
        agreed[0] = local[0]
    for group in model_parallel:
        group.all_reduce(agreed, op=dist.ReduceOp.SUM).wait()
    return GradStats(sq_norm=agreed[0], inf_count=agreed[1])
