"""The documentation's three charts, each drawn from a real run on CPU (gloo ranks), with the command under it.

    nice -n 10 python benchmarks/doc_charts.py loss           # docs/assets/loss-vs-ddp.png
    nice -n 10 python benchmarks/doc_charts.py memory         # docs/assets/memory-by-stage.png
    python benchmarks/doc_charts.py longest-sequence           # docs/assets/longest-sequence.png

``loss``: GPT ``tiny`` on 2 ranks, fp32, AdamW, the same seed and batches for every system (``runner.BatchSource``),
``--steps`` optimizer steps of DDP and of ZeRO stages 1-3 (``systems.build``, the benchmarks' own systems). Top: the
loss of each over the run; bottom: each ZeRO stage's distance from DDP's loss at every step. Parity is what the
tests assert (``tests/engine``); this is what a user sees of it over a run.

``memory``: GPT ``small`` (25.5M parameters) on 2 ranks, fp32 AdamW, ``--steps`` steps of DDP, ZeRO stages 0-3 and
the two CPU-offload presets, one after the other on the same 2 processes. A rank's memory is its peak anonymous
resident memory (``RssAnon`` of ``/proc/self/status``, sampled every half millisecond by ``PeakRssAnon``, with
``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so freed blocks leave) above what it held before the model was built: model
states, activations and communication buffers, what a rank really adds. Beside each bar, ``ds-strategy estimate``'s
model-state bytes for the same stage and offload (device + host: on a CPU run both are this RAM, which is why offload
moves bytes rather than saving them here; on a GPU the device part is what leaves the GPU).

``longest-sequence``: the longest sequence each configuration trains one step of within a per-rank memory cap, from
``benchmarks/results/long-context.json`` (written by ``benchmarks/long_context.py``, whose command the chart shows).

Each chart's footer holds the command that drew it; ``--out`` chooses the file, and the figures drawn go to
``benchmarks/results/doc-<chart>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from runner import BatchSource
from systems import SYSTEMS, Recipe, build

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "docs" / "assets"
RESULTS = Path(__file__).resolve().parent / "results"
MMAP_THRESHOLD = 1 << 20
LOSS_SYSTEMS = ("ddp", "zero1", "zero2", "zero3")
MEMORY_SYSTEMS = ("ddp", "zero0", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload")
SPECS = {spec.name: spec for spec in SYSTEMS}


def train(rank: int, world_size: int, names: tuple[str, ...], model: str, steps: int) -> dict:
    """Each system of ``names`` in turn on this rank: its mean loss per step over the ranks, this rank's peak
    ``RssAnon`` above the value before the build, and ``memory_report()``'s device/host bytes (ours only)."""
    from ds_strategy.models import gpt_config
    from ds_strategy.offload.host_memory import PeakRssAnon

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    recipe = Recipe(model=gpt_config(model), batch_size=4, seed=0)
    batches = BatchSource(recipe, steps, rank, world_size, recipe.seed)
    out = {}
    for name in names:
        gc.collect()  # the previous system's memory leaves before this one's baseline is read
        with PeakRssAnon() as peak:
            system = build(SPECS[name], recipe)
            losses = []
            for inputs, targets in batches.batches:
                losses.append(system.forward_backward(inputs, targets))
                system.optimizer_step()
            system.finish()
        report = system.engine.memory_report() if hasattr(system, "engine") else None
        system.close()
        del system
        mean = torch.stack(losses)
        dist.all_reduce(mean)
        out[name] = {
            "losses": (mean / world_size).tolist(),
            "peak_growth_bytes": peak.peak - peak.baseline,
            "states": None
            if report is None
            else {place: sum(kinds[place] for kinds in report.values()) for place in ("device", "host", "nvme")},
        }
    dist.destroy_process_group()
    return out


def run(names: tuple[str, ...], model: str, steps: int) -> dict[str, list[dict]]:
    """Per system, every rank's result, from one launch of 2 ranks that runs the systems in turn."""
    from ds_strategy.autotune.launcher import launch_ranks

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the ranks inherit it
    outcome = launch_ranks(train, 2, names, model, steps, timeout=3600, threads=1)
    if not outcome.ok:
        raise SystemExit(f"{names}: {outcome.error}")
    print(f"{', '.join(names)}: done in {outcome.seconds:.0f} s", flush=True)
    return {name: [values[name] for values in outcome.values] for name in names}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, command: str) -> None:
    fig.text(0.01, 0.015, f"$ {command}", fontsize=7, family="monospace", color="0.35")
    fig.savefig(out, dpi=110)
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")


def loss_chart(out: Path, steps: int, command: str) -> dict:
    results = run(LOSS_SYSTEMS, "tiny", steps)
    losses = {name: ranks[0]["losses"] for name, ranks in results.items()}
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for name, values in losses.items():
        top.plot(range(1, len(values) + 1), values, label=name, lw=1.2, ls="-" if name == "ddp" else "--")
    top.set_ylabel("training loss")
    top.set_title("GPT tiny, 2 gloo ranks, fp32 AdamW, the same batches: ZeRO stages against DDP", fontsize=10)
    top.legend()
    steps = range(1, len(losses["ddp"]) + 1)
    ulp = [
        float(torch.finfo(torch.float32).eps) * 2 ** torch.tensor(value).log2().floor().item()
        for value in losses["ddp"]
    ]
    bottom.semilogy(steps, ulp, color="0.6", lw=0.8, ls=":", label="one float32 step at DDP's loss")
    for offset, (name, values) in enumerate(item for item in losses.items() if item[0] != "ddp"):
        gaps = [max(abs(a - b), 1e-9) for a, b in zip(values, losses["ddp"])]
        bottom.semilogy([s + 0.2 * offset for s in steps], gaps, ".", ms=3, label=name)
    bottom.set_ylabel("|loss - DDP's|\n(0 drawn at 1e-9)")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _save(fig, out, command)
    return {"losses": losses}


def memory_chart(out: Path, steps: int, command: str) -> dict:
    from ds_strategy.estimate import estimate_memory, meta_model
    from ds_strategy.models import GPT, gpt_config

    results = run(MEMORY_SYSTEMS, "small", steps)
    model = meta_model(lambda: GPT(gpt_config("small")))
    measured = {name: max(rank["peak_growth_bytes"] for rank in ranks) / 2**20 for name, ranks in results.items()}
    estimated = {}
    for name in MEMORY_SYSTEMS:
        options = SPECS[name].options if SPECS[name].family == "ours" else {"stage": 0}
        row = estimate_memory(
            model,
            2,
            options["stage"],
            options.get("offload_optimizer", "none"),
            options.get("offload_params", "none"),
            "32-true",
        )
        estimated[name] = (row.device / 2**20, row.host / 2**20)
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(8, 4.5))
    x = range(len(MEMORY_SYSTEMS))
    axis.bar([i - 0.2 for i in x], [measured[n] for n in MEMORY_SYSTEMS], 0.4, label="measured: peak RssAnon growth")
    device = [estimated[n][0] for n in MEMORY_SYSTEMS]
    axis.bar([i + 0.2 for i in x], device, 0.4, label="estimate: model states, device")
    host = [estimated[n][1] for n in MEMORY_SYSTEMS]
    axis.bar([i + 0.2 for i in x], host, 0.4, bottom=device, label="estimate: model states, host (offload)")
    for i, name in enumerate(MEMORY_SYSTEMS):
        axis.annotate(f"{measured[name]:.0f}", (i - 0.2, measured[name]), ha="center", va="bottom", fontsize=8)
    axis.set_xticks(list(x), MEMORY_SYSTEMS)
    axis.set_ylabel("MiB per rank")
    axis.set_title("GPT small (25.5M parameters), 2 gloo ranks, fp32 AdamW: memory per rank", fontsize=10)
    axis.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _save(fig, out, command)
    return {"measured_mib": measured, "estimated_mib": estimated}


def _largest_tried(row: dict) -> bool:
    """Whether the row's length is the largest its run tried (``--max-length``): it fits, and more was not asked."""
    words = row["command"].split()
    return "--max-length" in words and int(words[words.index("--max-length") + 1]) == row["length"]


def longest_sequence_chart(out: Path, command: str) -> dict:
    report = json.loads((RESULTS / "long-context.json").read_text())
    rows = report["rows"]
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(8, 3.6))
    names = [f"{row['system']} ({row['ranks']} rank{'s' if row['ranks'] > 1 else ''})" for row in rows]
    lengths = [row["length"] for row in rows]
    axis.barh(names, lengths, color="tab:green")
    for index, row in enumerate(rows):
        label = f"{row['length']:,} tokens" + (" (the largest tried)" if _largest_tried(row) else "")
        axis.annotate(label, (row["length"], index), va="center", fontsize=8, xytext=(3, 0), textcoords="offset points")
    axis.invert_yaxis()
    axis.set_xlim(0, max(lengths) * 1.35)
    axis.set_xlabel("longest sequence that trains one step")
    cap = rows[0]["cap_bytes"] / 2**30
    axis.set_title(f"Llama 109.5M, bf16-mixed, {cap:.2f} GiB per rank, CPU: longest sequence", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.text(0.01, 0.06, f"$ {report['command'].split('  (')[0]}", fontsize=7, family="monospace", color="0.35")
    _save(fig, out, command)
    return {"lengths": dict(zip(names, lengths))}


CHARTS = {"loss": "loss-vs-ddp.png", "memory": "memory-by-stage.png", "longest-sequence": "longest-sequence.png"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chart", choices=tuple(CHARTS))
    parser.add_argument("--steps", type=int, help="optimizer steps (default: loss 200, memory 4)")
    parser.add_argument("--out", type=Path, help="the PNG (default docs/assets/<chart>.png)")
    args = parser.parse_args()
    out = args.out or ASSETS / CHARTS[args.chart]
    command = "python benchmarks/doc_charts.py " + args.chart + (f" --steps {args.steps}" if args.steps else "")
    if args.chart == "loss":
        figures = loss_chart(out, args.steps or 200, command)
    elif args.chart == "memory":
        figures = memory_chart(out, args.steps or 4, command)
    else:
        figures = longest_sequence_chart(out, command)
    numbers = RESULTS / f"doc-{args.chart}.json"
    numbers.write_text(json.dumps({"command": command, **figures}, indent=1) + "\n")
    print(f"wrote {numbers.relative_to(REPO)}")


if __name__ == "__main__":
    main()
