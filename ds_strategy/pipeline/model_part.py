"""What the engine is told, once at construction, of the whole model a pipeline cut left this rank part of."""

from __future__ import annotations

from torch import nn

from ..parallel.pipeline_split import StagePlan
from ..zero.model_part import CutPiece, ModelPart


def model_part(module: nn.Module, plan: StagePlan | None) -> ModelPart | None:
    """The pipeline's size, the whole model's names, this rank's tied copies and the meta pieces cut from ``module`` by
    ``plan`` (None without pipelining: the engine holds a whole model)."""
    if plan is None:
        return None
    pieces = tuple(CutPiece(*piece) for piece in plan.cut_pieces)
    return ModelPart(len(set(plan.rank_of_stage)), plan.whole_names, plan.tied_copies(module), pieces)
