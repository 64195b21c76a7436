"""Lightning's checkpoint hooks for ZeroStrategy, translated into :mod:`ds_strategy.checkpoint` calls.

A Trainer checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``) is a directory laid out like Lightning's
FSDP "sharded" checkpoints: the module and optimizer state written by every rank through DCP, and everything else
Lightning puts in a checkpoint (loops, LR schedulers, callbacks, precision plugin, hyperparameters) in rank 0's
``meta.pt``; see :mod:`ds_strategy.checkpoint.directory`. Nothing is gathered to save, the directory appears
atomically, and ``ckpt_path=`` may name a checkpoint saved at another world size or ZeRO stage.

Loading waits until after ``setup`` (the engine must exist to know this rank's shard) and restores model and
optimizer inside ``load_checkpoint``, so Lightning's own model/optimizer restore steps have nothing left to do.
No Lightning import here: the mixin serves both ``lightning.pytorch`` and ``pytorch_lightning``.
"""

from __future__ import annotations

from typing import Any

from .. import checkpoint


class ZeroCheckpointing:
    """Checkpoint hooks of a Lightning strategy that owns a ``ZeroEngine`` as ``self.engine``."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's share of the module state (pieces of its shards), not a gathered state dict."""
        return checkpoint.model_state(self.lightning_module, self.engine)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return checkpoint.optimizer_state(self.engine)

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy.save_checkpoint(..., storage_options=...) is not supported: ZeroStrategy "
                "writes sharded checkpoint directories itself, not through a CheckpointIO plugin"
            )
        path = self.broadcast(str(filepath))
        model = checkpoint_dict.pop("state_dict")
        optimizers = checkpoint_dict.pop("optimizer_states", None)
        optimizer = optimizers[0] if optimizers else None
        checkpoint.write(
            path,
            model,
            optimizer,
            checkpoint.manifest_for(self.lightning_module, self.engine, optimizer is not None),
            extra=checkpoint_dict,
        )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore module and (when fitting) optimizer now; return the rest for Lightning to restore."""
        path = self.broadcast(str(checkpoint_path))
        module = self.lightning_module
        return checkpoint.load(
            path, module, self.engine, load_optimizer=module.trainer.state.fn == "fit", strict=module.strict_loading
        )

    def load_model_state_dict(self, checkpoint_dict: Any, strict: bool = True) -> None:
        """Done in :meth:`load_checkpoint`."""

    def load_optimizer_state_dict(self, checkpoint_dict: Any) -> None:
        """Done in :meth:`load_checkpoint`."""

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)
