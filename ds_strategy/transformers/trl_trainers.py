"""TRL's trainers on ZeRO, composed from :class:`ZeroTrainerMixin` (imports ``trl``).

``ZeroSFTTrainer`` is ``trl.SFTTrainer`` and ``ZeroDPOTrainer`` is ``trl.DPOTrainer``, each with ZeroTrainer's
accelerator, saving and resuming. DPO's reference model is sharded at stage 3 by an engine without an optimizer and
kept whole on every rank below it, as TRL's ``prepare_deepspeed`` does under DeepSpeed (see
:mod:`.frozen_models`); ``sync_ref_model`` is refused at stage 3. GRPO is not composed here, untested: its
generation through ``unwrap_model_for_generation`` works at stage 3 and its reference and reward models would be
prepared like DPO's.
"""

from __future__ import annotations

from ..optional_packages import needs
from .trainer import ZeroTrainerMixin

with needs("trl", needed_by="ds_strategy.transformers.trl_trainers"):  # TRL is optional: say what to install
    import trl


class ZeroSFTTrainer(ZeroTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` training with ds_strategy's ZeRO; see :mod:`ds_strategy.transformers.trainer`."""


class ZeroDPOTrainer(ZeroTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` training with ds_strategy's ZeRO, its reference model sharded at stage 3."""
