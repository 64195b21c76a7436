"""ZeRO-Offload and ZeRO-Infinity: optimizer state and stage-3 parameter shards on the host or in NVMe files.

``CpuAdam`` / ``CpuAdagrad`` / ``CpuSGD`` (:mod:`.cpu_adam`) are the host optimizers, usable on their own;
``OffloadedStep`` (:mod:`.offloaded_step`) is the engine's step runner when ``ZeroConfig.offload_optimizer`` or
``offload_params`` is set, handed to the engine as its ``step_runner`` argument (:func:`step_runner_for` chooses;
see Note: [One-way dependency between the engine and offload] in :mod:`ds_strategy.zero.step_runner`);
``OffloadSetupError`` is raised at setup when ``nvme_path`` cannot hold a rank's files, ``OffloadIOError`` when one
cannot be written or read later (the disk filled up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cpu_adam import CpuAdagrad, CpuAdam, CpuSGD
from .nvme_swapper import OffloadIOError, OffloadSetupError
from .offloaded_step import OffloadedStep

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from ..zero.step_runner import StepRunnerFactory


def step_runner_for(config: ZeroConfig) -> StepRunnerFactory | None:
    """The ``step_runner`` for ``ZeroEngine`` under ``config``: :class:`OffloadedStep` when it offloads anything,
    None (the engine steps on the device) otherwise."""
    return OffloadedStep if config.plan.offloads else None


__all__ = ["CpuAdagrad", "CpuAdam", "CpuSGD", "OffloadIOError", "OffloadSetupError", "OffloadedStep", "step_runner_for"]
