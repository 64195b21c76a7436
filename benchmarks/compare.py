"""Train one GPT under DDP, FSDP2, DeepSpeed and ds_strategy's ZeRO configurations, interleaved, and compare.

    python benchmarks/compare.py --model small --world-size 2 --steps 20
    python benchmarks/compare.py --quick                      # the tiny preset, a couple of minutes here
    python benchmarks/compare.py --systems 'ddp,fsdp2*,zero*'  # names or shell patterns from systems.SYSTEMS
    python benchmarks/compare.py --systems 'zero[123],zero[123]-nooverlap' --rounds 6 --steps 18  # overlap on/off

For each system: median and p25–p75 of step time (the slowest rank's), tokens/s, peak model-state bytes per
rank, peak RSS per rank, communication bytes per step per rank, ratios against DDP and FSDP2 of the same
precision, and the last-step loss difference from DDP; systems run with and without ``overlap_comm``
(``X``, ``X-nooverlap``) also get their per-round on/off step-time ratios. Writes ``<out-dir>/<name>.md``,
``.json`` and ``.png``.
How each figure is measured: ``runner.py`` (rounds, timing, memory), ``accounting.py`` (bytes, RSS) and
``systems.py`` (the systems). The chart needs matplotlib: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from quick_args import parse_args_with_quick
from report import add_ratios, markdown_table, overlap_pairs, overlap_table, summarize, write_chart, write_json
from runner import Settings, rank_main
from systems import SYSTEMS, SystemSpec

from ds_strategy.autotune.launcher import launch_ranks

RESULTS = Path(__file__).resolve().parent / "results"
QUICK = {"model": "tiny", "steps": 4, "rounds": 2, "warmup": 2, "batch_size": 4}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="GPT preset: tiny, small, medium (gpt- prefix allowed)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system, spread over the rounds")
    parser.add_argument("--rounds", type=int, default=4, help="round-robin passes over the systems")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps each time a system is built (>= 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--systems", default="*", help="comma-separated names or patterns (default: all)")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: cores / world size)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke-sized run: {QUICK}")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", help="output file stem (default: <model>-ws<N>[-quick])")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    parser.add_argument("--list", action="store_true", help="list the systems and exit")
    args = parse_args_with_quick(parser, argv, QUICK)
    args.model = args.model.removeprefix("gpt-")
    return args


def select_systems(patterns: str) -> tuple[list[SystemSpec], list[dict]]:
    """The systems matching ``patterns`` that can run here, and rows explaining the ones that cannot."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [spec for spec in SYSTEMS if any(fnmatch.fnmatch(spec.name, p) for p in wanted)]
    if not chosen:
        raise SystemExit(f"--systems {patterns!r} matches none of: {', '.join(s.name for s in SYSTEMS)}")
    reasons = {spec.name: spec.unavailable() for spec in chosen}
    skipped = [
        {
            "name": s.name,
            "family": s.family,
            "precision": s.precision,
            "options": dict(s.options),
            "status": "unavailable",
            "error": reasons[s.name],
        }
        for s in chosen
        if reasons[s.name]
    ]
    return [s for s in chosen if not reasons[s.name]], skipped


def machine() -> dict:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "versions": versions,
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for spec in SYSTEMS:
            reason = spec.unavailable()
            print(
                f"{spec.name:18} {spec.family:10} {spec.precision:11} {dict(spec.options)}"
                + (f"  [unavailable: {reason}]" if reason else "")
            )
        return 0
    specs, skipped = select_systems(args.systems)
    rounds = min(args.rounds, args.steps)
    settings = Settings(
        model=args.model,
        batch_size=args.batch_size,
        rounds=rounds,
        steps_per_round=-(-args.steps // rounds),
        warmup=args.warmup,
        collective_timeout_s=min(600.0, args.timeout),
    )
    from ds_strategy.models import gpt_config

    config = gpt_config(settings.model)
    tokens_per_step = args.world_size * settings.batch_size * config.block_size
    print(
        f"{len(specs)} systems x {settings.rounds} rounds x ({settings.warmup} warmup + "
        f"{settings.steps_per_round} timed) steps, GPT {settings.model!r}, {args.world_size} gloo ranks ...",
        flush=True,
    )
    started = time.time()
    load_before = os.getloadavg()
    outcome = launch_ranks(rank_main, args.world_size, settings, specs, timeout=args.timeout, threads=args.threads)
    if not outcome.ok:
        print(f"benchmark ranks failed: {outcome.error}", file=sys.stderr)
        return 1
    rows = [summarize(spec, outcome.values, tokens_per_step) for spec in specs] + skipped
    add_ratios(rows)
    name = args.name or f"{settings.model}-ws{args.world_size}{'-quick' if args.quick else ''}"
    command = "python benchmarks/compare.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    title = (
        f"GPT {settings.model} ({_param_count(config) / 1e6:.2f}M params), "
        f"{args.world_size} gloo ranks, batch {settings.batch_size}x{config.block_size} per rank"
    )
    table = markdown_table(rows)
    pairs = overlap_pairs(rows)
    if pairs:
        table += "\n\nOverlap (`overlap_comm`), paired within each round:\n\n" + overlap_table(pairs)
    print(f"\n{title}\n`{command}`\n\n{table}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    chart_note = write_chart(args.out_dir / f"{name}.png", rows, title)
    host = {**machine(), "load_average_before": load_before}
    write_json(
        args.out_dir / f"{name}.json",
        {
            "command": command,
            "title": title,
            "machine": host,
            "settings": dataclasses.asdict(settings),
            "world_size": args.world_size,
            "tokens_per_step": tokens_per_step,
            "seconds": time.time() - started,
            "systems": rows,
            "overlap_pairs": pairs,
            "chart": None if chart_note else f"{name}.png",
            "notes": [chart_note] if chart_note else [],
        },
    )
    (args.out_dir / f"{name}.md").write_text(
        f"{title}\n\n`{command}` on {host['cpu']} ({host['cores']} cores), torch {torch.__version__}, "
        f"load average {load_before[0]:.1f} at start\n\n{table}\n"
    )
    print(
        f"\nwrote {args.out_dir}/{name}.{{md,json}}"
        + ("" if chart_note else ", .png")
        + (f"; {chart_note}" if chart_note else "")
        + f" in {time.time() - started:.0f} s"
    )
    return 0


def _param_count(config) -> int:
    from ds_strategy.models import GPT

    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


if __name__ == "__main__":
    sys.exit(main())
