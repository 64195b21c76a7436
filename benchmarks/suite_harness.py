"""The time boxes, item records and report files of ``gpu_suite.py``, apart from what it measures, and the device it
runs on.

A run is a list of :class:`Part` s, each a list of items; each item runs under a SIGALRM time box cut from its part's
share of the budget (:class:`Budget`), is recorded as an :class:`Item` and the JSON and Markdown report is rewritten
after it, so a run that is cut short, or killed, still leaves every figure it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

FAILED = ("fail", "error", "timeout")  # "overran": a speed or size item out of time, which is not a failure
OUT_OF_TIME_IS_FAILURE = ("smoke", "correctness", "two_ranks")  # parts whose items may hang rather than be slow


@dataclass
class SuiteContext:
    """What every part reads: the arguments, the device, a scratch directory, and the items of earlier parts (by
    name, for a part that builds on them)."""

    args: argparse.Namespace
    device: torch.device
    scratch: Path
    items: dict[str, Item] = field(default_factory=dict)


class Part(NamedTuple):
    """A part of the suite: ``run(runner, context)`` runs its items through ``runner`` (a :class:`Runner` already
    started on the part) reading a :class:`SuiteContext`; ``share`` is its fraction of the budget. Adding a part (a
    new benchmark) is one entry in ``gpu_suite.PARTS``."""

    name: str
    share: float
    run: Callable


# -- the device -------------------------------------------------------------------------------------------------
def resolve_device(name: str, local_rank: int | None = None, device_count: int | None = None) -> torch.device:
    """The device ``name`` ("cpu", "cuda" or "cuda:N") means for this process, with an index for CUDA:
    ``torch.cuda.set_device`` refuses a device without one. "cuda" is this process's local rank modulo the
    devices visible (``LOCAL_RANK``, 0 when unset), so ranks of one machine spread over its GPUs and share one
    when there is one."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if device_count is None else device_count
    if count == 0:
        raise ValueError(f"device {name!r}: torch sees no CUDA device; on the host use --device cpu")
    if device.index is not None:
        if device.index >= count:
            raise ValueError(f"device {name!r}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})")
        return device
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return torch.device("cuda", rank % count)


# -- time boxes --------------------------------------------------------------------------------------------
class ItemTimeout(Exception):
    """An item overran its time box (raised by SIGALRM between Python bytecodes)."""


class Budget:
    """Seconds for the whole run, shared between the parts in proportion to ``shares`` (part name -> share, in run
    order): a part may use its share of what is left, so time one part does not use goes to the parts after it. A
    part without a share may use all that is left."""

    def __init__(self, seconds: float, shares: Mapping[str, float] | None = None, clock=time.monotonic):
        self.clock = clock
        self.shares = dict(shares or {})
        self.deadline = clock() + seconds

    def left(self) -> float:
        return max(self.deadline - self.clock(), 0.0)

    def part_seconds(self, part: str) -> float:
        if part not in self.shares:
            return self.left()
        names = list(self.shares)
        later = sum(self.shares[name] for name in names[names.index(part) :])
        return self.left() * self.shares[part] / later


@contextlib.contextmanager
def time_box(seconds: float):
    """Raise ItemTimeout in this (main) thread if the block runs longer than ``seconds``."""

    def expire(*_):
        raise ItemTimeout(f"over its {seconds:.1f} s time box")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- report ---------------------------------------------------------------------------------------------------
@dataclass
class Item:
    part: str
    name: str
    status: str = "skipped"  # pass, fail, error, timeout, skipped
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    note: str = ""


@dataclass
class Report:
    path: Path  # without suffix: .json and .md are written
    meta: dict
    items: list[Item] = field(default_factory=list)

    @property
    def failed(self) -> list[Item]:
        return [item for item in self.items if item.status in FAILED]

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {**self.meta, "failed": len(self.failed), "items": [asdict(item) for item in self.items]}
        self.path.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
        self.path.with_suffix(".md").write_text(markdown(self))


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


SPEED_COLUMNS = ("tokens_per_s", "mfu", "step_ms", "peak_alloc_gib")


def markdown(report: Report) -> str:
    """A title line, the speed table (one row per system) and every item with its status and figures."""
    lines = [f"# {report.meta.get('title', 'GPU suite')}", "", f"`{report.meta.get('command', '')}`", ""]
    speed = [item for item in report.items if item.part == "speed" and item.status == "pass"]
    if speed:
        lines += ["| system | tokens/s | MFU | step ms | peak allocated GiB |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {item.name} | " + " | ".join(_number(item.metrics.get(key, "")) for key in SPEED_COLUMNS) + " |"
            for item in speed
        ]
        lines.append("")
    lines += ["| part | item | status | s | figures | note |", "|---|---|---|---:|---|---|"]
    for item in report.items:
        figures = "; ".join(f"{key} {_number(value)}" for key, value in item.metrics.items())
        note = item.note.replace("|", "/").replace("\n", " ")[:300]
        lines.append(f"| {item.part} | {item.name} | {item.status} | {item.seconds:.1f} | {figures} | {note} |")
    lines += ["", f"{len(report.failed)} failed of {len(report.items)} items."]
    return "\n".join(lines) + "\n"


class Runner:
    """Runs items under the part's time box, records each one and rewrites the report after it."""

    def __init__(self, report: Report, budget: Budget, min_item_s: float):
        self.report, self.budget, self.min_item_s = report, budget, min_item_s
        self.part, self.part_deadline = "", 0.0

    def start_part(self, part: str) -> None:
        self.part = part
        self.part_deadline = self.budget.clock() + self.budget.part_seconds(part)

    def left(self) -> float:
        """Seconds left in the current part."""
        return max(min(self.part_deadline, self.budget.deadline) - self.budget.clock(), 0.0)

    def run(self, name: str, fn, *args, skip: str = "", share: float = 1.0, **kwargs) -> Item:
        """``fn(*args, **kwargs)`` returns ``(passed, metrics)`` or ``(passed, metrics, note)``; it may use ``share``
        of the time left in the part (at least ``min_item_s``), and is skipped, with ``skip`` as the reason, when that
        is given or when less than ``min_item_s`` is left. Out of time, an item of ``OUT_OF_TIME_IS_FAILURE`` is a
        failure ("timeout": it may hang), a speed or size item is not ("overran": its part's budget was too small
        for it)."""
        item = Item(self.part, name)
        left = self.left()
        if skip or left < self.min_item_s:
            item.note = skip or f"no time left in the {self.part} part ({left:.0f} s)"
        else:
            started = time.monotonic()
            try:
                with time_box(max(share * left, self.min_item_s)):
                    passed, item.metrics, *note = fn(*args, **kwargs)
                item.status, item.note = ("pass" if passed else "fail"), (note[0] if note else "")
            except ItemTimeout as error:
                item.status = "timeout" if self.part in OUT_OF_TIME_IS_FAILURE else "overran"
                item.note = str(error)
            except Exception as error:  # noqa: BLE001 - recorded, and the run goes on
                item.status, item.note = "error", f"{type(error).__name__}: {error}"
            item.seconds = time.monotonic() - started
            release_memory()
        self.report.items.append(item)
        self.report.write()
        print(f"[{item.part}] {item.name}: {item.status} {item.metrics} {item.note[:200]}", flush=True)
        return item


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hard_stop_after(seconds: float, report: Report) -> threading.Timer:
    """End the process (status 3) ``seconds`` from now with the report written, should an item be stuck where the
    time box's signal cannot reach it (inside one long C call, a hung collective)."""

    def stop():
        report.items.append(Item("suite", "hard stop", "timeout", note=f"still running after {seconds:.0f} s"))
        report.write()
        print(
            f"gpu_suite: hard stop after {seconds:.0f} s; wrote {report.path}.json and .md", file=sys.stderr, flush=True
        )
        os._exit(3)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer
