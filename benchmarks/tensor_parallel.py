"""Tensor parallelism with ZeRO against Lightning's ModelParallelStrategy (FSDP2 + TP), on one GPT, in one run.

    python benchmarks/tensor_parallel.py                       # 4 gloo ranks: dp=4, tp=2 x dp=2, tp=4
    python benchmarks/tensor_parallel.py --quick               # the tiny GPT, one timed step: a smoke run
    python benchmarks/tensor_parallel.py --tp 2 --stage 2 --rounds 3 --steps 3

For every mesh (dp x tp over the same ranks) each system trains the same GPT from the same seed on the same global
batches (each data-parallel rank takes its slice; the ranks of a tensor-parallel group read the same slice), with
and without activation checkpointing of the blocks:

  zero       the auto plan (``auto_plan.tensor_parallel_plan``) applied over the mesh's tensor-parallel dimension,
             then ``compose.compose_model`` with the ``ParallelMesh``: ``ZeroConfig.activation_checkpointing``
             ("full", and with ``partition_activations`` over the tensor-parallel group where tp > 1), then
             ``ZeroEngine`` over the data-parallel group. ``cpu_checkpointing`` is not measured: on a CPU device
             the kept inputs are already in host memory and it does nothing.
  lightning  ``lightning.pytorch.strategies.ModelParallelStrategy``; ``configure_model`` does what Lightning's
             example (``examples/pytorch/tensor_parallel/parallelism.py``) does: ``parallelize_module`` with the
             same plan, torch's ``checkpoint_wrapper`` on every block when checkpointing, then ``fully_shard`` per
             block (the last one not resharded after forward) and the root over the data-parallel mesh, only when
             it has more than one rank. Its step runs in Lightning's loop (automatic optimization); the time is
             taken from ``on_train_batch_start`` to ``on_train_batch_end``, so data loading is left out.

Both use AdamW over the same parameter groups and no gradient clipping. Per system: step time (the slowest rank's,
median over every timed step), peak anonymous RSS per rank (``RssAnon`` of ``/proc/self/status`` sampled on a
thread from before the model is built to the last step, and its growth over the value at the start), model-state
bytes per rank after the last warmup step's optimizer step, set against the formula (the stage's fp32-Adam bytes per
parameter over dp, for this rank's tensor-parallel share of the parameters: ``Psi_tp / tp + Psi_replicated``), and
the last step's loss against the first system's (every system trains the same model). Writes
``results/<name>.{md,json}``.

Note: [Why systems are interleaved and rebuilt]
    As in ``runner.py``: a round runs every system once, in an order rotated by one per round, so a slow spell of a
    shared machine falls on all of them; each is built from the seed, trained, and freed (then ``malloc_trim``), so
    one system's states are alive at a time and its peak is its own. Lightning's Trainer reuses the process group
    the ranks start with; every system sees the same ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import gc
import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from accounting import optimizer_state_tensors, release_free_memory, storage_bytes
from lightning.pytorch.strategies import ModelParallelStrategy
from quick_args import parse_args_with_quick
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from ds_strategy.autotune.launcher import launch_ranks
from ds_strategy.compose import compose_model
from ds_strategy.compose.activation_checkpointing import remove_activation_checkpointing
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig, weight_decay_groups
from ds_strategy.offload.host_memory import PeakRssAnon, rss_anon_bytes
from ds_strategy.parallel.auto_plan import apply_tensor_parallel_plan, tensor_parallel_plan
from ds_strategy.parallel.mesh import build_parallel_mesh

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
FAMILIES = ("zero", "lightning")
STATE_KINDS = ("params", "grads", "optimizer")
QUICK = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq": 32, "steps": 1, "rounds": 1}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One system on one mesh: who shards (``family``), the tensor-parallel size, and what checkpointing keeps."""

    family: str
    tp: int
    checkpointing: str = "none"
    partition_activations: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"Variant.family={self.family!r} is not one of {FAMILIES}")
        if self.checkpointing not in ("none", "full"):
            raise ValueError(f"Variant.checkpointing={self.checkpointing!r} is not 'none' or 'full'")
        if self.partition_activations and (self.family != "zero" or self.tp == 1 or self.checkpointing == "none"):
            raise ValueError("Variant.partition_activations needs family='zero', tp > 1 and checkpointing='full'")

    @property
    def name(self) -> str:
        ac = {"none": "", "full": "+ac"}[self.checkpointing] + ("+partition" if self.partition_activations else "")
        return f"{self.family}-tp{self.tp}{ac}"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every system trains with; ``global_batch`` sequences per step, split over the data-parallel ranks."""

    model: GPTConfig
    stage: int = 3
    global_batch: int = 4
    warmup: int = 2
    steps: int = 3
    seed: int = 0
    lr: float = 3e-4

    def __post_init__(self) -> None:
        if self.warmup < 2:
            raise ValueError(f"Recipe.warmup={self.warmup} must be >= 2: states are sampled after the first step")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Recipe.stage={self.stage} is not one of 0, 1, 2, 3")


def variants(world_size: int, tps: list[int], patterns: str = "*") -> list[Variant]:
    """For each tensor-parallel size: ours and Lightning's, each without and with checkpointing (and ours
    partitioning the checkpointed inputs over the tensor-parallel group where there is one); those whose names
    match one of the comma-separated ``patterns``."""
    out = []
    for tp in tps:
        if world_size % tp:
            raise SystemExit(f"--tp {tp} does not divide the world size {world_size}")
        out += [Variant("zero", tp), Variant("zero", tp, "full")]
        out += [Variant("zero", tp, "full", partition_activations=True)] if tp > 1 else []
        out += [Variant("lightning", tp), Variant("lightning", tp, "full")]
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [v for v in out if any(fnmatch.fnmatch(v.name, p) for p in wanted)]
    if not chosen:
        raise SystemExit(f"--systems {patterns!r} matches none of: {', '.join(v.name for v in out)}")
    return chosen


def stage_bytes_per_param(stage: int, dp: int) -> float:
    """fp32 parameters and gradients (4 + 4 bytes) and Adam's two moments (8), as the ZeRO paper shards them."""
    return {0: 16.0, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[stage]


def local_numel(model: nn.Module) -> int:
    """Elements of this rank's tensor-parallel share: a DTensor parameter's local shard, any other whole."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in unique)


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


def _seeded_gpt(recipe: Recipe) -> GPT:
    torch.manual_seed(recipe.seed)
    return GPT(recipe.model)


def _adamw(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    return torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)


# -- the systems ------------------------------------------------------------------------------------------------
def train_zero(variant: Variant, recipe: Recipe, batches: list, mesh) -> dict:
    """The plan, checkpointing and engine in ``compose_model``'s order; ``batches`` are this rank's slices."""
    model = _seeded_gpt(recipe)
    if variant.tp > 1:  # before the optimizer, which must hold the DTensor parameters
        apply_tensor_parallel_plan(model, mesh.tp_mesh, tensor_parallel_plan(model, variant.tp))
    psi_local = local_numel(model)
    config = ZeroConfig(
        stage=recipe.stage,
        activation_checkpointing=variant.checkpointing,
        partition_activations=variant.partition_activations,
    )
    engine = compose_model(
        model, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=[_adamw(model, recipe)]
    ).engine
    losses, seconds, states = [], [], {}
    try:
        for i, (x, y) in enumerate(batches):
            start = time.perf_counter()
            _, loss = model(x, y)
            engine.backward(loss)
            engine.step()
            if i == len(batches) - 1:
                engine.wait_for_params()
            seconds.append(time.perf_counter() - start)
            losses.append(loss.detach())
            if i == recipe.warmup - 1:
                report = engine.memory_report()
                states = {kind: report[kind]["device"] + report[kind]["host"] for kind in STATE_KINDS}
    finally:
        engine.remove_hooks()
        remove_activation_checkpointing(model)
    return {"seconds": seconds[recipe.warmup :], "losses": losses, "states": states, "psi_local": psi_local}


def train_lightning(variant: Variant, recipe: Recipe, batches: list, _mesh) -> dict:
    """``ModelParallelStrategy`` in a Trainer on the ranks already started; step time from batch start to end."""
    module = LightningGPT(variant, recipe)
    dp = dist.get_world_size() // variant.tp
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=variant.tp),
        max_steps=len(batches),
        use_distributed_sampler=False,  # ``batches`` are this rank's slices already
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    out = {"seconds": module.seconds[recipe.warmup :], "losses": module.losses, "states": module.states}
    return {**out, "psi_local": module.psi_local}


class LightningGPT(L.LightningModule):
    """Our GPT as a Lightning user of ModelParallelStrategy would set it up (Lightning's TP example)."""

    def __init__(self, variant: Variant, recipe: Recipe):
        super().__init__()
        self.variant, self.recipe = variant, recipe
        self.losses, self.seconds, self.states = [], [], {}

    def configure_model(self):
        # Order as in Lightning's example and torchtitan: TP, then checkpointing, then FSDP (which must see
        # the wrapped blocks as its units).
        model = _seeded_gpt(self.recipe)
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp_mesh.size() > 1:
            parallelize_module(model, tp_mesh, tensor_parallel_plan(model, tp_mesh.size()))
        self.psi_local = local_numel(model)
        if self.variant.checkpointing == "full":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpoint_wrapper(block)
        if dp_mesh.size() > 1:
            for i, block in enumerate(model.blocks):
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=i < len(model.blocks) - 1)
            fully_shard(model, mesh=dp_mesh)
        self.model = model

    def configure_optimizers(self):
        return _adamw(self.model, self.recipe)

    def training_step(self, batch, batch_idx):
        _, loss = self.model(*batch)
        self.losses.append(loss.detach())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self._start)
        if batch_idx == self.recipe.warmup - 1:
            seen: set[int] = set()
            params = list(self.model.parameters())
            self.states = {
                "params": storage_bytes(params, seen),
                "grads": storage_bytes((p.grad for p in params), seen),
                "optimizer": storage_bytes(optimizer_state_tensors(self.trainer.optimizers[0]), seen),
            }


TRAINERS = {"zero": train_zero, "lightning": train_lightning}


# -- one rank ---------------------------------------------------------------------------------------------------
def rank_main(rank: int, world_size: int, recipe: Recipe, chosen: list[Variant], rounds: int) -> dict:
    """Every round on this rank (see Note: [Why systems are interleaved and rebuilt]); per variant, its windows."""
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("lightning")]:
        logging.getLogger(name).setLevel(logging.WARNING)  # Lightning's per-fit banners, on every rebuild
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    meshes = {tp: build_parallel_mesh("cpu", tp) for tp in sorted({v.tp for v in chosen})}
    batches = global_batches(recipe)
    windows: dict[str, list[dict]] = {v.name: [] for v in chosen}
    for round_index in range(rounds):
        shift = round_index % len(chosen)
        for variant in chosen[shift:] + chosen[:shift]:
            dp = world_size // variant.tp
            mine = my_slice(batches, rank // variant.tp, dp)  # consecutive ranks form a tensor-parallel group
            gc.collect()
            release_free_memory()
            sampler = PeakRssAnon(interval_s=0.002).start()
            window = TRAINERS[variant.family](variant, recipe, mine, meshes[variant.tp])
            peak = sampler.stop()
            losses = torch.stack(window.pop("losses"))
            dist.all_reduce(losses)
            window.update(
                losses=(losses / world_size).tolist(),
                peak_rss_anon=peak,
                rss_anon_growth=sampler.growth,
                round=round_index,
            )
            windows[variant.name].append(window)
            if rank == 0:
                print(f"round {round_index}: {variant.name} {sum(window['seconds']):.1f} s timed", flush=True)
            del window
    dist.destroy_process_group()
    return {"windows": windows, "rss_anon_at_end": rss_anon_bytes()}


# -- rows and the table -----------------------------------------------------------------------------------------
def summarize(variant: Variant, per_rank: list[dict], recipe: Recipe, world_size: int) -> dict:
    """One row: step statistics over every timed step (slowest rank each), memory maxima over ranks and rounds."""
    windows = [rank["windows"][variant.name] for rank in per_rank]
    steps = [max(t) for rounds in zip(*windows) for t in zip(*(w["seconds"] for w in rounds))]
    dp = world_size // variant.tp
    states = [sum(w["states"].values()) for rank in windows for w in rank]
    psi_local = max(w["psi_local"] for rank in windows for w in rank)
    formula = stage_bytes_per_param(recipe.stage if variant.family == "zero" else 3, dp) * psi_local
    return {
        "name": variant.name,
        **dataclasses.asdict(variant),
        "dp": dp,
        "step_seconds": steps,
        "step_median_s": statistics.median(steps),
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "tokens_per_s": recipe.global_batch * recipe.model.block_size / statistics.median(steps),
        "peak_rss_anon_bytes": max(w["peak_rss_anon"] for rank in windows for w in rank),
        "rss_anon_growth_bytes": max(w["rss_anon_growth"] for rank in windows for w in rank),
        "model_state_bytes": max(states),
        "model_state_bytes_by_kind": windows[0][0]["states"],
        "psi_local": psi_local,
        "formula_bytes": formula,
        "losses": windows[0][0]["losses"],
    }


def add_comparisons(rows: list[dict]) -> None:
    """Step time against Lightning's on the same mesh without checkpointing; loss against the first row's."""
    reference = rows[0]["losses"][-1]
    for row in rows:
        peer = next((r for r in rows if r["name"] == Variant("lightning", row["tp"]).name), None)
        row["step_vs_lightning"] = row["step_median_s"] / peer["step_median_s"] if peer else None
        row["loss_delta"] = abs(row["losses"][-1] - reference)


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| system | dp x tp | checkpointing | step ms, median (min–max) | tokens/s | step × Lightning tp, no AC "
        "| peak RssAnon MiB/rank | RssAnon growth MiB/rank | model states MiB/rank | formula MiB | states ÷ formula "
        "| loss Δ |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ac = r["checkpointing"] + (" + partition" if r["partition_activations"] else "")
        lines.append(
            f"| {r['family']} | {r['dp']} x {r['tp']} | {ac} | {1e3 * r['step_median_s']:.1f} "
            f"({1e3 * r['step_min_s']:.1f}–{1e3 * r['step_max_s']:.1f}) | {r['tokens_per_s']:,.0f} "
            f"| {_ratio(r['step_vs_lightning'])} | {r['peak_rss_anon_bytes'] / MIB:,.0f} "
            f"| {r['rss_anon_growth_bytes'] / MIB:,.0f} | {r['model_state_bytes'] / MIB:.1f} "
            f"| {r['formula_bytes'] / MIB:.1f} | {r['model_state_bytes'] / r['formula_bytes']:.2f} "
            f"| {r['loss_delta']:.1e} |"
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


# -- the command ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes, comma-separated (dp = world / tp)")
    parser.add_argument("--systems", default="*", help="names or patterns, e.g. 'zero-tp2*,lightning-tp2'")
    parser.add_argument("--stage", type=int, default=3, help="our ZeRO stage (Lightning's FSDP2 is stage 3)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all dp ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help=f"a smoke-sized run: {QUICK}")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default=None, help="output file stem (default: tensor-parallel-ws<N>[-quick])")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    return parse_args_with_quick(parser, argv, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tps = [int(tp) for tp in args.tp.split(",")]
    model = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    recipe = Recipe(model, stage=args.stage, global_batch=args.global_batch, warmup=args.warmup, steps=args.steps)
    chosen = variants(args.world_size, tps, args.systems)
    if recipe.global_batch % args.world_size:
        raise SystemExit(f"--global-batch {recipe.global_batch} must split over dp={args.world_size} ranks")
    print(f"{len(chosen)} systems x {args.rounds} rounds on {args.world_size} gloo ranks ...", flush=True)
    started, load_before = time.time(), os.getloadavg()
    outcome = launch_ranks(rank_main, args.world_size, recipe, chosen, args.rounds, timeout=args.timeout)
    if not outcome.ok:
        print(f"benchmark ranks failed: {outcome.error}", file=sys.stderr)
        return 1
    rows = [summarize(v, outcome.values, recipe, args.world_size) for v in chosen]
    add_comparisons(rows)
    name = args.name or f"tensor-parallel-ws{args.world_size}{'-quick' if args.quick else ''}"
    command = "python benchmarks/tensor_parallel.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    psi = sum(p.numel() for p in {id(p): p for p in GPT(model).parameters()}.values())
    title = (
        f"GPT {model.n_layer} layers x {model.n_embd} ({psi / 1e6:.2f}M params), ZeRO stage {recipe.stage} vs "
        f"Lightning ModelParallelStrategy, {args.world_size} gloo ranks, {recipe.global_batch}x{model.block_size} "
        f"tokens per step over the data-parallel ranks, fp32 AdamW"
    )
    table = markdown_table(rows)
    seconds = time.time() - started
    header = (
        f"{title}\n\n`{command}` on {os.cpu_count()} cores, torch {torch.__version__}, load average "
        f"{load_before[0]:.1f} at start, {seconds:.0f} s"
    )
    print(f"\n{header}\n\n{table}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(f"{header}\n\n{table}\n")
    document = {
        "command": command,
        "title": title,
        "recipe": dataclasses.asdict(recipe),
        "world_size": args.world_size,
        "params": psi,
        "load_average_before": load_before,
        "seconds": seconds,
        "versions": {"torch": torch.__version__, "lightning": _lightning_version()},
        "systems": rows,
    }
    (args.out_dir / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {args.out_dir}/{name}.{{md,json}} in {seconds:.0f} s")
    return 0


def _lightning_version() -> str:
    import lightning

    return lightning.__version__


if __name__ == "__main__":
    sys.exit(main())
