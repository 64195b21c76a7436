"""What the engine is told, once at construction, of the whole model a pipeline cut left this rank part of."""

from __future__ import annotations

from torch import nn

from ..parallel.pipeline_split import StagePlan
from ..zero.model_part import CutPiece, ModelPart


def model_part(module: nn.Module, plan: StagePlan | None) -> ModelPart | None:
    """The pipeline's size, the whole model's names, the meta pieces cut from ``module`` by ``plan`` and, for this
    rank's tied copies, the facts the engine knows of them: saved under their owner's name, and no share of the
    gradient norm, which the owner's stage counts (Note: [Parameters another part saves] in
    :mod:`ds_strategy.zero.model_part`). None without pipelining: the engine holds a whole model."""
    if plan is None:
        return None
    pieces = tuple(CutPiece(*piece) for piece in plan.cut_pieces)
    copies = plan.tied_copies(module)
    shares = dict.fromkeys(copies, 0.0)
    return ModelPart(len(set(plan.rank_of_stage)), plan.whole_names, copies, shares, pieces)
