"""Train a small GPT on the Python standard library's own source with ZeRO, through Lightning and Hydra.

    python examples/train.py                                  # zero2 on 2 CPU processes, 150 steps
    python examples/train.py strategy=zero1 strategy.reduce_bucket_size=1e6 trainer.devices=2
    python examples/train.py precision=bf16-mixed trainer.max_steps=300
    python examples/train.py --cfg job                        # print the composed config

The config groups (strategy, precision, model, data, trainer) are registered by ``ds_strategy.hydra``; the
defaults are ``configs/train.yaml`` (installed as ``pkg://ds_strategy.configs``). A bad override such as
``strategy.stage=5`` or an unknown key fails before any process starts. The run prints ZeRO's memory report at
setup and loss and tokens/s in the progress bar, and ends by writing a checkpoint and ``summary.json`` (final
loss, tokens/s, bytes per rank) to Hydra's output directory; the checkpoint is a directory of shards.
"""

from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import CSVLogger
from lightning_gpt import CharGPT, SummaryCallback, char_loader
from omegaconf import DictConfig

from ds_strategy import ZeroStrategy
from ds_strategy.hydra import zero_config
from ds_strategy.models import GPTConfig


@hydra.main(config_path="pkg://ds_strategy.configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    zero = zero_config(cfg.strategy, cfg.precision)  # validates every ZeRO key before any process starts
    L.seed_everything(cfg.seed)
    model_config = GPTConfig(**cfg.model)
    loader = char_loader(model_config, cfg.data.corpus_bytes, cfg.data.batch_size, cfg.data.num_workers)
    out_dir = Path(HydraConfig.get().runtime.output_dir)

    callback = SummaryCallback("lightning", cfg.data.batch_size, model_config.block_size)
    trainer = L.Trainer(
        strategy=ZeroStrategy(zero),
        precision=zero.precision,
        callbacks=[callback],
        default_root_dir=out_dir,
        logger=CSVLogger(out_dir),  # named, so Lightning does not warn that TensorBoard is missing
        **cfg.trainer,
    )
    module = CharGPT(model_config, cfg.lr, cfg.weight_decay)
    trainer.fit(module, loader)

    trainer.save_checkpoint(out_dir / "checkpoint", weights_only=False)  # a sharded checkpoint is a directory
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    callback.summary.finish(trainer.strategy.memory_report(), zero.stage, trainable, out_dir)


if __name__ == "__main__":
    main()
