"""``state_dict_type``: FSDP's name for the choice between sharded checkpoints and one file, for the Lightning and
Fabric strategies.

"sharded" (the default): every rank writes its own shards into a checkpoint directory; nothing is gathered, and the
directory loads at any world size, stage or parallel layout (:mod:`ds_strategy.checkpoint`). "full": as FSDP's
``state_dict_type="full"``, the module's state dict and the optimizer's state are gathered whole onto rank 0 (empty
on the other ranks), which writes one ``torch.save`` file that DDP, one device and other people's loaders read
(litgpt's ``lit_model.pth``), and which loads back, model and optimizer, at any world size and stage. Its cost: rank
0 holds the whole model and optimizer state in host memory while saving (for Adam in fp32, 16 bytes per parameter),
and the save moves all of it over rank 0's link (Note: [A whole optimizer state] in
``ds_strategy.checkpoint.full_optimizer`` says what it covers). The file is published atomically (Note: [Atomic
single files] in ``ds_strategy.checkpoint.directory``): a job killed while saving leaves the previous file or none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import directory

STATE_DICT_TYPES = ("sharded", "full")


def checked_state_dict_type(value: str, strategy: str) -> str:
    """``value`` when it is one of :data:`STATE_DICT_TYPES`, else a ValueError naming it and the allowed ones."""
    if value not in STATE_DICT_TYPES:
        raise ValueError(
            f"{strategy}(state_dict_type={value!r}): expected one of {', '.join(map(repr, STATE_DICT_TYPES))}"
        )
    return value


def save_full_file(checkpoint_io: Any, checkpoint: dict[str, Any], path: str) -> None:
    """Rank 0's one file of a "full" save, written by the strategy's ``checkpoint_io`` plugin into its partial
    sibling and renamed onto ``path``. A URL (``s3://...``) goes to the plugin as it is: an object store publishes
    an upload whole, and has no rename."""
    if "://" in path:
        checkpoint_io.save_checkpoint(checkpoint, path)
        return
    directory.publish_file(Path(path), lambda partial: checkpoint_io.save_checkpoint(checkpoint, partial))
