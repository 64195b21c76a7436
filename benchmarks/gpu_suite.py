"""One GPU, one command: does ds_strategy run on CUDA, how fast, and how big a model fits.

    python benchmarks/gpu_suite.py                                   # CUDA, <= 8 minutes, writes the report
    python benchmarks/gpu_suite.py --nvme-path /local/disk/dir       # also sizes the largest model with NVMe offload
    python benchmarks/gpu_suite.py --device cpu --size tiny          # the same logic on the host, in under a minute

World size 1: a process group of one rank (NCCL on CUDA, gloo on the host). Three parts, in this order, each
time-boxed (``--budget`` seconds in all, shared out as ``PART_SHARES``; a part's leftover goes to the next):

correctness  stages 0-3 under bf16-mixed and 16-mixed, CPU offload (stage 2 optimizer; stage 3 optimizer and
             parameters) and NVMe offload (stage 3), pinned buffers on CUDA, each against the same training in plain
             PyTorch (bf16: autocast with fp32 weights, losses within ``BF16_RTOL``; fp16: fp32 PyTorch, within
             ``FP16_RTOL``), on one repeated batch so that a missed or wrong optimizer step moves the losses; the
             Triton kernels compiled (CUDA only) against their PyTorch references; and ``gpu_check.py``'s placement,
             construction, loading and offload memory bounds.
speed        a Llama-shaped model (``SPEED_SHAPES``, 0.98B parameters on CUDA), bf16, sequence 2048: ZeRO stages
             0-3 against plain PyTorch (fp32 weights, bf16 autocast) and FSDP2 ``fully_shard`` (bf16 parameters,
             fp32 reduction), eager and with ``torch.compile`` on each decoder layer: tokens/s, MFU and peak
             allocated memory. MFU = model FLOPs per step / step time / the device's dense bf16 peak, with
             (PaLM, appendix B) model FLOPs = 6 N T + 12 L H S T for T tokens per step, N the parameters that take
             part in matmuls (all but the input embedding), L layers, H the hidden size and S the sequence length
             (attention counted without the causal half, as PaLM and Megatron do).
size         the largest Llama-shaped model (``SIZE_SHAPES``, 13B-like layers, the layer count searched) that the
             estimator (``ds_strategy.estimate``) says fits with stage 3 and CPU offload, then 2 steps of it; the
             same with NVMe offload when ``--nvme-path`` is given; and the offload step time as a percentage of the
             step without offload, on the speed model.

Writes ``<out>.json`` and ``<out>.md`` after every item, so a run cut short still leaves what it measured. Exit
status 1 if any item failed, raised or overran its time box; items skipped (no CUDA, no time left) do not fail it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gpu_check
import torch
import torch.distributed as dist
import transformers
from suite_harness import PART_SHARES, Budget, Item, Report, Runner, hard_stop_after

from ds_strategy.config import ZeroConfig
from ds_strategy.estimate import ModelSize, estimate_memory
from ds_strategy.offload import step_runner_for
from ds_strategy.precision import autocast_for
from ds_strategy.zero.engine import ZeroEngine

RESULTS = Path(__file__).resolve().parent / "results"
BF16_RTOL, FP16_RTOL = 2e-2, 5e-3  # ZeRO's bf16 keeps bf16 weights, autocast fp32 ones: see test_mixed_precision
LLAMA = {"num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CORRECT_SHAPES = {
    "tiny": {**TINY, "num_hidden_layers": 2},
    "full": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4},
}
SPEED_SHAPES = {
    "tiny": ({**TINY, "num_hidden_layers": 2}, 2, 64),
    "full": ({"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 18}, 4, 2048),  # (shape, b, s)
}
SIZE_SHAPES = {  # (shape without the layer count, most layers tried, sequence)
    "tiny": (TINY, 48, 64),
    "full": (
        {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40},
        80,
        1024,
    ),
}
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.1}
# Fractions of a capacity the estimate may fill: activations and allocator rounding need the rest.
DEVICE_FILL, HOST_FILL, DISK_FILL = 0.80, 0.60, 0.80


# -- models and formulas ----------------------------------------------------------------------------------------
def llama_config(shape: dict, seq: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        **{**LLAMA, **shape}, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False
    )


def build_llama(config: transformers.LlamaConfig, device: str | torch.device = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def matmul_params(config: transformers.LlamaConfig, total_params: int) -> int:
    """N of the FLOP formula: every parameter but the input embedding table, which is looked up, not multiplied."""
    return total_params - config.vocab_size * config.hidden_size


def train_flops(n_matmul: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Model FLOPs of one training step on ``tokens`` tokens (forward and backward): 6 N T + 12 L H S T."""
    return 6.0 * n_matmul * tokens + 12.0 * layers * hidden * seq * tokens


def mfu(flops_per_step: float, step_s: float, peak_flops: float | None) -> float | None:
    return None if not peak_flops else flops_per_step / step_s / peak_flops


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s: ``--peak-tflops``, else looked up by its name; None on the host."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def activation_bytes(config: transformers.LlamaConfig, batch: int, seq: int) -> int:
    """Activations kept for backward, bf16, no checkpointing: ~34 S B H per layer (Korthikanti et al. 2022, with
    a fused attention kernel) and the logits in bf16 and fp32 with their gradient, 10 S B V."""
    sbh = seq * batch * config.hidden_size
    return 34 * sbh * config.num_hidden_layers + 10 * seq * batch * config.vocab_size


def largest_fitting(low: int, high: int, fits) -> int | None:
    """The largest n in [low, high] with ``fits(n)``, for ``fits`` true up to some n and false after; None if
    not even ``low`` fits. Binary search: log2(high - low) calls."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


# -- one training run -------------------------------------------------------------------------------------------
def _batch(config: transformers.LlamaConfig, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    system: dict, config, device: torch.device, batch: int, seq: int, steps: int, warmup: int = 0, exact: bool = True
) -> dict:
    """Build ``system`` (``kind``: torch, fsdp2 or zero, with ``precision``, ``compile`` and ZeRO options) on a
    fresh Llama, train ``warmup + steps`` steps on one batch; losses, step times and peak allocated bytes.
    ``exact``: every system starts from the same weights, built on the host; else each is built where it is
    fastest (ZeRO from the meta device, unit by unit on the device; the others on the device itself)."""
    system = dict(system)
    kind, precision, compiled = system.pop("kind"), system.pop("precision"), system.pop("compile", False)
    model = build_llama(config, "cpu" if exact else "meta" if kind == "zero" else device)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    if kind == "zero":
        pin = device.type == "cuda" and any(
            system.get(k, "none") != "none" for k in ("offload_optimizer", "offload_params")
        )
        zero = ZeroConfig(**system, precision=precision, pin_memory=pin)
        engine = ZeroEngine(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            zero,
            device=device,
            step_runner=step_runner_for(zero),
        )
        backward, step = engine.backward, engine.step
    else:
        model.to(device)
        if kind == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            precision = "32-true"  # FSDP2 casts itself
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

        def backward(loss):
            (scaler.scale(loss) if scaler else loss).backward()

        def step():
            scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
            optimizer.zero_grad(set_to_none=True)

    ids = _batch(config, batch, seq, device)
    losses, times = [], []
    for index in range(warmup + steps):
        if index == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        started = time.perf_counter()
        with autocast_for(precision, device.type):
            loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        step()
        _sync(device)
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "losses": losses,
        "times": times[warmup:],
        "peak": peak,
        "params": sum(p.numel() for p in model.parameters()),
    }


# -- parts ------------------------------------------------------------------------------------------------------
def correctness_runs(nvme_dir: str) -> dict[str, dict]:
    """name -> ZeRO system; each is compared with plain PyTorch at its precision."""
    runs = {
        f"stage{stage} {precision}": {"stage": stage, "precision": precision, "param_persistence_threshold": 0}
        for precision in ("bf16-mixed", "16-mixed")
        for stage in (0, 1, 2, 3)
    }
    bf16 = {"precision": "bf16-mixed"}
    runs["stage2 bf16-mixed cpu offload"] = {**bf16, "stage": 2, "offload_optimizer": "cpu"}
    runs["stage3 bf16-mixed cpu offload"] = {**bf16, "stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    runs["stage3 bf16-mixed nvme offload"] = {
        **bf16,
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_params": "nvme",
        "nvme_path": nvme_dir,
    }
    return {name: {"kind": "zero", **system} for name, system in runs.items()}


def compare_losses(system: dict, reference: list[float], config, device, batch, seq, steps):
    rtol = BF16_RTOL if system["precision"] == "bf16-mixed" else FP16_RTOL
    losses = train(system, config, device, batch, seq, steps)["losses"]
    error = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    learned = losses[-1] < losses[0]
    return error <= rtol and learned, {"max_rel_loss_error": error, "rtol": rtol, "last_loss": losses[-1]}


def triton_kernels(device: torch.device):
    """The compiled Triton kernels against their PyTorch references on CUDA tensors, every dtype they take."""
    from ds_strategy.kernels import dispatch

    generator = torch.Generator(device).manual_seed(0)
    worst, equal = 0.0, True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grad = torch.randn(1_000_003, device=device, generator=generator).to(dtype)
        for poisoned in (False, True):
            if poisoned:
                grad[12345] = float("inf")
            ours, theirs = grad.clone(), grad.clone()
            norm_t, inf_t = dispatch.unscale_and_check(ours, 0.5, backend="triton")
            norm_r, inf_r = dispatch.unscale_and_check(theirs, 0.5, backend="reference")
            equal &= torch.equal(ours, theirs) and bool(inf_t == inf_r)
            if not poisoned:
                worst = max(worst, abs(norm_t.item() - norm_r.item()) / norm_r.item())
        for bits in (8, 4):
            q_t, s_t = dispatch.quantize_blockwise(grad.nan_to_num(posinf=0.0), 256, bits, backend="triton")
            q_r, s_r = dispatch.quantize_blockwise(grad.nan_to_num(posinf=0.0), 256, bits, backend="reference")
            equal &= torch.equal(q_t, q_r) and torch.allclose(s_t, s_r)
            out_t = dispatch.dequantize_blockwise(q_t, s_t, grad.numel(), dtype, bits, backend="triton")
            out_r = dispatch.dequantize_blockwise(q_r, s_r, grad.numel(), dtype, bits, backend="reference")
            equal &= torch.equal(out_t, out_r)
    return equal and worst < 1e-4, {"norm_rel_error": worst, "values_equal": equal}


def memory_check(check, *args):
    result = check(*args)
    figures = {
        "peak_mib": result.measured / 2**20,
        "bound_mib": result.bound / 2**20,
        "values_equal": result.values_equal,
    }
    return result.passed, figures, result.formula


def run_correctness(runner: Runner, args, device: torch.device, scratch: Path) -> None:
    runner.start_part("correctness")
    config = llama_config(CORRECT_SHAPES[args.size], 256)
    batch, seq, steps = (1, 16, 3) if args.size == "tiny" else (2, 256, 5)
    references = {}
    for precision in ("bf16-mixed", "32-true"):
        item = runner.run(
            f"plain PyTorch {precision}",
            lambda p=precision: (
                True,
                {"losses": train({"kind": "torch", "precision": p}, config, device, batch, seq, steps)["losses"]},
            ),
        )
        references[precision] = item.metrics.get("losses")
    for name, system in correctness_runs(str(scratch / "nvme")).items():
        reference = references["bf16-mixed" if system["precision"] == "bf16-mixed" else "32-true"]
        runner.run(
            name,
            compare_losses,
            system,
            reference,
            config,
            device,
            batch,
            seq,
            steps,
            skip="" if reference else "its plain PyTorch reference did not run",
        )
    runner.run(
        "triton kernels compiled",
        triton_kernels,
        device,
        skip="" if device.type == "cuda" else "compiled Triton needs a CUDA device",
    )
    size = "tiny" if args.size == "tiny" else "small"
    for check in (gpu_check.check_placement, gpu_check.check_construction, gpu_check.check_offload):
        runner.run(f"memory {check.__name__.removeprefix('check_')}", memory_check, check, size, device)
    runner.run("memory loading", memory_check, gpu_check.check_loading, size, device, scratch)


def speed_systems(compile_modes: list[bool]) -> dict[str, dict]:
    eager = {"torch": {"kind": "torch"}, "fsdp2": {"kind": "fsdp2"}}  # the order they run in, most wanted first
    eager.update({f"zero{stage}": {"kind": "zero", "stage": stage} for stage in (2, 3, 0, 1)})
    return {
        f"{name}{' +compile' if compiled else ''}": {**system, "precision": "bf16-mixed", "compile": compiled}
        for compiled in compile_modes
        for name, system in eager.items()
    }


def measure_speed(system: dict, config, device, batch: int, seq: int, steps: int, peak: float | None):
    warmup = 3 if system.get("compile") else 2
    run = train(system, config, device, batch, seq, steps, warmup, exact=False)
    step_s = statistics.median(run["times"])
    tokens = batch * seq
    flops = train_flops(matmul_params(config, run["params"]), config.num_hidden_layers, config.hidden_size, seq, tokens)
    figures = {
        "tokens_per_s": tokens / step_s,
        "mfu": mfu(flops, step_s, peak),
        "step_ms": 1000 * step_s,
        "peak_alloc_gib": run["peak"] / 2**30 if run["peak"] is not None else None,
        "params": run["params"],
        "last_loss": run["losses"][-1],
    }
    return all(torch.isfinite(torch.tensor(run["losses"]))), figures


def run_speed(runner: Runner, args, device: torch.device) -> dict[str, Item]:
    runner.start_part("speed")
    shape, batch, seq = SPEED_SHAPES[args.size]
    config = llama_config(shape, seq)
    compile_modes = (
        [False, True] if args.compile == "on" or (args.compile == "auto" and device.type == "cuda") else [False]
    )
    peak = peak_flops(device, args.peak_tflops)
    done = {}
    for name, system in speed_systems(compile_modes).items():
        done[name] = runner.run(name, measure_speed, system, config, device, batch, seq, args.steps, peak)
    if compile_modes == [False]:
        runner.run("+compile", lambda: None, skip="torch.compile is off (--compile auto turns it on for CUDA only)")
    return done


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


def run_size(runner: Runner, args, device: torch.device, scratch: Path, speed: dict[str, Item]) -> None:
    runner.start_part("size")
    nvme = str(args.nvme_path) if args.nvme_path else None
    if nvme:
        Path(nvme).mkdir(parents=True, exist_ok=True)
    no_disk = "" if nvme else "no --nvme-path"
    rates = {
        "cpu": runner.run("offload cpu step vs none", offload_share, "cpu", args, device, None, speed.get("zero3"))
    }
    rates["nvme"] = runner.run(
        "offload nvme step vs none", offload_share, "nvme", args, device, nvme, speed.get("zero3"), skip=no_disk
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


# -- main -------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (or cuda:N) or cpu")
    parser.add_argument("--size", default="full", choices=("full", "tiny"), help="model sizes (tiny: seconds on a CPU)")
    parser.add_argument(
        "--budget", type=float, default=450.0, help="seconds for all parts (default leaves ~30 s of 8 min for start-up)"
    )
    parser.add_argument("--steps", type=int, help="timed steps per speed system (default: 5, tiny 2)")
    parser.add_argument(
        "--compile", default="auto", choices=("auto", "on", "off"), help="torch.compile rows (auto: on CUDA)"
    )
    parser.add_argument("--nvme-path", type=Path, help="a directory on a local disk: NVMe offload rows")
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's dense bf16 peak, if its name is not in the table"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu-suite", help="output path without suffix")
    parser.add_argument("--parts", default="correctness,speed,size", help="comma-separated subset of the parts")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.size == "tiny" else 5)
    unknown = set(args.parts.split(",")) - set(PART_SHARES)
    if unknown:
        parser.error(f"--parts {args.parts!r}: unknown {sorted(unknown)}; allowed: {', '.join(PART_SHARES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget, started = Budget(args.budget), time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("gpu_suite: torch sees no CUDA device; on the host use --device cpu", file=sys.stderr)
            return 2
        torch.cuda.set_device(device)
    if args.size == "tiny":
        torch.set_num_threads(1)  # the tiny models gain nothing from more, and a loaded host loses
    transformers.logging.set_verbosity_error()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "host"
    report = Report(
        args.out,
        {
            "title": f"GPU suite on {name}, world size 1, torch {torch.__version__}",
            "command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "budget_s": args.budget,
        },
    )
    runner = Runner(report, budget, min_item_s=15.0 if args.size == "full" else 1.0)
    parts = args.parts.split(",")
    hard_stop = hard_stop_after(args.budget + 20, report)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_suite_") as scratch:
            if "correctness" in parts:
                run_correctness(runner, args, device, Path(scratch))
            speed = run_speed(runner, args, device) if "speed" in parts else {}
            if "size" in parts:
                run_size(runner, args, device, Path(scratch), speed)
    finally:
        hard_stop.cancel()
        report.meta["seconds"] = time.monotonic() - started
        report.write()
        dist.destroy_process_group()
    print(f"{len(report.failed)} failed of {len(report.items)}; wrote {args.out}.json and .md")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
