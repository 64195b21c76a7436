"""Pipeline parallelism with ZeRO: throughput, bubble and per-stage memory of every schedule against dp-only ZeRO.

    python benchmarks/pipeline_parallel.py                     # 4 gloo ranks: dp=4, pp=2 x dp=2, pp=4
    python benchmarks/pipeline_parallel.py --quick             # the tiny GPT, one timed step: a smoke run
    python benchmarks/pipeline_parallel.py --pp 2 --systems 'pp2*-z1' --rounds 3 --steps 5

Every system trains the same 8-block GPT from the same seed on the same global batches (``--global-batch``
sequences per step; each data-parallel rank takes its slice, the ranks of one pipeline read the same slice):

  dp<N>-z<s>               the baseline: no pipeline, ZeRO stage s over all N ranks, ``model(x, y)``,
                           ``engine.backward(loss)``, ``engine.step()``.
  pp<p>[xdp<d>]-<sched>-z<s>  ``compose_model`` (cut, engine, ``PipelineRunner``)
                           with ``pipeline_schedule=<sched>`` (gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv;
                           the last three hold two stages per rank), ``--microbatches`` per step on every pipeline,
                           ``runner.train_step`` then ``engine.step()``.

All use AdamW, no clipping and ``param_persistence_threshold=0``: at the default (1e5) every matrix of this small
GPT (the largest is 128 x 512) would stay whole under stage 3, and the formula below assumes all are sharded.
Per system:

- step time: a barrier, then one step (train and optimizer step) on every rank; the step is the slowest rank's
  time from the barrier, the median over every timed step; tokens/s is the global batch's tokens over it.
- busy: this rank's seconds in stage compute, timed around ``ZeroPipelineStage.forward_one_chunk``,
  ``ZeroPipelineStage.backward_maybe_with_nosync`` (every backward piece, the zero-bubble schedules' input and
  weight parts included) and the last stage's loss (see Note: [How busy time is taken]); for the baseline the
  forward and ``engine.backward``. Two fractions, each averaged over ranks, then the median over steps:
  ``idle in step`` = 1 - busy / step (the issue's definition: the bubble plus the gradient reduction after the
  schedule, the optimizer step, and for the baseline its optimizer step and whatever of the reduction backward
  does not hide) and ``schedule bubble`` = 1 - busy / schedule, where the schedule is the slowest rank's time from
  the barrier to the end of ``schedule.step`` (for the baseline, to the end of backward: rank imbalance only).
  The theory beside it is the idealised bubble of equal stages with free communication: (p-1)/(m+p-1) for
  GPipe and 1F1B, (p-1)/(v·m+p-1) for interleaved 1F1B with v=2 chunks per rank; the zero-bubble schedules aim
  at none.
- memory per pipeline rank (its stages): peak anonymous RSS growth (``RssAnon`` of ``/proc/self/status`` sampled
  on a thread from before the model is built to the last step; the maximum over the ranks of that pipeline
  position), model-state bytes from ``engine.memory_report()`` after the last warmup step's optimizer step, and
  the formula: the stage's fp32-Adam bytes per parameter over the data-parallel group times this rank's
  parameters (the tied embedding counts on each rank that holds a copy). Growth above the states is
  activations in flight (GPipe keeps m micro-batches', 1F1B at most p) and transient buffers. The whole GPT is
  built before the cut, so 4 bytes x all parameters pass through every rank once.
- the last step's loss against the first row's (every system trains the same model on the same tokens).

Writes ``results/<name>.{md,json}``.

Note: [How busy time is taken]
    ``StageClock.install`` wraps the methods above on the classes, in each rank process only (the ranks are
    spawned, so nothing outside this benchmark sees it); calls nested inside a timed call are not counted twice.
    On this machine the ranks outnumber the cores, so a stage's compute stretches when its neighbours compute at
    the same time and shrinks when they idle: busy time, and so either fraction, mixes the schedule's bubble with
    the CPU's sharing. The theory column is the schedule's alone.

Note: [Why systems are interleaved and rebuilt]
    As in ``tensor_parallel.py``: a round runs every system once, in an order rotated by one per round, so a slow
    spell of a shared machine falls on all of them; each is built from the seed, trained, and freed (then
    ``malloc_trim``), so one system's states are alive at a time and its peak is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import functools
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accounting import release_free_memory
from quick_args import parse_args_with_quick
from torch import nn

from ds_strategy.autotune.launcher import launch_ranks
from ds_strategy.compose import compose_model
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig, weight_decay_groups
from ds_strategy.offload.host_memory import PeakRssAnon
from ds_strategy.parallel.mesh import build_parallel_mesh
from ds_strategy.parallel.pipeline_schedules import SCHEDULES, stage_count, stages_per_rank
from ds_strategy.pipeline.runner import PipelineRunner
from ds_strategy.pipeline.stage import ZeroPipelineStage

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
STATE_KINDS = ("params", "grads", "optimizer")
DEFAULT_SYSTEMS = "*-z1,dp4-z3,pp2xdp2-1f1b-z3"
QUICK = {"n_embd": 32, "n_head": 2, "seq": 16, "steps": 1, "rounds": 1}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One system: the pipeline size (1: the dp-only baseline), its schedule, the ZeRO stage; dp is the rest."""

    pp: int
    dp: int
    schedule: str | None
    stage: int

    def __post_init__(self) -> None:
        if (self.pp == 1) != (self.schedule is None):
            raise ValueError(f"Variant(pp={self.pp}, schedule={self.schedule!r}): a schedule goes with pp > 1 only")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"Variant.schedule={self.schedule!r} is not one of {tuple(SCHEDULES)}")

    @property
    def name(self) -> str:
        if self.pp == 1:
            return f"dp{self.dp}-z{self.stage}"
        mesh = f"pp{self.pp}" + (f"xdp{self.dp}" if self.dp > 1 else "")
        return f"{mesh}-{self.schedule}-z{self.stage}"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every system trains with; ``global_batch`` sequences per step, split over the data-parallel ranks and
    then, on a pipeline, into ``microbatches``."""

    model: GPTConfig
    global_batch: int = 16
    microbatches: int = 8
    warmup: int = 2
    steps: int = 5
    seed: int = 0
    lr: float = 3e-4

    def __post_init__(self) -> None:
        if self.warmup < 2:
            raise ValueError(f"Recipe.warmup={self.warmup} must be >= 2: states are sampled after the first step")


def variants(world_size: int, pps: list[int], stages: list[int], patterns: str) -> list[Variant]:
    """Per ZeRO stage: the dp-only baseline, then every schedule on every pipeline size; those whose names match
    one of the comma-separated ``patterns``."""
    out = []
    for stage in stages:
        out.append(Variant(1, world_size, None, stage))
        for pp in pps:
            if pp < 2 or world_size % pp:
                raise SystemExit(f"--pp {pp} must be above 1 and divide the world size {world_size}")
            out += [Variant(pp, world_size // pp, schedule, stage) for schedule in SCHEDULES]
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [v for v in out if any(fnmatch.fnmatch(v.name, p) for p in wanted)]
    if not chosen:
        raise SystemExit(f"--systems {patterns!r} matches none of: {', '.join(v.name for v in out)}")
    return chosen


def stage_bytes_per_param(stage: int, dp: int) -> float:
    """fp32 parameters and gradients (4 + 4 bytes) and Adam's two moments (8), as the ZeRO paper shards them."""
    return {0: 16.0, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[stage]


def theoretical_bubble(schedule: str | None, pp: int, microbatches: int) -> float | None:
    """The idle share of an ideal schedule (equal stages, free communication); None where there is no formula."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == "interleaved_1f1b":
        v = stages_per_rank(schedule)
        return (pp - 1) / (v * microbatches + pp - 1)
    return None


def global_batches(recipe: Recipe) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same (inputs, targets) for every system: windows of the stdlib corpus at seeded offsets."""
    from ds_strategy.data import stdlib_tokens

    config = recipe.model
    tokens = stdlib_tokens(vocab_size=config.vocab_size, byte_budget=1_000_000)
    span, out = config.block_size + 1, []
    for step in range(recipe.warmup + recipe.steps):
        generator = torch.Generator().manual_seed(recipe.seed * 100_003 + step)
        starts = torch.randint(len(tokens) - span, (recipe.global_batch,), generator=generator)
        windows = torch.stack([tokens[s : s + span] for s in starts.tolist()])
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out


def my_slice(batches: list, dp_rank: int, dp: int) -> list:
    """Data-parallel rank ``dp_rank``'s equal share of every global batch."""
    per_rank = len(batches[0][0]) // dp
    part = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [(x[part], y[part]) for x, y in batches]


def unique_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: GPT's own (mean over the micro-batch's tokens)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-1)


def _seeded_gpt(recipe: Recipe) -> GPT:
    torch.manual_seed(recipe.seed)
    return GPT(recipe.model)


def _adamw(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    return torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)


# -- timing -----------------------------------------------------------------------------------------------------
class StageClock:
    """Seconds this rank spends computing stages since ``reset`` (Note: [How busy time is taken])."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._depth = 0

    def install(self) -> StageClock:
        timed = (
            (ZeroPipelineStage, "forward_one_chunk"),
            (ZeroPipelineStage, "backward_maybe_with_nosync"),
            (PipelineRunner, "_scaled_loss"),
        )
        for cls, name in timed:
            setattr(cls, name, self.timing(getattr(cls, name)))
        return self

    def timing(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start
                self._depth -= 1

        return timed

    def reset(self) -> None:
        self.busy = 0.0


@dataclasses.dataclass
class StepTimes:
    """One rank's seconds for one step, each from the barrier before it: to the end of the schedule (of backward
    for the baseline), to the end of the optimizer step; and its busy seconds in between."""

    schedule: float
    step: float
    busy: float


# -- the systems ------------------------------------------------------------------------------------------------
def train_dp(variant: Variant, recipe: Recipe, batches: list, mesh, clock: StageClock) -> dict:
    """The baseline: the whole GPT under ZeRO over every rank, the engine's ordinary backward."""
    model = _seeded_gpt(recipe)
    psi_local = unique_numel(model)  # before stage 3 empties the parameters
    engine = compose_model(
        model, ZeroConfig(stage=variant.stage, param_persistence_threshold=0),
        mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=[_adamw(model, recipe)],
    ).engine  # fmt: skip

    def step(x, y) -> tuple[torch.Tensor, float, float]:
        start = time.perf_counter()
        _, loss = model(x, y)
        engine.backward(loss)
        backward_end = time.perf_counter()
        return loss, backward_end, backward_end - start

    try:
        return _train(engine, step, recipe, batches, psi_local, stage_ids=())
    finally:
        engine.remove_hooks()


def train_pipeline(variant: Variant, recipe: Recipe, batches: list, mesh, clock: StageClock) -> dict:
    """This rank's stages of the GPT, the engine over its data-parallel group, the schedule run by the runner."""
    model = _seeded_gpt(recipe)
    config = ZeroConfig(
        stage=variant.stage,
        pipeline_parallel_size=variant.pp,
        pipeline_schedule=variant.schedule,
        pipeline_microbatches=recipe.microbatches,
        param_persistence_threshold=0,
    )
    psi_local = 0

    def optimizers() -> list[torch.optim.Optimizer]:  # compose_model builds them once the model is cut to this rank's
        # stages
        nonlocal psi_local
        gc.collect()  # the blocks of other ranks' stages
        psi_local = unique_numel(model)  # this rank's stages, before stage 3 empties the parameters
        return [_adamw(model, recipe)]

    composed = compose_model(
        model, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=optimizers
    )
    engine, runner = composed.engine, composed.pipeline
    schedule_end = [0.0]
    run_schedule = runner.schedule.step

    def timed_schedule(*args, **kwargs):
        try:
            return run_schedule(*args, **kwargs)
        finally:
            schedule_end[0] = time.perf_counter()

    runner.schedule.step = timed_schedule  # this runner's only, to read when its schedule ends

    def step(x, y) -> tuple[torch.Tensor, float, float]:
        clock.reset()
        loss = runner.train_step(x, y, cross_entropy, 1.0)
        return loss, schedule_end[0], clock.busy

    try:
        return _train(engine, step, recipe, batches, psi_local, stage_ids=composed.stage_plan.stage_ids)
    finally:
        engine.remove_hooks()


def _train(engine, step, recipe: Recipe, batches: list, psi_local: int, stage_ids: tuple[int, ...]) -> dict:
    """Every step after a barrier; ``step(x, y)`` gives the loss, when its schedule ended and its busy seconds."""
    losses, times, states = [], [], {}
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss, schedule_end, busy = step(x, y)
        engine.step()
        engine.wait_for_params()
        times.append(StepTimes(schedule_end - start, time.perf_counter() - start, busy))
        losses.append(loss.detach().float().reshape(()))
        if i == recipe.warmup - 1:
            report = engine.memory_report()
            states = {kind: report[kind]["device"] + report[kind]["host"] for kind in STATE_KINDS}
    timed = [dataclasses.asdict(t) for t in times[recipe.warmup :]]
    return {"times": timed, "losses": losses, "states": states, "psi_local": psi_local, "stage_ids": list(stage_ids)}


# -- one rank ---------------------------------------------------------------------------------------------------
def rank_main(rank: int, world_size: int, recipe: Recipe, chosen: list[Variant], rounds: int) -> dict:
    """Every round on this rank (Note: [Why systems are interleaved and rebuilt]); per variant, its windows."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    clock = StageClock().install()
    meshes = {pp: build_parallel_mesh("cpu", 1, pipeline_parallel_size=pp) for pp in sorted({v.pp for v in chosen})}
    batches = global_batches(recipe)
    windows: dict[str, list[dict]] = {v.name: [] for v in chosen}
    for round_index in range(rounds):
        shift = round_index % len(chosen)
        for variant in chosen[shift:] + chosen[:shift]:
            mesh = meshes[variant.pp]
            mine = my_slice(batches, mesh.dp_rank, mesh.dp_size)
            gc.collect()
            release_free_memory()
            sampler = PeakRssAnon(interval_s=0.002).start()
            train = train_dp if variant.pp == 1 else train_pipeline
            window = train(variant, recipe, mine, mesh, clock)
            sampler.stop()
            losses = torch.stack(window.pop("losses"))
            dist.all_reduce(losses)  # every pipeline rank holds its slice's loss: the world's mean is the batch's
            window.update(
                losses=(losses / world_size).tolist(),
                pp_rank=mesh.pp_rank,
                peak_rss_anon=sampler.peak,
                rss_anon_growth=sampler.growth,
                round=round_index,
            )
            windows[variant.name].append(window)
            if rank == 0:
                seconds = sum(t["step"] for t in window["times"])
                print(f"round {round_index}: {variant.name} {seconds:.1f} s timed", flush=True)
            del window
    dist.destroy_process_group()
    return {"windows": windows}


# -- rows and the tables ----------------------------------------------------------------------------------------
def summarize(variant: Variant, per_rank: list[dict], recipe: Recipe) -> dict:
    """One row: per timed step the slowest rank's step and schedule, the rank-mean idle fractions; medians over
    steps; memory grouped by pipeline rank, maxima over its data-parallel ranks and the rounds."""
    windows = [rank["windows"][variant.name] for rank in per_rank]  # [rank][round]
    steps, idle, bubble = [], [], []
    for rounds in zip(*windows):  # one round, every rank
        for times in zip(*(w["times"] for w in rounds)):  # one step, every rank
            step, schedule = max(t["step"] for t in times), max(t["schedule"] for t in times)
            steps.append(step)
            idle.append(statistics.fmean(1 - t["busy"] / step for t in times))
            bubble.append(statistics.fmean(1 - t["busy"] / schedule for t in times))
    median = statistics.median(steps)
    return {
        "name": variant.name,
        **dataclasses.asdict(variant),
        "microbatches": recipe.microbatches if variant.pp > 1 else None,
        "step_seconds": steps,
        "step_median_s": median,
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "tokens_per_s": recipe.global_batch * recipe.model.block_size / median,
        "idle_in_step": statistics.median(idle),
        "schedule_bubble": statistics.median(bubble),
        "theoretical_bubble": theoretical_bubble(variant.schedule, variant.pp, recipe.microbatches),
        "peak_rss_anon_growth_bytes": max(w["rss_anon_growth"] for rank in windows for w in rank),
        "stages": [_stage_row(variant, [r for r in windows if r[0]["pp_rank"] == p]) for p in range(variant.pp)],
        "losses": windows[0][0]["losses"],
    }


def _stage_row(variant: Variant, windows: list[list[dict]]) -> dict:
    """One pipeline rank's memory, over the data-parallel ranks that hold its stages."""
    states = [sum(w["states"].values()) for rank in windows for w in rank]
    psi_local = windows[0][0]["psi_local"]
    formula = stage_bytes_per_param(variant.stage, variant.dp) * psi_local
    return {
        "pp_rank": windows[0][0]["pp_rank"],
        "stage_ids": windows[0][0]["stage_ids"],
        "psi_local": psi_local,
        "peak_rss_anon_bytes": max(w["peak_rss_anon"] for rank in windows for w in rank),
        "rss_anon_growth_bytes": max(w["rss_anon_growth"] for rank in windows for w in rank),
        "model_state_bytes": max(states),
        "model_state_bytes_by_kind": windows[0][0]["states"],
        "formula_bytes": formula,
    }


def add_comparisons(rows: list[dict]) -> None:
    """Throughput against the dp-only row of the same ZeRO stage; the last loss against the first row's."""
    reference = rows[0]["losses"][-1]
    for row in rows:
        base = next((r for r in rows if r["pp"] == 1 and r["stage"] == row["stage"]), None)
        row["throughput_vs_dp"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["loss_delta"] = abs(row["losses"][-1] - reference)


def markdown_tables(rows: list[dict]) -> str:
    lines = [
        "| system | pp x dp | schedule | ZeRO | m | step ms, median (min–max) | tokens/s | × dp-only "
        "| idle in step | schedule bubble | theory | peak RssAnon growth MiB/rank | loss Δ |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['pp']} x {r['dp']} | {r['schedule'] or 'none (dp only)'} | {r['stage']} "
            f"| {r['microbatches'] or '–'} | {1e3 * r['step_median_s']:.0f} "
            f"({1e3 * r['step_min_s']:.0f}–{1e3 * r['step_max_s']:.0f}) | {r['tokens_per_s']:,.0f} "
            f"| {_fmt(r['throughput_vs_dp'], '{:.2f}×')} | {r['idle_in_step']:.2f} | {r['schedule_bubble']:.2f} "
            f"| {_fmt(r['theoretical_bubble'], '{:.2f}')} | {r['peak_rss_anon_growth_bytes'] / MIB:,.1f} "
            f"| {r['loss_delta']:.1e} |"
        )
    lines += [
        "",
        "Memory per pipeline rank (maximum over its data-parallel ranks and the rounds):",
        "",
        "| system | pp rank | stages | params | peak RssAnon MiB | RssAnon growth MiB | model states MiB "
        "| formula MiB | states ÷ formula | growth − states MiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for s in r["stages"]:
            stages = ", ".join(map(str, s["stage_ids"])) or "all"
            lines.append(
                f"| {r['name']} | {s['pp_rank']} | {stages} | {s['psi_local'] / 1e6:.2f}M "
                f"| {s['peak_rss_anon_bytes'] / MIB:,.1f} | {s['rss_anon_growth_bytes'] / MIB:,.1f} "
                f"| {s['model_state_bytes'] / MIB:.1f} | {s['formula_bytes'] / MIB:.1f} "
                f"| {s['model_state_bytes'] / s['formula_bytes']:.2f} "
                f"| {(s['rss_anon_growth_bytes'] - s['model_state_bytes']) / MIB:,.1f} |"
            )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else spec.format(value)


# -- the command ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--pp", default=None, help="pipeline sizes, comma-separated (default: 2 and 4, those that fit)")
    parser.add_argument("--stages", default="1,3", help="ZeRO stages to build rows for, before --systems filters")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help="names or patterns, e.g. 'pp2*-z1,dp4-z1'")
    parser.add_argument("--n-layer", type=int, default=8, help="blocks (pp=4 with two stages per rank needs 8)")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step over all dp ranks")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step on every pipeline")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"a smoke-sized run: {QUICK}")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default=None, help="output file stem (default: pipeline-parallel-ws<N>[-quick])")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    args = parse_args_with_quick(parser, argv, QUICK)
    if args.pp is None:
        args.pp = ",".join(str(p) for p in (2, 4) if p <= args.world_size and args.world_size % p == 0)
    return args


def check_batch(recipe: Recipe, chosen: list[Variant]) -> None:
    """Every system must split the global batch evenly over its dp ranks and, on a pipeline, its micro-batches."""
    for v in chosen:
        per_dp = recipe.global_batch // v.dp
        if recipe.global_batch % v.dp or (v.pp > 1 and per_dp % recipe.microbatches):
            raise SystemExit(
                f"--global-batch {recipe.global_batch} does not split over {v.name}'s dp={v.dp} ranks"
                + (f" and then into --microbatches {recipe.microbatches}" if v.pp > 1 else "")
            )
        stages = stage_count(v.pp, v.schedule) if v.schedule else 1
        if recipe.model.n_layer % stages or recipe.microbatches < stages and v.pp > 1:
            raise SystemExit(f"{v.name} has {stages} stages: --n-layer and --microbatches must be multiples of it")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pps = [int(p) for p in args.pp.split(",")]
    model = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    recipe = Recipe(
        model, global_batch=args.global_batch, microbatches=args.microbatches, warmup=args.warmup, steps=args.steps
    )
    chosen = variants(args.world_size, pps, [int(s) for s in args.stages.split(",")], args.systems)
    check_batch(recipe, chosen)
    print(f"{len(chosen)} systems x {args.rounds} rounds on {args.world_size} gloo ranks ...", flush=True)
    started, load_before = time.time(), os.getloadavg()
    outcome = launch_ranks(rank_main, args.world_size, recipe, chosen, args.rounds, timeout=args.timeout)
    if not outcome.ok:
        print(f"benchmark ranks failed: {outcome.error}", file=sys.stderr)
        return 1
    rows = [summarize(v, outcome.values, recipe) for v in chosen]
    add_comparisons(rows)
    name = args.name or f"pipeline-parallel-ws{args.world_size}{'-quick' if args.quick else ''}"
    command = "python benchmarks/pipeline_parallel.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    psi = unique_numel(GPT(model))
    title = (
        f"GPT {model.n_layer} blocks x {model.n_embd} ({psi / 1e6:.2f}M params), pipeline schedules with ZeRO vs "
        f"dp-only ZeRO, {args.world_size} gloo ranks, {recipe.global_batch}x{model.block_size} tokens per step, "
        f"{recipe.microbatches} micro-batches per pipeline, fp32 AdamW"
    )
    tables = markdown_tables(rows)
    seconds = time.time() - started
    header = (
        f"{title}\n\n`{command.strip()}` on {os.cpu_count()} cores, torch {torch.__version__}, load average "
        f"{load_before[0]:.1f} at start, {seconds:.0f} s; {recipe.warmup} warmup + {recipe.steps} timed steps "
        f"per system per round, {args.rounds} rounds"
    )
    print(f"\n{header}\n\n{tables}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(f"{header}\n\n{tables}\n")
    document = {
        "command": command.strip(),
        "title": title,
        "recipe": dataclasses.asdict(recipe),
        "world_size": args.world_size,
        "params": psi,
        "load_average_before": load_before,
        "seconds": seconds,
        "versions": {"torch": torch.__version__},
        "systems": rows,
    }
    (args.out_dir / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {args.out_dir}/{name}.{{md,json}} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
