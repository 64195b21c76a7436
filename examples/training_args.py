"""The command-line options every example's training loop shares (model, steps, batches, data, output)."""

import argparse


def training_parser(description: str, out: str) -> argparse.ArgumentParser:
    """A parser with the shared options; ``out`` is the example's default output directory."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="GPT preset: tiny, small or medium")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=1_000_000)
    parser.add_argument("--out", default=out)
    return parser
