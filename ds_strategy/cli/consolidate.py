"""``ds-strategy consolidate CKPT OUT``: one full state dict from a sharded checkpoint (see
:func:`ds_strategy.checkpoint.consolidate`)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..checkpoint import CheckpointError, consolidate

HELP = "write a sharded ds_strategy checkpoint as one .pt or .safetensors state dict"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint directory (as written by ZeroStrategy or ds_strategy.checkpoint.save)"
    )
    parser.add_argument("out", help="output file; its suffix, .pt or .safetensors, picks the format")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating-point weights (default: as stored, fp32 for trained parameters)",
    )
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also write the optimizer state, keyed by parameter name (.pt only)",
    )
    parser.add_argument("--exclude-frozen", action="store_true", help="leave out parameters with requires_grad=False")


def run(args: argparse.Namespace) -> int:
    try:
        out = consolidate(
            args.checkpoint,
            args.out,
            dtype=DTYPES.get(args.dtype),
            weights_only=not args.with_optimizer,
            exclude_frozen_parameters=args.exclude_frozen,
        )
    except (CheckpointError, ValueError) as error:
        print(f"ds-strategy consolidate: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
