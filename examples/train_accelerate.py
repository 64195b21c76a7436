"""Train a small GPT on the Python standard library's own source with ZeRO, through Hugging Face Accelerate.

    ds-strategy launch --config_file configs/accelerate/zero2.yaml examples/train_accelerate.py
    DS_STRATEGY_CONFIG='{"stage": 1}' accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py

``ds-strategy launch`` hands the YAML's accelerate settings to accelerate's launcher and its ``ds_strategy:``
section to ``ZeroAccelerator`` through ``$DS_STRATEGY_CONFIG``; with plain ``accelerate launch`` set that variable
yourself (inline JSON or a file path). On a machine without GPUs the processes train on CPU. Ends by saving the
state with ``accelerator.save_state`` and printing the run summary (final loss, tokens/s, bytes per rank).
"""

import argparse
from pathlib import Path

import torch
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # accelerate.utils has them only with deepspeed
from run_summary import RunSummary
from torch.utils.data import DataLoader
from training_args import training_parser

from ds_strategy.accelerate import ZeroAccelerator
from ds_strategy.data import CharDataset, stdlib_tokens
from ds_strategy.models import GPT, gpt_config


def parse_args() -> argparse.Namespace:
    return training_parser(__doc__, out="outputs/accelerate").parse_args()


def main() -> None:
    args = parse_args()
    accelerator = ZeroAccelerator(gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)

    config = gpt_config(args.model)
    model = GPT(config)
    dataset = CharDataset(stdlib_tokens(config.vocab_size, args.corpus_bytes), config.block_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    # A DeepSpeed config's optimizer/scheduler sections build the real ones: pass placeholders, as with accelerate's
    # own DeepSpeed back-end (the sections' "auto" values come from them).
    sections = accelerator.deepspeed_sections
    optimizer_cls = DummyOptim if "optimizer" in sections else torch.optim.AdamW
    optimizer = optimizer_cls(model.optimizer_param_groups(weight_decay=0.1), lr=args.lr)
    if "scheduler" in sections:
        steps = args.max_steps or len(loader) // args.accumulate
        scheduler = DummyScheduler(optimizer, total_num_steps=steps, warmup_num_steps=steps // 10)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    else:
        scheduler = None
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    tokens_per_step = args.batch_size * config.block_size * args.accumulate * accelerator.num_processes
    summary = RunSummary("accelerate", tokens_per_step)
    step_loss = torch.zeros((), device=accelerator.device)
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            _, loss = model(inputs, targets)
            accelerator.backward(loss)
            step_loss += loss.detach() / args.accumulate
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            tokens_per_s = summary.record(accelerator.reduce(step_loss, reduction="mean").item(), grad_norm.item())
            step_loss.zero_()
            step = len(summary.losses)
            if step % 10 == 0 or step == args.max_steps:
                accelerator.print(f"step {step:4d}  loss {summary.losses[-1]:.3f}  {tokens_per_s:,.0f} tokens/s")
            if step == args.max_steps:
                break

    accelerator.save_state(Path(args.out, "checkpoint"))
    summary.finish(
        accelerator.memory_report(),
        accelerator.zero_config.stage,
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        args.out,
    )


if __name__ == "__main__":
    main()
