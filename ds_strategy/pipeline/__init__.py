"""Pipeline parallelism above the ZeRO engine: torch's schedules running this rank's stages (:mod:`.runner`, the stages
themselves in :mod:`.stage`, the weights two stages' ranks share in :mod:`.tied_weights`), one training or evaluation
step with or without a schedule (:mod:`.step`), and what the engine is told of the whole model a stage plan cut
(:mod:`.model_part`). Where a model's pieces are and which stage owns which is the layout's, below the engine
(``ds_strategy.parallel.pipeline_layout``, ``pipeline_split``); the engine knows only ZeRO and is driven through its
schedule interface."""

from .model_part import model_part
from .runner import PipelineRunner
from .step import pipeline_step, ran_its_backward

__all__ = ["PipelineRunner", "model_part", "pipeline_step", "ran_its_backward"]
