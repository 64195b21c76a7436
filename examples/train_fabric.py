"""Train a small GPT on the Python standard library's own source with ZeRO, through Lightning Fabric.

    python examples/train_fabric.py                       # zero2 on 2 CPU processes
    python examples/train_fabric.py --strategy zero1 --accumulate 2 --max-steps 200

``import ds_strategy`` registers the ``zero*`` names with Fabric; ``fabric.setup(model, optimizer)`` shards the
optimizer state (and, from zero2, the gradients) across the processes. Ends by saving a checkpoint with
``fabric.save`` and printing the run summary (final loss, tokens/s, bytes per rank).
"""

import argparse
from pathlib import Path

import lightning as L
import torch
from run_summary import RunSummary
from torch.utils.data import DataLoader
from training_args import training_parser

import ds_strategy  # noqa: F401  (registers the zero* strategy names with Fabric)
from ds_strategy.data import CharDataset, stdlib_tokens
from ds_strategy.models import GPT, gpt_config


def parse_args() -> argparse.Namespace:
    parser = training_parser(__doc__, out="outputs/fabric")
    parser.add_argument("--strategy", default="zero2", help="a registered name: zero0, zero1, zero2, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default="32-true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = L.Fabric(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(0)

    config = gpt_config(args.model)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.optimizer_param_groups(weight_decay=0.1), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    dataset = CharDataset(stdlib_tokens(config.vocab_size, args.corpus_bytes), config.block_size)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=args.batch_size, shuffle=True))

    tokens_per_step = args.batch_size * config.block_size * args.accumulate * fabric.world_size
    summary = RunSummary("fabric", tokens_per_step)
    batches = iter(loader)
    for step in range(1, args.max_steps + 1):
        step_loss = torch.zeros((), device=fabric.device)
        for micro in range(args.accumulate):
            inputs, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                _, loss = model(inputs, targets)
                fabric.backward(loss / args.accumulate)
            step_loss += loss.detach() / args.accumulate
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        tokens_per_s = summary.record(fabric.all_reduce(step_loss, reduce_op="mean").item(), grad_norm.item())
        if step % 10 == 0 or step == args.max_steps:
            fabric.print(f"step {step:4d}  loss {summary.losses[-1]:.3f}  {tokens_per_s:,.0f} tokens/s")

    fabric.save(Path(args.out, "checkpoint.ckpt"), {"model": model, "optimizer": optimizer, "step": step})
    summary.finish(
        fabric.strategy.memory_report(),
        fabric.strategy.config.stage,
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        args.out,
    )


if __name__ == "__main__":
    main()
