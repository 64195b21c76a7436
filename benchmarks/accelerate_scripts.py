"""Hugging Face accelerate's own test scripts, run under ZeroAccelerator on 2 gloo CPU processes per ZeRO stage.

Each script's ``Accelerator`` is replaced by a ZeroAccelerator at the stage under test, and each of its checks is
called on its own, so one failing check does not hide the others. A check passes when it passes on every rank.
Where a check fails by design (it reads what ZeRO shards away, or needs DDP's machinery), ``BY_DESIGN`` says why;
any other failure is a bug. Writes ``benchmarks/results/accelerate-scripts.{md,json}``.

    python benchmarks/accelerate_scripts.py [--stages 1,2,3]

Run with ``--worker`` by torchrun, one process per rank (the command above launches it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SCRIPTS = "accelerate.test_utils.scripts"
_FP32_PARTS = " (fp32 parts)"
ACCUMULATION = [
    (split, dispatch, each) for split in (True, False) for dispatch in (True, False) for each in (True, False)
]
# (script, check, arguments); "accelerator" stands for an accelerator built by the script's own Accelerator().
# "training_check (fp32 parts)" is training_check with the script's is_bf16_available / is_fp16_available
# answering False, so that its fp32 comparisons are reported apart from its mixed-precision ones.
CHECKS = [
    ("test_sync", "test_dataloader_break", ()),
    ("test_sync", "test_distributed_sync", ("accelerator",)),
    ("test_sync", "test_distributed_sync_multiple_fwd", ("accelerator",)),
    *[("test_sync", "test_gradient_accumulation", args) for args in ACCUMULATION],
    *[("test_sync", "test_gradient_accumulation_with_opt_and_scheduler", args) for args in ACCUMULATION],
    ("test_script", "training_check", (False,)),
    ("test_script", "training_check", (True,)),
    *[("test_script", f"training_check{_FP32_PARTS}", (sampler,)) for sampler in (False, True)],
    ("test_distributed_data_loop", "test_default_ensures_even_batch_sizes", ()),
    ("test_distributed_data_loop", "test_can_disable_even_batches", ()),
    ("test_distributed_data_loop", "test_join_can_override_even_batches", ()),
    ("test_distributed_data_loop", "test_join_can_override_for_mixed_type_dataloaders", ()),
    ("test_distributed_data_loop", "test_join_raises_warning_for_iterable_when_overriding_even_batches", ()),
    ("test_distributed_data_loop", "test_pickle_accelerator", ()),
]
# Not run: test_distributed_data_loop's test_can_join_uneven_inputs has rank 0 run two backwards and rank 1 one.
# DDP's Join shadows the missing collectives; a ZeRO engine (like DeepSpeed's) needs every rank to run the same
# backward calls, so the extra one waits until collective_timeout.
NOT_RUN = {
    "test_can_join_uneven_inputs": "uneven backward counts per rank need DDP's Join; ZeRO requires every "
    "rank to run the same backward calls (as DeepSpeed does)"
}
# check -> (stages where it fails by design, why)
BY_DESIGN = {
    "test_distributed_sync": (
        (2, 3),
        "reads param.grad, which is None at stage 2/3: gradients live only as reduced shards",
    ),
    "test_distributed_sync_multiple_fwd": ((2, 3), "reads param.grad (None at stage 2/3)"),
    "test_gradient_accumulation": ((2, 3), "reads param.grad (None at stage 2/3)"),
    "test_gradient_accumulation_with_opt_and_scheduler": (
        (1, 2, 3),
        "compares param.grad after optimizer.step(): the engine's step consumes the gradients (as "
        "DeepSpeed's does) and leaves .grad None until the next backward",
    ),
    "training_check": (
        (1, 2, 3),
        "its bf16 part compares bf16 training with fp32 training to 1e-6: accelerate's DDP path keeps "
        "fp32 weights under autocast, the engine computes with 16-bit weights beside fp32 masters "
        "(ZeRO's mixed precision); its fp32 parts pass (the next rows)",
    ),
}


def _run_check(module, check: str, args: tuple, accelerator_class) -> str:
    """Like each script's main(): a fresh accelerator state, an accelerator made first, then the check."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = accelerator_class()
    arguments = [accelerator if a == "accelerator" else a for a in args]
    saved = {}
    if check.endswith(_FP32_PARTS):
        saved = {name: getattr(module, name) for name in ("is_bf16_available", "is_fp16_available")}
        for name in saved:
            setattr(module, name, lambda *args, **kwargs: False)
    try:
        getattr(module, check.removesuffix(_FP32_PARTS))(*arguments)
        return "passed"
    except Exception as error:  # a check's failure is its result; the next check still runs
        where = traceback.extract_tb(error.__traceback__)[-1]
        message = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return f"{type(error).__name__} at {Path(where.filename).name}:{where.lineno}: {message}"
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def worker(out: str, scripts: list[str]) -> None:
    import torch.distributed as dist

    from ds_strategy.accelerate import ZeroAccelerator  # configured by $DS_STRATEGY_CONFIG (see run_stage)

    accelerator_class = ZeroAccelerator
    results = []
    for script, check, args in checks_of(scripts):
        module = importlib.import_module(f"{SCRIPTS}.{script}")
        module.Accelerator = accelerator_class
        mine = _run_check(module, check, args, accelerator_class)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        failed = [f"rank {r}: {result}" for r, result in enumerate(everyone) if result != "passed"]
        results.append(
            {
                "script": script,
                "check": check,
                "args": list(args),
                "result": "passed" if not failed else "; ".join(failed),
            }
        )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))


def checks_of(scripts: list[str]) -> list[tuple]:
    return [check for check in CHECKS if check[0] in scripts]


def run_stage(stage: int, scripts: list[str], timeout: float = 900) -> list[dict]:
    """Launch the worker on 2 processes with torchrun and return its per-check results, in ``CHECKS`` order."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "results.json")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DS_STRATEGY_CONFIG": json.dumps({"stage": stage, "collective_timeout": 60}),
        }
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                str(_free_port()),
                __file__,
                "--worker",
                "--scripts",
                ",".join(scripts),
                "--out",
                str(out),
            ],
            check=True,
            env=env,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(out.read_text())


def verdict(result: dict, stage: int) -> str:
    """ "passed", "by design" (a failure ``BY_DESIGN`` explains) or "FAILED" (a bug)."""
    if result["result"] == "passed":
        return "passed"
    return "by design" if stage in BY_DESIGN.get(result["check"], ((), ""))[0] else "FAILED"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--scripts", default=",".join(dict.fromkeys(c[0] for c in CHECKS)))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.out, args.scripts.split(","))
        return 0
    stages, scripts = [int(s) for s in args.stages.split(",")], args.scripts.split(",")
    table = {stage: run_stage(stage, scripts) for stage in stages}
    lines = [
        "| script | check | arguments | " + " | ".join(f"stage {s}" for s in stages) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in stages) + " |",
    ]
    bugs = 0
    for i, (script, check, arguments) in enumerate(checks_of(scripts)):
        cells = [verdict(table[s][i], s) for s in stages]
        bugs += cells.count("FAILED")
        lines.append(f"| {script} | {check} | {', '.join(map(str, arguments))} | " + " | ".join(cells) + " |")
    notes = [f"- `{check}` (stages {', '.join(map(str, st))}): {why}" for check, (st, why) in BY_DESIGN.items()]
    notes += [f"- `{check}` is not run: {why}" for check, why in NOT_RUN.items()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "accelerate-scripts.md").write_text("\n".join(lines + ["", *notes]) + "\n")
    (RESULTS / "accelerate-scripts.json").write_text(json.dumps({str(s): r for s, r in table.items()}, indent=1))
    print("\n".join(lines + ["", *notes]))
    print(f"{bugs} check(s) failed that should pass")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
