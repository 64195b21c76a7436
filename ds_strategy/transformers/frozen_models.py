"""The accelerator a ZeroTrainer builds: a ``ZeroAccelerator`` that also shards, at stage 3, the models a Trainer
subclass prepares for evaluation beside the one it trains (TRL's DPO reference model, GRPO's reference and reward
models).

Note: [Frozen models beside the trained one]
TRL prepares such a model with ``accelerator.prepare_model(model, evaluation_mode=True)`` unless accelerate's
DeepSpeed back-end is on, where its ``prepare_deepspeed`` gives the model a DeepSpeed engine without an optimizer:
sharded under ZeRO-3, whole on every rank (stage 0) under ZeRO-1/2, on the assumption that a model which fits for
training fits for inference. DeepSpeed users expect that memory, so ``prepare_model`` here does the same: at a
stage that partitions parameters the model gets a ZeRO engine without an optimizer (its forward gathers one unit at
a time, as the trained model's does), and below it accelerate's own ``prepare_model`` keeps it whole.

The trained model itself is not sharded this way, although Trainer also passes it to ``prepare_model`` when
``evaluate`` runs before ``train``: sharded without an optimizer, it could not then be prepared with the Trainer's,
whose parameter groups split the engine's flat buffers (see Note: [An optimizer prepared after its model]). It is
recognised by identity, by asking the trainer which model it trains. The exception is a trained model still on the
meta device, built sharded for the trainer (``ds_strategy.transformers.build_hook``): it has no values but the
engine's, so an evaluation before training (an evaluation-only script) shards it without an optimizer, as DeepSpeed
initialises an inference engine for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..accelerate import ZeroAccelerator
from ..accelerate.accelerator import DEFERRED_BUILD_ATTR


class TrainerAccelerator(ZeroAccelerator):
    """``ZeroAccelerator`` whose ``prepare_model(evaluation_mode=True)`` shards frozen models at stage 3 (see
    Note: [Frozen models beside the trained one]). ``trained_model()`` answers the trainer's model, which is left to
    the Trainer's own ``prepare``."""

    def __init__(self, zero_config: Any, *, trained_model: Callable[[], nn.Module | None], **kwargs: Any):
        super().__init__(zero_config, **kwargs)
        self._trained_model = trained_model

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        frozen = evaluation_mode and model is not self._trained_model()
        deferred = evaluation_mode and DEFERRED_BUILD_ATTR in model.__dict__
        sharded = (frozen and self.zero_config.plan.partitions_parameters) or deferred
        if sharded and self.engine_of(model) is None:
            return self.prepare(model, device_placement=None if device_placement is None else [device_placement])
        return super().prepare_model(model, device_placement, evaluation_mode)
