"""Train a small GPT with ZeRO configured by a DeepSpeed JSON file, for users migrating from DeepSpeed.

    python examples/train_deepspeed_json.py                        # examples/ds_config.json, 2 CPU processes
    python examples/train_deepspeed_json.py --ds-config my_config.json --max-steps 200

``ZeroStrategy.from_deepspeed_config`` reads the config with DeepSpeed's meaning (every key DeepSpeed accepts has a
rule: mapped onto a ZeroConfig, accepted with no effect, or rejected naming the key; see
docs/migrating-from-deepspeed.md),
and builds the config's ``optimizer``/``scheduler`` sections when ``configure_optimizers`` returns None. The Trainer
runs accumulation and clipping, so this script passes the config's accumulation steps and micro-batch size to it (the
strategy checks they agree).
"""

import argparse
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from lightning_gpt import CharGPT, SummaryCallback, char_loader

from ds_strategy import ZeroStrategy
from ds_strategy.models import gpt_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ds-config", default=str(Path(__file__).with_name("ds_config.json")))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--out", default="outputs/deepspeed_json")
    args = parser.parse_args()

    strategy = ZeroStrategy.from_deepspeed_config(args.ds_config)
    zero = strategy.config
    L.seed_everything(0)
    model_config = gpt_config("tiny")
    batch_size = zero.train_micro_batch_size_per_gpu or 16
    callback = SummaryCallback("deepspeed-json", batch_size, model_config.block_size)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=zero.gradient_accumulation_steps,
        callbacks=[callback],
        default_root_dir=args.out,
        logger=CSVLogger(args.out),  # named, so Lightning does not warn that TensorBoard is missing
        log_every_n_steps=10,
        enable_checkpointing=False,
    )
    module = CharGPT(model_config, lr=3e-3, weight_decay=0.1)
    trainer.fit(module, char_loader(model_config, 1_000_000, batch_size))

    trainer.save_checkpoint(Path(args.out, "checkpoint"), weights_only=False)  # a sharded checkpoint is a directory
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    callback.summary.finish(trainer.strategy.memory_report(), zero.stage, trainable, args.out)


if __name__ == "__main__":
    main()
