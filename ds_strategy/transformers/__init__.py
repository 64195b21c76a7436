"""Hugging Face ``Trainer`` and TRL trainers on ds_strategy's ZeRO: ``ZeroTrainer`` and ``ZeroSFTTrainer`` in place of
``Trainer`` and ``SFTTrainer``, reading the same DeepSpeed JSON (see :mod:`.trainer`).

TRL is optional: ``ZeroSFTTrainer`` imports it when first named.
"""

from ..optional_packages import needs

# the whole adapter needs transformers, whose Trainer needs accelerate: without them, fail here saying what to install
with needs("transformers", "accelerate", needed_by="ds_strategy.transformers"):
    from .pretrained import sharded_from_pretrained
    from .trainer import ZeroTrainer, ZeroTrainerMixin
    from .trainer_config import TrainerZeroConfig, fill_from_training_args, trainer_zero_config

__all__ = [
    "TrainerZeroConfig",
    "ZeroSFTTrainer",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "fill_from_training_args",
    "sharded_from_pretrained",
    "trainer_zero_config",
]


def __getattr__(name: str):
    if name == "ZeroSFTTrainer":
        from .trl_trainers import ZeroSFTTrainer

        return ZeroSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
