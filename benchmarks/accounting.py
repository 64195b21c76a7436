"""What a benchmark rank counts: collective bytes, bytes of model-state tensors, and resident memory.

Note: [How communication is counted]
``CommCounter`` replaces the collectives of ``torch.distributed`` by thin
wrappers that add up bytes while counting is on, then call the original. Every system under test reaches gloo
through those Python functions: FSDP2 (``all_gather_single`` / ``reduce_scatter_single``), DeepSpeed (its
``deepspeed.comm`` backend calls ``torch.distributed``; the wrappers must be installed before
``deepspeed.init_distributed``, which caches function references), ds_strategy (``Collectives``), and DDP once
torch's own ``allreduce_hook`` is registered as its comm hook (DDP's default algorithm, but run from Python;
the C++ built-in would bypass the wrappers). Bytes follow the ZeRO paper's convention, the one
``ds_strategy.comm.collectives`` uses: an all-reduce of a B-byte buffer counts 2B, a reduce-scatter counts its
B-byte input, an all-gather its B-byte output, a broadcast B. A ring moves (N-1)/N of that through each rank.
A collective called from inside another (an alias that forwards) is counted once, by the outer call.
DTensor's functional collectives (FSDP2's gradient-norm reduction of a few scalars) are not seen.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(args, kwargs, index: int, *names: str):
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    raise TypeError(f"collective called without argument {names[0]!r}")


# name in torch.distributed -> (kind, bytes counted for one call)
_COUNTED = {
    "all_reduce": ("all_reduce", lambda a, k: 2 * _nbytes(_arg(a, k, 0, "tensor"))),
    "all_reduce_coalesced": ("all_reduce", lambda a, k: 2 * sum(map(_nbytes, _arg(a, k, 0, "tensors")))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k: sum(map(_nbytes, _arg(a, k, 1, "input_list")))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "all_gather": ("all_gather", lambda a, k: sum(map(_nbytes, _arg(a, k, 0, "tensor_list")))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "reduce": ("reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
}


class CommCounter:
    """Bytes and calls per collective kind issued through ``torch.distributed`` while :attr:`active`."""

    def __init__(self) -> None:
        self.active = False
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._depth = threading.local()

    @classmethod
    def install(cls) -> CommCounter:
        """Wrap the collectives of ``torch.distributed`` in this process; returns the counter they report to."""
        counter = cls()
        for name, (kind, size) in _COUNTED.items():
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, counter._wrap(original, kind, size))
        return counter

    def _wrap(self, original, kind: str, size):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if self.active and depth == 0:
                self.bytes[kind] = self.bytes.get(kind, 0) + size(args, kwargs)
                self.calls[kind] = self.calls.get(kind, 0) + 1
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        counted.__wrapped__ = original
        return counted

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total(self) -> int:
        return sum(self.bytes.values())


# -- model-state bytes ------------------------------------------------------------------------------------------
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once).

    ``seen`` (storage addresses) is updated, so successive calls never count a storage twice.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        storage = local_tensor(t).untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0 or storage.device.type == "meta":
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.numel() > 1]


def reachable_tensors(obj, max_depth: int = 3) -> list[tuple[str, torch.Tensor]]:
    """(attribute path, tensor) for tensors in ``obj.__dict__``, following lists, tuples and dicts."""
    found: list[tuple[str, torch.Tensor]] = []
    visited: set[int] = set()

    def visit(path: str, value, depth: int) -> None:
        if torch.is_tensor(value):
            found.append((path, value))
        elif depth < max_depth and id(value) not in visited and isinstance(value, (list, tuple, dict)):
            visited.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                visit(f"{path}[{key}]", item, depth + 1)

    for name, value in vars(obj).items():
        visit(name, value, 0)
    return found


# -- resident memory --------------------------------------------------------------------------------------------
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS mark (``VmHWM``) from the current RSS; False where Linux does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so the next system starts from a low RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
