"""Rank bodies for test_expert_parallel.py: the expert-parallel MoE layers against the unsharded model, and ZeRO
with experts on 4 gloo ranks against one process."""

import moe_models
import torch
from hf_models import SEQ, VOCAB

from ds_strategy.comm.collectives import Collectives
from ds_strategy.parallel.expert_parallel import shard_experts, tokens_per_expert
from ds_strategy.parallel.moe_layers import find_experts_containers


def _batch(rank: int, world_size: int, per_rank: int = 2, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (per_rank * world_size, SEQ), generator=generator)
    return ids, ids[rank * per_rank : (rank + 1) * per_rank]


def layer_matches_unsharded(rank: int, world_size: int, name: str) -> dict:
    """Every rank holds 1/world of the experts: its loss equals the unsharded model's on its batch, and its
    experts' gradients equal the unsharded gradients of the sum of every rank's loss."""
    reference, model = moe_models.build(name), moe_models.build(name)
    group = Collectives(None)
    for _, experts in find_experts_containers(model):
        shard_experts(experts, group)
    everything, mine = _batch(rank, world_size)
    per_rank = mine.shape[0]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    total = sum(
        reference(input_ids=everything[r * per_rank : (r + 1) * per_rank], labels=everything[r * per_rank : (r + 1) * per_rank]).loss
        for r in range(world_size)
    )
    total.backward()
    mine_reference = reference(input_ids=mine, labels=mine).loss
    worst = 0.0
    for (_, ref), (_, experts) in zip(find_experts_containers(reference), find_experts_containers(model)):
        for pname, p in experts.named_parameters(recurse=False):
            rows = getattr(ref, pname).grad.narrow(0, experts.first_expert, experts.num_experts)
            worst = max(worst, (p.grad - rows).abs().max().item())
    routed = {k: v.tolist() for k, v in tokens_per_expert(model).items()}
    return {"loss": loss.item(), "reference": mine_reference.item(), "grad_diff": worst, "routed": routed}
