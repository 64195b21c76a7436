"""ZeRO-Offload and ZeRO-Infinity: optimizer state and stage-3 parameter shards on the host or in NVMe files.

``CpuAdam`` / ``CpuAdagrad`` / ``CpuSGD`` (:mod:`.cpu_adam`) are the host optimizers, usable on their own;
``OffloadedStep`` (:mod:`.offloaded_step`) is the engine's step runner when ``ZeroConfig.offload_optimizer`` or
``offload_params`` is set, registered with the engine here (see Note: [One-way dependency between the engine and
offload] in :mod:`ds_strategy.zero.step_runner`); ``OffloadSetupError`` is raised at setup when ``nvme_path``
cannot hold a rank's files, ``OffloadIOError`` when one cannot be written or read later (the disk filled up).
"""

from ..zero.step_runner import register_off_device_runner
from .cpu_adam import CpuAdagrad, CpuAdam, CpuSGD
from .nvme_swapper import OffloadIOError, OffloadSetupError
from .offloaded_step import OffloadedStep

register_off_device_runner(OffloadedStep)

__all__ = ["CpuAdagrad", "CpuAdam", "CpuSGD", "OffloadIOError", "OffloadSetupError", "OffloadedStep"]
