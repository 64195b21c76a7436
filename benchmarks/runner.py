"""The body of one benchmark rank: every system, round-robin, inside one gloo process group.

Note: [Why systems are rebuilt each round]
A round runs each system once, in an order rotated by one position per round, so slow spells of a shared machine fall on
every system alike and the ratios stay fair. Each time a system runs it is built from the seed, trained for ``warmup``
steps, timed for ``steps_per_round`` steps and freed: only one system's states are alive at a time, so the peak RSS of
its window is its own (after the previous system's memory was handed back with ``malloc_trim``), and every round repeats
the same experiment (same initial weights, same batches), so losses can be compared across systems. Model states are
sampled on the last warmup step, when Adam's state exists: as each transformer block starts its forward (a ZeRO-3 or
FSDP2 unit is gathered then), after backward and after the optimizer step; never in a timed step. Steps are not
separated by barriers: a barrier on gloo waits for in-flight collectives and would hide ZeRO's overlap of the parameter
all-gather with the next forward; instead the last timed step ends only once the system's pending work is done
(``finish``), and each step's time is the slowest rank's.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import time
import traceback

import torch
import torch.distributed as dist
from accounting import CommCounter, peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes
from systems import STATE_KINDS, Recipe, SystemSpec, build


@dataclasses.dataclass(frozen=True)
class Settings:
    """One benchmark invocation's knobs, shipped to every rank."""

    model: str = "small"
    batch_size: int = 4
    rounds: int = 4
    steps_per_round: int = 5
    warmup: int = 2
    seed: int = 0
    collective_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.warmup < 2:
            raise ValueError(
                f"warmup={self.warmup} must be >= 2: model states are sampled on a warmup step "
                f"after the first, once the optimizer state exists"
            )
        if self.rounds < 1 or self.steps_per_round < 1:
            raise ValueError(f"rounds={self.rounds} and steps_per_round={self.steps_per_round} must be >= 1")


class BatchSource:
    """The same global batches for every system and round: windows of the stdlib corpus at seeded offsets."""

    def __init__(self, recipe: Recipe, count: int, rank: int, world_size: int, seed: int):
        from ds_strategy.data import stdlib_tokens

        config = recipe.model
        tokens = stdlib_tokens(vocab_size=config.vocab_size, byte_budget=1_000_000)
        span = config.block_size + 1
        self.batches = []
        for step in range(count):
            generator = torch.Generator().manual_seed(seed * 100_003 + step)
            starts = torch.randint(len(tokens) - span, (world_size * recipe.batch_size,), generator=generator)
            mine = starts[rank * recipe.batch_size : (rank + 1) * recipe.batch_size]
            windows = torch.stack([tokens[s : s + span] for s in mine.tolist()])
            self.batches.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))


def rank_main(rank: int, world_size: int, settings: Settings, specs: list[SystemSpec]) -> dict:
    """Run every round on this rank; returns per-system lists of window measurements and failures."""
    counter = CommCounter.install()  # before DeepSpeed caches torch.distributed's functions
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=settings.collective_timeout_s))
    if any(spec.family == "deepspeed" for spec in specs):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    from ds_strategy.models import gpt_config

    recipe = Recipe(model=gpt_config(settings.model), batch_size=settings.batch_size, seed=settings.seed)
    batches = BatchSource(recipe, settings.warmup + settings.steps_per_round, rank, world_size, settings.seed)
    windows: dict[str, list[dict]] = {spec.name: [] for spec in specs}
    failed: dict[str, str] = {}
    for round_index in range(settings.rounds):
        live = [spec for spec in specs if spec.name not in failed]
        shift = round_index % max(1, len(live))
        for spec in live[shift:] + live[:shift]:
            try:
                window, error = measure_window(spec, recipe, batches, counter, settings, world_size), None
            except Exception as exc:  # noqa: BLE001 - one system failing must not stop the others
                window, error = None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"
            failures = torch.tensor([0 if error is None else 1])
            dist.all_reduce(failures)
            if failures.item():
                failed[spec.name] = error or "failed on another rank"
            else:
                window["round"] = round_index
                windows[spec.name].append(window)
    dist.destroy_process_group()
    return {"windows": windows, "failed": failed}


def measure_window(
    spec: SystemSpec, recipe: Recipe, batches: BatchSource, counter: CommCounter, settings: Settings, world_size: int
) -> dict:
    """Build ``spec``, warm it up, time ``steps_per_round`` steps, and free it."""
    gc.collect()
    release_free_memory()
    rss_before = rss_bytes()
    reset_peak_rss()
    system = build(spec, recipe)
    try:
        build_peak = peak_rss_bytes()
        reset_peak_rss()
        losses, states = [], []
        for i in range(settings.warmup):
            last = i == settings.warmup - 1
            sample = lambda *_: states.append(system.state_bytes())  # noqa: F821 (ruff misreads the del below)
            hooks = [block.register_forward_pre_hook(sample) for block in system.blocks()] if last else []
            losses.append(system.forward_backward(*batches.batches[i]))
            for hook in hooks:
                hook.remove()
            states += [system.state_bytes()] if last else []
            system.optimizer_step()
            states += [system.state_bytes()] if last else []
        system.finish()
        dist.barrier()
        counter.reset()
        system.reset_own_comm()
        counter.active = True
        stamps = [time.perf_counter()]
        for i in range(settings.warmup, settings.warmup + settings.steps_per_round):
            losses.append(system.forward_backward(*batches.batches[i]))
            system.optimizer_step()
            stamps.append(time.perf_counter())
        system.finish()
        stamps[-1] = time.perf_counter()
        counter.active = False
        own_comm = system.own_comm_bytes()
        peak = peak_rss_bytes()
    finally:
        counter.active = False
        system.close()
        del system
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    return {
        "step_seconds": [b - a for a, b in zip(stamps, stamps[1:])],
        "state_bytes": max(states, key=lambda s: sum(s.get(k, 0) for k in STATE_KINDS)),
        "comm_bytes": dict(counter.bytes),
        "comm_calls": dict(counter.calls),
        "own_comm_bytes": own_comm,
        "peak_rss": peak,
        "build_peak_rss": build_peak,
        "rss_before": rss_before,
        "losses": (mean_losses / world_size).tolist(),
    }
