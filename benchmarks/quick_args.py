"""``--quick`` for every benchmark's command line: a smoke-sized run that still honours what the user typed."""

from __future__ import annotations

import argparse


def parse_args_with_quick(parser: argparse.ArgumentParser, argv: list[str] | None, quick: dict) -> argparse.Namespace:
    """Parse ``argv``; under ``--quick``, each option of ``quick`` left at its default takes the smoke-sized value
    instead, so ``--quick --steps 5`` keeps the 5 (a value equal to the default counts as left alone)."""
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in quick.items():
            if parser.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    return args
