"""Accelerate's ``save_state``/``load_state`` for ZeroAccelerator: the model and optimizer the engine shards go
through :mod:`ds_strategy.checkpoint`, everything else through accelerate as usual.

``accelerator.save_state(out)`` writes accelerate's own files for what it owns (LR schedulers, data loader
samplers, each process's RNG states, the step, objects registered for checkpointing) and the sharded checkpoint
directory ``out/zero_checkpoint``: every rank writes only its shards of the model and optimizer, nothing is
gathered, and the directory appears atomically. ``load_state`` restores that checkpoint before accelerate restores
anything, so a damaged or mismatched checkpoint raises with the training state unchanged, and it may run at
another world size, ZeRO stage, precision or offload setting. (RNG states are saved per process: a process that
did not exist at save time finds none, and accelerate leaves its generators as they are.)

Accelerate's save and load pre-hooks run once accelerate has chosen the directory (``automatic_checkpoint_naming``
included) and before it writes or reads anything, so the sharded checkpoint is written and read from there. For
the length of the call the engine's model and optimizer are hidden from accelerate's lists, so it neither gathers
the model into one state dict nor pickles rank 0's optimizer shard; its hooks do not see them either.

With ``ZeroAccelerator(state_dict_type="full")`` (FSDP's choice and meaning, :mod:`ds_strategy.adapters.
state_dict_type`) ``save_state`` writes accelerate's own files, as under DDP: ``model.safetensors`` (or
``pytorch_model.bin``) from ``get_state_dict``, and ``optimizer.bin`` from the prepared optimizer's whole state
(``ZeroAcceleratedOptimizer.state_dict``), gathered onto rank 0, which writes them. ``load_state`` reads such a
directory, or one DDP's or one process's ``save_state`` wrote, at any world size and stage: each rank takes its
shards of the whole weights and optimizer state. Accelerate loads a model file with the model's
``load_state_dict``, whose parameters here are views of the engine's shards; for the call the engine's model stands
in accelerate's list as a :class:`WholeWeightsLoader`, which hands the state dict to the engine's strict load.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .. import checkpoint
from ..checkpoint.pretrained import load_weights

SHARDED_DIR = "zero_checkpoint"


class ZeroAcceleratorCheckpointing:
    r"""``save_state``/``load_state`` of an ``Accelerator`` that owns ``ZeroEngine``\ s as ``self.engines``: the
    first prepared model's checkpoint is ``zero_checkpoint``, the i-th's ``zero_checkpoint_{i}`` (accelerate's own
    ``pytorch_model``, ``pytorch_model_1``, ... numbering)."""

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        if self.state_dict_type == "full":  # accelerate's own files, from get_state_dict and the whole optimizer
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        with self._engine_state_sharded():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        if self.state_dict_type == "full":
            with self._engine_models_loading_whole():
                return super().load_state(input_dir, **kwargs)
        with self._engine_state_sharded():
            return super().load_state(input_dir, **kwargs)

    @contextlib.contextmanager
    def _engine_models_loading_whole(self):
        """Within accelerate's load_state: each engine's model stands in accelerate's list as a
        :class:`WholeWeightsLoader`, in its place, so accelerate's file numbering is unchanged."""
        engines = {id(engine.module): engine for engine in self.engines}
        models = self._models
        self._models = [WholeWeightsLoader(engines[id(m)]) if id(m) in engines else m for m in models]
        try:
            yield
        finally:
            self._models = models

    @contextlib.contextmanager
    def _engine_state_sharded(self):
        """Within accelerate's save_state/load_state: the engines' models and optimizers are saved and loaded as
        sharded checkpoints by pre-hooks, and hidden from accelerate's own lists."""
        if not self.engines:
            yield
            return
        modules = {id(engine.module) for engine in self.engines}
        held = {id(optimizer) for engine in self.engines for optimizer in engine.optimizers}
        models, optimizers = self._models, self._optimizers
        self._models = [model for model in models if id(model) not in modules]
        self._optimizers = [optimizer for optimizer in optimizers if id(optimizer.optimizer) not in held]
        hooks = [
            self.register_save_state_pre_hook(self._save_sharded),
            self.register_load_state_pre_hook(self._load_sharded),
        ]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers
            for hook in hooks:
                hook.remove()

    def _sharded_dirs(self, output_dir: str):
        for i, engine in enumerate(self.engines):
            yield Path(output_dir, SHARDED_DIR if i == 0 else f"{SHARDED_DIR}_{i}"), engine

    def _save_sharded(self, models: list, weights: list, output_dir: str) -> None:
        for path, engine in self._sharded_dirs(output_dir):
            checkpoint.save(path, engine.module, engine)

    def _load_sharded(self, models: list, input_dir: str) -> None:
        for path, engine in self._sharded_dirs(input_dir):
            checkpoint.load(path, engine.module, engine)


class WholeWeightsLoader(nn.Module):
    """What accelerate's ``load_state`` loads a whole model file into, for a model an engine shards: its
    ``load_state_dict`` gives each rank its shards of the state dict (:func:`ds_strategy.checkpoint.pretrained.
    load_weights`, strict: a missing, unexpected or mis-shaped name raises before anything changes). It holds no
    tensors, so safetensors' ``load_model`` finds none shared."""

    def __init__(self, engine: Any):
        super().__init__()
        self.engine = engine

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> _IncompatibleKeys:
        load_weights(self.engine, dict(state_dict))
        return _IncompatibleKeys([], [])
