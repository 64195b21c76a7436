"""TRL's trainers on ZeRO, composed from :class:`ZeroTrainerMixin` (imports ``trl``).

``ZeroSFTTrainer`` is ``trl.SFTTrainer`` with ZeroTrainer's accelerator, saving and resuming. TRL's DPO and GRPO
trainers are not composed here, untested: their generation through ``unwrap_model_for_generation`` works at stage 3,
but they prepare reference and reward models with ``accelerator.prepare_model``, which leaves them whole on every
rank (see the README's "Hugging Face Trainer and TRL").
"""

from __future__ import annotations

from ..optional_packages import needs
from .trainer import ZeroTrainerMixin

with needs("trl", needed_by="ds_strategy.transformers.trl_trainers"):  # TRL is optional: say what to install
    import trl


class ZeroSFTTrainer(ZeroTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` training with ds_strategy's ZeRO; see :mod:`ds_strategy.transformers.trainer`."""
