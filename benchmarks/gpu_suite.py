"""One GPU, one command: does ds_strategy run on CUDA, is it right, how fast, and how big a model fits.

On the device, from the repository root (no network needed, see docs/gpu.md):

    pip install --no-deps --no-build-isolation --no-index -e . ; python benchmarks/gpu_suite.py

    python benchmarks/gpu_suite.py --nvme-path /local/disk/dir       # also sizes the largest model with NVMe offload
    python benchmarks/gpu_suite.py --device cpu --size tiny          # the rehearsal on the host, in minutes

The install is offline: no dependencies fetched, no isolated build environment (which would download setuptools),
editable (a wheel built elsewhere once lacked ``ds_strategy.compose``), so the installed package is this checkout. The
suite stops at once, naming that command, when ``ds_strategy`` is not installed, and its first item fails when the
one installed is not this checkout's. The checkout's root is never put on ``sys.path``: its ``kernels/`` folder
(installed as ``ds_strategy.kernels``) would hide PyPI's ``kernels``, which transformers imports since 5.25. torch
and transformers must be there already.

World size 1 (NCCL on CUDA, gloo on the host) except the two-rank part. Parts, in this order (``PARTS``), each item
time-boxed (``--budget`` seconds in all, shared out as the parts' shares; a part's leftover goes to the next):

smoke        the first minute's answers: every ds_strategy module imports, one ZeRO-3 step, one offloaded step and one
             compiled ZeRO-3 step on the device, and the report is on disk.
correctness  stages 0-3 in fp32 with SGD (whose update scales with the gradient: a wrong gradient scale shows) and
             AdamW, losses and every parameter within ``FP32_RTOL`` of the same training in plain PyTorch; stages 0-3
             under bf16-mixed (AdamW, losses within ``BF16_RTOL`` of bf16 autocast with fp32 weights) and 16-mixed
             (within ``FP16_RTOL`` of fp32 PyTorch taking exactly the steps the loss scaler took); CPU offload
             (stage 2 optimizer; stage 3 optimizer and parameters, pinned on CUDA, in fp32 SGD and bf16) and NVMe
             offload (stage 3); on one repeated batch, so a missed or wrong step moves the losses. Then the Triton
             kernels compiled (CUDA only) against their PyTorch references, and ``gpu_check.py``'s placement,
             construction, loading and offload memory bounds.
two_ranks    ``two_ranks.py``: two processes on this one device (gloo, as NCCL refuses two ranks on one GPU), stages
             1-3 against DDP with communication overlapped, and a stage-3 sharded checkpoint round trip.
speed        a Llama-shaped model (``SPEED_SHAPES`` in ``suite_training.py``, 0.98B parameters on CUDA), bf16,
             sequence 2048: ZeRO stages 0-3 against plain PyTorch (fp32 weights, bf16 autocast) and FSDP2
             ``fully_shard`` (bf16 parameters, fp32 reduction), eager and with ``torch.compile`` on each decoder
             layer (a compiled row that compiled nothing fails: Note: [A compiled row that runs eager]): tokens/s,
             MFU and peak allocated memory. MFU = model FLOPs per step / step time / the device's dense bf16 peak,
             with (PaLM, appendix B) model FLOPs = 6 N T + 12 L H S T for T tokens per step, N the parameters that
             take part in matmuls (all but the input embedding), L layers, H the hidden size and S the sequence
             length (attention counted without the causal half, as PaLM and Megatron do). Then the host-overhead
             row (``host_overhead.one_rank_row``): 96 blocks of ``Linear(64, 64)``, one rank, ZeRO-2 and ZeRO-3
             step time against plain torch's, where the device waits on the host's per-unit work.
long_context ``suite_long_context.py``: the longest sequence of one training step of a 110M-parameter Hugging Face
             Llama (32K vocabulary, ``long_context.py``) within 8 GiB of device memory, for the plain Hugging Face
             Trainer, ``ZeroTrainer`` at stage 3 with tiled MLP and loss and host-offloaded checkpoints, and the
             same on 2 ranks with Ulysses sp=2 (2 devices; skipped on one): length, tokens/s, peak memory. Its share
             of the default budget allows a few probes, so its lengths are lower bounds marked as such;
             ``--parts long_context`` gives it the whole budget.
size         ``suite_size.py``: the largest Llama-shaped model (13B-like layers, the layer count searched) that the
             estimator (``ds_strategy.estimate``) says fits with stage 3 and CPU offload, then 2 steps of it; the
             same with NVMe offload when ``--nvme-path`` is given; and the offload step time as a percentage of the
             step without offload, on the speed model.

Writes ``<out>.json`` and ``<out>.md`` after every item, so a run cut short still leaves what it measured. Exit
status 1 if any item failed, raised or (smoke, correctness, two ranks) overran its time box; items skipped (no
CUDA, no time left) do not fail it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import pkgutil
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
INSTALL = "pip install --no-deps --no-build-isolation --no-index -e ."
if importlib.util.find_spec("ds_strategy") is None:
    sys.exit(f"ds_strategy is not installed; from {CHECKOUT}: {INSTALL}")

import gpu_check  # noqa: E402
import host_overhead  # noqa: E402
import rank_kill  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
import two_ranks  # noqa: E402
from suite_harness import Budget, Part, Report, Runner, SuiteContext, hard_stop_after, resolve_device  # noqa: E402
from suite_long_context import run_long_context  # noqa: E402
from suite_size import run_size  # noqa: E402
from suite_training import (  # noqa: E402
    CORRECT_SHAPES,
    SPEED_SHAPES,
    llama_config,
    matmul_params,
    mfu,
    train,
    train_flops,
)

RESULTS = Path(__file__).resolve().parent / "results"
# ZeRO's bf16 keeps bf16 weights, autocast fp32 ones (see test_mixed_precision); fp16 is compared with fp32; fp32
# with fp32, where only a matmul's algorithm may differ (flat-buffer views are aligned differently): a wrong gradient
# scale moves SGD's parameters by percents.
BF16_RTOL, FP16_RTOL, FP32_RTOL = 2e-2, 5e-3, 1e-4
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.1}


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s: ``--peak-tflops``, else looked up by its name; None on the host."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


# -- smoke ------------------------------------------------------------------------------------------------------
def import_every_module():
    """Every ds_strategy module imports, but for those needing an optional package that is not installed."""
    import ds_strategy

    imported, optional, broken = 0, set(), []
    for module in pkgutil.walk_packages(ds_strategy.__path__, "ds_strategy."):
        try:
            importlib.import_module(module.name)
            imported += 1
        except ModuleNotFoundError as error:
            missing = error.name or "?"
            if missing.startswith("ds_strategy"):
                broken.append(f"{module.name}: {error}")
            else:
                optional.add(missing.split(".")[0])
        except Exception as error:  # noqa: BLE001 - any other import error is a broken module
            broken.append(f"{module.name}: {type(error).__name__}: {error}")
    try:
        installed = importlib.metadata.version("ds_strategy")
    except importlib.metadata.PackageNotFoundError:
        installed = "no"
    figures = {
        "modules": imported,
        "from": str(Path(ds_strategy.__file__).parent),
        "installed": installed,
        "optional_missing": ", ".join(sorted(optional)) or "none",
    }
    if Path(ds_strategy.__file__).resolve().parent != CHECKOUT / "ds_strategy":
        broken.append(f"the installed ds_strategy is not this checkout's; from {CHECKOUT}: {INSTALL}")
    return not broken, figures, "; ".join(broken)


def one_step(device: torch.device, **system):
    """One training step of a tiny Llama under ``system`` (ZeRO stage 3, bf16, unless given)."""
    config = llama_config(CORRECT_SHAPES["tiny"], 16)
    system = {"kind": "zero", "stage": 3, "precision": "bf16-mixed", "param_persistence_threshold": 0, **system}
    run = train(system, config, device, 1, 16, 1)
    figures = {"loss": run["losses"][0], "seconds": sum(run["times"]), **run.get("pinned", {})}
    passed = bool(torch.isfinite(torch.tensor(run["losses"])).all())
    if "compiled_frames" in run:
        figures.update(compiled_frames=run["compiled_frames"], graph_breaks=run["graph_breaks"])
        if not run["compiled_frames"]:
            return False, figures, "compiled nothing: the step ran eager"
    return passed, figures


def report_on_disk(report: Report):
    written = json.loads(report.path.with_suffix(".json").read_text())
    return len(written["items"]) == len(report.items), {"items": len(written["items"])}


def run_smoke(runner: Runner, context: SuiteContext) -> None:
    device = context.device
    runner.run("import ds_strategy", import_every_module)
    runner.run("one ZeRO-3 step", one_step, device)
    runner.run("one offloaded step", one_step, device, offload_optimizer="cpu", offload_params="cpu")
    runner.run("one compiled ZeRO-3 step", one_step, device, compile=True)
    runner.run("report written", report_on_disk, runner.report)


# -- correctness ------------------------------------------------------------------------------------------------
def correctness_runs(nvme_dir: str) -> dict[str, dict]:
    """name -> ZeRO system; each is compared with plain PyTorch at its precision and with its optimizer."""
    zero = {"kind": "zero", "param_persistence_threshold": 0}
    runs = {
        f"stage{stage} 32-true {optimizer}": {**zero, "stage": stage, "precision": "32-true", "optimizer": optimizer}
        for optimizer in ("sgd", "adamw")
        for stage in (0, 1, 2, 3)
    }
    runs.update(
        {
            f"stage{stage} {precision}": {**zero, "stage": stage, "precision": precision, "optimizer": "adamw"}
            for precision in ("bf16-mixed", "16-mixed")
            for stage in (0, 1, 2, 3)
        }
    )
    cpu2 = {"stage": 2, "offload_optimizer": "cpu"}
    cpu3 = {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    fp32_sgd, bf16 = {"precision": "32-true", "optimizer": "sgd"}, {"precision": "bf16-mixed", "optimizer": "adamw"}
    runs["stage2 32-true sgd cpu offload"] = {**zero, **fp32_sgd, **cpu2}
    runs["stage3 32-true sgd cpu offload"] = {**zero, **fp32_sgd, **cpu3}
    runs["stage2 bf16-mixed cpu offload"] = {**zero, **bf16, **cpu2}
    runs["stage3 bf16-mixed cpu offload"] = {**zero, **bf16, **cpu3}
    runs["stage3 bf16-mixed nvme offload"] = {
        **zero,
        **bf16,
        "stage": 3,
        "offload_optimizer": "nvme",
        "offload_params": "nvme",
        "nvme_path": nvme_dir,
    }
    return runs


REFERENCES = {  # name -> plain PyTorch system; 16-mixed rows train theirs, replaying the loss scaler's skips
    "plain PyTorch bf16-mixed adamw": {"kind": "torch", "precision": "bf16-mixed", "optimizer": "adamw"},
    "plain PyTorch 32-true adamw": {"kind": "torch", "precision": "32-true", "optimizer": "adamw"},
    "plain PyTorch 32-true sgd": {"kind": "torch", "precision": "32-true", "optimizer": "sgd"},
}


def reference_for(system: dict) -> str | None:
    """The name of the reference a row is compared with; None for 16-mixed (see ``compare_with_reference``)."""
    precision = system["precision"]
    return None if precision == "16-mixed" else f"plain PyTorch {precision} {system['optimizer']}"


def relative_error(values: torch.Tensor, reference: torch.Tensor) -> float:
    return ((values - reference).norm() / reference.norm()).item()


def compare_with_reference(system: dict, reference: dict | None, config, device, batch, seq, steps):
    """``system`` against ``reference`` (a plain PyTorch run), or, for fp16, against fp32 PyTorch taking exactly
    the steps ZeRO's loss scaler took: an overflow skips a step on purpose, which a reference that never skips
    would call a wrong loss. fp32 rows compare every parameter too. A row must learn (its last loss below its
    first, once a step was taken before it) and must have taken a step at all."""
    precision, exact = system["precision"], system["precision"] == "32-true"
    run = train(system, config, device, batch, seq, steps, keep_params=exact)
    if reference is None:
        replay = {"kind": "torch", "precision": "32-true", "optimizer": system["optimizer"]}
        reference = train(replay, config, device, batch, seq, steps, taken=run["stepped"])
    losses, taken = run["losses"], run["stepped"]
    rtol = {"bf16-mixed": BF16_RTOL, "16-mixed": FP16_RTOL, "32-true": FP32_RTOL}[precision]
    figures = {
        "max_rel_loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])),
        "rtol": rtol,
        "last_loss": losses[-1],
        "skipped_steps": taken.count(False),
        **run.get("pinned", {}),
    }
    passed = figures["max_rel_loss_error"] <= rtol
    if exact:
        figures["rel_weight_error"] = relative_error(run["weights"], reference["weights"])
        passed &= figures["rel_weight_error"] <= rtol
    if not any(taken):
        return False, figures, "every step was skipped: the loss scale never settled"
    if any(taken[:-1]):
        passed &= losses[-1] < losses[0]
    return passed, figures


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


def run_correctness(runner: Runner, context: SuiteContext) -> None:
    args, device, scratch = context.args, context.device, context.scratch
    config = llama_config(CORRECT_SHAPES[args.size], 256)
    batch, seq, steps = (1, 16, 3) if args.size == "tiny" else (2, 256, 5)
    references = {}
    for name, system in REFERENCES.items():
        exact = system["precision"] == "32-true"

        def reference(name=name, system=system, exact=exact):
            run = train(system, config, device, batch, seq, steps, keep_params=exact)
            references[name] = run
            return True, {"losses": run["losses"]}

        runner.run(name, reference)
    for name, system in correctness_runs(str(scratch / "nvme")).items():
        wanted = reference_for(system)
        reference = references.get(wanted) if wanted else None
        missing = wanted is not None and reference is None
        runner.run(
            name,
            compare_with_reference,
            system,
            reference,
            config,
            device,
            batch,
            seq,
            steps,
            skip=f"its reference ({wanted}) did not run" if missing else "",
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


# -- two ranks --------------------------------------------------------------------------------------------------
def two_ranks_on_this_device(context: SuiteContext, out: Path):
    """``two_ranks.py``'s two ranks on this device; killed if the time box ends them."""
    status, output = two_ranks.launch(str(context.device), context.args.size, out)
    checks = json.loads(out.read_text())["checks"] if out.exists() else []
    note = "" if checks and status in (0, 1) else output[-1500:]
    return status in (0, 1) and bool(checks), {"checks": len(checks), "exit_status": status}, note


def run_two_ranks(runner: Runner, context: SuiteContext) -> None:
    out = context.scratch / "two_ranks.json"
    started = runner.run("two ranks: start, train, finish", two_ranks_on_this_device, context, out)
    checks = json.loads(out.read_text())["checks"] if out.exists() else []
    for check in checks:
        runner.run(check["name"], lambda check=check: (check["passed"], check["metrics"], check["note"]))
    if started.status != "pass" and not checks:
        runner.run("stage1-3 vs DDP, checkpoint", lambda: None, skip="the two ranks did not report")
    cuda = context.device.type == "cuda"
    runner.run(
        "rank killed in a save",
        lambda: rank_kill.verdict(rank_kill.launch(str(context.device), context.scratch / "rank_kill.json")),
        skip="" if cuda else "CUDA only (on the host: tests/e2e/test_rank_fault_matrix.py)",
    )


# -- speed ------------------------------------------------------------------------------------------------------
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
    finite = all(torch.isfinite(torch.tensor(run["losses"])))
    if "compiled_frames" in run:
        figures.update(compiled_frames=run["compiled_frames"], graph_breaks=run["graph_breaks"])
        if not run["compiled_frames"]:
            return False, figures, "compiled nothing: the row ran eager"
    return finite, figures


def run_speed(runner: Runner, context: SuiteContext) -> None:
    args, device = context.args, context.device
    shape, batch, seq = SPEED_SHAPES[args.size]
    config = llama_config(shape, seq)
    compile_modes = (
        [False, True] if args.compile == "on" or (args.compile == "auto" and device.type == "cuda") else [False]
    )
    peak = peak_flops(device, args.peak_tflops)
    for name, system in speed_systems(compile_modes).items():
        context.items[name] = runner.run(name, measure_speed, system, config, device, batch, seq, args.steps, peak)
    runner.run("host overhead: 96 small blocks", host_overhead.one_rank_row, device)
    if compile_modes == [False]:
        runner.run("+compile", lambda: None, skip="torch.compile is off (--compile auto turns it on for CUDA only)")


# -- main -------------------------------------------------------------------------------------------------------
PARTS = [  # run in this order; a new benchmark is one more entry (see docs/gpu.md)
    Part("smoke", 0.12, run_smoke),  # with the default budget, ~55 s: inductor's first compilation is most of it
    Part("correctness", 0.28, run_correctness),
    Part("two_ranks", 0.15, run_two_ranks),
    Part("speed", 0.27, run_speed),
    Part("long_context", 0.10, run_long_context),
    Part("size", 0.18, run_size),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (this rank's: LOCAL_RANK), cuda:N or cpu")
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
    names = [part.name for part in PARTS]
    parser.add_argument("--parts", default=",".join(names), help="comma-separated subset of the parts")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.size == "tiny" else 5)
    unknown = set(args.parts.split(",")) - set(names)
    if unknown:
        parser.error(f"--parts {args.parts!r}: unknown {sorted(unknown)}; allowed: {', '.join(names)}")
    return args


def start(device: torch.device, size: str) -> None:
    """This process's device and its world of one rank (NCCL on CUDA, gloo on the host)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if size == "tiny":
        torch.set_num_threads(1)  # the tiny models gain nothing from more, and a loaded host loses
    transformers.logging.set_verbosity_error()
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        print(f"gpu_suite: {error}", file=sys.stderr)
        return 2
    started = time.monotonic()
    start(device, args.size)
    chosen = [part for part in PARTS if part.name in args.parts.split(",")]
    budget = Budget(args.budget, {part.name: part.share for part in chosen})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "host"
    report = Report(
        args.out,
        {
            "title": f"GPU suite on {name} ({device}), world size 1, torch {torch.__version__}",
            "command": "python benchmarks/gpu_suite.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "budget_s": args.budget,
        },
    )
    runner = Runner(report, budget, min_item_s=15.0 if args.size == "full" else 1.0)
    hard_stop = hard_stop_after(args.budget + 20, report)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_suite_") as scratch:
            context = SuiteContext(args, device, Path(scratch))
            for part in chosen:
                runner.start_part(part.name)
                part.run(runner, context)
    finally:
        hard_stop.cancel()
        report.meta["seconds"] = time.monotonic() - started
        report.write()
        dist.destroy_process_group()
    print(f"{len(report.failed)} failed of {len(report.items)}; wrote {args.out}.json and .md")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
