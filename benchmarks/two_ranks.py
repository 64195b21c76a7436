"""Two ranks on one device: ZeRO stages 1-3 against DDP with communication overlapped, and a sharded checkpoint
round trip, each rank a process of its own.

    python benchmarks/two_ranks.py --device cuda:0 --out benchmarks/results/two-ranks.json   # both ranks on one GPU
    python benchmarks/two_ranks.py --device cpu --size tiny --out /tmp/two-ranks.json         # the host rehearsal

The GPU suite runs it as its "two ranks" part. Why gloo on a GPU: NCCL refuses two ranks on one device, and a
world of one rank exercises none of the multi-rank paths. gloo runs collectives of CUDA tensors through pinned host
copies and orders the current stream after them, so both ranks' model states live on the GPU and everything ZeRO
does across ranks runs for real there: sharding over 2, the reduce-scatter / all-gather layouts, the divide by N,
prefetching and bucketed reduction overlapping backward, the sequence check, a checkpoint each rank writes and
reads its own pieces of. What it cannot show is NCCL itself (its streams, its speed): that takes two GPUs.

Each check trains fp32 with SGD and momentum, whose updates scale with the gradient, so a wrong gradient scale or a
missing divide by N moves the parameters (Adam's updates would hide it), on two micro-batches per step (the first
under ``no_sync``), clipped. Rank 0 writes ``{"checks": [{name, passed, metrics, note}]}`` to ``--out``; exit status
1 if a check failed, 2 if the ranks did not finish. Each rank is a process of its own (``--rank``, started by
:func:`launch`), so that a hung rank can be killed with everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from suite_harness import resolve_device
from suite_training import CORRECT_SHAPES, build_llama, llama_config
from torch.nn.parallel import DistributedDataParallel

from ds_strategy.checkpoint import sharded_checkpoint
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine

# CLIP is above the gradient norms here: clipping to a norm would undo a uniformly wrong gradient scale. Its
# norms are compared instead, which checks the global norm over the shards.
WORLD, STEPS, MICRO_BATCHES, CLIP, LR = 2, 3, 2, 1e3, 0.05
RTOL = 1e-4  # fp32 on both sides; the sums differ only in order (flat buckets, 2 ranks)
SHAPES = {"tiny": (CORRECT_SHAPES["tiny"], 2, 16), "full": (CORRECT_SHAPES["full"], 2, 256)}  # (shape, batch/rank, seq)


def batches(config, per_rank: int, seq: int, steps: int) -> list[list[torch.Tensor]]:
    """``steps`` x ``MICRO_BATCHES`` global batches of token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(7)
    shape = (WORLD * per_rank, seq)
    return [
        [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(MICRO_BATCHES)]
        for _ in range(steps)
    ]


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


class InFlight:
    """The most collectives an engine had launched and not yet waited on at once (overlap makes it exceed 1)."""

    def __init__(self):
        self.now = self.most = 0

    def __call__(self, event: str, kind: str, label: str, nbytes: int) -> None:
        self.now += 1 if event == "launch" else -1
        self.most = max(self.most, self.now)


def run_steps(model, backward, no_sync, clip, step, data, rank: int, per_rank: int, device) -> dict:
    """Train on ``data``: this rank's rows of each micro-batch; the steps' losses averaged over ranks and the
    gradient norms clipping saw."""
    losses, norms = [], []
    for micro_batches in data:
        total = torch.zeros((), device=device)
        for index, ids in enumerate(micro_batches):
            mine = ids[rank * per_rank : (rank + 1) * per_rank].to(device)
            with no_sync() if index < MICRO_BATCHES - 1 else contextlib.nullcontext():
                loss = model(input_ids=mine, labels=mine).loss / MICRO_BATCHES
                backward(loss)
            total += loss.detach()
        norms.append(float(clip(CLIP)))
        step()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    return {"losses": losses, "norms": norms}


def zero_run(stage: int, config, data, rank, per_rank, device, seed=0, steps=None, load=None, save=None):
    """A ZeRO run of ``stage``; returns losses, every parameter (fp32, on the host) and collectives in flight."""
    model = build_llama(config, "cpu", seed)
    zero = ZeroConfig(stage=stage, precision="32-true", overlap_comm=True, param_persistence_threshold=0)
    engine = ZeroEngine(model, sgd(model), zero, device=device)
    if load is not None:
        sharded_checkpoint.load(load, model, engine)
    in_flight = InFlight()
    engine.collectives.observers.append(in_flight)

    run = run_steps(
        model,
        engine.backward,
        engine.no_sync,
        engine.clip_grad_norm_,
        engine.step,
        data[:steps],
        rank,
        per_rank,
        device,
    )
    engine.collectives.observers.remove(in_flight)
    if save is not None:
        sharded_checkpoint.save(save, model, engine)
    params = {k: v.detach().cpu() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.remove_hooks()
    return {**run, "params": params, "in_flight": in_flight.most}


def ddp_run(config, data, rank, per_rank, device):
    model = build_llama(config, "cpu", 0).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = sgd(model)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    run = run_steps(
        ddp,
        lambda loss: loss.backward(),
        ddp.no_sync,
        lambda norm: torch.nn.utils.clip_grad_norm_(model.parameters(), norm),
        step,
        data,
        rank,
        per_rank,
        device,
    )
    return {**run, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def compare(run: dict, reference: dict) -> dict:
    """Largest relative loss and gradient-norm errors, and the largest parameter error in relative norm
    ||a - b|| / ||b||."""
    errors = {
        f"max_rel_{name}_error": max(abs(a - b) / abs(b) for a, b in zip(run[key], reference[key]))
        for name, key in (("loss", "losses"), ("grad_norm", "norms"))
    }
    errors["max_rel_param_error"] = max(
        ((run["params"][k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12)).item()
        for k, v in reference["params"].items()
    )
    return errors


def check(name: str, errors: dict, **metrics) -> dict:
    passed = all(error <= RTOL for error in errors.values())
    note = f"within {RTOL:g}" if passed else f"over {RTOL:g}"
    return {"name": name, "passed": passed, "metrics": {**errors, **metrics}, "note": note}


def rank_main(rank: int, args: argparse.Namespace) -> None:
    """One rank: every check in one gloo process group over ``args.store``; rank 0 writes the results."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5)
    )
    checks = []
    try:
        checks = run_checks(rank, args.size, device)
    except Exception:
        checks.append({"name": "two ranks", "passed": False, "metrics": {}, "note": traceback.format_exc()[-2000:]})
        raise
    finally:
        if rank == 0:
            args.out.write_text(json.dumps({"checks": checks, "device": str(device)}, indent=2))
        dist.destroy_process_group()


def run_checks(rank: int, size: str, device: torch.device) -> list[dict]:
    shape, per_rank, seq = SHAPES[size]
    config = llama_config(shape, seq)
    data = batches(config, per_rank, seq, STEPS + 1)
    ddp = ddp_run(config, data[:STEPS], rank, per_rank, device)
    checks = []
    for stage in (1, 2, 3):
        started = time.monotonic()
        run = zero_run(stage, config, data, rank, per_rank, device, steps=STEPS)
        checks.append(
            check(
                f"stage{stage} vs DDP, overlapped",
                compare(run, ddp),
                most_in_flight=run["in_flight"],
                seconds=time.monotonic() - started,
            )
        )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="two_ranks_ckpt_") as scratch:
        path = [str(Path(scratch) / "ckpt")]
        dist.broadcast_object_list(path, src=0)  # rank 0's directory: one checkpoint for both
        whole = zero_run(3, config, data, rank, per_rank, device, steps=STEPS + 1)
        zero_run(3, config, data[:2], rank, per_rank, device, steps=2, save=path[0])
        resumed = zero_run(3, config, data[2:], rank, per_rank, device, seed=1, steps=STEPS - 1, load=path[0])
        dist.barrier()
    errors = compare(resumed, {"losses": whole["losses"][2:], "norms": whole["norms"][2:], "params": whole["params"]})
    checks.append(check("stage3 sharded checkpoint round trip", errors, seconds=time.monotonic() - started))
    return checks


def launch(device: str, size: str, out: Path, env: dict | None = None) -> tuple[int, str]:
    """Start both ranks as processes of their own (killed, with anything they started, if this is interrupted:
    the GPU suite's time box); the worst exit status and their output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="two_ranks_") as scratch:
        command = [sys.executable, __file__, "--device", device, "--size", size, "--out", str(out)]
        command += ["--store", os.path.join(scratch, "store")]
        ranks = [
            subprocess.Popen(
                [*command, "--rank", str(rank)],
                env=env,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in range(WORLD)
        ]
        try:
            outputs = [process.communicate()[0].decode(errors="replace") for process in ranks]
        finally:
            for process in ranks:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    return max(process.returncode for process in ranks), "\n".join(outputs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N (both ranks on it) or cpu")
    parser.add_argument("--size", default="full", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True, help="the JSON file rank 0 writes")
    parser.add_argument("--rank", type=int, help="run this rank (launch sets it; without it, both are launched)")
    parser.add_argument("--store", help="the rendezvous file of the ranks (launch sets it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args)
        return 0
    status, output = launch(args.device, args.size, args.out)
    if not args.out.exists():
        print(output[-3000:], file=sys.stderr)
        return 2
    checks = json.loads(args.out.read_text())["checks"]
    for item in checks:
        print(f"[two ranks] {item['name']}: {'pass' if item['passed'] else 'FAIL'} {item['metrics']}", flush=True)
    return 0 if status == 0 and all(item["passed"] for item in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
