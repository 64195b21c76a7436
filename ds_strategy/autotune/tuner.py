"""Autotuner: screen configurations with the memory estimator, time the rest in fresh processes, keep the fastest.

    tuner = Autotuner(make_module, make_datamodule, world_size=2, memory_budget=2 * 2**30, time_budget=600)
    result = tuner.run()            # prints progress; never raises for a trial that fails
    result.best.config              # the ZeroConfig with the highest measured throughput
    tuner.write(result, "configs/strategy/autotuned.yaml", "ds_config.autotuned.json")

In the spirit of Lightning's ``Tuner``: it takes the LightningModule and DataModule (as factories, since each
trial builds them in new processes) and sets the micro-batch size through their ``batch_size`` attribute.

Note: [What the memory budget covers]
The budget is bytes per rank of ZeRO's model states (parameters,
gradients, optimizer state) plus its communication buckets: what :func:`~ds_strategy.estimate.estimate_memory`
predicts before a trial and ``memory_report()`` measures during one. Activations are not in either, so leave
room for them (on a GPU, a trial's ``torch.cuda.max_memory_allocated`` is checked against the budget as well).
A configuration is rejected without running when its estimate exceeds the budget, and a trial fails when its
measurement does.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

import torch

from ..config import ZeroConfig
from ..estimate import ModelSize, estimate_memory
from .export import write_deepspeed_json, write_hydra_yaml
from .launcher import launch_ranks
from .space import DEFAULT_DIMENSIONS, DEFAULT_MICRO_BATCH_SIZES, Candidate, candidates
from .trial import TrialJob, run_trial

OK, FAILED, REJECTED, SKIPPED = "ok", "failed", "rejected", "skipped"


@dataclasses.dataclass
class TrialResult:
    """One candidate's fate: measured (ok), failed with a reason, rejected by the estimator, or never reached."""

    candidate: Candidate
    config: ZeroConfig
    status: str
    reason: str = ""
    estimated_bytes: int = 0
    measured_bytes: int | None = None
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    seconds: float = 0.0

    @property
    def step_median_s(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None


@dataclasses.dataclass
class TuneResult:
    trials: list[TrialResult]
    best: TrialResult | None
    memory_budget: int
    seconds: float

    def ranked(self) -> list[TrialResult]:
        """Measured trials, fastest first."""
        return sorted((t for t in self.trials if t.status == OK), key=lambda t: -t.samples_per_s)


def default_memory_budget(world_size: int, accelerator: str = "cpu") -> int:
    """What the device has: an accelerator's memory, or on CPU the machine's memory shared by the ranks."""
    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world_size


class Autotuner:
    """Find the fastest ZeRO configuration of a LightningModule that fits ``memory_budget`` bytes per rank.

    ``dimensions`` maps ZeroConfig field names to the values to try (default: stage 0-3 and two gradient bucket
    sizes); ``micro_batch_sizes`` are per rank. Each trial runs ``warmup + steps`` steps on ``world_size`` new
    processes and is ranked by the median of its timed steps. ``time_budget`` (seconds) bounds the whole search:
    trials that would not finish in it are skipped. ``progress`` receives the lines printed as trials finish.
    """

    def __init__(
        self,
        model_factory: Callable,
        datamodule_factory: Callable | None = None,
        *,
        world_size: int = 2,
        memory_budget: int | None = None,
        time_budget: float = 600.0,
        dimensions: Mapping[str, Sequence] | None = None,
        micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
        base_config: ZeroConfig | None = None,
        warmup: int = 2,
        steps: int = 3,
        trial_timeout: float = 300.0,
        accelerator: str = "cpu",
        threads: int | None = None,
        batch_arg_name: str = "batch_size",
        log_dir: str | os.PathLike | None = None,
        progress: TextIO | None = None,
    ):
        self.model_factory, self.datamodule_factory = model_factory, datamodule_factory
        self.world_size, self.accelerator, self.threads = world_size, accelerator, threads
        self.memory_budget = int(memory_budget) if memory_budget else default_memory_budget(world_size, accelerator)
        self.time_budget, self.trial_timeout = time_budget, trial_timeout
        self.dimensions = dict(dimensions if dimensions is not None else DEFAULT_DIMENSIONS)
        self.micro_batch_sizes = list(micro_batch_sizes)
        self.base_config = base_config or ZeroConfig()
        self.warmup, self.steps, self.batch_arg_name = warmup, steps, batch_arg_name
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="ds_strategy_autotune_"))
        self.out = progress or sys.stdout
        self._model_size: ModelSize | None = None

    # -- screening ----------------------------------------------------------------------------------------------
    def model_size(self) -> ModelSize:
        """The model's parameter counts and units, from a build on the meta device where the factory allows it."""
        if self._model_size is None:
            try:
                with torch.device("meta"):
                    module = self.model_factory()
                    if hasattr(module, "configure_model"):
                        module.configure_model()
            except Exception:  # noqa: BLE001 - some factories need real tensors; build for real then
                module = self.model_factory()
            self._model_size = ModelSize.of_module(module, self.base_config)
        return self._model_size

    def estimate(self, config: ZeroConfig) -> int:
        """Estimated device bytes per rank of ``config``'s model states, gathered units and buckets."""
        return estimate_memory(
            self.model_size(),
            self.world_size,
            config.stage,
            getattr(config, "offload_optimizer", "none"),
            getattr(config, "offload_params", "none"),
            config.precision,
            config=config,
        ).device

    def screen(self) -> list[TrialResult]:
        """Every candidate, rejected with the reason where the estimate exceeds the budget, else pending."""
        found = candidates(self.dimensions, self.micro_batch_sizes, self.base_config, self.model_size().params)
        screened = []
        for candidate in found:
            config = candidate.config(self.base_config)
            estimate = self.estimate(config)
            over = estimate > self.memory_budget
            reason = f"estimate {_mib(estimate)} > budget {_mib(self.memory_budget)}" if over else ""
            screened.append(TrialResult(candidate, config, REJECTED if over else "pending", reason, estimate))
        return screened

    # -- trials -------------------------------------------------------------------------------------------------
    def run(self) -> TuneResult:
        """Screen, then run the fitting candidates in order until done or out of time; never raises for a trial."""
        start = time.monotonic()
        trials = self.screen()
        pending = [t for t in trials if t.status == "pending"]
        rejected = len(trials) - len(pending)
        self._print(
            f"autotune: {len(trials)} configurations, {rejected} rejected by the memory estimate "
            f"(budget {_mib(self.memory_budget)} per rank), {len(pending)} to try on {self.world_size} "
            f"ranks within {self.time_budget:.0f} s"
        )
        for trial in trials:
            if trial.status == REJECTED:
                self._print(f"  rejected  {trial.candidate.label}: {trial.reason}")
        durations: list[float] = []
        for index, trial in enumerate(pending):
            left = self.time_budget - (time.monotonic() - start)
            expected = max(durations) if durations else 0.0
            if left <= expected or left <= 1.0:
                trial.status, trial.reason = SKIPPED, f"time budget: {left:.0f} s left, a trial takes ~{expected:.0f} s"
                continue
            self._run_one(trial, index, timeout=min(self.trial_timeout, left))
            durations.append(trial.seconds)
            self._print(self._progress_line(index + 1, len(pending), trial))
            self._print(format_table(trials, indent="    "))
        result = TuneResult(trials, None, self.memory_budget, time.monotonic() - start)
        ranked = result.ranked()
        result.best = ranked[0] if ranked else None
        self._print(
            f"autotune: best {result.best.candidate.label} at {result.best.samples_per_s:,.1f} samples/s"
            if result.best
            else "autotune: no configuration completed a trial"
        )
        return result

    def _run_one(self, trial: TrialResult, index: int, timeout: float) -> None:
        job = TrialJob(
            self.model_factory,
            self.datamodule_factory,
            trial.config,
            self.warmup,
            self.steps,
            self.accelerator,
            self.batch_arg_name,
        )
        outcome = launch_ranks(
            run_trial,
            self.world_size,
            job,
            timeout=timeout,
            threads=self.threads,
            log_dir=self.log_dir / f"trial{index:03d}",
        )
        trial.seconds = outcome.seconds
        if not outcome.ok:
            trial.status, trial.reason = FAILED, _first_lines(outcome.error)
            return
        steps = [max(times) for times in zip(*(rank["step_seconds"] for rank in outcome.values))]
        measured = max(rank["peak_state_bytes"].get("device", 0) for rank in outcome.values)
        accelerator_peak = max((rank["peak_accelerator_bytes"] or 0) for rank in outcome.values)
        trial.measured_bytes = max(measured, accelerator_peak)
        trial.step_seconds = steps
        if not steps:
            trial.status, trial.reason = FAILED, "no timed step completed (the data ran out?)"
        elif trial.measured_bytes > self.memory_budget:
            trial.status = FAILED
            trial.reason = f"measured {_mib(trial.measured_bytes)} > budget {_mib(self.memory_budget)}"
        else:
            trial.status = OK
            median = statistics.median(steps)
            trial.samples_per_s = self.world_size * trial.candidate.micro_batch_size / median
            items = outcome.values[0]["items_per_step"]
            trial.tokens_per_s = self.world_size * items / median if items else None

    # -- output -------------------------------------------------------------------------------------------------
    def write(
        self,
        result: TuneResult,
        yaml_path: str | os.PathLike | None = "configs/strategy/autotuned.yaml",
        json_path: str | os.PathLike | None = None,
    ) -> list[Path]:
        """Write the winner as a Hydra strategy config and, if asked, a DeepSpeed-style JSON; returns the paths."""
        if result.best is None:
            raise ValueError("no trial succeeded, so there is no configuration to write")
        note = (
            f"{result.best.samples_per_s:,.1f} samples/s on {self.world_size} ranks, best of "
            f"{len(result.ranked())} measured trials ({len(result.trials)} configurations considered)"
        )
        written = []
        if yaml_path:
            written.append(write_hydra_yaml(Path(yaml_path), result.best.config, self.dimensions, note))
        if json_path:
            written.append(write_deepspeed_json(Path(json_path), result.best.config))
        return written

    def _progress_line(self, done: int, total: int, trial: TrialResult) -> str:
        width = 24
        filled = math.floor(width * done / total)
        outcome = (
            f"{trial.samples_per_s:,.1f} samples/s"
            if trial.status == OK
            else f"{trial.status}: {trial.reason.splitlines()[0][:100]}"
        )
        return (
            f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {trial.candidate.label}  ->  {outcome}"
            f"  ({trial.seconds:.0f} s)"
        )

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def format_table(trials: Sequence[TrialResult], indent: str = "") -> str:
    """Trials so far, measured ones fastest first, then failed, rejected and skipped ones."""
    order = {OK: 0, FAILED: 1, REJECTED: 2, SKIPPED: 3}
    shown = [t for t in trials if t.status in order]
    shown.sort(key=lambda t: (order[t.status], -(t.samples_per_s or 0)))
    lines = [f"{'configuration':48} {'status':9} {'samples/s':>10} {'step ms':>8} {'est MiB':>8} {'meas MiB':>8}"]
    for t in shown:
        median = t.step_median_s
        lines.append(
            f"{t.candidate.label[:48]:48} {t.status:9} "
            f"{'' if t.samples_per_s is None else f'{t.samples_per_s:,.1f}':>10} "
            f"{'' if median is None else f'{1e3 * median:.1f}':>8} {t.estimated_bytes / 2**20:8.1f} "
            f"{'' if t.measured_bytes is None else f'{t.measured_bytes / 2**20:.1f}':>8}"
        )
    return "\n".join(indent + line for line in lines)


def _mib(value: int) -> str:
    return f"{value / 2**20:,.1f} MiB"


def _first_lines(text: str, keep: int = 12) -> str:
    """The message and the end of a traceback: what a reader needs to see why a trial failed."""
    lines = text.strip().splitlines()
    return "\n".join(lines if len(lines) <= keep else lines[:2] + ["..."] + lines[-(keep - 3) :])
