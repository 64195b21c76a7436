"""``ds-strategy estimate``: model-state bytes per rank for every ZeRO stage and offload mode, as a table."""

from __future__ import annotations

import argparse
import json

from ..estimate import ModelSize, estimate_memory, meta_model, valid_offloads

HELP = "estimate model-state memory per rank for every ZeRO stage and offload mode"

_UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="trainable parameter count, e.g. 7.5e9 (the paper's formulas)")
    what.add_argument(
        "--model",
        choices=("tiny", "small", "medium"),
        help="a ds_strategy GPT preset, counted from its modules (adds units and buckets)",
    )
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    parser.add_argument(
        "--precision",
        default="bf16-mixed",
        help="32-true, bf16-mixed, 16-mixed, bf16-true or 16-true (default bf16-mixed: 2+2+12 bytes)",
    )
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="only this stage (default: all)")
    parser.add_argument("--largest-layer", type=float, help="elements of the largest stage-3 unit (working set)")
    parser.add_argument("--reduce-bucket-size", type=float, help="gradient bucket elements (adds bucket buffers)")
    parser.add_argument("--optimizer-states", type=int, default=2, help="moments per parameter (Adam 2, SGD 1, Muon 1)")
    parser.add_argument(
        "--largest-whole-param",
        type=float,
        default=0,
        help="elements of the largest parameter a whole-tensor optimizer (Muon) keeps whole on one rank",
    )
    parser.add_argument("--no-offload", action="store_true", help="leave out the offload rows")
    parser.add_argument(
        "--unit", choices=tuple(_UNITS), default="GB", help="byte unit (default GB = 1e9, as the paper)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    model = args.params if args.params is not None else _gpt(args.model)
    rows = []
    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    for stage in stages:
        offloads = [("none", "none")] if args.no_offload else valid_offloads(stage)
        for offload_optimizer, offload_params in offloads:
            rows.append(
                estimate_memory(
                    model,
                    args.world_size,
                    stage,
                    offload_optimizer,
                    offload_params,
                    args.precision,
                    largest_layer=None if args.largest_layer is None else int(args.largest_layer),
                    optimizer_states=args.optimizer_states,
                    largest_whole_param=int(args.largest_whole_param),
                    reduce_bucket_size=None if args.reduce_bucket_size is None else int(args.reduce_bucket_size),
                )
            )
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **{
                            k: getattr(r, k)
                            for k in ("stage", "world_size", "precision", "offload_optimizer", "offload_params")
                        },
                        "bytes": r.bytes,
                        "device": r.device,
                        "host": r.host,
                        "nvme": r.nvme,
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return 0
    size = None if args.params is not None else ModelSize.of_module(model)
    print(_heading(args, size))
    print(format_table(rows, args.unit))
    return 0


def _gpt(preset: str):
    """The preset built on the meta device: its shapes, units and buckets count, not its memory."""
    from ..models import GPT, gpt_config

    return meta_model(lambda: GPT(gpt_config(preset)))


def _heading(args: argparse.Namespace, size: ModelSize | None) -> str:
    count = args.params if size is None else size.params
    what = f"GPT '{args.model}', {count / 1e6:,.1f}M trainable parameters" if size else f"{count / 1e9:g}B parameters"
    whole = (
        f", a whole-tensor optimizer's largest parameter ({args.largest_whole_param:,.0f} elements) on top of each "
        f"partitioned 1/N"
        if args.largest_whole_param
        else ""
    )
    return (
        f"ZeRO model-state bytes per rank: {what} on {args.world_size} ranks, {args.precision}, "
        f"{args.optimizer_states} optimizer states per parameter{whole} ({args.unit} = {_UNITS[args.unit]:g} bytes)\n"
    )


def format_table(rows, unit: str = "GB") -> str:
    """A Markdown table of estimates: one row per (stage, offload) with device / host / nvme totals.

    A last column shows how much of the total is gradient buckets, when any row has some.
    """
    scale = _UNITS[unit]
    show = lambda value: f"{value / scale:,.2f} {unit}" if value else "0"
    with_buffers = any(r.total(kinds=("buffers",)) for r in rows)
    lines = [
        "| stage | partitions | offload optimizer | offload params | device | host | nvme |"
        + (" of which buckets |" if with_buffers else ""),
        "|---|---|---|---|---:|---:|---:|" + ("---:|" if with_buffers else ""),
    ]
    for r in rows:
        cells = [show(value) for value in (r.device, r.host, r.nvme)]
        cells += [show(r.total(kinds=("buffers",)))] if with_buffers else []
        lines.append(
            f"| {r.stage} | {r.label} | {r.offload_optimizer} | {r.offload_params} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)
