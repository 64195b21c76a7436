"""Fabric's ``save``/``load`` for ZeroFabricStrategy, translated into :mod:`ds_strategy.checkpoint` calls.

``fabric.save(path, {"model": model, "optimizer": optimizer, "step": step, ...})`` writes a sharded checkpoint
directory at ``path``: the model set up by ``fabric.setup`` and its optimizer are written by every rank through
DCP, each rank only its shards; every other entry (plain values, and the ``state_dict()`` of other stateful
objects such as LR schedulers) goes into rank 0's ``extra`` under its key. The keys of the model and optimizer
are recorded in ``extra`` too, with a marker for a value, so ``fabric.load`` checks the requested keys against
the saved ones as Fabric does for a plain file. ``fabric.load`` may run at another world size, ZeRO stage,
precision or offload setting; see :mod:`ds_strategy.checkpoint.directory` for the layout and atomicity. One
checkpoint holds one sharded model (with several set up, save each to its own path), as with DeepSpeed and FSDP.
``fabric.strategy.get_module_state_dict(model)`` gathers the whole state dict, from the fp32 masters.

With ``state_dict_type="full"`` (FSDP's choice, :mod:`ds_strategy.adapters.state_dict_type`) ``fabric.save`` writes
one ``torch.save`` file instead, as DDP writes it: the model's whole state dict and each optimizer's whole state
(``optimizer.state_dict()`` of one process, keyed by position: Note: [A whole optimizer state] in
:mod:`ds_strategy.checkpoint.full_optimizer`) gathered onto rank 0, which writes them with the other entries.

A single file (this one, or DDP's or one device's) loads too, as DeepSpeed's ``load_full_weights`` and FSDP load it:
every rank reads the file, a model set up by ``fabric.setup`` takes its shards of the weights
(``checkpoint.pretrained.load_weights``) and its optimizers their shards of the optimizer state
(:func:`~ds_strategy.checkpoint.full_optimizer.load_full_optimizer_state`), at any world size and stage, any other
module (``fabric.load_raw`` before ``setup``) loads the state dict whole, and the other entries are restored as Fabric
restores them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from lightning.fabric.wrappers import _unwrap_objects
from torch import nn
from torch.optim import Optimizer

from .. import checkpoint
from ..adapters.state_dict_type import save_full_file
from ..checkpoint import directory
from ..checkpoint.full_optimizer import full_optimizer_state, load_full_optimizer_state
from ..checkpoint.pretrained import load_weights
from ..zero.engine import ZeroEngine

IN_SHARDS = "<ds_strategy: in the checkpoint's shard files>"


class ZeroFabricCheckpointing:
    """Checkpoint hooks of a Fabric strategy that owns a ``ZeroEngine`` per model set up, as ``self.engines``."""

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
        engine, module_key, optimizer_keys = self._engine_keys(state, "save")
        if self.state_dict_type == "full":
            self._save_full(path, state, engine, module_key, optimizer_keys, filter or {})
            return
        filtered = sorted({module_key, *optimizer_keys} & set(filter or {}))
        if filtered:
            raise NotImplementedError(
                f"fabric.save(filter=...) for {filtered}: the sharded model and optimizer are "
                f"saved whole; filter the consolidated state dict instead"
            )
        extra: dict[str, Any] = {}
        for key, obj in state.items():
            if key in (module_key, *optimizer_keys):
                extra[key] = IN_SHARDS
            else:
                _apply_filter(key, filter or {}, obj.state_dict() if isinstance(obj, _Stateful) else obj, extra)
        checkpoint.save(
            self.broadcast(str(path)),
            engine.module,
            engine,
            extra=extra,
            with_optimizer=bool(optimizer_keys),
        )

    def _save_full(
        self,
        path,
        state: dict[str, Any],
        engine: ZeroEngine,
        module_key: str,
        optimizer_keys: list[str],
        filter: dict[str, Callable[[str, Any], bool]],
    ) -> None:
        """One file from rank 0: the model's and optimizers' whole states (gathered: collectives, so every rank
        calls this) and every other entry, as DDP writes it."""
        whole: dict[str, Any] = {}
        for key, obj in state.items():
            if key == module_key:
                value = engine.full_state_dict(rank0_only=True)
            elif key in optimizer_keys:
                value = full_optimizer_state(engine, _optimizer_index(engine, obj))
            else:
                value = obj.state_dict() if isinstance(obj, _Stateful) else obj
            _apply_filter(key, filter, value, whole)
        if self.is_global_zero:
            save_full_file(self.checkpoint_io, whole, str(path))
        self.barrier()

    def load_checkpoint(
        self,
        path,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the model (and optimizer) from their shards, then every other requested entry; return the
        entries that were not requested. Everything is checked before anything is restored. A bare module
        (``fabric.load_raw``) gets its weights only, also before ``fabric.setup``. A single file loads as the
        module docstring says. ``weights_only`` is torch.load's for a single file; for a directory, True reads rank
        0's ``meta.pt`` with torch's allow-list too, None and False as trusted (Note: [Unpickling meta.pt] in
        :mod:`ds_strategy.checkpoint.directory`)."""
        path = self.broadcast(str(path))
        if Path(path).is_file():
            return self._load_file(path, state, strict, weights_only)
        if isinstance(state, nn.Module):
            engine = self._engine_of_module(state)
            checkpoint.load(path, state, engine, load_optimizer=False, strict=strict, weights_only=bool(weights_only))
            return {}
        if isinstance(state, Optimizer) or not state:
            raise ValueError(
                f"ZeroFabricStrategy.load_checkpoint(..., state={type(state).__name__}): pass the model "
                f"set up by fabric.setup, with its optimizer if it should be restored too, e.g. "
                f"fabric.load(path, {{'model': model, 'optimizer': optimizer}})"
            )
        engine, module_key, optimizer_keys = self._engine_keys(state, "load")
        saved = _saved_entries(path, bool(weights_only))
        _validate_keys_for_strict_loading(state.keys(), saved.keys(), strict=strict)
        load_optimizer = bool(optimizer_keys) and all(_is_marker(saved.get(key)) for key in optimizer_keys)
        remainder = checkpoint.load(
            path, engine.module, engine, load_optimizer=load_optimizer, strict=strict, weights_only=bool(weights_only)
        )
        for key, obj in state.items():
            if key in (module_key, *optimizer_keys) or key not in remainder:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(remainder.pop(key))
            else:
                state[key] = remainder.pop(key)
        return {key: value for key, value in remainder.items() if not _is_marker(value)}

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The whole state dict of a model set up by ``fabric.setup``, on every rank (a collective): trainable
        parameters from the optimizer's masters in the dtype the model gave them (Note: [What an export returns] in
        ``ds_strategy.zero.full_state_dict``). Any other module's own ``state_dict()``."""
        engine = self._engine_of_module(_unwrap_objects(module))
        if engine is None:
            return super().get_module_state_dict(module)
        return engine.full_state_dict(rank0_only=False)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """A state dict read from a single file: a set-up model takes its shards of it, any other module all of it.
        The engine's load is strict: a missing, unexpected or mis-shaped name raises before anything changes."""
        engine = self._engine_of_module(module)
        if engine is None:
            super().load_module_state_dict(module, state_dict, strict=strict)
        else:
            load_weights(engine, state_dict)

    def _engine_of_module(self, module: nn.Module) -> ZeroEngine | None:
        return next((engine for engine in self.engines if engine.module is module), None)

    def _load_file(self, path: str, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """A single file: Fabric's own restore, but a set-up optimizer takes its shards of the whole state."""
        engines = {id(optimizer): engine for engine in self.engines for optimizer in engine.optimizers}
        if not isinstance(state, dict) or not any(id(obj) in engines for obj in state.values()):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        loaded = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        _validate_keys_for_strict_loading(state.keys(), loaded.keys(), strict=strict)
        optimizer_keys = [key for key, obj in state.items() if id(obj) in engines and key in loaded]
        for key, obj in state.items():  # the weights before the optimizer states
            if key not in loaded or key in optimizer_keys:
                continue
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(obj, loaded.pop(key), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(loaded.pop(key))
            else:
                state[key] = loaded.pop(key)
        for key in optimizer_keys:
            engine = engines[id(state[key])]
            load_full_optimizer_state(engine, loaded.pop(key), _optimizer_index(engine, state[key]))
        return loaded

    def _engine_keys(self, state: dict[str, Any], verb: str) -> tuple[ZeroEngine, str, list[str]]:
        """The engine of the one set-up model in ``state``, its key, and its optimizers' keys: all of them, or
        (saving or loading the weights alone) none."""
        if not self.engines:
            raise RuntimeError(
                f"fabric.{verb}: call fabric.setup(model, optimizer) first; the checkpoint is written "
                f"from the shards it creates"
            )
        modules = [(key, engine) for key, obj in state.items() if (engine := self._engine_of_module(obj)) is not None]
        if len(modules) != 1:
            several = f"holds {len(modules)} models set up by fabric.setup" if modules else "holds no model"
            raise ValueError(
                f"fabric.{verb}(path, state): the state must hold one model set up by fabric.setup, "
                f"e.g. {{'model': model, 'optimizer': optimizer}}, but {several} (keys {sorted(state)}); "
                f"save each sharded model, with its optimizer, to its own path"
            )
        module_key, engine = modules[0]
        optimizer_keys = [key for key, obj in state.items() if engine.holds(obj)]
        if optimizer_keys and len(optimizer_keys) != len(engine.optimizers):
            raise ValueError(
                f"fabric.{verb}(path, state): the state holds {len(optimizer_keys)} of the {len(engine.optimizers)} "
                f"optimizers training the model ({optimizer_keys}); their states are saved together, so pass all "
                f"of them, or none for the weights alone"
            )
        return engine, module_key, optimizer_keys


def _optimizer_index(engine: ZeroEngine, optimizer: Optimizer) -> int:
    """The position of ``optimizer`` among the engine's; a chain of several has no one whole state."""
    indices = engine.sharded_optimizers.indices_of(optimizer)
    if len(indices) != 1:
        raise ValueError(
            f"state_dict_type='full': a chain of {len(indices)} optimizers has no one whole optimizer state; give "
            f"each optimizer its own entry, or keep state_dict_type='sharded'"
        )
    return next(iter(indices))


def _saved_entries(path: str, weights_only: bool) -> dict[str, Any]:
    """Rank 0's extra state of the checkpoint at ``path``, read after checking that the checkpoint is complete."""
    where, manifest = directory.open_checkpoint(path)
    return directory.read_meta(where, manifest, weights_only)["extra"]


def _is_marker(value: Any) -> bool:
    return isinstance(value, str) and value == IN_SHARDS
