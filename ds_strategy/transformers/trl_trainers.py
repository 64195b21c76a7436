"""TRL's trainers on ZeRO, composed from :class:`ZeroTrainerMixin` (imports ``trl``).

``ZeroSFTTrainer``, ``ZeroDPOTrainer`` and ``ZeroGRPOTrainer`` are TRL's ``SFTTrainer``, ``DPOTrainer`` and
``GRPOTrainer``, each with ZeroTrainer's accelerator, saving and resuming. The reference model of DPO and GRPO, and
GRPO's reward models, are sharded at stage 3 by engines without an optimizer and kept whole on every rank below it,
as TRL's ``prepare_deepspeed`` does under DeepSpeed (see :mod:`.frozen_models`); ``sync_ref_model`` is refused at
stage 3. GRPO generates through ``unwrap_model_for_generation``, which at stage 3 gathers each unit per token.
``ZeroSFTTrainer`` trains under DeepSpeed-Ulysses too (``sequence_parallel_size > 1``); DPO and GRPO, whose losses
compare whole sequences, refuse it.
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

    supports_sequence_parallel = False  # its loss compares whole sequences' log-probabilities


class ZeroGRPOTrainer(ZeroTrainerMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` training with ds_strategy's ZeRO, its reference and reward models sharded at stage 3."""

    supports_sequence_parallel = False  # it generates whole sequences and scores them as wholes
