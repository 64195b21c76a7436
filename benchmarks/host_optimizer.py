"""The host optimizer step and the NVMe swap, against the memory and disk bandwidth measured in the same run.

    python benchmarks/host_optimizer.py                     # 100M-element fp32 shard, as in the issue
    python benchmarks/host_optimizer.py --numel 20000000 --repeats 3 --json out.json

Part 1, one Adam step over an fp32 shard of ``--numel`` elements: ms and GB/s, counting 28 bytes per element (read
p, g, m, v; write p, m, v) and 30 with the bf16 copy-out (read 4 + write 2 more would be a second pass; here it is
2). Rows: a plain tensor copy (8 bytes per element: the memory bandwidth the step is bound by), torch.optim.AdamW
with foreach=True and with fused=True, and CpuAdam (fused kernel tiled on its own thread pool), with and without
the copy-out; plus the alternatives CpuAdam's design was chosen over (the same tiles on ATen's intra-op threads,
and torch's fused step followed by a separate copy).

Part 2, ZeRO-Infinity: a one-rank ZeroEngine with offload_optimizer="nvme" under ``--nvme-path`` steps the same
shard size; each step reads and writes the fp32 master and both moments (24 bytes per element moved), once as it
runs (buffered IO: recently written ranges may still be in the page cache) and once with the files written back and
evicted from the page cache before each step (the disk-bound case). Compared with the disk's sequential write and
read bandwidth measured on a file of the same 12 bytes per element (64 MiB blocks, fsync, page cache dropped before
reading), and with the step time of in-memory (offload_optimizer="cpu") offload.
Each figure is the best of ``--repeats`` after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ds_strategy.config import ZeroConfig
from ds_strategy.offload import CpuAdam, step_runner_for
from ds_strategy.zero.engine import ZeroEngine

BLOCK = 64 << 20


def best_seconds(fn, repeats: int, before_each=lambda: None) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs after one warm-up; ``before_each`` runs untimed."""
    fn()
    times = []
    for _ in range(repeats):
        before_each()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def row(name: str, seconds: float, nbytes: float) -> dict:
    return {"name": name, "ms": seconds * 1e3, "GB/s": nbytes / seconds / 1e9}


# -- part 1: host step -----------------------------------------------------------------------------------------
def copy_row(numel: int, repeats: int) -> dict:
    source, target = torch.randn(numel), torch.empty(numel)
    return row("tensor copy (memory bandwidth)", best_seconds(lambda: target.copy_(source), repeats), 8 * numel)


def step_row(name: str, optimizer: torch.optim.Optimizer, repeats: int, nbytes: float, **step_args) -> dict:
    """One optimizer's step; its state is dropped on return, so rows do not add up in memory."""
    return row(name, best_seconds(lambda: optimizer.step(**step_args), repeats), nbytes)


def adam_rows(numel: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    copy16 = torch.empty(numel, dtype=torch.bfloat16)
    fused = torch.optim.AdamW([param], fused=True)

    def fused_then_copy():
        fused.step()
        copy16.copy_(param.detach())

    return [
        copy_row(numel, repeats),
        step_row("torch AdamW foreach=True", torch.optim.AdamW([param], foreach=True), repeats, 28 * numel),
        step_row("torch AdamW fused=True", torch.optim.AdamW([param], fused=True), repeats, 28 * numel),
        step_row("CpuAdam", CpuAdam([param]), repeats, 28 * numel),
        step_row(
            "CpuAdam + bf16 copy-out (one pass)", CpuAdam([param]), repeats, 30 * numel, param_copies={param: copy16}
        ),
        # tiles run inline on the caller's thread, each kernel call on ATen's intra-op threads
        step_row(
            "  alt: same tiles on ATen's threads + copy-out",
            CpuAdam([param], threads=1),
            repeats,
            30 * numel,
            param_copies={param: copy16},
        ),
        row("  alt: torch fused, then a bf16 copy pass", best_seconds(fused_then_copy, repeats), 30 * numel),
    ]


# -- part 2: NVMe ------------------------------------------------------------------------------------------------
def disk_rows(directory: Path, nbytes: int, repeats: int) -> list[dict]:
    path = directory / "sequential.bin"
    block = torch.randint(0, 255, (BLOCK,), dtype=torch.uint8).numpy()
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:

        def write():
            for offset in range(0, nbytes, BLOCK):
                os.pwrite(fd, memoryview(block)[: min(BLOCK, nbytes - offset)], offset)
            os.fsync(fd)

        def read():
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
            for offset in range(0, nbytes, BLOCK):
                os.preadv(fd, [memoryview(block)[: min(BLOCK, nbytes - offset)]], offset)

        return [
            row("disk sequential write (+fsync)", best_seconds(write, repeats), nbytes),
            row("disk sequential read (cache dropped)", best_seconds(read, repeats), nbytes),
        ]
    finally:
        os.close(fd)
        path.unlink()


class OneTensor(nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(numel))


def drop_page_cache(engine: ZeroEngine) -> None:
    """Write the NVMe files back and evict them from the page cache, so the next step reads from the disk."""
    for files in engine.step_runner.hosts[0].files.values():
        for file in files.values():
            os.fsync(file.fd)
            os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def engine_step_seconds(numel: int, repeats: int, cold: bool = False, **offload) -> float:
    """A one-rank stage-1 engine over one flat parameter with random gradients: seconds per ``engine.step()``;
    ``cold``: with the NVMe files out of the page cache before each step."""
    module = OneTensor(numel)
    config = ZeroConfig(stage=1, **offload)
    engine = ZeroEngine(
        module, torch.optim.AdamW(module.parameters(), fused=True), config, step_runner=step_runner_for(config)
    )
    (fp,) = engine.flat_params
    fp.grad_full.normal_()
    try:  # later steps see zeroed gradients: the same work
        return best_seconds(engine.step, repeats, (lambda: drop_page_cache(engine)) if cold else (lambda: None))
    finally:
        engine.remove_hooks()


def nvme_rows(numel: int, repeats: int, nvme_path: Path, sub_group: int) -> list[dict]:
    rows = disk_rows(nvme_path, 12 * numel, repeats)
    in_memory = engine_step_seconds(numel, repeats, offload_optimizer="cpu")
    rows.append(row("engine step, offload_optimizer=cpu", in_memory, 28 * numel))
    nvme = {"nvme_path": str(nvme_path), "buffer_size": sub_group, "sub_group_size": sub_group}
    warm = engine_step_seconds(numel, repeats, offload_optimizer="nvme", **nvme)
    rows.append(row("engine step, offload_optimizer=nvme (swap bytes)", warm, 24 * numel))
    cold = engine_step_seconds(numel, repeats, cold=True, offload_optimizer="nvme", **nvme)
    rows.append(row("  same, page cache dropped before each step", cold, 24 * numel))
    rows.append({"name": "nvme step / cpu step (warm, cold)", "ratio": (warm / in_memory, cold / in_memory)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nvme-path", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--sub-group", type=int, default=1 << 23, help="NVMe sub-group / buffer elements")
    parser.add_argument("--skip-nvme", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    print(f"{args.numel:,} fp32 elements, {torch.get_num_threads()} torch threads, best of {args.repeats}")
    rows = adam_rows(args.numel, args.repeats)
    if not args.skip_nvme:
        with tempfile.TemporaryDirectory(dir=args.nvme_path) as directory:
            rows += nvme_rows(args.numel, args.repeats, Path(directory), args.sub_group)
    for r in rows:
        ratio = r.get("ratio")
        figures = (
            " ".join(f"{x:.2f}x" for x in ratio)
            if isinstance(ratio, tuple)
            else f"{r['ms']:9.1f} ms {r['GB/s']:7.2f} GB/s"
        )
        print(f"{r['name']:<52} {figures}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"numel": args.numel, "threads": torch.get_num_threads(), "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
