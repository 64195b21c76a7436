"""Expert parallelism with ZeRO-3 against ZeRO-3 alone, on one mixture-of-experts model, in one run.

    python benchmarks/moe_expert_parallel.py                 # 4 gloo ranks: ep = 1 (ZeRO-3 alone), 2, 4
    python benchmarks/moe_expert_parallel.py --quick         # the tiny model, one timed step: a smoke run
    python benchmarks/moe_expert_parallel.py --experts 16 --hidden 128 --steps 5

A Qwen3-MoE from a config (``--experts`` experts per layer, top-2, every layer sparse) is trained by
``compose.compose_model`` at stage 3 on every rank's own batch, with ``expert_parallel_size`` 1, 2 and 4. Per
setting: the slowest rank's median step time; model-state bytes per rank (``memory_report``, shards of every kind)
and at the working set's peak (``memory_report(peak=True)``: the gathered stage-3 units beside the shards, where
expert parallelism shows: a layer gathers only the experts this rank holds, ``1/ep`` of them); the elements of this
rank's experts stage 3 gathers per step; and the bytes moved per step by kind (all-to-all: the token exchange).
Every setting trains the same model on the same batches, so the last loss is shown against the first setting's.
Writes ``results/<name>.{md,json}``.

What a GPU run would add (``gpu_suite.py``): the same table on NCCL, where the all-to-alls overlap nothing yet and
their cost against the saved all-gathers is the figure that matters, at 16-64 experts and hidden 1-4k.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from quick_args import parse_args_with_quick

from ds_strategy.autotune.launcher import launch_ranks
from ds_strategy.compose import build_mesh, compose_model
from ds_strategy.config import ZeroConfig
from ds_strategy.parallel.moe_layers import find_experts_containers

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
QUICK = {"hidden": 32, "experts": 8, "layers": 2, "steps": 1}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # spread the tokens over the experts as a trained router does
    return model


def _setting(rank: int, world_size: int, args: argparse.Namespace, ep: int) -> dict:
    config = ZeroConfig(stage=3, expert_parallel_size=ep)
    model = _model(args)
    experts = sum(p.numel() for _, m in find_experts_containers(model) for p in m.parameters()) // ep
    engine = compose_model(
        model,
        config,
        mesh=build_mesh(config, "cpu"),
        device=torch.device("cpu"),
        log=lambda message: None,
        optimizers=lambda: [torch.optim.AdamW(model.parameters(), lr=1e-3)],
    ).engine
    generator = torch.Generator().manual_seed(rank)
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            engine.working_set.reset()
            before = engine.comm_stats()
        ids = torch.randint(0, 256, (args.batch, args.seq), generator=generator)
        dist.barrier()
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - started)
    after = engine.comm_stats()
    moved = {kind: (after[kind]["bytes"] - before[kind]["bytes"]) / args.steps for kind in after}
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    engine.remove_hooks()
    return {
        "step_s": statistics.median(times[args.warmup :]),
        "state_mib": sum(sum(v.values()) for v in engine.memory_report().values()) / MIB,
        "peak_mib": sum(sum(v.values()) for v in engine.memory_report(peak=True).values()) / MIB,
        "expert_gather_elements": 2 * experts,  # every layer's, gathered for forward and again for backward
        "bytes_per_step": moved,
        "loss": loss.item() / world_size,
    }


def rank_main(rank: int, world_size: int, args: argparse.Namespace, eps: list[int]) -> dict:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    return {ep: _setting(rank, world_size, args, ep) for ep in eps}


def _row(ep: int, values: list[dict], first_loss: float) -> dict:
    mine = [v[ep] for v in values]
    kinds = sorted({k for m in mine for k in m["bytes_per_step"]})
    return {
        "system": "zero3" if ep == 1 else f"zero3 + ep{ep}",
        "step_s": max(m["step_s"] for m in mine),
        "state_mib": max(m["state_mib"] for m in mine),
        "peak_mib": max(m["peak_mib"] for m in mine),
        "expert_gather_elements": max(m["expert_gather_elements"] for m in mine),
        "mib_per_step": {k: max(m["bytes_per_step"].get(k, 0) for m in mine) / MIB for k in kinds},
        "loss": mine[0]["loss"],
        "loss_vs_first": mine[0]["loss"] - first_loss,
    }


def _table(rows: list[dict]) -> str:
    kinds = sorted({k for row in rows for k, v in row["mib_per_step"].items() if v})
    head = ["system", "step (s)", "states/rank (MiB)", "peak/rank (MiB)", "expert elements gathered/step"]
    head += [f"{k} MiB/step" for k in kinds] + ["loss - first"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["system"], f"{r['step_s']:.3f}", f"{r['state_mib']:.2f}", f"{r['peak_mib']:.2f}"]
        cells += [f"{r['expert_gather_elements']:,}"] + [f"{r['mib_per_step'].get(k, 0):.2f}" for k in kinds]
        cells += [f"{r['loss_vs_first']:+.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ep", default="1,2,4", help="expert-parallel sizes, comma-separated (1: ZeRO-3 alone)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--quick", action="store_true", help="the tiny model, one timed step")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parse_args_with_quick(parser, argv, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    eps = [int(ep) for ep in args.ep.split(",")]
    started, load_before = time.time(), os.getloadavg()
    outcome = launch_ranks(rank_main, args.world_size, args, eps, timeout=args.timeout)
    if not outcome.ok:
        print(f"benchmark ranks failed: {outcome.error}", file=sys.stderr)
        return 1
    first = outcome.values[0][eps[0]]["loss"]
    rows = [_row(ep, outcome.values, first) for ep in eps]
    command = "python benchmarks/moe_expert_parallel.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    title = (
        f"Qwen3-MoE {args.layers} layers x {args.hidden}, {args.experts} experts top-2, ZeRO stage 3 with and "
        f"without expert parallelism, {args.world_size} gloo ranks, {args.batch}x{args.seq} tokens per rank per "
        f"step, fp32 AdamW"
    )
    header = (
        f"{title}\n\n`{command}` on {os.cpu_count()} cores, torch {torch.__version__}, load average "
        f"{load_before[0]:.1f} at start, {time.time() - started:.0f} s"
    )
    table = _table(rows)
    print(f"\n{header}\n\n{table}")
    name = args.name or f"moe-expert-parallel-ws{args.world_size}{'-quick' if args.quick else ''}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(f"{header}\n\n{table}\n")
    document = {"command": command, "title": title, "args": vars(args) | {"out_dir": str(args.out_dir)}, "rows": rows}
    (args.out_dir / f"{name}.json").write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
