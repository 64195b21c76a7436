"""The GPU suite's size part: the largest model that fits with offload, by the estimator, then trained; and what
offload costs per step. See ``gpu_suite.py`` for the part's place in the suite."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch
import transformers
from suite_harness import Item, Runner, SuiteContext
from suite_training import SPEED_SHAPES, TINY, activation_bytes, llama_config, train

from ds_strategy.config import ZeroConfig
from ds_strategy.estimate import ModelSize, estimate_memory

SIZE_SHAPES = {  # (shape without the layer count, most layers tried, sequence)
    "tiny": (TINY, 48, 64),
    "full": (
        {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40},
        80,
        1024,
    ),
}
# Fractions of a capacity the estimate may fill: activations, allocator rounding, the page cache and pinned buffers
# (bounded on their own: Note: [Pinned host memory is bounded] in ds_strategy.offload.pinned) need the rest.
DEVICE_FILL, HOST_FILL, DISK_FILL = 0.80, 0.50, 0.80


def largest_fitting(low: int, high: int, fits) -> int | None:
    """The largest n in [low, high] with ``fits(n)``, for ``fits`` true up to some n and false after; None if
    not even ``low`` fits. Binary search: log2(high - low) calls."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def size_fits(config, seq: int, offload: str, capacity: dict) -> tuple[bool, dict]:
    """Whether the estimator puts stage 3 with ``offload`` of ``config`` within the capacities; its figures."""
    zero = ZeroConfig(
        stage=3, offload_optimizer=offload, offload_params=offload, nvme_path="/estimate" if offload == "nvme" else None
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    estimate = estimate_memory(ModelSize.of_module(model, zero), 1, 3, offload, offload, "bf16-mixed", config=zero)
    device = estimate.device + activation_bytes(config, 1, seq)
    figures = {
        "params": sum(p.numel() for p in model.parameters()),
        "device": device,
        "host": estimate.host,
        "nvme": estimate.nvme,
    }
    fits = (
        device <= DEVICE_FILL * capacity["device"]
        and estimate.host <= HOST_FILL * capacity["host"]
        and estimate.nvme <= DISK_FILL * capacity["disk"]
    )
    return fits, figures


def capacities(device: torch.device, nvme_dir: str | None, size: str) -> dict:
    """Bytes of device memory, free host memory and free disk under ``nvme_dir``; with the tiny sizes, small fixed
    figures that bind the search well below its most layers."""
    if size == "tiny":
        return {"device": 64 * 2**20, "host": 24 * 2**20, "disk": 24 * 2**20}
    host = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host
    disk = os.statvfs(nvme_dir).f_bavail * os.statvfs(nvme_dir).f_frsize if nvme_dir else 0
    return {"device": device_bytes, "host": host, "disk": disk}


def offload_system(offload: str, nvme_dir: str | None) -> dict:
    """Stage 3, bf16, optimizer and parameters offloaded to ``offload`` (none, cpu or nvme under ``nvme_dir``)."""
    system = {"kind": "zero", "precision": "bf16-mixed", "stage": 3}
    return {**system, "offload_optimizer": offload, "offload_params": offload, "nvme_path": nvme_dir}


def offload_share(offload: str, args, device: torch.device, nvme_dir: str | None, baseline: Item | None):
    """The speed model's stage-3 step with ``offload`` against its step without (measured here if the speed
    part did not)."""
    shape, batch, seq = SPEED_SHAPES[args.size]
    config = llama_config(shape, seq)
    if baseline is not None and baseline.status == "pass":
        without = baseline.metrics["step_ms"] / 1000
    else:
        without = statistics.median(
            train(offload_system("none", None), config, device, batch, seq, 2, 1, False)["times"]
        )
    run = train(offload_system(offload, nvme_dir), config, device, batch, seq, 2, 1, False)
    step_s = statistics.median(run["times"])
    return True, {
        "step_s": step_s,
        "no_offload_step_s": without,
        "percent_of_no_offload": 100 * step_s / without,
        "params": run["params"],
    }


def train_largest(offload: str, args, device, nvme_dir: str | None, seconds: float, rate: Item | None):
    """The most layers of ``SIZE_SHAPES`` that the estimator fits with ``offload``, and that ``rate`` (the offload
    step of the speed model, in seconds per parameter) says will build and take 2 steps in the time left
    (``4 * rate * params + 15 s`` within 80% of it); then 2 steps of that model."""
    shape, most, seq = SIZE_SHAPES[args.size]
    capacity = capacities(device, nvme_dir, args.size)
    per_param = rate.metrics["step_s"] / rate.metrics["params"] if rate is not None and rate.status == "pass" else 0.0
    budget_s = 0.8 * seconds

    def fits(layers: int) -> bool:
        fit, estimate = size_fits(llama_config({**shape, "num_hidden_layers": layers}, seq), seq, offload, capacity)
        return fit and 4 * per_param * estimate["params"] + 15 <= budget_s

    layers = largest_fitting(1, most, fits)
    if layers is None:
        return False, {"capacity_gib": {k: v / 2**30 for k, v in capacity.items()}}, "not even one layer fits"
    config = llama_config({**shape, "num_hidden_layers": layers}, seq)
    _, estimate = size_fits(config, seq, offload, capacity)
    run = train(offload_system(offload, nvme_dir), config, device, 1, seq, 2, 0, False)
    figures = {
        "layers": layers,
        "params_b": estimate["params"] / 1e9,
        "estimate_device_gib": estimate["device"] / 2**30,
        "estimate_host_gib": estimate["host"] / 2**30,
        "estimate_nvme_gib": estimate["nvme"] / 2**30,
        "step_s": statistics.median(run["times"]),
        "peak_alloc_gib": run["peak"] / 2**30 if run["peak"] is not None else None,
    }
    if layers == most:
        limit = f"the most layers tried ({most})"
    elif not size_fits(llama_config({**shape, "num_hidden_layers": layers + 1}, seq), seq, offload, capacity)[0]:
        limit = "memory, by the estimate"
    else:
        limit = f"the time left ({budget_s:.0f} s)"
    return all(torch.isfinite(torch.tensor(run["losses"]))), figures, f"bound by {limit}"


def run_size(runner: Runner, context: SuiteContext) -> None:
    args, device = context.args, context.device
    nvme = str(args.nvme_path) if args.nvme_path else None
    if nvme:
        Path(nvme).mkdir(parents=True, exist_ok=True)
    no_disk = "" if nvme else "no --nvme-path"
    baseline = context.items.get("zero3")
    rates = {"cpu": runner.run("offload cpu step vs none", offload_share, "cpu", args, device, None, baseline)}
    rates["nvme"] = runner.run(
        "offload nvme step vs none", offload_share, "nvme", args, device, nvme, baseline, skip=no_disk
    )
    share = 0.6 if nvme else 1.0  # of the part's time left, for the CPU one
    runner.run(
        "largest model, cpu offload",
        train_largest,
        "cpu",
        args,
        device,
        None,
        share * runner.left(),
        rates["cpu"],
        share=share,
    )
    runner.run(
        "largest model, nvme offload",
        train_largest,
        "nvme",
        args,
        device,
        nvme,
        runner.left(),
        rates["nvme"],
        skip=no_disk,
    )
