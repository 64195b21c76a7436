"""How large a model trains here, per system, and what loading a pretrained one costs each rank.

    python benchmarks/scale.py --quick                        # small sizes, every row kind (~10 min on 2 cores)
    python benchmarks/scale.py --nvme-path /work/scratch       # the docs table: >= 1B rows for ours (~30 min)

Training rows. Each system (ours: stage 3 with parameters and optimizer on NVMe, and stage 3 in memory; DDP;
FSDP2 ``fully_shard``, and with ``CPUOffloadPolicy``; DeepSpeed stage 3 on the CPU accelerator) trains a model
of fixed width at a few depths, 2 optimizer steps (AdamW, clipping at 1.0) on one repeated batch of 1 x
``--tokens`` tokens per rank, on fresh gloo ranks; our GPT (``ds_strategy.models.GPT``) and a Hugging Face
``LlamaForCausalLM`` from a config. Ours and FSDP2 build on the meta device; DDP and DeepSpeed build the whole
model on every rank (as their users do). A size "trains" when both losses are finite and the second is below the
first. Each rank samples its anonymous RSS (``RssAnon`` in ``/proc/self/status``, ``ds_strategy.offload.host_memory``)
from before the build to after the second step, and reads ``/proc/self/io`` around the second step: bytes read
from and written to storage per step (the NVMe files, and the page cache's write-back of the gradient maps), and
those over the step's seconds. Every rank of every system starts with ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB, the
setting our offload makes itself (Note: [Large host blocks are mapped and unmapped] in
``ds_strategy.offload.host_memory``), so the table compares what each system keeps alive, not glibc's heap. A
least-squares line through (parameters, peak) per system gives its bytes per parameter per rank and fixed cost, and from
them the largest model the machine's memory (all ranks) holds; for NVMe also the free disk at ``--nvme-path`` (20 bytes
per parameter over all ranks: parameter, master, two Adam moments and gradient files, fp32).

Loading rows. A Llama of ``--load-depth`` blocks is written once with ``save_pretrained`` (bf16, several
shards) under ``--nvme-path``, then loaded on 2 ranks (a) into stage 3 built on the meta device through
``checkpoint.pretrained.load_weights`` (what ``load_pretrained`` calls), each rank reading only its shards, and
(b) as FSDP2 users do: ``fully_shard`` on the meta device, ``to_empty``, then rank 0 ``from_pretrained`` and
``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, and (c) through transformers' FSDP
"cpu_ram_efficient_loading" as ``accelerate launch --use_fsdp --cpu`` runs it: ``from_pretrained`` on every rank
under ``ACCELERATE_USE_FSDP`` and ``FSDP_CPU_RAM_EFFICIENT_LOADING``, then Accelerate's FSDP2 ``prepare`` where the
``Accelerator`` enters FSDP (on CPU it does not; the row says what ran). Reported: each rank's peak RssAnon
above its value before the load, and seconds. Rows are written to ``results/<name>.{md,json}`` as each finishes,
so a run stopped at a deadline keeps what it measured; files under ``--nvme-path`` are removed at the end.
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
from ds_strategy.offload.host_memory import MAP_LARGE_BLOCKS_BYTES, PeakRssAnon

RESULTS = Path(__file__).resolve().parent / "results"
OURS = {
    "zero3": {},
    "zero3-nvme": {"offload_optimizer": "nvme", "offload_params": "nvme", "buffer_size": 1 << 22},
}
SYSTEMS = ("ddp", "fsdp2", "fsdp2-offload", "ds-zero3", *OURS)
VOCAB = 1024
LR = float(os.environ.get("DS_STRATEGY_SCALE_LR", "1e-3"))  # set from --lr by main; ranks inherit it
NVME_DISK_BYTES_PER_PARAM = 20
LOAD = ("load", "llama", ())  # where in a plan the sharded-loading rows are measured
# (system, model, depths) in the order run, most wanted first, so that a run stopped at a deadline has them: width
# 2048 (~50M parameters a block, depth 20 is ~1.0B); NVMe writes ~20 bytes per parameter per step
FULL_PLAN = [
    ("zero3-nvme", "gpt", (1, 2, 20)),
    LOAD,
    ("ddp", "gpt", (1, 2)),
    ("fsdp2", "gpt", (1, 2)),
    ("fsdp2-offload", "gpt", (1, 2)),
    ("ds-zero3", "gpt", (1, 2)),
    ("zero3-nvme", "llama", (20,)),
    ("zero3-nvme", "gpt", (4,)),
    ("zero3", "gpt", (1, 2)),
]
QUICK_PLAN = [(system, "gpt", (1, 2)) for system in SYSTEMS] + [("zero3-nvme", "llama", (2,)), LOAD]


def build_model(family: str, depth: int, width: int, tokens: int, meta: bool):
    """(model, loss_of(tokens)); ``meta``: built on the meta device, for the system to materialise."""
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        if family == "gpt":
            from ds_strategy.models import GPT, GPTConfig

            config = GPTConfig(vocab_size=VOCAB, block_size=tokens, n_layer=depth, n_head=width // 64, n_embd=width)
            model = GPT(config)
            return model, lambda x: model(x, x)[1]
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config(depth, width, tokens))
        return model, lambda x: model(input_ids=x, labels=x).loss


def llama_config(depth: int, width: int, tokens: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=int(width * 2.75),
        num_hidden_layers=depth,
        num_attention_heads=width // 64,
        max_position_embeddings=max(tokens, 64),
    )


def blocks_of(model, family: str):
    return model.model.layers if family == "llama" else model.blocks


def build_system(system: str, family: str, depth: int, width: int, tokens: int, nvme_path: str):
    """(step(tokens) -> loss, trainable parameter count, close) for one system on this rank."""
    from ds_strategy.models import weight_decay_groups

    if system in OURS:
        from ds_strategy.config import ZeroConfig
        from ds_strategy.offload import step_runner_for
        from ds_strategy.zero.engine import ZeroEngine

        model, loss_of = build_model(family, depth, width, tokens, meta=True)
        optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=LR, fused=True)
        options = {**OURS[system], **({"nvme_path": nvme_path} if "nvme" in system else {})}
        config = ZeroConfig(stage=3, **options)
        engine = ZeroEngine(model, optimizer, config, step_runner=step_runner_for(config))

        def step(x):
            loss = loss_of(x)
            engine.backward(loss)
            engine.clip_grad_norm_(1.0)
            engine.step()
            return loss.item()

        return step, sum(fp.numel for fp in engine.flat_params), engine.remove_hooks
    if system == "ds-zero3":
        return _deepspeed(family, depth, width, tokens)
    meta = system.startswith("fsdp2")
    model, loss_of = build_model(family, depth, width, tokens, meta=meta)
    psi = sum(p.numel() for p in model.parameters())
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
        loss_fn = (lambda x: wrapped(input_ids=x, labels=x).loss) if family == "llama" else (lambda x: wrapped(x, x)[1])
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if system == "fsdp2-offload" else {}
        for block in blocks_of(model, family):
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        model.to_empty(device="cpu")
        with torch.no_grad():  # the same initialisation for every rank's shards; its values do not matter here
            for p in model.parameters():
                p.normal_(0.0, 0.02)
            for name, buffer in model.named_buffers():
                if "inv_freq" in name:
                    buffer.copy_(model.model.rotary_emb.original_inv_freq)
        loss_fn = loss_of
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=LR)

    def step(x):
        loss = loss_fn(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step, psi, lambda: None


def _deepspeed(family: str, depth: int, width: int, tokens: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from ds_strategy.models import weight_decay_groups

    model, _ = build_model(family, depth, width, tokens, meta=False)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3},
    }
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer)

    def step(x):
        loss = engine(input_ids=x, labels=x).loss if family == "llama" else engine(x, x)[1]
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, sum(p.ds_numel for p in model.parameters()), engine.destroy


def measure_rank(rank: int, world_size: int, system: str, family: str, depth: int, width: int, tokens: int, nvme_path):
    """Train 2 steps on one repeated batch; peak RssAnon from before the build to after the second step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    sampler = PeakRssAnon().start()
    started = time.perf_counter()
    step, psi, close = build_system(system, family, depth, width, tokens, nvme_path)
    built = time.perf_counter()
    x = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(rank))
    losses, times = [], []
    for _ in range(2):
        io_before, t0 = _disk_bytes(), time.perf_counter()
        losses.append(step(x))
        times.append(time.perf_counter() - t0)
        io = [after - before for after, before in zip(_disk_bytes(), io_before)]
    peak = sampler.stop()
    close()
    dist.destroy_process_group()
    return {"peak": peak, "psi": psi, "losses": losses, "build_s": built - started, "step_s": times[-1], "io": io}


def _disk_bytes() -> tuple[int, int]:
    """(read, written) bytes of storage IO by this process (``/proc/self/io``)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def time_left(args) -> float:
    """Seconds a measurement may take: ``--timeout``, or less so as to end by ``--deadline``."""
    return min(args.timeout, args.deadline - time.time())


def measure(system: str, family: str, depth: int, args) -> dict:
    started, row = time.perf_counter(), {"kind": "train", "system": system, "model": family, "depth": depth}
    if time_left(args) < 60:
        return {**row, "error": "not run: --deadline"}
    outcome = launch_ranks(
        measure_rank, 2, system, family, depth, args.width, args.tokens, args.nvme_path, timeout=time_left(args)
    )
    row["wall_s"] = time.perf_counter() - started
    if not outcome.ok:
        return {**row, "error": str(outcome.error).strip().splitlines()[-1][:200]}
    ranks = outcome.values
    losses = ranks[0]["losses"]
    step_s = max(r["step_s"] for r in ranks)
    read, written = (sum(r["io"][i] for r in ranks) for i in (0, 1))
    return {
        **row,
        "params": ranks[0]["psi"],
        "peak_per_rank": max(r["peak"] for r in ranks),
        "trains": all(math.isfinite(v) for v in losses) and losses[1] < losses[0],
        "losses": losses,
        "build_s": max(r["build_s"] for r in ranks),
        "step_s": step_s,
        "read_gb_per_step": read / 1e9,
        "write_gb_per_step": written / 1e9,
        "read_gb_per_s": read / 1e9 / step_s,
        "write_gb_per_s": written / 1e9 / step_s,
    }


# -- sharded loading ------------------------------------------------------------------------------------------------
def write_checkpoint(path: Path, depth: int, width: int) -> dict:
    """A bf16 Llama saved with ``save_pretrained`` in about 5 shards; returns its parameter count and size."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(depth, width, 64)).to(torch.bfloat16)
    psi = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=max(2**20, 2 * psi // 5))
    del model
    files = list(path.glob("*.safetensors"))
    return {"params": psi, "files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def load_rank(rank: int, world_size: int, system: str, path: str, depth: int, width: int) -> dict:
    """Load the checkpoint at ``path`` into this rank as ``system`` does: peak RssAnon over the load, seconds."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    loaded = LOADERS[system](rank, path, depth, width)
    dist.destroy_process_group()
    return loaded


def _load_ours(rank: int, path: str, depth: int, width: int) -> dict:
    import torch.distributed as dist

    from ds_strategy.checkpoint.pretrained import load_weights
    from ds_strategy.config import ZeroConfig
    from ds_strategy.zero.engine import ZeroEngine

    started = time.perf_counter()
    model, _ = build_model("llama", depth, width, 64, meta=True)
    engine = ZeroEngine(model, None, ZeroConfig(stage=3))
    build_s = time.perf_counter() - started
    largest_unit = max(sum(fp.padded_numel * 4 for fp in unit.flat_params) for unit in engine.units)
    largest_tensor = max(slot.numel * 4 for fp in engine.flat_params for slot in fp.slots)
    dist.barrier()
    with PeakRssAnon() as peak:
        started = time.perf_counter()
        load_weights(engine, path)
        seconds = time.perf_counter() - started
    engine.remove_hooks()
    return {
        "growth": peak.growth,
        "peak": peak.peak,
        "seconds": seconds,
        "build_s": build_s,
        "largest_unit": largest_unit,
        "largest_tensor": largest_tensor,
    }


def _load_fsdp2(rank: int, path: str, depth: int, width: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    started = time.perf_counter()
    model, _ = build_model("llama", depth, width, 64, meta=True)
    for block in blocks_of(model, "llama"):
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    build_s = time.perf_counter() - started
    dist.barrier()
    with PeakRssAnon() as peak:
        started = time.perf_counter()
        full = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict() if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        del full
        seconds = time.perf_counter() - started
    return {"growth": peak.growth, "peak": peak.peak, "seconds": seconds, "build_s": build_s}


def _load_transformers(rank: int, path: str, depth: int, width: int) -> dict:
    """transformers' FSDP "cpu_ram_efficient_loading" as ``accelerate launch --use_fsdp --cpu
    --fsdp_cpu_ram_efficient_loading true`` sets it up: its two environment variables, ``from_pretrained`` on every
    rank (meant to read weights on local rank 0 only, the others staying on meta), then Accelerate's FSDP2 ``prepare``
    (``sync_module_states``: rank 0 broadcasts). ``prepare`` runs only where the ``Accelerator`` entered FSDP; the row
    records the distributed type it chose and whether this rank's ``from_pretrained`` materialised every weight."""
    import accelerate
    import torch.distributed as dist
    import transformers
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    started = time.perf_counter()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    build_s = time.perf_counter() - started
    dist.barrier()
    with PeakRssAnon() as peak:
        started = time.perf_counter()
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        materialised = not any(p.is_meta for p in model.parameters())
        prepared = accelerator.prepare(model) if accelerator.distributed_type == DistributedType.FSDP else None
        seconds = time.perf_counter() - started
    return {
        "growth": peak.growth,
        "peak": peak.peak,
        "seconds": seconds,
        "build_s": build_s,
        "materialised": materialised,
        "distributed_type": str(accelerator.distributed_type.value),
        "prepared": type(prepared).__name__ if prepared is not None else None,
        "versions": f"transformers {transformers.__version__}, accelerate {accelerate.__version__}",
    }


LOADERS = {"ours": _load_ours, "fsdp2": _load_fsdp2, "transformers": _load_transformers}
PER_RANK_FACTS = ("materialised", "distributed_type", "prepared")  # what transformers' path did on each rank


def measure_loading(path: Path, depth: int, args, checkpoint: dict) -> list[dict]:
    rows = []
    for system in LOADERS:
        row = {"kind": "load", "system": system, "model": "llama", "depth": depth, **checkpoint}
        outcome = launch_ranks(load_rank, 2, system, str(path), depth, args.width, timeout=max(1, time_left(args)))
        if not outcome.ok:
            rows.append({**row, "error": str(outcome.error).strip().splitlines()[-1][:200]})
        else:
            ranks = outcome.values
            rows.append(
                {
                    **row,
                    "growth_per_rank": [r["growth"] for r in ranks],
                    "peak_per_rank": max(r["peak"] for r in ranks),
                    "seconds": max(r["seconds"] for r in ranks),
                    "build_s": max(r["build_s"] for r in ranks),
                    **{k: ranks[0][k] for k in ("largest_unit", "largest_tensor", "versions") if k in ranks[0]},
                    **{f"{k}_per_rank": [r[k] for r in ranks] for k in PER_RANK_FACTS if k in ranks[0]},
                }
            )
        print(json.dumps(rows[-1]), flush=True)
    return rows


# -- fits and results -----------------------------------------------------------------------------------------------
def fit(rows: list[dict]) -> tuple[float, float] | None:
    """(fixed bytes, bytes per parameter) per rank: least squares through the sizes that trained."""
    points = [(r["params"], r["peak_per_rank"]) for r in rows if r.get("trains")]
    if len({p for p, _ in points}) < 2:
        return None
    n, sx, sy = len(points), sum(p for p, _ in points), sum(m for _, m in points)
    sxx, sxy = sum(p * p for p, _ in points), sum(p * m for p, m in points)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - slope * sx) / n, slope


def predict(line: tuple[float, float], budget: int, system: str, free_disk: int) -> dict:
    fixed, slope = line
    by_memory = (budget / 2 - fixed) / slope if slope > 0 else math.inf
    by_disk = free_disk / NVME_DISK_BYTES_PER_PARAM if "nvme" in system else math.inf
    return {
        "bytes_per_param_per_rank": slope,
        "fixed_bytes_per_rank": fixed,
        "limit_by_memory": by_memory,
        "limit_by_disk": by_disk,
        "limit": min(by_memory, by_disk),
        "bound": "disk" if by_disk < by_memory else "memory",
    }


def fits_of(rows: list[dict], budget: int, free_disk: int) -> dict:
    fits = {}
    for key in dict.fromkeys((r["system"], r["model"]) for r in rows if r["kind"] == "train"):
        line = fit([r for r in rows if r["kind"] == "train" and (r["system"], r["model"]) == key])
        if line is not None:
            fits["/".join(key)] = predict(line, budget, key[0], free_disk)
    return fits


def write_results(args, command: str, rows: list[dict], budget: int, free_disk: int, done: bool) -> None:
    fits = fits_of(rows, budget, free_disk)
    status = "" if done else " (partial: still running or stopped before the end)"
    lines = [
        f"`{command}`{status}: 2 gloo ranks, {os.cpu_count()} cores, memory {budget / 2**30:.1f} GiB, free disk "
        f"{free_disk / 1e9:.0f} GB, width {args.width}, batch 1x{args.tokens} tokens per rank, fp32, "
        f"AdamW lr {args.lr:g}, MALLOC_MMAP_THRESHOLD_={MAP_LARGE_BLOCKS_BYTES} on every rank",
        "",
        "| system | model | params | peak RssAnon / rank | trains | s/step | read GB/step | write GB/step | "
        "read GB/s | write GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["kind"] == "train"):
        if "error" in r:
            lines.append(f"| {r['system']} | {r['model']} | depth {r['depth']} | failed: {r['error']} ||||||")
            continue
        lines.append(
            f"| {r['system']} | {r['model']} | {_params(r['params'])} | {r['peak_per_rank'] / 2**30:.2f} GiB | "
            f"{'yes' if r['trains'] else 'no'} | {r['step_s']:.1f} | {r['read_gb_per_step']:.2f} | "
            f"{r['write_gb_per_step']:.2f} | {r['read_gb_per_s']:.2f} | {r['write_gb_per_s']:.2f} |"
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
    loads = [r for r in rows if r["kind"] == "load"]
    if loads:
        lines += [
            "",
            "| load into 2 ranks | checkpoint | peak RssAnon growth / rank | peak RssAnon / rank | build s | load s |",
            "|---|---|---|---|---|---|",
        ]
        for r in loads:
            what = f"{_params(r['params'])} bf16, {r['files']} files, {r['bytes'] / 1e9:.1f} GB"
            if "error" in r:
                lines.append(f"| {r['system']} | {what} | failed: {r['error']} | | | |")
                continue
            growth = " / ".join(f"{g / 2**30:.2f}" for g in r["growth_per_rank"])
            bound = (
                f" (unit {r['largest_unit'] / 2**30:.2f} + tensor {r['largest_tensor'] / 2**30:.2f})"
                if "largest_unit" in r
                else ""
            )
            lines.append(
                f"| {_load_name(r)} | {what} | {growth} GiB{bound} | {r['peak_per_rank'] / 2**30:.2f} GiB | "
                f"{r['build_s']:.1f} | {r['seconds']:.1f} |"
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    payload = {"command": command, "done": done, "rows": rows, "fits": fits, "budget": budget, "free_disk": free_disk}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(payload, indent=1, default=str))
    _plot(RESULTS / f"{args.name}.png", [r for r in rows if r["kind"] == "train" and "error" not in r])


def _load_name(row: dict) -> str:
    if row["system"] == "ours":
        return "ours: stage 3 on meta + load_pretrained"
    if row["system"] == "fsdp2":
        return "FSDP2: fully_shard + from_pretrained (rank 0) + set_model_state_dict(broadcast_from_rank0)"
    materialised = "/".join("all" if m else "meta" for m in row["materialised_per_rank"])
    prepared = row["prepared_per_rank"][0]
    prepare = prepared or f"not run, Accelerator(cpu=True) chose {row['distributed_type_per_rank'][0]}, not FSDP"
    return (
        f"transformers cpu_ram_efficient_loading ({row['versions']}): from_pretrained on each rank under "
        f"ACCELERATE_USE_FSDP + FSDP_CPU_RAM_EFFICIENT_LOADING (weights per rank: {materialised}); "
        f"Accelerate FSDP2 prepare: {prepare}"
    )


def _plot(path: Path, rows: list[dict]) -> None:
    """Peak RssAnon per rank against parameters, one line per system and model (skipped without matplotlib or rows)."""
    try:
        import matplotlib
    except ImportError:
        return
    if not rows:
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["system"], r["model"]) for r in rows):
        points = sorted((r["params"], r["peak_per_rank"]) for r in rows if (r["system"], r["model"]) == key)
        axes.plot([p / 1e6 for p, _ in points], [m / 2**30 for _, m in points], marker="o", label="/".join(key))
    axes.set_xlabel("parameters (M)")
    axes.set_ylabel("peak RssAnon per rank (GiB)")
    axes.set_xscale("log")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M"


def _billions(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value / 1e9:.2f}B"


def _plan_of(rows: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``--rows``: "load" or "system/model/depth" items, comma-separated, as a plan."""
    plan = []
    for item in rows.split(","):
        if item == "load":
            plan.append(LOAD)
            continue
        system, model, depth = item.split("/")
        if system not in SYSTEMS or model not in ("gpt", "llama"):
            raise SystemExit(f"--rows item {item!r}: system must be one of {SYSTEMS}, model gpt or llama")
        plan.append((system, model, (int(depth),)))
    return plan


def _epoch_of(hh_mm: str) -> float:
    """The next time it is ``hh_mm`` UTC, in seconds since the epoch."""
    now = time.time()
    hours, minutes = map(int, hh_mm.split(":"))
    today = now - now % 86400 + hours * 3600 + minutes * 60
    return today if today > now else today + 86400


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="width 256, depths 1-2, a 4-block checkpoint")
    parser.add_argument("--width", type=int, default=None, help="model width (default 2048; --quick 256)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank per step")
    parser.add_argument("--load-depth", type=int, default=None, help="Llama blocks of the checkpoint (default 20)")
    parser.add_argument("--skip-loading", action="store_true")
    parser.add_argument("--rows", default=None, help="instead of the plan: system/model/depth,... and/or load")
    parser.add_argument("--nvme-path", default=None, help="NVMe files and the checkpoint go here (removed after)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per measurement")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of every system")
    parser.add_argument("--deadline", default=None, help="UTC HH:MM: measurements are cut off at it")
    parser.add_argument("--name", default=None, help="results/<name>.{md,json} (default scale, or scale-quick)")
    parser.add_argument(
        "--plot-only",
        default=None,
        help="redraw results/<name>.png from the training rows of these results (comma-separated names), run nothing",
    )
    args = parser.parse_args(argv)
    args.width = args.width or (256 if args.quick else 2048)
    args.load_depth = args.load_depth or (4 if args.quick else 20)
    args.name = args.name or ("scale-quick" if args.quick else "scale")
    args.deadline = _epoch_of(args.deadline) if args.deadline else math.inf
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        rows = [
            r for name in args.plot_only.split(",") for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"]
        ]
        _plot(RESULTS / f"{args.name}.png", [r for r in rows if r["kind"] == "train" and "error" not in r])
        return 0
    command = "python benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MAP_LARGE_BLOCKS_BYTES)  # ranks inherit it: see the docstring
    os.environ["DS_STRATEGY_SCALE_LR"] = str(args.lr)
    scratch = Path(tempfile.mkdtemp(prefix="ds-strategy-scale-", dir=args.nvme_path))
    args.nvme_path = str(scratch / "nvme")
    Path(args.nvme_path).mkdir()
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free_disk = shutil.disk_usage(scratch).free
    rows: list[dict] = []
    try:
        plan = _plan_of(args.rows) if args.rows else QUICK_PLAN if args.quick else FULL_PLAN
        for system, family, depths in plan:
            if (system, family, depths) == LOAD:
                if not args.skip_loading and time_left(args) > 300:
                    checkpoint = write_checkpoint(scratch / "checkpoint", args.load_depth, args.width)
                    rows += measure_loading(scratch / "checkpoint", args.load_depth, args, checkpoint)
                    shutil.rmtree(scratch / "checkpoint")
            for depth in depths:
                rows.append(measure(system, family, depth, args))
                print(json.dumps(rows[-1]), flush=True)
            write_results(args, command, rows, budget, free_disk, done=False)
        write_results(args, command, rows, budget, free_disk, done=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print((RESULTS / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
