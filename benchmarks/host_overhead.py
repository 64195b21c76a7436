"""Host overhead: a step's cost on models whose compute is negligible, so that a step is the framework's own work
plus the latency of its collectives, for DDP, FSDP2, DeepSpeed and ds_strategy's stages, interleaved in one run.

    python benchmarks/host_overhead.py                              # 2 gloo ranks on the host, all models
    python benchmarks/host_overhead.py --models blocks --rounds 2 --steps 40 --out benchmarks/results/host_overhead

Models (``MODELS``), each of many small units, where a per-unit or per-tensor cost shows:
  blocks  96 blocks of ``Linear(64, 64)`` + tanh (about 400k parameters): many small layers.
  lora    24 blocks of a frozen ``Linear(128, 128)`` with a rank-4 LoRA adapter (A and B trainable) and a trainable
          LayerNorm: many small trainable tensors beside frozen ones.
  moe     12 blocks of a router and 8 experts of ``Linear(32, 32)``, all experts computed and mixed by the softmax
          gate (dense, so every expert has a gradient): many small tensors per unit.

Systems (``SYSTEMS``), each as a user would configure it by default: DDP; FSDP2 with ``fully_shard`` on each block,
then the root; DeepSpeed ZeRO-2 and ZeRO-3 (its CPU accelerator, ``DS_ACCELERATOR=cpu``, its own defaults:
5e8-element buckets, persistence threshold 1e5); ds_strategy ``ZeroEngine`` at stages 1, 2 and 3, defaults. AdamW,
fp32, micro-batch 8. Each round builds every (model, system) in turn, runs ``--warmup`` steps and times
``--steps``; the table holds each system's median step over the rounds, its ratio to DDP's and, for ds_strategy, the
collectives per step by kind (``comm_stats(last_step=True)``). Rounds interleave the systems, so load on a shared
machine falls on all of them alike; compare ratios, not milliseconds.

Writes ``host_overhead.json``, ``host_overhead.md`` (the table in docs/performance/host-overhead.md) and, with
matplotlib, ``host_overhead.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MODELS = ("blocks", "lora", "moe")
SYSTEMS = ("ddp", "fsdp2", "deepspeed-zero2", "deepspeed-zero3", "zero1", "zero2", "zero3")
# on request (--systems): stage 3 with every parameter partitioned (persistence threshold 0), one gather per unit
OPTIONAL_SYSTEMS = ("zero3-partitioned",)
BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class LoraBlock(nn.Module):
    def __init__(self, width: int = 128, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(width, rank))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + torch.tanh(self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()))


class MoeBlock(nn.Module):
    def __init__(self, width: int = 32, experts: int = 8):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        gate = torch.softmax(self.router(x), dim=-1)
        mixed = sum(gate[:, i : i + 1] * torch.tanh(expert(x)) for i, expert in enumerate(self.experts))
        return x + mixed


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], width: int):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.width = width

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build_model(name: str) -> Stack:
    torch.manual_seed(0)
    if name == "blocks":
        return Stack([Block(64) for _ in range(96)], 64)
    if name == "lora":
        return Stack([LoraBlock(128) for _ in range(24)], 128)
    if name == "moe":
        return Stack([MoeBlock(32) for _ in range(12)], 32)
    raise ValueError(f"model {name!r} is not one of {MODELS}")


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def build_system(system: str, model: Stack):
    """(step function, collectives-per-step reader or None, teardown)."""
    if system == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = _optimizer(model)

        def step(x):
            ddp(x).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, None, lambda: None
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = _optimizer(model)

        def step(x):
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, None, lambda: None
    if system.startswith("deepspeed"):
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": int(system[-1])},
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)

        def step(x):
            engine.backward(engine(x))
            engine.step()

        return step, None, lambda: engine.destroy() if hasattr(engine, "destroy") else None
    from ds_strategy.config import ZeroConfig
    from ds_strategy.zero.engine import ZeroEngine

    options = {"param_persistence_threshold": 0} if system == "zero3-partitioned" else {}
    engine = ZeroEngine(model, _optimizer(model), ZeroConfig(stage=int(system[len("zero")]), **options))

    def step(x):
        engine.backward(model(x))
        engine.step()

    def calls():
        return {kind: v["calls"] for kind, v in engine.comm_stats(last_step=True).items() if v["calls"]}

    return step, calls, engine.remove_hooks


def measure(model_name: str, system: str, warmup: int, steps: int) -> dict:
    model = build_model(model_name)
    step, calls, close = build_system(system, model)
    x = torch.randn(BATCH, model.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(warmup):
        step(x)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    result = {"ms": 1e3 * statistics.median(times), "collectives": calls() if calls else None}
    close()
    return result


def one_rank_row(device: torch.device, steps: int = 20) -> tuple[bool, dict]:
    """The GPU suite's row: the blocks model on this process's one rank (its group already initialised), plain
    torch against ZeroEngine stages 2 and 3, step time with the device synchronised: what a step costs the host
    when the collectives are trivial, and that cost as a ratio to plain torch's."""
    from ds_strategy.config import ZeroConfig
    from ds_strategy.zero.engine import ZeroEngine

    figures = {}
    for system in ("torch", "zero2", "zero3"):
        model = build_model("blocks").to(device)
        optimizer = _optimizer(model)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=int(system[-1]))) if system != "torch" else None
        x = torch.randn(BATCH, model.width, device=device)
        times = []
        for index in range(3 + steps):
            start = time.perf_counter()
            if engine is None:
                model(x).backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                engine.backward(model(x))
                engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= 3:
                times.append(time.perf_counter() - start)
        figures[f"{system}_step_ms"] = 1e3 * statistics.median(times)
        if engine is not None:
            figures[f"{system}_collectives"] = sum(v["calls"] for v in engine.comm_stats(last_step=True).values())
            engine.remove_hooks()
    for system in ("zero2", "zero3"):
        figures[f"{system}_vs_torch"] = figures[f"{system}_step_ms"] / figures["torch_step_ms"]
    return True, figures


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = []
    for round_index in range(args.rounds):
        for model_name in args.models:
            for system in args.systems:
                try:
                    outcome = measure(model_name, system, args.warmup, args.steps)
                except Exception as error:  # a system that cannot run this model is reported, not fatal
                    outcome = {"ms": None, "error": f"{type(error).__name__}: {str(error)[:200]}"}
                results.append({"round": round_index, "model": model_name, "system": system, **outcome})
                if rank == 0:
                    print(json.dumps(results[-1]), flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_overhead.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def summarise(results: list[dict], models: list[str], systems: list[str]) -> list[dict]:
    """Per (model, system): the median over rounds of the per-round medians, and the ratio to DDP's."""
    rows = []
    for model in models:
        medians = {}
        for system in systems:
            runs = [r for r in results if r["model"] == model and r["system"] == system and r["ms"] is not None]
            if runs:
                medians[system] = (statistics.median(r["ms"] for r in runs), [r["ms"] for r in runs], runs[-1])
        ddp = medians.get("ddp", (None,))[0]
        for system in systems:
            if system not in medians:
                rows.append({"model": model, "system": system, "ms": None})
                continue
            ms, rounds, last = medians[system]
            rows.append(
                {
                    "model": model,
                    "system": system,
                    "ms": ms,
                    "rounds": rounds,
                    "vs_ddp": ms / ddp if ddp else None,
                    "collectives": last.get("collectives"),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | system | step ms (median; per round) | / DDP | collectives per step (ds_strategy) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if row["ms"] is None:
            lines.append(f"| {row['model']} | {row['system']} | did not run | | |")
            continue
        rounds = ", ".join(f"{ms:.1f}" for ms in row["rounds"])
        ratio = f"{row['vs_ddp']:.2f}" if row["vs_ddp"] is not None else ""
        calls = ", ".join(f"{kind} {n:g}" for kind, n in (row["collectives"] or {}).items())
        lines.append(f"| {row['model']} | {row['system']} | {row['ms']:.1f} ({rounds}) | {ratio} | {calls} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [
            next((r["vs_ddp"] or 0 for r in rows if r["model"] == m and r["system"] == system and r["ms"]), 0)
            for m in models
        ]
        ax.bar([j + i * width for j in range(len(models))], values, width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.set_ylabel("step time / DDP's")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + OPTIONAL_SYSTEMS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/host_overhead"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mp.spawn(rank_main, args=(args, args.port), nprocs=2)
    results = json.loads((args.out / "host_overhead.json").read_text())
    rows = summarise(results, args.models, args.systems)
    (args.out / "host_overhead.md").write_text(table(rows))
    plot(rows, args.out / "host_overhead.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
