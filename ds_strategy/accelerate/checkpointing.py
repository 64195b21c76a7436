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
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from .. import checkpoint

SHARDED_DIR = "zero_checkpoint"


class ZeroAcceleratorCheckpointing:
    r"""``save_state``/``load_state`` of an ``Accelerator`` that owns ``ZeroEngine``\ s as ``self.engines``: the
    first prepared model's checkpoint is ``zero_checkpoint``, the i-th's ``zero_checkpoint_{i}`` (accelerate's own
    ``pytorch_model``, ``pytorch_model_1``, ... numbering)."""

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        with self._engine_state_sharded():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        with self._engine_state_sharded():
            return super().load_state(input_dir, **kwargs)

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
