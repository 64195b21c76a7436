"""Model parallelism around the ZeRO engine: the (pp, dp, sp, tp) device mesh (``mesh``), DTensor parameters in flat
buffers (``dtensor_params``), automatic tensor-parallel plans (``auto_plan``) and the styles torch lacks
(``tp_styles``), DeepSpeed-Ulysses sequence parallelism (``ulysses``), and pipeline parallelism: where a model's
pieces are (``pipeline_layout``), which stage owns which (``pipeline_split``), torch's schedules by name
(``pipeline_schedules``); running them over ZeRO-sharded stages is ``ds_strategy.pipeline``'s, above
the engine."""

from ds_strategy.parallel.auto_plan import STYLE_NAMES, apply_tensor_parallel_plan, tensor_parallel_plan
from ds_strategy.parallel.ulysses import (
    gradient_divide_factor,
    register_hf_attention,
    sequence_parallel_loss,
    shard_sequence,
    ulysses_attention,
    ulysses_sdpa,
)

__all__ = [
    "STYLE_NAMES",
    "apply_tensor_parallel_plan",
    "tensor_parallel_plan",
    "gradient_divide_factor",
    "register_hf_attention",
    "sequence_parallel_loss",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_sdpa",
]
