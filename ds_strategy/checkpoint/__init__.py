"""Sharded, atomic, reshardable checkpoints of a ZeRO-sharded model, and their consolidation into one file.

``save(path, module, engine)`` / ``load(path, module, engine)`` are collectives over the engine's process group
(the whole world under tensor or pipeline parallelism): each rank writes and reads only its own shards, by
parameter name, so a checkpoint loads at any world size, ZeRO stage, precision, offload setting or tensor- and
pipeline-parallel split. ``consolidate(path, out)`` and ``latest(root)`` (the checkpoint a restarted job
resumes from) need no process group. The layout and the atomic publication are described in :mod:`.directory`, the
naming of entries (and tied weights) in :mod:`.manifest`.
The Lightning adapter (``ds_strategy.lightning.checkpointing``) translates Trainer checkpoint hooks into these.
"""

from .consolidate import consolidate
from .errors import CheckpointError
from .rank_state import model_state, optimizer_state
from .sharded_checkpoint import latest, load, manifest_for, remove, save, write

__all__ = [
    "CheckpointError",
    "consolidate",
    "latest",
    "load",
    "manifest_for",
    "model_state",
    "optimizer_state",
    "remove",
    "save",
    "write",
]
