"""The pipeline schedules ``ZeroConfig.pipeline_schedule`` names, as torch.distributed.pipelining implements them.

Kept free of ds_strategy imports so that ``ds_strategy.config`` can validate against ``SCHEDULES`` without a cycle;
torch's schedules module is imported only when a class is asked for.
"""

from __future__ import annotations

SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
_SINGLE_STAGE = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle; the others are PipelineScheduleMulti


def stages_per_rank(schedule: str) -> int:
    """How many stage chunks each rank holds: the interleaved and zero-bubble schedules need two to fill bubbles."""
    _check(schedule)
    return 1 if schedule in _SINGLE_STAGE else 2


def stage_count(pipeline_size: int, schedule: str) -> int:
    """How many stages the model is cut into over ``pipeline_size`` ranks; also the default number of micro-batches
    per step (``ZeroConfig.pipeline_microbatch_count``): one per stage, the fewest that can keep every stage busy."""
    return pipeline_size * stages_per_rank(schedule)


def schedule_class(schedule: str) -> type:
    """The torch.distributed.pipelining schedule class ``schedule`` names."""
    from torch.distributed.pipelining import schedules

    _check(schedule)
    return getattr(schedules, SCHEDULES[schedule])


def _check(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not known; expected one of {', '.join(SCHEDULES)}")
