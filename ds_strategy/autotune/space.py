"""The configurations an autotuner may try: ZeroConfig fields crossed with micro-batch sizes, without duplicates."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import ZeroConfig

# What is searched unless told otherwise; any ZeroConfig field can be a dimension (precision, offload, ...).
DEFAULT_DIMENSIONS: dict[str, tuple] = {"stage": (0, 1, 2, 3), "reduce_bucket_size": (5_000_000, 500_000_000)}
DEFAULT_MICRO_BATCH_SIZES = (8, 4, 2, 1)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to try: ZeroConfig fields and the per-rank micro-batch size."""

    micro_batch_size: int
    fields: tuple[tuple[str, Any], ...]

    def config(self, base: ZeroConfig) -> ZeroConfig:
        """``base`` with this candidate's fields and micro-batch size (validated by ZeroConfig)."""
        return base.replace(**dict(self.fields), train_micro_batch_size_per_gpu=self.micro_batch_size)

    @property
    def label(self) -> str:
        shown = " ".join(f"{name}={_short(value)}" for name, value in self.fields)
        return f"{shown} mbs={self.micro_batch_size}"


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    return str(value)


def candidates(
    dimensions: Mapping[str, Sequence], micro_batch_sizes: Sequence[int], base: ZeroConfig, model_numel: int
) -> list[Candidate]:
    """Every combination, largest micro-batch first (the likeliest fastest, so a time budget cuts the rest),
    with combinations that behave identically (a field that does not matter at the stage, a bucket above the
    model size) kept once. A bad field name or value raises ValueError before anything runs."""
    if not micro_batch_sizes or any(not isinstance(m, int) or m < 1 for m in micro_batch_sizes):
        raise ValueError(f"micro_batch_sizes={micro_batch_sizes!r} must be a non-empty list of integers >= 1")
    names = list(dimensions)
    seen, found = set(), []
    for micro_batch in sorted(set(micro_batch_sizes), reverse=True):
        for values in itertools.product(*(dimensions[name] for name in names)):
            candidate = Candidate(micro_batch, tuple(zip(names, values)))
            config = candidate.config(base)
            key = (micro_batch, tuple(_effective(config, name, model_numel) for name in names))
            if key not in seen:
                seen.add(key)
                found.append(candidate)
    return found


def _effective(config: ZeroConfig, name: str, model_numel: int) -> Any:
    """What ``name``'s value does in ``config``: nothing at a stage it does not act at (None), and a bound on
    elements above the model's size acts as that size (both declared with the field: ``setting``)."""
    declared = ZeroConfig.__dataclass_fields__[name].metadata
    if config.stage not in declared["acts_at"]:
        return None
    value = getattr(config, name)
    return min(value, model_numel) if declared["bounds_elements"] and isinstance(value, int) else value
