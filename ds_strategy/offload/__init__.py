"""ZeRO-Offload and ZeRO-Infinity: optimizer state and stage-3 parameter shards on the host or in NVMe files.

``CpuAdam`` / ``CpuAdagrad`` / ``CpuSGD`` (:mod:`.cpu_adam`) are the host optimizers, usable on their own;
``EngineOffload`` (:mod:`.engine_offload`) is what ``ZeroEngine`` delegates to when ``ZeroConfig.offload_optimizer``
or ``offload_params`` is set; ``OffloadSetupError`` is raised at setup when ``nvme_path`` cannot hold a rank's files.
"""
from .cpu_adam import CpuAdagrad, CpuAdam, CpuSGD
from .nvme_swapper import OffloadSetupError

__all__ = ["CpuAdagrad", "CpuAdam", "CpuSGD", "OffloadSetupError"]
