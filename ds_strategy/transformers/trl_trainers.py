"""TRL's trainers on ZeRO, composed from :class:`ZeroTrainerMixin` (imports ``trl``).

``ZeroSFTTrainer`` is ``trl.SFTTrainer`` with ZeroTrainer's accelerator, saving and resuming. TRL's DPO and GRPO
trainers are not composed here: their reference model and generation need a gather of stage-3 shards that is not
wired up (see the README's "Hugging Face Trainer and TRL").
"""

from __future__ import annotations

from ..optional_packages import needs
from .trainer import ZeroTrainerMixin

with needs("trl", needed_by="ds_strategy.transformers.trl_trainers"):  # TRL is optional: say what to install
    import trl


class ZeroSFTTrainer(ZeroTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` training with ds_strategy's ZeRO; see :mod:`ds_strategy.transformers.trainer`."""
