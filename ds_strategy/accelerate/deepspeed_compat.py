"""What scripts written for accelerate's DeepSpeed back-end, or for DDP, ask of an Accelerator and its models.

- ``accelerator.state.deepspeed_plugin``: accelerate's examples choose ``DummyOptim``/``DummyScheduler`` by testing it
  (``deepspeed_with_config_support.py``: ``None`` or no ``"optimizer"`` in its ``deepspeed_config`` means a real
  optimizer). A ZeroAccelerator configured by a DeepSpeed config with ``optimizer``/``scheduler`` sections answers a
  :class:`DeepSpeedPluginView`; otherwise ``None``, as accelerate does without DeepSpeed. Only this accelerator's
  ``state`` carries the view: the process-wide ``AcceleratorState()`` still reports no DeepSpeed, so neither
  accelerate nor transformers takes a DeepSpeed code path.
- ``model.no_sync()``: DDP's context manager, which scripts call on the prepared model to accumulate locally
  (``gradient_accumulation_for_autoregressive_models.py``). A prepared model answers it with the accelerator's
  ``no_sync(model)``, whose meaning per stage is ``ZeroEngine.no_sync``'s.
- ``ds-strategy launch`` sets ``$DS_STRATEGY_LAUNCH_MARKERS`` to a directory where each ZeroAccelerator leaves a file
  named for its rank; a launch whose workers left none ran a script that never built one (a plain ``Accelerator``
  trains each process alone), which the launcher reports as a failure.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import ZeroConfig

LAUNCH_MARKERS_VAR = "DS_STRATEGY_LAUNCH_MARKERS"


@dataclasses.dataclass(frozen=True)
class DeepSpeedPluginView:
    """The part of accelerate's ``DeepSpeedPlugin`` scripts read: ``deepspeed_config`` (the config's optimizer and
    scheduler sections as written, the ZeRO stage, the batch settings) and ``zero_stage``."""

    deepspeed_config: Mapping[str, Any]
    zero_stage: int

    @classmethod
    def of(cls, config: ZeroConfig, sections: Mapping[str, Any]) -> DeepSpeedPluginView:
        batch = {
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
            "train_batch_size": config.train_batch_size,
        }
        deepspeed_config = {
            "zero_optimization": {"stage": config.stage},
            **{key: value for key, value in batch.items() if value is not None},
            **sections,
        }
        return cls(deepspeed_config, config.stage)


class StateWithDeepSpeedView:
    """An ``AcceleratorState`` whose ``deepspeed_plugin`` is a :class:`DeepSpeedPluginView`; everything else is the
    state's own (reads and writes)."""

    def __init__(self, state: Any, plugin: DeepSpeedPluginView):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "deepspeed_plugin", plugin)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._state, name, value)

    def __repr__(self) -> str:
        return f"{self._state!r}ds_strategy DeepSpeed config view: {dict(self.deepspeed_plugin.deepspeed_config)}\n"


def mark_launched_worker(rank: int) -> None:
    """Under ``ds-strategy launch``: record that this worker built a ZeroAccelerator."""
    directory = os.environ.get(LAUNCH_MARKERS_VAR)
    if directory:
        Path(directory, f"rank{rank}").touch()


def launched_workers(directory: str | os.PathLike) -> int:
    """How many workers of a launch built a ZeroAccelerator."""
    return sum(1 for path in Path(directory).iterdir() if path.name.startswith("rank"))
