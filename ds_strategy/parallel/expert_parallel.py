"""Expert parallelism: each rank of an expert-parallel group holds ``num_experts / ep`` of every MoE layer's experts,
and tokens travel to their experts' ranks and back with all-to-alls over that group.

Only the experts container changes (:mod:`.moe_layers` finds it): the router, the shared experts and the auxiliary
losses run as before on this rank's tokens, over every expert's logits, so they keep their meaning. The container's
class is swapped for a subclass whose ``forward`` wraps the original one (as FSDP2's ``fully_shard`` swaps a module's
class), and its stacked parameters are cut to this rank's rows: parameter names stay what the model calls them, and
the original ``forward`` computes the local experts unchanged, whichever implementation transformers picked for it.

Note: [Dropless dispatch]
  Each of this rank's T tokens chose K experts. The T*K (token, expert) pairs are sorted by expert (stably), so the
  pairs for the experts rank r holds are one contiguous run, and the counts per expert, exchanged first with an
  equal-sized all-to-all, tell every rank how many rows it will receive from each rank for each of its experts.
  The rows are then exchanged with an uneven all-to-all (every pair is sent: no capacity, nothing dropped); the
  receiving rank runs its experts on them (each row with weight 1, its local expert index), sends the results back
  with the reverse exchange, and the sender multiplies each by its routing weight and sums a token's K results.
  That is the unsharded container's arithmetic, reordered: losses match it to float rounding. The exchange is
  differentiable (:class:`~ds_strategy.comm.differentiable.AllToAllUneven`), and every rank runs both exchanges in
  backward even when it received no rows, since the others wait for it: the computed rows always depend on the
  received ones.

Note: [Recomputing a dispatch]
  Under activation checkpointing a decoder layer holding an experts container runs its forward again in backward,
  all-to-alls included, and every rank of the expert-parallel group must run the same exchanges in the same order.
  It does: the routing is a function of the layer's saved input and of the same weights (stage 3 gathers them
  again for the recomputation), so the counts, and with them every split size, are those of the forward; the ranks
  recompute their layers in the same backward order; and torch stops a recomputation early only after the last
  tensor the forward saved, which on every rank comes after the combine (its product with the routing weights
  saves the returned rows), so no rank stops between two exchanges. The first failure seen here, a recomputed
  DeepSeek-V3 layer saving tensors of other shapes, was not expert parallelism but the KV cache: with
  ``config.use_cache=True`` the recomputation appends its keys to the cache the forward filled, in one process
  too (``apply_activation_checkpointing`` warns of it; turn the cache off for training).

Note: [Expert gradient scale]
  An expert's gradient on its rank sums the contributions of the tokens every rank of the expert-parallel group
  sent it; summed again over the expert-data-parallel group, it covers every rank's tokens once, as the unsharded
  sum over the world does. So expert gradients are divided by the world size, as the other parameters' are, not by
  the size of the group they are reduced over (DeepSpeed-MoE scales them the same way).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..comm.collectives import Collectives
from ..comm.differentiable import AllToAllUneven
from ..profiler_ranges import profiler_range


class ExpertParallel:
    """Mixed into an experts container's class by :func:`shard_experts`: ``forward(hidden_states, top_k_index,
    top_k_weights)`` dispatches the tokens to the ranks holding their experts (Note: [Dropless dispatch]).

    ``num_experts`` is the local count once sharded (what the original ``forward`` indexes); ``global_experts``,
    ``first_expert`` place this rank's rows among all of them; ``routed_tokens`` holds the last forward's count of
    this rank's tokens per (global) expert, for load-imbalance logging."""

    expert_collectives: Collectives
    global_experts: int
    first_expert: int
    routed_tokens: torch.Tensor | None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, **kwargs):
        with profiler_range("moe.expert_parallel", type(self).__name__):
            return self._dispatch_compute_combine(hidden_states, top_k_index, top_k_weights, **kwargs)

    def _dispatch_compute_combine(self, hidden, top_k_index, top_k_weights, **kwargs) -> torch.Tensor:
        group, ep, local = self.expert_collectives, self.expert_collectives.world_size, self.num_experts
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        token_of = order // top_k_index.shape[-1]
        counts = torch.bincount(chosen, minlength=self.global_experts)
        self.routed_tokens = counts.detach()
        incoming = torch.empty_like(counts)
        group.all_to_all(incoming, counts, label="expert counts").wait()
        incoming = incoming.view(ep, local)
        sent, received = counts.view(ep, local).sum(1).tolist(), incoming.sum(1).tolist()
        rows = AllToAllUneven.apply(hidden[token_of], group, sent, received, "expert dispatch")
        experts = torch.repeat_interleave(torch.arange(local, device=hidden.device).repeat(ep), incoming.reshape(-1))
        computed = super().forward(rows, experts[:, None], rows.new_ones(len(experts), 1), **kwargs)
        computed = computed + rows[:0].sum()  # keeps the exchange in the graph with no rows (Note: [Dropless dispatch])
        back = AllToAllUneven.apply(computed, group, received, sent, "expert combine")
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(hidden).index_add_(0, token_of, weighted.to(hidden.dtype))


def expert_rows(module: nn.Module) -> list[str]:
    """The names of ``module``'s own parameters stacked one row per expert (their first dimension is
    ``num_experts``): what expert parallelism cuts."""
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() and p.shape[0] == module.num_experts]


def shard_experts(module: nn.Module, collectives: Collectives) -> None:
    """Turn the experts container ``module`` into its expert-parallel form in place: keep this rank's
    ``num_experts / ep`` rows of each stacked parameter and route tokens through ``collectives`` (the expert-parallel
    group). The rows kept are consecutive: rank r holds experts ``r * E/ep`` to ``(r + 1) * E/ep - 1``. On a model
    built on the meta device the rows kept stay on meta; the engine initialises them as a normal build draws them
    (Note: [A sharded build equals a normal build] in :mod:`ds_strategy.zero.sharded_init`)."""
    total, ep = module.num_experts, collectives.world_size
    if total % ep:
        raise ValueError(
            f"{type(module).__name__} has num_experts={total}, which expert_parallel_size={ep} does not divide; "
            f"allowed sizes: {[n for n in range(1, total + 1) if total % n == 0]}"
        )
    local = total // ep
    first = collectives.rank * local
    for name in expert_rows(module):
        p = getattr(module, name)
        rows = p.detach().narrow(0, first, local).clone()
        setattr(module, name, nn.Parameter(rows, requires_grad=p.requires_grad))
    module.__class__ = _expert_parallel_class(type(module))
    module.num_experts, module.global_experts, module.first_expert = local, total, first
    module.expert_collectives, module.routed_tokens = collectives, None


@functools.cache
def _expert_parallel_class(cls: type) -> type:
    """One subclass per container class, as FSDP2 makes one ``FSDP<cls>`` per module class."""
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


def is_expert_parallel(module: nn.Module) -> bool:
    return isinstance(module, ExpertParallel)


def tokens_per_expert(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each expert-parallel container's last forward: how many of this rank's tokens chose each expert, by the
    container's name (a logger sums them over ranks, or plots the imbalance as they are)."""
    return {
        name: m.routed_tokens
        for name, m in model.named_modules()
        if is_expert_parallel(m) and m.routed_tokens is not None
    }
