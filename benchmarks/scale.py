"""The largest model that trains here, per system: measure, fit bytes per parameter, predict, then run the prediction.

    python benchmarks/scale.py                                  # every system, our GPT and HF Llama, 3 sizes each
    python benchmarks/scale.py --systems zero3-nvme --models gpt --depths 2,8 --run-largest
    python benchmarks/scale.py --budget-gib 20 --nvme-path /work/nvme

For each system (DDP, FSDP2, DeepSpeed stage 3 where it runs on the CPU, and ours: stage 3, + CPU offload, + NVMe)
and model family (``ds_strategy.models.GPT``; Hugging Face ``LlamaForCausalLM`` from a config), a model of fixed
width and a few depths trains 2 optimizer steps on one repeated batch (1 x 64 tokens per rank) on fresh gloo ranks.
A size "trains" when both losses are finite and the second is below the first. Each rank samples its anonymous
RSS (``RssAnon`` in ``/proc/self/status``, every millisecond on a thread; ``ru_maxrss`` counts file-backed maps
too) from before the model is built to after the second step. A least-squares line through (parameters, peak)
gives the bytes per parameter per rank and the fixed cost; the largest trainable model for a budget (default: the
machine's memory, all ranks together) follows from it, and for NVMe also from the free disk at ``--nvme-path``
(20 bytes per parameter over all ranks: parameter, master, two Adam moments and gradient files, fp32). With
``--run-largest`` the predicted limit of each of our systems (at 90%) is then trained for real and reported with
its seconds per step and the disk bandwidth its step used. Writes ``results/scale.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ds_strategy.autotune.launcher import launch_ranks
from ds_strategy.host_memory import PeakRssAnon

RESULTS = Path(__file__).resolve().parent / "results"
OURS = {
    "zero3": {},
    "zero3-cpu": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "zero3-nvme": {"offload_optimizer": "nvme", "offload_params": "nvme", "buffer_size": 1 << 22},
}
SYSTEMS = ("ddp", "fsdp2", "ds-zero3", *OURS)
WIDTH, TOKENS, VOCAB = 1024, 64, 1024
NVME_DISK_BYTES_PER_PARAM = 20


def build_model(family: str, depth: int, meta: bool):
    """(model, loss_of(tokens)); ``meta``: built on the meta device, for ZeRO-3 to materialise unit by unit."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        if family == "gpt":
            from ds_strategy.models import GPT, GPTConfig

            model = GPT(GPTConfig(vocab_size=VOCAB, block_size=TOKENS, n_layer=depth, n_head=WIDTH // 64, n_embd=WIDTH))
            return model, lambda x: model(x, x)[1]
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=int(WIDTH * 2.75),
            num_hidden_layers=depth,
            num_attention_heads=WIDTH // 64,
            max_position_embeddings=TOKENS,
        )
        model = LlamaForCausalLM(config)
        return model, lambda x: model(input_ids=x, labels=x).loss


def build_system(system: str, family: str, depth: int, nvme_path: str):
    """(step(tokens) -> loss, trainable parameter count, close) for one system on this rank."""
    from ds_strategy.models import weight_decay_groups

    if system in OURS:
        from ds_strategy.config import ZeroConfig
        from ds_strategy.zero.engine import ZeroEngine

        model, loss_of = build_model(family, depth, meta=True)
        optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3, fused=True)
        options = {**OURS[system], **({"nvme_path": nvme_path} if "nvme" in system else {})}
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, **options))

        def step(x):
            loss = loss_of(x)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            return loss.item()

        return step, sum(fp.numel for fp in engine.flat_params), engine.remove_hooks
    model, loss_of = build_model(family, depth, meta=False)
    psi = sum(p.numel() for p in model.parameters())
    if system == "ds-zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 1.0,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": 3},
        }
        engine, *_ = deepspeed.initialize(
            model=model, config=config, optimizer=torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3)
        )

        def step(x):
            loss = engine(input_ids=x, labels=x).loss if family == "llama" else engine(x, x)[1]
            engine.backward(loss)
            engine.step()
            return loss.item()

        return step, psi, engine.destroy
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
        loss_fn = (lambda x: wrapped(input_ids=x, labels=x).loss) if family == "llama" else (lambda x: wrapped(x, x)[1])
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers if family == "llama" else model.blocks:
            fully_shard(block)
        fully_shard(model)
        loss_fn = loss_of
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3)

    def step(x):
        loss = loss_fn(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step, psi, lambda: None


def measure_rank(rank: int, world_size: int, system: str, family: str, depth: int, nvme_path: str) -> dict:
    """Train 2 steps on one repeated batch; peak RssAnon from before the build to after the second step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    sampler = PeakRssAnon().start()
    started = time.perf_counter()
    step, psi, close = build_system(system, family, depth, nvme_path)
    built = time.perf_counter()
    x = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(rank))
    losses, times, io = [], [], []
    for _ in range(2):
        io_before, t0 = _disk_bytes(), time.perf_counter()
        losses.append(step(x))
        times.append(time.perf_counter() - t0)
        io.append(_disk_bytes() - io_before)
    peak = sampler.stop()
    close()
    dist.destroy_process_group()
    return {
        "peak": peak,
        "psi": psi,
        "losses": losses,
        "build_s": built - started,
        "step_s": times[-1],
        "disk_bytes": io[-1],
    }


def _disk_bytes() -> int:
    """Bytes this process read from and wrote to storage (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


def measure(system: str, family: str, depth: int, world_size: int, nvme_path: str, timeout: float) -> dict:
    outcome = launch_ranks(measure_rank, world_size, system, family, depth, nvme_path, timeout=timeout)
    row = {"system": system, "model": family, "depth": depth}
    if not outcome.ok:
        return {**row, "error": str(outcome.error).strip().splitlines()[-1][:200]}
    ranks = outcome.values
    losses = ranks[0]["losses"]
    return {
        **row,
        "params": ranks[0]["psi"],
        "peak_per_rank": max(r["peak"] for r in ranks),
        "trains": all(math.isfinite(v) for v in losses) and losses[1] < losses[0],
        "losses": losses,
        "build_s": max(r["build_s"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "disk_mb_per_s": sum(r["disk_bytes"] for r in ranks) / max(r["step_s"] for r in ranks) / 1e6,
    }


def fit(rows: list[dict]) -> tuple[float, float] | None:
    """(fixed bytes, bytes per parameter) per rank: least squares through the sizes that trained."""
    points = [(r["params"], r["peak_per_rank"]) for r in rows if r.get("trains")]
    if len({p for p, _ in points}) < 2:
        return None
    n, sx, sy = len(points), sum(p for p, _ in points), sum(m for _, m in points)
    sxx, sxy = sum(p * p for p, _ in points), sum(p * m for p, m in points)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - slope * sx) / n, slope


def predict(line: tuple[float, float], budget: int, world_size: int, system: str, free_disk: int) -> dict:
    fixed, slope = line
    by_memory = (budget / world_size - fixed) / slope if slope > 0 else math.inf
    by_disk = free_disk / NVME_DISK_BYTES_PER_PARAM if "nvme" in system else math.inf
    return {
        "bytes_per_param_per_rank": slope,
        "fixed_bytes_per_rank": fixed,
        "limit_by_memory": by_memory,
        "limit_by_disk": by_disk,
        "limit": min(by_memory, by_disk),
        "bound": "disk" if by_disk < by_memory else "memory",
    }


def depth_for(family: str, params: float) -> int:
    """The depth whose model has about ``params`` parameters at this width."""
    per_block = 12 * WIDTH * WIDTH if family == "gpt" else 4 * WIDTH * WIDTH + 3 * WIDTH * int(WIDTH * 2.75)
    return max(1, int((params - 2 * VOCAB * WIDTH) // per_block))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {SYSTEMS}")
    parser.add_argument("--models", default="gpt,llama", help="gpt, llama or both")
    parser.add_argument("--depths", default="2,4,8", help="depths measured (width 1024: ~12.6M params a block)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=None, help="memory budget, all ranks (default: MemTotal)")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--run-largest", action="store_true", help="then train each of our predicted limits")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement")
    parser.add_argument("--name", default="scale")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = int(args.budget_gib * 2**30) if args.budget_gib else machine
    free_disk = shutil.disk_usage(args.nvme_path).free
    rows, fits = [], {}
    for family in args.models.split(","):
        for system in args.systems.split(","):
            measured = []
            for depth in map(int, args.depths.split(",")):
                measured.append(measure(system, family, depth, args.world_size, args.nvme_path, args.timeout))
                print(json.dumps(measured[-1]), flush=True)
            rows += measured
            line = fit(measured)
            if line is not None:
                fits[f"{system}/{family}"] = predict(line, budget, args.world_size, system, free_disk)
                if args.run_largest and system in OURS:
                    depth = depth_for(family, 0.9 * fits[f"{system}/{family}"]["limit"])
                    largest = measure(system, family, depth, args.world_size, args.nvme_path, args.timeout)
                    rows.append({**largest, "predicted_largest": True})
                    print(json.dumps(rows[-1]), flush=True)
    command = "python benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.name, command, rows, fits, budget, free_disk, args.world_size)
    return 0


def write_results(
    name: str, command: str, rows: list[dict], fits: dict, budget: int, free_disk: int, world_size: int
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [
        f"`{command}`: {world_size} gloo ranks, {os.cpu_count()} cores, budget {budget / 2**30:.1f} GiB, "
        f"free disk {free_disk / 1e9:.0f} GB, batch 1x{TOKENS} tokens per rank, width {WIDTH}",
        "",
        "| system | model | params | peak RssAnon / rank | trains | s/step | disk MB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['model']} | depth {r['depth']} | failed: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['system']}{' (predicted largest)' if r.get('predicted_largest') else ''} | {r['model']} | "
            f"{r['params'] / 1e6:,.0f}M | {r['peak_per_rank'] / 2**30:.2f} GiB | "
            f"{'yes' if r['trains'] else 'no'} "
            f"| {r['step_s']:.1f} | {r['disk_mb_per_s']:.0f} |"
        )
    lines += [
        "",
        "| system/model | B/param/rank | fixed / rank | largest by memory | by disk | limit |",
        "|---|---|---|---|---|---|",
    ]
    for key, f in fits.items():
        lines.append(
            f"| {key} | {f['bytes_per_param_per_rank']:.2f} | {f['fixed_bytes_per_rank'] / 2**30:.2f} GiB | "
            f"{_billions(f['limit_by_memory'])} | {_billions(f['limit_by_disk'])} | {_billions(f['limit'])} "
            f"({f['bound']}) |"
        )
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{name}.json").write_text(
        json.dumps(
            {"command": command, "rows": rows, "fits": fits, "budget": budget, "free_disk": free_disk},
            indent=1,
            default=str,
        )
    )
    _plot(RESULTS / f"{name}.png", rows)
    print("\n".join(lines))


def _billions(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value / 1e9:.2f}B"


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["system"], r["model"]) for r in rows if "error" not in r):
        points = sorted(
            (r["params"], r["peak_per_rank"]) for r in rows if "error" not in r and (r["system"], r["model"]) == key
        )
        axes.plot([p / 1e6 for p, _ in points], [m / 2**30 for _, m in points], marker="o", label="/".join(key))
    axes.set_xlabel("parameters (M)")
    axes.set_ylabel("peak RssAnon per rank (GiB)")
    axes.set_xscale("log")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
