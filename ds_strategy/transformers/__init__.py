"""Hugging Face ``Trainer`` and TRL trainers on ds_strategy's ZeRO: ``ZeroTrainer``, ``ZeroSFTTrainer`` and
``ZeroDPOTrainer`` in place of ``Trainer``, ``SFTTrainer`` and ``DPOTrainer``, reading the same DeepSpeed JSON (see
:mod:`.trainer`).

Importing it wraps transformers' ``from_pretrained`` and ``from_config``: under a stage-3 configuration they build
the model sharded for the ZeroTrainer instead of inside DeepSpeed's ``zero.Init`` (see :mod:`.build_hook`).

TRL is optional: the TRL trainers import it when first named.
"""

from ..optional_packages import needs

# the whole adapter needs transformers, whose Trainer needs accelerate: without them, fail here saying what to install
with needs("transformers", "accelerate", needed_by="ds_strategy.transformers", extra="transformers"):
    from . import build_hook
    from .pretrained import sharded_from_config, sharded_from_pretrained
    from .trainer import ZeroTrainer, ZeroTrainerMixin
    from .trainer_config import TrainerZeroConfig, ZeroTrainingArguments, fill_from_training_args, trainer_zero_config

# from_pretrained/from_config build sharded while a stage-3 configuration is armed (Note: [Building sharded before
# the Trainer exists] in .build_hook)
build_hook.install()
building_whole = build_hook.building_whole

__all__ = [
    "TrainerZeroConfig",
    "ZeroDPOTrainer",
    "ZeroGRPOTrainer",
    "ZeroSFTTrainer",
    "ZeroTrainer",
    "ZeroTrainerMixin",
    "ZeroTrainingArguments",
    "building_whole",
    "fill_from_training_args",
    "sharded_from_config",
    "sharded_from_pretrained",
    "trainer_zero_config",
]
_TRL_TRAINERS = ("ZeroDPOTrainer", "ZeroGRPOTrainer", "ZeroSFTTrainer")


def __getattr__(name: str):
    if name in _TRL_TRAINERS:
        from . import trl_trainers

        return getattr(trl_trainers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
