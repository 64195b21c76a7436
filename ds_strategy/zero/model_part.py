"""What the engine must know of a model it holds only part of (a pipeline stage's share), given once at
construction: the engine itself knows nothing of pipelines, only these facts about the module it was handed.

Note: [Tied copies]
  A rank may hold a copy of a parameter another rank owns (an LM head tied to the embedding on another rank's
  pipeline stage). The engine keeps a copy in flat buffers of its own, names it by its owner's name (so checkpoints
  and pretrained loading find one tensor under one name) and leaves it out of the gradient norm, which the owner
  counts. Whoever cut the model says which parameters are copies (:attr:`ModelPart.copy_owners`); the engine reads
  that when it lays out its units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn


@dataclasses.dataclass(frozen=True)
class CutPiece:
    """A module built on the meta device that a cut set to None in ``parent`` (as attribute ``name``): it holds no
    memory, and is put back while the model is initialised (Note: [A sharded build equals a normal build] in
    :mod:`.sharded_init`)."""

    parent: nn.Module
    name: str
    module: nn.Module


@dataclasses.dataclass(frozen=True)
class ModelPart:
    """``pipeline_size``: how many ranks the whole model is spread over, one part each (the pipeline's size, by which
    checkpoints know to gather every part's entries). ``whole_names``: the whole model's ``state_dict`` names in order,
    by which checkpoints order every part's entries (this module holds only its own). ``copy_owners``: this module's
    names of tied copies (its first name for each), mapped to the name their owner saves them under
    (Note: [Tied copies]). ``cut_pieces``: the meta pieces cut away from it."""

    pipeline_size: int = 1
    whole_names: tuple[str, ...] = ()
    copy_owners: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cut_pieces: tuple[CutPiece, ...] = ()
