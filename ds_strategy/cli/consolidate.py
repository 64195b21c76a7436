"""``ds-strategy consolidate CKPT OUT``: one full state dict from a sharded checkpoint (see
:func:`ds_strategy.checkpoint.consolidate`)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..checkpoint import CheckpointError, consolidate

HELP = "write a sharded ds_strategy checkpoint as one .pt/.pth or .safetensors state dict"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="checkpoint directory (as written by ZeroStrategy or ds_strategy.checkpoint.save)"
    )
    parser.add_argument("out", help="output file; its suffix, .pt/.pth/.ckpt or .safetensors, picks the format")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating-point weights (default: each in the dtype the model gave it, from the fp32 masters; "
        "fp32 writes the masters unrounded whatever the model's dtype)",
    )
    parser.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also write the optimizer state, keyed by parameter name (.pt/.pth/.ckpt only); a Lightning Trainer's "
        "checkpoint, always written as a Lightning file that load_from_checkpoint loads, then also resumes under DDP",
    )
    parser.add_argument("--exclude-frozen", action="store_true", help="leave out parameters with requires_grad=False")
    parser.add_argument(
        "--hf",
        action="store_true",
        help="write OUT as a Hugging Face save_pretrained directory (config.json, sharded safetensors, index); "
        "see ds_strategy.checkpoint.hf_export",
    )
    parser.add_argument("--config", default=None, help="with --hf: the model's config.json (or its directory)")
    parser.add_argument("--prefix", default=None, help="with --hf: the prefix to strip from names (default: found)")
    parser.add_argument("--max-shard-size", default="5GB", help="with --hf: the largest safetensors file (5GB)")


def run(args: argparse.Namespace) -> int:
    if args.hf:
        return _run_hf(args)
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


def _run_hf(args: argparse.Namespace) -> int:
    from ..checkpoint.hf_export import export_pretrained

    try:
        done = export_pretrained(
            args.checkpoint,
            args.out,
            config=args.config,
            prefix=args.prefix,
            dtype=DTYPES.get(args.dtype),
            max_shard_size=args.max_shard_size,
        )
    except (CheckpointError, ValueError, FileNotFoundError) as error:
        print(f"ds-strategy consolidate: error: {error}", file=sys.stderr)
        return 1
    if done["left_out"]:
        print(f"left out, outside prefix {done['prefix']!r}: {', '.join(done['left_out'])}")
    print(f"wrote {args.out} ({done['model']}, prefix {done['prefix']!r} stripped)")
    return 0
