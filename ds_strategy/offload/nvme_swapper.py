"""ZeRO-Infinity's NVMe tier: per-rank files under ``nvme_path`` and the optimizer step that streams through them.

Note: [What a crash leaves behind]
Each rank of each run creates its own directory ``<nvme_path>/ds_strategy-offload-<host>-<pid>-rank<r>-<random>``
and holds an exclusive ``flock`` on its ``owner.lock`` for as long as the process lives; the kernel drops the lock
when the process dies, however it dies. A run never opens a directory it did not create, so it cannot mistake
another run's files for its own state. At setup every rank sweeps ``nvme_path`` for directories whose lock it can
take (their owner is gone) and removes them. A directory is built, and its lock taken, under a hidden staging
name (``.ds_strategy-offload-...creating``) that the sweep does not take for a run's, and only then renamed into
place: a rank starting at the same moment can never find a directory whose lock file exists but is not yet held,
take that lock and delete a live run's files (ranks started together by a forking launcher did). Staging and
unlocked directories older than an hour (a run killed while creating one) are removed too. Teardown
(``ZeroEngine.remove_hooks``) removes the rank's own directory, and so does interpreter exit if teardown never ran.

Note: [Files, page cache and the tensors others see]
Files are written and read with ``os.pwritev``/``os.preadv`` (buffered, large, 4 KiB-aligned, sequential ranges,
from a thread pool; the GIL is released during IO), and each written range is advised out of the page cache
(``POSIX_FADV_DONTNEED``), so the state lives on the disk rather than in memory. ``FlatParam.master`` and the
optimizer's state tensors, which checkpointing and ``memory_report`` read, are shared memory maps of the same
files (``SwapFile.view``): buffered IO and shared maps go through one page cache, so both always see the same
bytes. The step never touches the maps, so they cost no resident memory; whoever reads one (a checkpoint) pages
it in, and ``trim`` (after every step) unmaps those pages again (``MADV_DONTNEED``, harmless on a shared file
map: dirty pages stay in the page cache and reach the file).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import queue
import shutil
import socket
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from .cpu_adam import TilePool, UpdateRule, tiled_update

if TYPE_CHECKING:
    from .pinned import PinnedHostMemory

log = logging.getLogger(__name__)

PREFIX = "ds_strategy-offload-"
LOCK_NAME = "owner.lock"
STAGING_SUFFIX = ".creating"
UNLOCKED_STALE_AFTER_S = 3600.0
ALIGN_ELEMENTS = 1024  # sub-groups start at multiples of this: 4 KiB-aligned file offsets for fp32


class OffloadSetupError(RuntimeError):
    """NVMe offload cannot start: ``nvme_path`` is missing, not writable or too small for this rank's files."""


class OffloadIOError(RuntimeError):
    """An NVMe offload file could not be written or read during training (the disk filled up, or failed).

    The step it happened in is incomplete, so the rank cannot go on: it raises, and its peers leave their next
    collective naming it (see [How a failed rank ends the job] in :mod:`ds_strategy.comm.rank_failure`).
    """


def _gib(nbytes: int) -> str:
    return f"{nbytes:,} bytes ({nbytes / 2**30:.2f} GiB)"


class RunDirectory:
    """This rank's own directory under ``nvme_path``, unique per process and locked while it lives."""

    def __init__(self, path: Path, lock_fd: int):
        self.path = path
        self._finalizer = weakref.finalize(self, _remove_directory, path, lock_fd)

    @classmethod
    def create(cls, root: str | os.PathLike, rank: int, nbytes: int) -> RunDirectory:
        """Check ``root`` can hold ``nbytes`` and create the directory; raises :class:`OffloadSetupError`."""
        root = Path(root)
        need = f"rank {rank} needs {_gib(nbytes)} of NVMe offload files there"
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OffloadSetupError(f"nvme_path {str(root)!r} cannot be created ({error.strerror}); {need}") from error
        if not root.is_dir():
            raise OffloadSetupError(f"nvme_path {str(root)!r} is not a directory; {need}")
        remove_stale_directories(root)
        _require_free(root, nbytes, need)
        name = f"{PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
        path, staging = root / name, root / f".{name}{STAGING_SUFFIX}"
        try:
            staging.mkdir()
            lock_fd = os.open(staging / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # before the sweep can see it: [What a crash ...]
            staging.rename(path)
        except OSError as error:
            raise OffloadSetupError(f"nvme_path {str(root)!r} is not writable ({error.strerror}); {need}") from error
        os.write(lock_fd, f"pid {os.getpid()} on {socket.gethostname()}, rank {rank}, since {time.ctime()}\n".encode())
        return cls(path, lock_fd)

    def require(self, rank: int, nbytes: int) -> None:
        """Check that ``nbytes`` more fit beside what is here already; raises :class:`OffloadSetupError`."""
        _require_free(self.path.parent, nbytes, f"rank {rank} needs {_gib(nbytes)} more of NVMe offload files there")

    def new_file(self, name: str, numel: int, dtype: torch.dtype) -> SwapFile:
        """A file of ``numel`` elements with its blocks allocated now, so a full disk fails here, not mid-training."""
        try:
            return SwapFile(self.path / name, numel, dtype)
        except OSError as error:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            self.close()
            raise OffloadSetupError(
                f"nvme_path {str(self.path.parent)!r}: cannot allocate {_gib(nbytes)} for "
                f"{name} ({error.strerror}); free space went below what this run needs"
            ) from error

    def close(self) -> None:
        """Remove the directory and everything in it, and release the lock."""
        self._finalizer()


def _require_free(root: Path, nbytes: int, need: str) -> None:
    free = shutil.disk_usage(root).free
    if free < nbytes:
        raise OffloadSetupError(f"nvme_path {str(root)!r} has {_gib(free)} free but {need}")


def _remove_directory(path: Path, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)


def _unlocked_too_long(entry: Path) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > UNLOCKED_STALE_AFTER_S
    except FileNotFoundError:  # renamed into place or removed by another rank meanwhile
        return False


def remove_stale_directories(root: Path) -> None:
    """Remove the offload directories of runs that are gone (see [What a crash leaves behind])."""
    for staging in root.glob(f".{PREFIX}*{STAGING_SUFFIX}"):
        if _unlocked_too_long(staging):
            shutil.rmtree(staging, ignore_errors=True)
    for entry in root.glob(PREFIX + "*"):
        lock = entry / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            if _unlocked_too_long(entry):
                shutil.rmtree(entry, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run owns it
        finally:
            os.close(fd)  # also drops a lock just taken
        log.info("removing %s: NVMe offload files of a run that ended without teardown", entry)
        shutil.rmtree(entry, ignore_errors=True)


class SwapFile:
    """One tensor's worth of elements in a file: positional IO into host tensors, and a shared memory map."""

    def __init__(self, path: Path, numel: int, dtype: torch.dtype):
        self.path, self.numel, self.dtype = path, numel, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if numel:  # a rank may own nothing of a buffer (Note: [Whole parameters on owner ranks])
                os.posix_fallocate(self.fd, 0, numel * self.itemsize)
        except OSError:
            os.close(self.fd)
            raise
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def view(self) -> torch.Tensor:
        """The file as a 1-D tensor (a shared map; see [Files, page cache and the tensors others see])."""
        if self._view is None and not self.numel:
            self._view = torch.empty(0, dtype=self.dtype)  # nothing to map
        if self._view is None:
            self._map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._view = torch.frombuffer(self._map, dtype=self.dtype)
        return self._view

    def read(self, dst: torch.Tensor, start: int) -> None:
        """Fill contiguous ``dst`` with elements ``[start, start + dst.numel())``."""
        buffer = memoryview(dst.view(torch.uint8).numpy())
        offset, done = start * self.itemsize, 0
        while done < len(buffer):
            try:
                count = os.preadv(self.fd, [buffer[done:]], offset + done)
            except OSError as error:
                raise self._failed("reading", len(buffer), offset, error) from error
            if count == 0:
                raise OffloadIOError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += count

    def write(self, src: torch.Tensor, start: int) -> None:
        """Store contiguous ``src`` (of this file's dtype) at element ``start``, then drop it from the page cache."""
        buffer = memoryview(src.view(torch.uint8).numpy())
        offset, done = start * self.itemsize, 0
        while done < len(buffer):
            try:
                done += os.pwritev(self.fd, [buffer[done:]], offset + done)
            except OSError as error:
                raise self._failed("writing", len(buffer), offset, error) from error
        os.posix_fadvise(self.fd, offset, len(buffer), os.POSIX_FADV_DONTNEED)

    def _failed(self, doing: str, nbytes: int, offset: int, error: OSError) -> OffloadIOError:
        """The error naming ``nvme_path`` (this file is in the run's directory there), the file, range and cause."""
        return OffloadIOError(
            f"nvme_path {str(self.path.parent.parent)!r}: {doing} {nbytes:,} bytes at byte {offset:,} of "
            f"{self.path} failed: [Errno {error.errno}] {error.strerror} ({errno.errorcode.get(error.errno, '?')})"
        )

    def write_converted(self, src: torch.Tensor, start: int = 0, chunk: int = 1 << 22) -> None:
        """Store ``src`` of any dtype or device, converting ``chunk`` elements at a time.

        Each chunk is a copy: exporting ``src``'s own storage to numpy would make it non-resizable, and a stage-3
        full buffer (whose shard is written here) must be freed by resizing it to zero."""
        for lo in range(0, src.numel(), chunk):
            piece = src[lo : lo + chunk].to(device="cpu", dtype=self.dtype, copy=True).contiguous()
            self.write(piece, start + lo)

    def trim(self) -> None:
        """Unmap whatever pages of the memory map were touched (they are then no longer resident in this process)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Close the file (its memory map stays valid while tensors view it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class SwapBuffer:
    """Host memory for one sub-group in flight: the master, each state, and the updated parameters' staging."""

    tensors: dict[str, torch.Tensor]
    staging: torch.Tensor | None


@dataclass
class SubGroup:
    """Elements ``[lo, hi)`` of one flat parameter's shard, and what its update needs."""

    files: dict[str, SwapFile]
    keys: tuple[str, ...]
    lo: int
    hi: int
    grad: torch.Tensor
    hyper: dict
    step: torch.Tensor | None
    first: bool
    initial: dict[str, float | None]
    sink: object  # ParamSink: where the updated parameters go
    writes: list[Future] = field(default_factory=list)


class _Read(NamedTuple):
    """A sub-group being read into its buffer: the update waits on ``future`` (see [The pipeline])."""

    group: SubGroup
    buffer: SwapBuffer
    future: Future


class NvmeSwapper:
    """Streams sub-groups of offloaded state through ``buffer_count`` host buffers during the optimizer step.

    Note: [The pipeline] With sub-groups s_1..s_k in order, while s_i is updated on the compute threads the reads
    of s_{i+1}.. (up to ``buffer_count - 2`` ahead) and the write-behind of s_{i-1}.. run on the IO threads. A
    buffer returns to the free list when its write-behind is done, and the next read waits for a free buffer, so
    host memory stays at ``buffer_count`` sub-groups whatever the shard size. On a state's first step nothing is
    read but the master: the buffers are filled with the state's initial value. The step returns once every
    write is on its way to the disk (in the page cache, being written back).
    """

    def __init__(
        self,
        rule: UpdateRule,
        keys: tuple[str, ...],
        sub_group_numel: int,
        buffer_count: int,
        master_dtype: torch.dtype,
        staging_dtype: torch.dtype | None,
        pool: TilePool,
        pinned: PinnedHostMemory | None,
    ):
        """``pinned``: where the staging buffers (copied to the device) come from; the state buffers are the
        host's alone and stay pageable (Note: [Pinned host memory is bounded] in :mod:`.pinned`)."""
        self.rule, self.pool = rule, pool
        self.sub_group_numel = sub_group_numel

        def staging() -> torch.Tensor | None:
            if staging_dtype is None:
                return None
            if pinned is None:
                return torch.empty(sub_group_numel, dtype=staging_dtype)
            return pinned.empty(sub_group_numel, staging_dtype)

        self.buffers = [
            SwapBuffer({key: torch.empty(sub_group_numel, dtype=master_dtype) for key in ("master",) + keys}, staging())
            for _ in range(buffer_count)
        ]
        self.io = ThreadPoolExecutor(buffer_count, thread_name_prefix="ds_strategy_nvme_io")
        self.read_ahead = max(1, buffer_count - 2)

    @staticmethod
    def sub_group_numel_for(largest_shard: int, sub_group_size: int, buffer_size: int) -> int:
        """Elements per sub-group: at most ``sub_group_size`` and ``buffer_size``, aligned unless one covers all."""
        numel = min(largest_shard, sub_group_size, buffer_size)
        if numel < largest_shard:
            numel = max(ALIGN_ELEMENTS, numel // ALIGN_ELEMENTS * ALIGN_ELEMENTS)
        return numel

    def buffer_tensors(self) -> list[torch.Tensor]:
        return [t for b in self.buffers for t in list(b.tensors.values()) + [b.staging] if t is not None]

    def run(self, sub_groups: list[SubGroup]) -> None:
        """Update every sub-group (see [The pipeline])."""
        free: queue.SimpleQueue[SwapBuffer] = queue.SimpleQueue()
        for buffer in self.buffers:
            free.put(buffer)
        reads: collections.deque[_Read] = collections.deque()
        upcoming = iter(sub_groups)
        writes: list[Future] = []

        def start_next_read() -> None:
            group = next(upcoming, None)
            if group is not None:
                buffer = free.get()
                reads.append(_Read(group, buffer, self.io.submit(self._read, group, buffer)))

        for _ in range(self.read_ahead):
            start_next_read()
        while reads:
            group, buffer, read = reads.popleft()
            read.result()
            start_next_read()
            self._update(group, buffer)
            write = self.io.submit(self._write, group, buffer)
            write.add_done_callback(lambda _, buffer=buffer: free.put(buffer))
            writes.append(write)
        for write in writes:
            write.result()

    def _read(self, group: SubGroup, buffer: SwapBuffer) -> None:
        n = group.hi - group.lo
        group.files["master"].read(buffer.tensors["master"][:n], group.lo)
        for key in group.keys:
            if not group.first:
                group.files[key].read(buffer.tensors[key][:n], group.lo)
            elif group.initial[key] is not None:
                buffer.tensors[key][:n].fill_(group.initial[key])

    def _update(self, group: SubGroup, buffer: SwapBuffer) -> None:
        n = group.hi - group.lo
        master = buffer.tensors["master"][:n]
        staging = None if buffer.staging is None else buffer.staging[:n]
        out = group.sink.target(group.lo, group.hi, staging)
        tiled_update(
            self.pool,
            self.rule,
            group.hyper,
            master,
            group.grad[group.lo : group.hi],
            [buffer.tensors[key][:n] for key in group.keys],
            group.step,
            group.first,
            out,
        )
        group.sink.after_update(group.lo, group.hi, out)

    def _write(self, group: SubGroup, buffer: SwapBuffer) -> None:
        n = group.hi - group.lo
        for key in ("master",) + group.keys:
            group.files[key].write(buffer.tensors[key][:n], group.lo)
        group.sink.write_behind(group.lo, group.hi, None if buffer.staging is None else buffer.staging[:n])

    def close(self) -> None:
        self.io.shutdown(wait=True)
