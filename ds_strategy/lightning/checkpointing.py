"""Lightning's checkpoint hooks for ZeroStrategy, translated into :mod:`ds_strategy.checkpoint` calls.

A Trainer checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``) is a directory laid out like Lightning's
FSDP "sharded" checkpoints: the module and optimizer state written by every rank through DCP, and everything else
Lightning puts in a checkpoint (loops, LR schedulers, callbacks, precision plugin, hyperparameters) in rank 0's
``meta.pt``; see :mod:`ds_strategy.checkpoint.directory`. Nothing is gathered to save, the directory appears
atomically, a save never replaces what is not a checkpoint of ours, and ``ckpt_path=`` may name a checkpoint saved
at another world size or ZeRO stage, or a single Lightning file (DDP's, one device's). ``ds-strategy consolidate``
turns a directory back into a Lightning file, weights only or (``--with-optimizer``) one a DDP fit resumes from
(:func:`ds_strategy.checkpoint.consolidate`).

With ``ZeroStrategy(state_dict_type="full")`` (FSDP's choice and meaning, :mod:`ds_strategy.adapters.state_dict_type`)
``lightning_module_state_dict()`` and ``optimizer_state()`` are whole on rank 0 and empty elsewhere, and a Trainer
checkpoint is the one ``torch.save`` file rank 0 writes of them, as DDP writes it. A single file, this one or DDP's,
resumes with its optimizer state cut into this run's shards, at any world size and stage.

Loading waits until after ``setup`` (the engine must exist to know this rank's shard) and restores model and
optimizer inside ``load_checkpoint``, so Lightning's own model/optimizer restore steps have nothing left to do.
No Lightning import here: the mixin serves both ``lightning.pytorch`` and ``pytorch_lightning``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint
from ..adapters.state_dict_type import save_full_file
from ..checkpoint.consolidate import OPTIMIZER_ORDER
from ..checkpoint.full_optimizer import full_optimizer_state, load_full_optimizer_state, why_not_whole
from ..checkpoint.pretrained import load_weights

# Lightning's ``_CheckpointConnector`` method that asks for the module state to put in a checkpoint it saves.
_SAVING_CALLER = "_get_lightning_module_state_dict"


class ZeroCheckpointing:
    """Checkpoint hooks of a Lightning strategy that owns a ``ZeroEngine`` as ``self.engine``."""

    _warned_directory_suffix = False
    _optimizer_order: list[list[str]] | None = None
    _fit_engine = None  # the fit's engine while validate/test/predict run on one without its optimizer

    def record_optimizer_order(self, optimizers: list) -> None:
        """Remember, per param group (every optimizer's, one after another), the names of the parameters in the
        order the optimizers list them, for ``ds-strategy consolidate`` to key the optimizer state by position as
        Lightning does ("" for a parameter outside the module, which keeps its position and has no state)."""
        names = {id(p): name for name, p in self.lightning_module.named_parameters()}
        self._optimizer_order = [
            [names.get(id(p), "") for p in group["params"]]
            for optimizer in optimizers
            for group in optimizer.param_groups
        ]

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every key of the module's ``state_dict`` as a whole tensor, on every rank, as DDP, FSDP and DeepSpeed
        give it; trainable parameters from the optimizer's masters in the dtype the module gave them (fp32 weights
        of an fp32 model trained in bf16-mixed: Note: [What an export returns] in ``ds_strategy.zero.
        full_state_dict``), gathered one flat buffer at a time. A collective, so every rank calls it.

        Note: [The module state Lightning saves is not gathered]
        Lightning asks for this in two places: ``trainer.save_checkpoint`` (through its checkpoint connector's
        ``_get_lightning_module_state_dict``), and user code exporting the weights. A save must not gather (a
        stage-3 model need not fit on one rank): it wants this rank's pieces, which :meth:`save_checkpoint` writes.
        Lightning passes nothing that tells the two apart, so the caller's name does. Should Lightning rename that
        method, saves stay correct (:meth:`save_checkpoint` takes the pieces from the engine, not from what this
        returned) and only pay a needless gather.
        """
        if self.engine is not None and self.state_dict_type == "full":
            return self.engine.full_state_dict(rank0_only=True)
        if sys._getframe(1).f_code.co_name == _SAVING_CALLER:
            return checkpoint.model_state(self.lightning_module, self.engine)
        if self.engine is None:
            return super().lightning_module_state_dict()
        return self.engine.full_state_dict(rank0_only=False)

    def keep_fit_optimizer(self, fitting: bool) -> None:
        """Called by ``setup`` before it builds the engine: keep the fit's engine when the model is set up again
        without an optimizer, so that a save afterwards still writes the fit's optimizer state.

        Note: [A save after fit and test keeps the optimizer state]
        ``trainer.validate/test/predict`` after ``fit`` run ``setup`` again, which builds an engine without an
        optimizer over the same module, while Lightning still lists the fit's optimizer and a later
        ``trainer.save_checkpoint`` saves it (as under DDP). The fit's engine (torn down: no hooks, its shards and
        optimizer state still held, as DDP holds its optimizer) is kept until the next fit and gives the
        checkpoint's optimizer state and manifest; the weights come from the current engine, whose layout is the
        same (same module, config and ranks). An offloaded optimizer's state is released at teardown, so it is not
        kept (the save warns instead).
        """
        if fitting:
            self._fit_engine = None
        elif self.engine is not None and self.engine.optimizers:
            self._fit_engine = None if self.engine.plan.offloads_optimizer else self.engine

    def _optimizer_engine(self):
        """The engine whose optimizer state a save writes: this one's, else the fit's kept for it (or None)."""
        if self.engine is not None and self.engine.optimizers:
            return self.engine
        return self._fit_engine

    def optimizer_state(self, optimizer) -> dict[str, Any] | None:
        """This rank's share of the optimizer state (of the fit's engine after validate/test/predict, see Note: [A
        save after fit and test keeps the optimizer state]); None when there is none to save."""
        engine = self._optimizer_engine()
        if engine is not None and self.state_dict_type == "full":
            indices = engine.sharded_optimizers.indices_of(optimizer)
            if len(indices) != 1:
                raise ValueError(
                    f"state_dict_type='full': a chain of {len(indices)} optimizers has no one whole optimizer state; "
                    f"keep state_dict_type='sharded'"
                )
            return full_optimizer_state(engine, next(iter(indices)))
        return None if engine is None else checkpoint.optimizer_state(engine)

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` (also when it ends in ``.ckpt``; warned once)."""
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy.save_checkpoint(..., storage_options=...) is not supported: ZeroStrategy "
                "writes sharded checkpoint directories itself, not through a CheckpointIO plugin"
            )
        path = self.broadcast(str(filepath))
        if self.state_dict_type == "full":  # whole on rank 0 already (lightning_module_state_dict, optimizer_state)
            if self.is_global_zero:
                save_full_file(self.checkpoint_io, checkpoint_dict, path)
            self.barrier("ZeroStrategy.save_checkpoint")
            return
        self._warn_directory_suffix(path)
        checkpoint_dict.pop("state_dict")  # this rank's pieces, taken again below whatever Lightning collected
        model = checkpoint.model_state(self.lightning_module, self.engine)
        optimizers = checkpoint_dict.pop("optimizer_states", None)
        optimizer = optimizers[0] if optimizers else None
        if optimizers and optimizer is None:
            warnings.warn(
                f"saving {path} without optimizer state: the model was set up again without its optimizer "
                f"(trainer.validate/test/predict after a fit with an offloaded optimizer, whose state is released "
                f"at teardown); save before validating or testing to keep it",
                stacklevel=2,
            )
        if optimizer is not None and self._optimizer_order is not None:
            checkpoint_dict[OPTIMIZER_ORDER] = self._optimizer_order
        checkpoint.write(
            path,
            model,
            optimizer,
            checkpoint.manifest_for(
                self.lightning_module,
                self._optimizer_engine() if optimizer is not None else self.engine,
                optimizer is not None,
            ),
            extra=checkpoint_dict,
        )

    def _warn_directory_suffix(self, path: str) -> None:
        if path.endswith((".ckpt", ".pt", ".pth")) and not ZeroCheckpointing._warned_directory_suffix:
            ZeroCheckpointing._warned_directory_suffix = True
            warnings.warn(
                f"{path} will be a directory, not a file: ZeroStrategy always writes sharded checkpoint directories, "
                f"whatever the name ends in (ds-strategy consolidate makes one Lightning .ckpt file of it)",
                stacklevel=3,
            )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore module and (when fitting) optimizer now; return the rest for Lightning to restore. A single
        file (DDP's, one device's, or ``ds-strategy consolidate``'s) loads too: see :meth:`_load_single_file`."""
        path = self.broadcast(str(checkpoint_path))
        module = self.lightning_module
        fitting = module.trainer.state.fn == "fit"
        if Path(path).is_file():
            return self._load_single_file(path, fitting, bool(weights_only))
        extra = checkpoint.load(
            path,
            module,
            self.engine,
            load_optimizer=fitting,
            strict=module.strict_loading,
            weights_only=bool(weights_only),
        )
        extra.pop(OPTIMIZER_ORDER, None)
        return extra

    def _load_single_file(self, path: str, fitting: bool, weights_only: bool) -> dict[str, Any]:
        """Each rank memory-maps the file and takes its shards of ``state_dict`` (checked whole first, as
        :func:`ds_strategy.checkpoint.pretrained.load_weights` does); loops, schedulers, callbacks and the rest
        go back to Lightning. When fitting, each optimizer takes its shards of the saved whole state (keyed by
        position in the order the optimizer was given: Note: [A whole optimizer state] in
        ``ds_strategy.checkpoint.full_optimizer``); where no whole state fits this run (tensor or pipeline
        parallelism, a whole-tensor or offloaded optimizer) only the param-group hyperparameters are restored and the
        moments start afresh (warned), as DeepSpeed's ``load_full_weights`` does."""
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        if not isinstance(loaded, dict) or "state_dict" not in loaded:
            raise checkpoint.CheckpointError(
                f"{path} is a file without a 'state_dict' entry: not a Lightning checkpoint (a plain state dict "
                f"loads with trainer.strategy.load_pretrained from a hook such as on_fit_start)"
            )
        load_weights(self.engine, loaded.pop("state_dict"))
        saved_optimizers = loaded.pop("optimizer_states", None)
        if fitting and saved_optimizers and self.engine.optimizers and why_not_whole(self.engine) is None:
            for index, saved_optimizer in enumerate(saved_optimizers):
                load_full_optimizer_state(self.engine, saved_optimizer, index)
        elif fitting and saved_optimizers and self.engine.optimizers:
            for optimizer, saved_optimizer in zip(self.engine.optimizers, saved_optimizers):
                groups = saved_optimizer.get("param_groups", [])
                if len(groups) == len(optimizer.param_groups):
                    for group, saved in zip(optimizer.param_groups, groups):
                        group.update({key: value for key, value in saved.items() if key != "params"})
            warnings.warn(
                f"{path} is a single-file checkpoint: its weights, loops, schedulers and callbacks are restored, and "
                f"its optimizer's hyperparameters, but its optimizer state (moments) is not cut into this run's shards "
                f"(tensor or pipeline parallelism, a whole-tensor or offloaded optimizer) and starts afresh; resume "
                f"from a ZeroStrategy checkpoint directory to keep it",
                stacklevel=2,
            )
        return loaded

    def load_model_state_dict(self, checkpoint_dict: Any, strict: bool = True) -> None:
        """Done in :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint_dict: Any) -> None:
        """Done in :meth:`load_checkpoint`."""

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)
