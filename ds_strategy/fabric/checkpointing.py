"""Fabric's ``save``/``load`` for ZeroFabricStrategy, translated into :mod:`ds_strategy.checkpoint` calls.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": step, ...})`` writes a sharded checkpoint
directory at ``path``: the model set up by ``fabric.setup`` and its optimizer are written by every rank through
DCP, each rank only its shards; every other entry (plain values, and the ``state_dict()`` of other stateful
objects such as LR schedulers) goes into rank 0's ``extra`` under its key. The keys of the model and optimizer
are recorded in ``extra`` too, with a marker for a value, so ``fabric.load`` checks the requested keys against
the saved ones as Fabric does for a plain file. ``fabric.load`` may run at another world size, ZeRO stage,
precision or offload setting; see :mod:`ds_strategy.checkpoint.directory` for the layout and atomicity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from .. import checkpoint
from ..checkpoint import directory

IN_SHARDS = "<ds_strategy: in the checkpoint's shard files>"


class ZeroFabricCheckpointing:
    """Checkpoint hooks of a Fabric strategy that owns a ``ZeroEngine`` as ``self.engine``."""

    def save_checkpoint(
        self,
        path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroFabricStrategy.save_checkpoint(..., storage_options=...) is not supported: it writes "
                "sharded checkpoint directories itself, not through a CheckpointIO plugin"
            )
        module_key, optimizer_key = self._engine_keys(state, "save")
        filtered = sorted({module_key, optimizer_key} & set(filter or {}))
        if filtered:
            raise NotImplementedError(
                f"fabric.save(filter=...) for {filtered}: the sharded model and optimizer are "
                f"saved whole; filter the consolidated state dict instead"
            )
        extra: dict[str, Any] = {}
        for key, obj in state.items():
            if key in (module_key, optimizer_key):
                extra[key] = IN_SHARDS
            else:
                _apply_filter(key, filter or {}, obj.state_dict() if isinstance(obj, _Stateful) else obj, extra)
        checkpoint.save(
            self.broadcast(str(path)),
            self.engine.module,
            self.engine,
            extra=extra,
            with_optimizer=optimizer_key is not None,
        )

    def load_checkpoint(
        self,
        path,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the model (and optimizer) from their shards, then every other requested entry; return the
        entries that were not requested. Everything is checked before anything is restored. A bare module
        (``fabric.load_raw``) gets its weights only. ``weights_only`` does not apply: rank 0's ``meta.pt`` is read
        as :func:`ds_strategy.checkpoint.load` reads it."""
        path = self.broadcast(str(path))
        if isinstance(state, nn.Module):
            self._engine_keys({"model": state}, "load_raw")
            checkpoint.load(path, state, self.engine, load_optimizer=False, strict=strict)
            return {}
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                f"ZeroFabricStrategy.load_checkpoint(..., state={type(state).__name__}): pass the model "
                f"set up by fabric.setup, with its optimizer if it should be restored too, e.g. "
                f"fabric.load(path, {{'model': model, 'optimizer': optimizer}})"
            )
        module_key, optimizer_key = self._engine_keys(state, "load")
        saved = _saved_entries(path)
        _validate_keys_for_strict_loading(state.keys(), saved.keys(), strict=strict)
        load_optimizer = optimizer_key is not None and _is_marker(saved.get(optimizer_key))
        remainder = checkpoint.load(path, self.engine.module, self.engine, load_optimizer=load_optimizer, strict=strict)
        for key, obj in state.items():
            if key in (module_key, optimizer_key) or key not in remainder:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(remainder.pop(key))
            else:
                state[key] = remainder.pop(key)
        return {key: value for key, value in remainder.items() if not _is_marker(value)}

    def _engine_keys(self, state: dict[str, Any], verb: str) -> tuple[str, str | None]:
        """The keys of the engine's model (required) and optimizer (optional) in ``state``."""
        if self.engine is None:
            raise RuntimeError(
                f"fabric.{verb}: call fabric.setup(model, optimizer) first; the checkpoint is written "
                f"from the shards it creates"
            )
        modules = [key for key, obj in state.items() if obj is self.engine.module]
        if len(modules) != 1:
            raise ValueError(
                f"fabric.{verb}(path, state): the state must hold the model set up by fabric.setup once, "
                f"e.g. {{'model': model, 'optimizer': optimizer}}; its keys are {sorted(state)}"
            )
        optimizers = [key for key, obj in state.items() if obj is self.engine.optimizer]
        return modules[0], optimizers[0] if optimizers else None


def _saved_entries(path: str) -> dict[str, Any]:
    """Rank 0's extra state of the checkpoint at ``path``, read after checking that the checkpoint is complete."""
    where, manifest = directory.open_checkpoint(path)
    return directory.read_meta(where, manifest)["extra"]


def _is_marker(value: Any) -> bool:
    return isinstance(value, str) and value == IN_SHARDS
