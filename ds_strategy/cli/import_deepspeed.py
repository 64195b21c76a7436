"""``ds-strategy import-deepspeed SOURCE OUT``: a DeepSpeed ZeRO checkpoint as a ds_strategy sharded checkpoint
(see :func:`ds_strategy.deepspeed.checkpoint_import.import_deepspeed`)."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint import CheckpointError
from ..deepspeed.checkpoint_import import DeepSpeedCheckpointError, describe, import_deepspeed

HELP = "convert a DeepSpeed ZeRO 1/2/3 checkpoint into a ds_strategy sharded checkpoint (no DeepSpeed needed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="DeepSpeed checkpoint: the save_checkpoint directory (with its 'latest' file) "
        "or one tag folder such as global_step1000",
    )
    parser.add_argument("out", help="ds_strategy checkpoint directory to write (replaced atomically if it exists)")
    parser.add_argument("--tag", default=None, help="tag folder under SOURCE to read (default: the one 'latest' names)")


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = import_deepspeed(args.source, args.out, tag=args.tag)
    except (DeepSpeedCheckpointError, CheckpointError) as error:
        print(f"ds-strategy import-deepspeed: error: {error}", file=sys.stderr)
        return 1
    print(describe(checkpoint))
    print(f"wrote {args.out}")
    return 0
