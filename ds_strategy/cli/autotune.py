"""``ds-strategy autotune``: the fastest ZeRO configuration that fits a memory budget, written as configs."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from pathlib import Path

HELP = "find the fastest ZeRO configuration that fits a memory budget, by estimate and short trials"

_SIZE_SUFFIXES = {
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5e9' or '3GB' as a byte count."""
    lowered = text.strip().lower()
    for suffix in sorted(_SIZE_SUFFIXES, key=len, reverse=True):
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * _SIZE_SUFFIXES[suffix])
    return int(float(lowered))


def _numbers(text: str) -> list[int]:
    return [int(float(item)) for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--model",
        choices=("tiny", "small", "medium"),
        default="tiny",
        help="tune ds_strategy's GPT preset on the stdlib corpus (default tiny)",
    )
    what.add_argument("--module", help="your LightningModule factory, 'package.module:function'")
    parser.add_argument("--datamodule", help="your DataModule factory, 'package.module:function' (with --module)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per trial (default 2)")
    parser.add_argument(
        "--memory-budget", type=parse_bytes, help="model-state bytes per rank, e.g. 2GiB (default: what the device has)"
    )
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds for the whole search")
    parser.add_argument("--stages", type=_numbers, default=[0, 1, 2, 3], help="e.g. 1,2,3")
    parser.add_argument("--micro-batch-sizes", type=_numbers, default=[8, 4, 2, 1], help="per rank, e.g. 8,4,2")
    parser.add_argument(
        "--reduce-bucket-sizes",
        type=_numbers,
        default=[5_000_000, 500_000_000],
        help="gradient bucket elements to try, e.g. 5e6,5e8",
    )
    parser.add_argument("--precisions", help="also tune precision, e.g. 32-true,bf16-mixed")
    parser.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="also tune any ZeroConfig field, e.g. --try offload_optimizer=none,cpu "
        "--try overlap_comm=true,false (repeatable; values read as YAML scalars)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per trial")
    parser.add_argument("--trial-timeout", type=float, default=300.0, help="seconds before a trial is killed")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--output", default="configs/strategy/autotuned.yaml", help="Hydra strategy config to write")
    parser.add_argument(
        "--deepspeed-output", default="ds_config.autotuned.json", help="DeepSpeed-style JSON to write ('' for none)"
    )
    parser.add_argument("--log-dir", help="where each trial's rank logs go (default: a temporary folder)")
    parser.add_argument("--results", help="also write every trial's outcome to this JSON file")


def _import(reference: str):
    module, _, name = reference.partition(":")
    if not name:
        raise SystemExit(f"{reference!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def _tries(tries: list[str]) -> dict[str, list]:
    """``["offload_optimizer=none,cpu"]`` as ``{"offload_optimizer": ["none", "cpu"]}``; ZeroConfig checks them."""
    import yaml

    dimensions = {}
    for text in tries:
        field, equals, values = text.partition("=")
        if not equals or not values:
            raise SystemExit(f"--try {text!r} must look like FIELD=VALUE1,VALUE2")
        dimensions[field.strip()] = [_scalar(yaml.safe_load(value.strip())) for value in values.split(",")]
    return dimensions


def _scalar(value):
    """YAML reads '5e6' as a string; a number written that way is meant as one."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    return value


def run(args: argparse.Namespace) -> int:
    from ..autotune import Autotuner

    if args.module:
        model_factory = _import(args.module)
        datamodule_factory = _import(args.datamodule) if args.datamodule else None
    else:
        from ..autotune.gpt_task import gpt_task, stdlib_data

        model_factory = functools.partial(gpt_task, args.model)
        datamodule_factory = functools.partial(stdlib_data, args.model)
    dimensions = {"stage": args.stages, "reduce_bucket_size": args.reduce_bucket_sizes}
    if args.precisions:
        dimensions["precision"] = [p.strip() for p in args.precisions.split(",")]
    dimensions.update(_tries(args.tries))
    tuner = Autotuner(
        model_factory,
        datamodule_factory,
        world_size=args.world_size,
        memory_budget=args.memory_budget,
        time_budget=args.time_budget,
        dimensions=dimensions,
        micro_batch_sizes=args.micro_batch_sizes,
        warmup=args.warmup,
        steps=args.steps,
        trial_timeout=args.trial_timeout,
        accelerator=args.accelerator,
        log_dir=args.log_dir,
    )
    result = tuner.run()
    if args.results:
        path = Path(args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results_document(result), indent=2, default=str) + "\n")
    if result.best is None:
        print("no configuration completed a trial; nothing written")
        return 1
    for path in tuner.write(result, args.output or None, args.deepspeed_output or None):
        print(f"wrote {path}")
    return 0


def results_document(result) -> dict:
    """Every trial as plain data, for ``--results``."""
    return {
        "memory_budget": result.memory_budget,
        "seconds": result.seconds,
        "best": result.best.candidate.label if result.best else None,
        "trials": [
            {
                "configuration": t.candidate.label,
                "status": t.status,
                "reason": t.reason,
                "estimated_bytes": t.estimated_bytes,
                "measured_bytes": t.measured_bytes,
                "step_seconds": t.step_seconds,
                "samples_per_s": t.samples_per_s,
                "tokens_per_s": t.tokens_per_s,
                "seconds": t.seconds,
            }
            for t in result.trials
        ],
    }
