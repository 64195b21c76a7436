"""Sharded, atomic, reshardable checkpoints of a ZeRO-sharded model, and their consolidation into one file.

``save`` / ``load`` are collectives over the engine's process group; ``consolidate`` needs no process group.
The Lightning adapter (``ds_strategy.lightning.checkpointing``) translates Trainer checkpoint hooks into these.
"""
from .consolidate import consolidate
from .errors import CheckpointError
from .rank_state import model_state, optimizer_state
from .sharded_checkpoint import load, manifest_for, remove, save, write

__all__ = ["CheckpointError", "consolidate", "load", "manifest_for", "model_state", "optimizer_state", "remove", "save",
           "write"]
