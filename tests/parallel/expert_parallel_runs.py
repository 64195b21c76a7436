"""Rank bodies for test_expert_parallel.py: the expert-parallel MoE layers against the unsharded model, and ZeRO
with experts on 4 gloo ranks against one process."""

import contextlib

import moe_models
import torch
from hf_models import SEQ, VOCAB

from ds_strategy.comm.collectives import Collectives
from ds_strategy.compose.activation_checkpointing import CheckpointedForward
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
        reference(
            input_ids=everything[r * per_rank : (r + 1) * per_rank],
            labels=everything[r * per_rank : (r + 1) * per_rank],
        ).loss
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
    return {
        "loss": loss.item(),
        "reference": mine_reference.item(),
        "grad_diff": worst,
        "routed": routed,
    }


def _global_mean(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().clone()
    torch.distributed.all_reduce(value)
    return value.item() / world_size


def zero_with_experts_matches_one_process(
    rank: int, world_size: int, name: str, stage: int, ep: int, on_meta: bool = False, **fields
) -> dict:
    """ZeRO at ``stage`` with ``expert_parallel_size=ep`` on every rank's batch, against one process training the
    unsharded model on the global batch: per-step losses, gradient norms (clipped, so the norm spanning both kinds of
    parameters steers the update) and the exported weights, before training (equal bitwise) and after. ``on_meta``:
    every rank builds the model on the meta device (transformers' build alone, the reference too), which the engine
    initialises unit by unit. ``fields``: more ZeroConfig fields; what they turned on is reported (the step runner,
    offloaded or on the device, and how many units are checkpointed)."""
    from ds_strategy.compose import build_mesh, compose_model
    from ds_strategy.config import ZeroConfig

    config = ZeroConfig(stage=stage, expert_parallel_size=ep, **fields)
    mesh = build_mesh(config, "cpu")
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = moe_models.build(name, spread_routers=not on_meta)
    composed = compose_model(
        model,
        config,
        mesh=mesh,
        device=torch.device("cpu"),
        log=lambda message: None,
        optimizers=lambda: [torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)],
    )
    engine = composed.engine
    reference = moe_models.build(name, spread_routers=not on_meta)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    result = {"losses": [], "reference_losses": [], "norms": [], "reference_norms": []}
    initial, expected = engine.full_state_dict(rank0_only=False), reference.state_dict()
    result["initial_equal"] = initial.keys() == expected.keys() and all(
        torch.equal(initial[k], expected[k]) for k in expected
    )
    for step in range(3):
        everything, mine = _batch(rank, world_size, seed=step)
        loss = model(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        result["norms"].append(engine.clip_grad_norm_(0.05).item())
        engine.step()
        result["losses"].append(_global_mean(loss, world_size))
        reference_loss = reference(input_ids=everything, labels=everything).loss
        reference_loss.backward()
        result["reference_norms"].append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item())
        optimizer.step()
        optimizer.zero_grad()
        result["reference_losses"].append(reference_loss.item())
    exported = engine.full_state_dict()
    if rank == 0:
        expected = reference.state_dict()
        assert exported.keys() == expected.keys()
        result["weight_diff"] = max((exported[k] - expected[k]).abs().max().item() for k in expected)
    result["comm"] = engine.comm_stats()
    result["step_runner"] = type(engine.step_runner).__name__
    result["checkpointed"] = sum(isinstance(m.__dict__.get("forward"), CheckpointedForward) for m in model.modules())
    return result


def _composed(name: str, stage: int, ep: int):
    from ds_strategy.compose import build_mesh, compose_model
    from ds_strategy.config import ZeroConfig

    config = ZeroConfig(stage=stage, expert_parallel_size=ep)
    model = moe_models.build(name)
    composed = compose_model(
        model,
        config,
        mesh=build_mesh(config, "cpu"),
        device=torch.device("cpu"),
        log=lambda message: None,
        optimizers=lambda: [torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)],
    )
    return model, composed.engine


def _train_step(model, engine, rank: int, world_size: int, step: int) -> float:
    _, mine = _batch(rank, world_size, seed=step)
    loss = model(input_ids=mine, labels=mine).loss
    engine.backward(loss)
    engine.step()
    return _global_mean(loss, world_size)


def resumes_at_another_expert_parallel_size(rank: int, world_size: int, name: str, tmp: str) -> dict:
    """Train 2 steps at stage 3 with ep=2 and save; load into stage 2 with ep=4 (and stage 1 with ep=1, no expert
    parallelism at all) and take a third step in each: the same weights, then the same loss and weights as the
    run that went on. The checkpoint also consolidates into the Hugging Face layout."""
    from ds_strategy import checkpoint

    saved_model, saved_engine = _composed(name, 3, 2)
    for step in range(2):
        _train_step(saved_model, saved_engine, rank, world_size, step)
    checkpoint.save(f"{tmp}/ckpt", saved_model, saved_engine)
    result = {"saved": saved_engine.full_state_dict(rank0_only=False)}
    result["loss"] = _train_step(saved_model, saved_engine, rank, world_size, 2)
    result["after"] = saved_engine.full_state_dict(rank0_only=False)
    for stage, ep in ((2, 4), (1, 1)):
        model, engine = _composed(name, stage, ep)
        checkpoint.load(f"{tmp}/ckpt", model, engine)
        result[ep] = {"loaded": engine.full_state_dict(rank0_only=False)}
        result[ep]["loss"] = _train_step(model, engine, rank, world_size, 2)
        result[ep]["after"] = engine.full_state_dict(rank0_only=False)
    if rank == 0:
        out = checkpoint.consolidate(f"{tmp}/ckpt", f"{tmp}/consolidated.safetensors")
        from safetensors.torch import load_file

        result["consolidated"] = load_file(out)
    return result
