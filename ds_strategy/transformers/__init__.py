"""Hugging Face ``Trainer`` and TRL trainers on ds_strategy's ZeRO: ``ZeroTrainer``, ``ZeroSFTTrainer`` and
``ZeroDPOTrainer`` in place of ``Trainer``, ``SFTTrainer`` and ``DPOTrainer``, reading the same DeepSpeed JSON (see
:mod:`.trainer`).

TRL is optional: the TRL trainers import it when first named.
"""

from ..optional_packages import needs

# the whole adapter needs transformers, whose Trainer needs accelerate: without them, fail here saying what to install
with needs("transformers", "accelerate", needed_by="ds_strategy.transformers", extra="transformers"):
    from .pretrained import sharded_from_pretrained
    from .trainer import ZeroTrainer, ZeroTrainerMixin
    from .trainer_config import TrainerZeroConfig, fill_from_training_args, trainer_zero_config

__all__ = [
    "TrainerZeroConfig",
    "ZeroDPOTrainer",
    "ZeroGRPOTrainer",
    "ZeroSFTTrainer",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "fill_from_training_args",
    "sharded_from_pretrained",
    "trainer_zero_config",
]
_TRL_TRAINERS = ("ZeroDPOTrainer", "ZeroGRPOTrainer", "ZeroSFTTrainer")


def __getattr__(name: str):
    if name in _TRL_TRAINERS:
        from . import trl_trainers

        return getattr(trl_trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
