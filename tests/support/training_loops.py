"""The two training loops every parity test compares: ZeRO on real ranks, and one process on the global batch.

Both draw the same global batches from one seeded generator. The ZeRO rank trains on its slice of each
global micro-batch; the reference runs every rank's slice through one unsharded model and averages the losses,
which is exactly what data parallelism computes (per-slice BatchNorm statistics included).
"""

import contextlib
import dataclasses
from dataclasses import dataclass, field

import models
import torch
import torch.distributed as dist

from ds_strategy.config import ZeroConfig
from ds_strategy.offload import step_runner_for
from ds_strategy.zero.engine import ZeroEngine


@dataclass(frozen=True)
class Recipe:
    """What to train and how: the settings the parity tests share."""

    model: str = "TinyGPT"
    steps: int = 10
    accumulate: int = 2
    clip: float = 1.0
    per_rank_batch: int = 4
    lr: float = 1e-2
    eps: float = 1e-6
    zero: dict = field(default_factory=dict)
    pattern: str = "no_sync"  # how backward calls are driven between steps: one of PATTERNS


# Note: [Backward patterns]
#   Every pattern computes the same gradient per step (the mean over ranks of the sum of the micro-batch losses),
#   so all are compared with the one reference. "no_sync": non-boundary micro-batches under ``no_sync`` (one
#   reduction per step at stage 0/1). "every": a synced backward per micro-batch (Accelerate's plain manual
#   loop, ``accumulate(sync_each_batch=True)``). "twice": each micro-batch forwarded twice and each half of its
#   loss backwarded separately, every backward synced. "forwards_first": the step's forwards all run under
#   ``no_sync``, then their backwards outside it (Accelerate's test_sync.py pattern).
PATTERNS = ("no_sync", "every", "twice", "forwards_first")


def build(recipe: Recipe):
    torch.manual_seed(0)
    model = getattr(models, recipe.model)()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=recipe.lr, betas=(0.9, 0.99), eps=recipe.eps)
    return model, optimizer


def drive_micro_batch(pattern: str, boundary: bool, loss_of, backward, no_sync, pending: list) -> torch.Tensor:
    """One micro-batch of ``pattern`` (see Note: [Backward patterns]); returns its loss.

    ``loss_of()`` runs the forward and returns the micro-batch's share of the step's loss, ``backward(loss)``
    and ``no_sync()`` are the entry point's own; ``pending`` carries the losses "forwards_first" has not yet
    backwarded, from one call to the next.
    """
    if pattern == "no_sync":
        with contextlib.nullcontext() if boundary else no_sync():
            loss = loss_of()
            backward(loss)
    elif pattern == "every":
        loss = loss_of()
        backward(loss)
    elif pattern == "twice":
        loss = loss_of()
        backward(loss / 2)
        backward(loss_of() / 2)
    else:
        with no_sync():
            loss = loss_of()
        pending.append(loss)
        if boundary:
            for queued in pending:
                backward(queued)
            pending.clear()
    return loss


def _micro_batches(recipe: Recipe, world_size: int):
    """Yields (step, micro, global batch) in the same order for every caller."""
    model_cls = getattr(models, recipe.model)
    generator = torch.Generator().manual_seed(1234)
    for step in range(recipe.steps):
        for micro in range(recipe.accumulate):
            yield step, micro, model_cls.make_batch(generator, recipe.per_rank_batch * world_size)


def _rank_slice(batch, rank: int, per_rank: int):
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def train_zero(rank: int, world_size: int, recipe: Recipe, stage: int) -> dict:
    """Run on each rank under ``run_ranks``: returns global losses per step and the final full parameters."""
    torch.set_num_threads(1)
    model, optimizer = build(recipe)
    config = ZeroConfig(stage=stage, **recipe.zero)
    engine = ZeroEngine(model, optimizer, config, step_runner=step_runner_for(config))
    losses, step_loss, gathered_between_steps, pending = [], torch.zeros(()), 0, []
    for _step, micro, batch in _micro_batches(recipe, world_size):
        boundary = micro == recipe.accumulate - 1
        mine = _rank_slice(batch, rank, recipe.per_rank_batch)
        loss = drive_micro_batch(
            recipe.pattern,
            boundary,
            lambda: model(mine) / recipe.accumulate,
            torch.Tensor.backward,
            engine.no_sync,
            pending,
        )
        step_loss += loss.detach()
        if boundary:
            if recipe.clip:
                engine.clip_grad_norm_(recipe.clip)
            engine.step()
            if engine.gatherer is not None:
                gathered_between_steps = max(gathered_between_steps, engine.gatherer.gathered_numel())
            dist.all_reduce(step_loss)
            losses.append(step_loss.item() / world_size)
            step_loss = torch.zeros(())
    params = full_state(engine, model)
    return {
        "losses": losses,
        "params": params,
        "memory": engine.memory_report(),
        "gathered_between_steps": gathered_between_steps,
        "peak_gathered": engine.gatherer.peak_gathered_numel if engine.gatherer else 0,
        "unit_numels": [sum(fp.padded_numel for fp in u.partitioned) for u in engine.units],
    }


def full_state(engine: ZeroEngine, model: torch.nn.Module) -> dict:
    """Parameters by name, whole (gathered unit by unit under stage 3)."""
    state = engine.full_state_dict(rank0_only=False)
    return {name: state[name] for name, _ in model.named_parameters()}


def train_reference(recipe: Recipe, world_size: int) -> dict:
    """One process, unsharded, the same global batches split into ``world_size`` slices per micro-batch."""
    model, optimizer = build(recipe)
    losses, step_loss = [], 0.0
    for _step, micro, batch in _micro_batches(recipe, world_size):
        slices = [_rank_slice(batch, r, recipe.per_rank_batch) for r in range(world_size)]
        loss = torch.stack([model(s) for s in slices]).mean() / recipe.accumulate
        loss.backward()
        step_loss += loss.item()
        if micro == recipe.accumulate - 1:
            _zero_missing_grads(model)
            if recipe.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step_loss)
            step_loss = 0.0
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _zero_missing_grads(model: torch.nn.Module) -> None:
    """A trainable parameter that took no part in the loss gets a zero gradient, as under DDP (and ZeRO): the
    optimizer still applies weight decay and momentum to it, where plain torch would skip it."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def train_stages(rank: int, world_size: int, recipe: Recipe, stages: tuple) -> dict:
    """Several stages in one process group (spawning ranks is the slow part of these tests)."""
    return {stage: train_zero(rank, world_size, recipe, stage) for stage in stages}


def train_jobs(rank: int, world_size: int, jobs: dict) -> dict:
    """``{name: (recipe, stage)}`` trained one after another in one process group."""
    return {name: train_zero(rank, world_size, recipe, stage) for name, (recipe, stage) in jobs.items()}


def check_jobs(jobs: dict, world_size: int = 2) -> dict:
    """Train ``jobs`` on ``world_size`` ranks and return ``{name: (per-rank results, reference)}``."""
    from distributed import run_ranks

    ranks = run_ranks(train_jobs, world_size, jobs, timeout=600)
    references = {}
    for recipe, _ in jobs.values():
        if _reference_key(recipe) not in references:
            references[_reference_key(recipe)] = train_reference(recipe, world_size)
    return {
        name: ([rank[name] for rank in ranks], references[_reference_key(recipe)]) for name, (recipe, _) in jobs.items()
    }


def _reference_key(recipe: Recipe) -> str:
    """The reference reads neither the ZeRO settings nor the backward pattern: jobs differing only there share it."""
    return repr(dataclasses.replace(recipe, zero={}, pattern=PATTERNS[0]))


def assert_matches(zero: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Losses to ``rtol`` elementwise; each parameter tensor to ``rtol`` in relative norm, ||a - b|| / ||b||.

    Note: [Why parameters are compared in norm]
    Sharded and unsharded runs add the same numbers in different
    orders, so gradients differ in the last bits. Adam divides by sqrt(v) + eps, which turns last-bit noise in
    a coordinate whose true gradient is ~0 (the attention key bias has an exactly-zero gradient) into a step of
    up to ``lr``; an elementwise check would then measure float noise, not the engine. The recipes use
    eps=1e-6 for the same reason. A bug in sharding (a wrong slice, a missed or doubled gradient) moves whole
    tensors by far more than 1e-5.
    """
    assert len(zero["losses"]) == len(reference["losses"])
    torch.testing.assert_close(torch.tensor(zero["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=0.0)
    assert zero["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        error = (zero["params"][name] - value).norm() / value.norm().clamp_min(1e-12)
        assert error <= rtol, f"{name}: relative error {error:.2e} > {rtol:.0e}"
