"""Stage-3 parameter shards kept on the host or in NVMe files between gathers, and where updated values go.

The gathered working set (``FlatParam.full``) stays on the device; only the rank's shard moves. A gather reads
it through ``FlatParam.gather_source()``: on a CUDA device a copy to the device, fenced so that the host step does
not rewrite the shard before the device has read it (Note: [Host buffers a device copy reads] in
:mod:`.transfers`); on a CPU device the shard itself (the host is the device: zero-copy; an NVMe shard is then read
through its memory map by the collective, see :mod:`.nvme_swapper`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .nvme_swapper import RunDirectory, SwapFile

if TYPE_CHECKING:
    from ..zero.flat_param import FlatParam
    from ..zero.step_runner import StepContext
    from .pinned import PinnedHostMemory
    from .transfers import Transfers


def host_copy(tensor: torch.Tensor, pinned: PinnedHostMemory | None) -> torch.Tensor:
    """``tensor`` in host memory (from ``pinned`` when given), or ``tensor`` itself when it is there already."""
    if tensor.device.type == "cpu" and (pinned is None or pinned.is_pinned(tensor)):
        return tensor
    if pinned is not None:
        return pinned.copy_of(tensor)
    return tensor.to("cpu", copy=True)


class ShardFiles:
    """NVMe files for stage-3 parameter shards, written as each unit is materialised (``FlatParam.shard_store``).

    A model built on the meta device is initialised one unit at a time; were its shards kept in memory until the
    offload takes them, the whole model's shards (4 bytes per parameter / N in fp32) would be resident at once
    at the end of construction. Stored here, each shard goes to its file as soon as it is cut, so construction
    holds one unit's full buffer and nothing that grows with the model. The directory is created at the first
    shard and adopted by :class:`~.offloaded_step.OffloadedStep`, which checks the free space for the rest.
    """

    def __init__(self, root: str, rank: int):
        self.root, self.rank = root, rank
        self.directory: RunDirectory | None = None
        self.files: dict[int, SwapFile] = {}

    def store(self, fp: FlatParam, values: torch.Tensor) -> torch.Tensor:
        """Write ``values`` (``fp``'s new shard) to a file of its own; returns the file's memory map."""
        if self.directory is None:
            self.directory = RunDirectory.create(self.root, self.rank, values.numel() * values.element_size())
        file = self.directory.new_file(f"shard{len(self.files)}.param", values.numel(), values.dtype)
        file.write_converted(values)
        self.files[fp.index] = file
        return file.view

    def nbytes(self) -> int:
        return sum(file.nbytes for file in self.files.values())


class ParamOffload:
    """Moves each partitioned flat parameter's ``shard`` to ``place`` ("cpu" or "nvme") and gathers from there,
    through ``transfers`` (None on a CPU device: the shard itself is gathered)."""

    def __init__(
        self,
        context: StepContext,
        place: str,
        directory: RunDirectory | None,
        pinned: PinnedHostMemory | None,
        transfers: Transfers | None,
    ):
        self.flat_params = [fp for fp in context.flat_params if fp.policy.params]
        stored = context.shard_store.files if isinstance(context.shard_store, ShardFiles) else {}
        self.files: dict[int, SwapFile] = {}  # fp.index -> the file holding its shard
        self.transfers = transfers
        for fp in self.flat_params:
            if fp.index in stored:  # written when its unit was materialised
                self.files[fp.index] = stored[fp.index]
                shard = fp.shard
            elif place == "nvme":
                file = self.files[fp.index] = directory.new_file(
                    f"flat{fp.index}.param", fp.shard_numel, fp.compute_dtype
                )
                file.write_converted(fp.shard)
                shard = file.view
            else:
                shard = host_copy(fp.shard, pinned)  # copied to the device at every gather: pinned
            fp.relocate_shard(shard, self._device_copy(fp) if transfers is not None else None)

    def _device_copy(self, fp: FlatParam):
        return lambda: self.transfers.to_device(fp.shard)

    def wait_device_reads(self) -> None:
        """Before the host rewrites shards: every gather's copy has read them (Note: [Host buffers a device copy
        reads] in :mod:`.transfers`)."""
        if self.transfers is not None:
            self.transfers.wait_device_reads()

    @staticmethod
    def nvme_bytes(flat_params: list[FlatParam]) -> int:
        return sum(fp.shard_numel * fp.full.element_size() for fp in flat_params if fp.policy.params)

    def file_of(self, fp: FlatParam) -> SwapFile | None:
        return self.files.get(fp.index)

    def host_tensors(self) -> list[torch.Tensor]:
        return [fp.shard for fp in self.flat_params if fp.index not in self.files]

    def trim(self) -> None:
        for file in self.files.values():
            file.trim()

    def close(self) -> None:
        for file in self.files.values():
            file.close()


class ParamSink:
    """Where one flat parameter's updated values go after its host step, sub-group by sub-group.

    "none": the master is the compute region itself (fp32 on a CPU device): nothing to copy. "host": the region is
    host memory, written in the optimizer's own pass. "device": through a host staging buffer, then copied to the
    device. "file": through a staging buffer into the NVMe parameter file.
    """

    def __init__(self, fp: FlatParam, master: torch.Tensor, file: SwapFile | None):
        self.fp, self.file = fp, file
        self.region = fp.master_region()
        self._copied: dict[int, torch.cuda.Event] = {}
        if file is not None:
            self.kind = "file"
        elif self.region.device.type != "cpu":
            self.kind = "device"
        elif self.region.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
            self.kind = "none"
        else:
            self.kind = "host"

    @property
    def needs_staging(self) -> bool:
        return self.kind in ("device", "file")

    @property
    def dtype(self) -> torch.dtype:
        return self.fp.compute_dtype if self.file is not None else self.region.dtype

    def target(self, lo: int, hi: int, staging: torch.Tensor | None) -> torch.Tensor | None:
        """The host tensor the update pass copies elements ``[lo, hi)`` into, if any."""
        if self.kind == "host":
            return self.region[lo:hi]
        return staging if self.needs_staging else None

    def after_update(self, lo: int, hi: int, out: torch.Tensor | None) -> None:
        if self.kind == "device":
            self.region[lo:hi].copy_(out, non_blocking=out.is_pinned())
            event = torch.cuda.Event()
            event.record()
            self._copied[lo] = event

    def write_behind(self, lo: int, hi: int, staging: torch.Tensor | None) -> None:
        """Finish with the staging buffer of ``[lo, hi)`` (it is reused after this returns)."""
        if self.kind == "file":
            self.file.write(staging, lo)
        elif self.kind == "device":
            self._copied.pop(lo).synchronize()
