"""Page-locked host buffers for offload's copies: only the buffers that are copied, exactly sized, within a budget.

Note: [Pinned host memory is bounded]
Pinned (page-locked) memory lets a host<->device copy run asynchronously at full speed, and the OS can never swap
it out or reclaim it. Allocated with ``pin_memory=True`` it comes from torch's caching host allocator, which rounds
every block up to a power of two and keeps freed blocks for reuse: a 5 GiB buffer takes 8 GiB of locked RAM, and
offloading every host tensor that way (masters, moments, gradients, parameter shards) could lock more than the
machine has while the sizing said 60% of it would be used. So:
  * only buffers that are copied to or from the device are pinned: the parameter shards a gather reads, the
    gradient buffers a reduction writes, the staging buffers updated parameters go through. The fp32 masters and
    the optimizer's moments are read and written by the host alone and stay pageable: about 4 of the 12 bytes
    per parameter of mixed-precision Adam are pinned instead of all of them.
  * each is allocated pageable and registered with the driver (``cudaHostRegister``) at its exact size, outside
    the caching allocator: nothing is rounded up, nothing is cached after it is freed.
  * the pinned bytes stay within ``budget`` (:func:`default_budget`: a quarter of the machine's RAM, shared by the
    ranks on it); a buffer that would pass it, or that the driver refuses, stays pageable, which costs speed (its
    copies are synchronous) and never correctness.
  * :meth:`PinnedHostMemory.release` unregisters everything when the offload closes, before the memory is freed.
Buffers below ``MIN_PINNED_BYTES`` are not pinned: they may share pages with other allocations, which the driver
would refuse to register twice, and their copies are short anyway.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from .host_memory import MAP_LARGE_BLOCKS_BYTES

log = logging.getLogger(__name__)

MIN_PINNED_BYTES = MAP_LARGE_BLOCKS_BYTES  # from here up glibc maps each block on its own pages (see host_memory)
BUDGET_FRACTION = 0.25  # of the machine's RAM, shared by the ranks on it


def default_budget() -> int:
    """Bytes one rank may pin: ``BUDGET_FRACTION`` of physical RAM over the ranks of this machine
    (``LOCAL_WORLD_SIZE``, set by torchrun and the project's launchers; 1 if unset)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(BUDGET_FRACTION * total / local_ranks)


def _cuda_code(result) -> int:
    return int(getattr(result, "value", result))


def cuda_register(pointer: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``pointer`` for the CUDA driver; False (and the sticky error cleared) if refused."""
    cudart = torch.cuda.cudart()
    if _cuda_code(cudart.cudaHostRegister(pointer, nbytes, 0)) == 0:
        return True
    cudart.cudaGetLastError()
    return False


def cuda_unregister(pointer: int) -> None:
    cudart = torch.cuda.cudart()
    if _cuda_code(cudart.cudaHostUnregister(pointer)) != 0:
        cudart.cudaGetLastError()


class PinnedHostMemory:
    """Host buffers for device copies, pinned within ``budget`` bytes (see [Pinned host memory is bounded]).

    ``register(pointer, nbytes) -> bool`` and ``unregister(pointer)`` page-lock and release memory (the CUDA
    driver's by default; tests pass their own)."""

    def __init__(
        self,
        budget: int,
        register: Callable[[int, int], bool] = cuda_register,
        unregister: Callable[[int], None] = cuda_unregister,
    ):
        self.budget = budget
        self._register, self._unregister = register, unregister
        self._pinned: dict[int, torch.Tensor] = {}  # storage address -> the tensor, kept alive while registered
        self.pinned_bytes = 0
        self.refused_bytes = 0  # asked for but left pageable: over the budget, or refused by the driver

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``numel`` elements, pinned if the budget allows."""
        tensor = torch.empty(numel, dtype=dtype)
        self.pin(tensor)
        return tensor

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in a new host buffer, pinned if the budget allows."""
        copy = self.empty(tensor.numel(), tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        return copy

    def pin(self, tensor: torch.Tensor) -> bool:
        """Page-lock the whole storage of ``tensor`` (a host tensor of its own storage) if it is large enough and
        fits the budget; whether it is pinned now."""
        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
        if pointer in self._pinned:
            return True
        if nbytes < MIN_PINNED_BYTES:
            return False
        if self.pinned_bytes + nbytes > self.budget or not self._register(pointer, nbytes):
            if not self.refused_bytes:
                log.warning(
                    "offload: %.1f MiB of host buffers left pageable (pinned budget %.1f MiB, %.1f MiB pinned): "
                    "their copies to and from the device are synchronous",
                    nbytes / 2**20,
                    self.budget / 2**20,
                    self.pinned_bytes / 2**20,
                )
            self.refused_bytes += nbytes
            return False
        self._pinned[pointer] = tensor
        self.pinned_bytes += nbytes
        return True

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    def unpin(self, tensor: torch.Tensor) -> None:
        """Release ``tensor``'s registration (before it is dropped); nothing if it was not pinned here."""
        pointer = tensor.untyped_storage().data_ptr()
        kept = self._pinned.pop(pointer, None)
        if kept is not None:
            self._unregister(pointer)
            self.pinned_bytes -= kept.untyped_storage().nbytes()

    def release(self) -> None:
        """Unregister every pinned buffer (teardown; the buffers stay usable, pageable)."""
        for pointer in list(self._pinned):
            self._unregister(pointer)
        self._pinned.clear()
        self.pinned_bytes = 0


def pinned_memory_for(device: torch.device, pin_memory: bool) -> PinnedHostMemory | None:
    """The pinned buffers of an offload on ``device`` with ``ZeroConfig.pin_memory``: None unless both ask for it."""
    return PinnedHostMemory(default_budget()) if pin_memory and device.type == "cuda" else None
