"""What the engine must know of a model it holds only part of (a pipeline stage's share), given once at
construction: the engine itself knows nothing of pipelines, only these facts about the module it was handed.

Note: [Parameters another part saves]
  A rank may hold a copy of a parameter another rank owns and saves (under pipelining, an LM head sharing the
  embedding's weight on another rank's stage). The engine knows two facts per parameter, never why: the share of
  the global gradient norm this rank's copy carries (:attr:`ModelPart.norm_shares`; 0 for such a copy, which its
  owner counts) and the name it is saved under (:attr:`ModelPart.saved_as`; the owner's, so that checkpoints and
  pretrained loading find one tensor under one name). Its flat buffers keep parameters of different shares apart,
  and hold each parameter under its saved name; the engine lists the trainable ones saved under another name as
  ``ZeroEngine.saved_as``, which checkpoints leave to the part that saves them. Whoever cut the model supplies both
  facts (``ds_strategy.pipeline.model_part``).
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
    by which checkpoints order every part's entries (this module holds only its own). ``saved_as``: this module's names
    (its first name for each) of parameters another part saves, mapped to the name it saves them under;
    ``norm_shares``: this module's names of parameters whose gradients carry another share than 1 of the global
    norm, mapped to that share (Note: [Parameters another part saves]). ``cut_pieces``: the meta pieces cut away
    from it."""

    pipeline_size: int = 1
    whole_names: tuple[str, ...] = ()
    saved_as: Mapping[str, str] = dataclasses.field(default_factory=dict)
    norm_shares: Mapping[str, float] = dataclasses.field(default_factory=dict)
    cut_pieces: tuple[CutPiece, ...] = ()
