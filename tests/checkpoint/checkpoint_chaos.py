"""Chaos trials of checkpointing: a two-rank training run that saves a sharded checkpoint after every step has one
rank SIGKILLed at a chosen or random moment, and is then restarted from the latest complete checkpoint.

``run_trial(draw(seed), workdir, reference)`` runs one trial and returns what it found, including every invariant
it saw broken; ``tests/checkpoint/test_checkpoint_chaos.py`` runs a few dozen and ``benchmarks/chaos.py`` a few hundred.

Note: [Chaos trial invariants]
A trial (1) starts two ranks that train STEPS steps of TinyGPT under ZeRO-2, saving after every step either to
``step_<k>`` (one directory per step) or over a single ``current`` directory; (2) kills one rank at its kill point:
the victim arms a hook that SIGKILLs itself when it reaches a named point while working on step ``at`` (inside the
optimizer step, after writing its shard file, before the manifest, between the renames, after the rename, after
the save), or the parent kills it after a random delay; the other rank is then stuck in a collective and is killed
too, as a launcher would; (3) inspects the checkpoint root in this process; (4) restarts two fresh ranks that load
``latest(root)`` and train to the end, saving as before. It holds when

* every directory found, and every checkpoint name, either loads into parameters bitwise equal to the uninterrupted
  run's after the step the checkpoint records, or is refused with a :class:`CheckpointError` naming it: nothing
  half-written is ever loaded (a ``.partial`` without its manifest is always refused);
* every save that had returned before the kill still loads, at its step or a later one, and ``latest`` names a
  checkpoint at least that new;
* the restarted run loads exactly the state of the step it resumes from and ends bitwise equal to the
  uninterrupted run;
* after the restart's saves the root holds only the checkpoints' own names: no ``.partial``, ``.previous`` or
  ``.removing`` directory is left;
* no rank raised before the kill, and a self-kill point was reached (else the trial tested nothing).

Comparisons are exact (``torch.equal``) because every run is fp32 on CPU with the same world size and batches.
"""

from __future__ import annotations

import enum
import os
import random
import signal
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import distributed
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_runs import STEPS, build, global_batches, train
from distributed import run_ranks
from training_loops import full_state

from ds_strategy.checkpoint import CheckpointError, directory, latest, load, save

WORLD_SIZE, CONFIG = 2, "zero2"
NAMINGS = ("per_step", "overwrite")
_POLL_S = 0.02
_DEADLINE_S = 120.0


class KillPoint(enum.Enum):
    """Where the victim dies, on step ``at``; the value says what is on disk at that moment."""

    STEP = "in the optimizer step: this rank's shard updated, the parameters not yet gathered"
    SHARD_WRITTEN = "in a save: this rank's shard file written, no manifest yet"
    BEFORE_MANIFEST = "in a save, rank 0: every shard and meta.pt written, manifest.json not yet"
    IN_RENAME = "in the rename, rank 0: before .NAME.partial -> NAME (after NAME -> .NAME.previous when replacing)"
    AFTER_RENAME = "just after the rename, rank 0: before the directory sync and the removal of .NAME.previous"
    AFTER_SAVE = "just after a save returned on this rank"
    TIMER = "killed by the parent after a random delay (uniform over the run's duration)"


_RANK0_POINTS = (KillPoint.BEFORE_MANIFEST, KillPoint.IN_RENAME, KillPoint.AFTER_RENAME)


@dataclass(frozen=True)
class Trial:
    seed: int
    point: KillPoint
    victim: int
    at: int  # the step (1-based) during whose training or save the victim dies
    naming: str
    delay_fraction: float  # TIMER only: when to kill, as a fraction of the uninterrupted run's duration

    def __str__(self) -> str:
        when = f"after {self.delay_fraction:.2f} of the run" if self.point is KillPoint.TIMER else f"on step {self.at}"
        return (
            f"trial seed={self.seed}: kill rank {self.victim} {self.point.name} {when}, {self.naming} "
            f"checkpoints (replay: python benchmarks/chaos.py --seed {self.seed} --trials 1)"
        )


def draw(seed: int) -> Trial:
    """Trial ``seed``: kill points taken in turn (so any run of len(KillPoint) seeds covers them all), the rest
    drawn from the seed."""
    rng = random.Random(seed)
    point = list(KillPoint)[seed % len(KillPoint)]
    victim = 0 if point in _RANK0_POINTS else rng.randrange(WORLD_SIZE)
    return Trial(seed, point, victim, rng.randint(1, STEPS), rng.choice(NAMINGS), rng.random())


@dataclass
class TrialResult:
    trial: Trial
    killed: bool = False
    resumed_from: int = 0
    via_previous: bool = False  # the restart loaded NAME from .NAME.previous (killed between the renames)
    refused: int = 0  # directories found after the kill that load refused with a CheckpointError
    broken: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def checkpoint_name(naming: str, step: int) -> str:
    return f"step_{step}" if naming == "per_step" else "current"


# -- in the ranks -------------------------------------------------------------------------------------------------
_working_on = {"step": 0}  # the step the rank is training or saving; what the armed hooks compare with ``at``


def _fit(
    root: Path,
    naming: str,
    start: int,
    model,
    engine,
    marks: Path | None = None,
    point: KillPoint | None = None,
    at: int = 0,
    record: bool = False,
) -> list:
    """Train from step ``start`` to STEPS, saving after every step; rank 0 logs each returned save in
    ``marks/completed``. Returns the full parameters after every step when ``record``."""
    batches, states = global_batches(), []
    for step in range(start + 1, STEPS + 1):
        _working_on["step"] = step
        train(model, engine, batches[step - 1 : step])
        save(root / checkpoint_name(naming, step), model, engine, extra={"step": step})
        if marks is not None and engine.rank == 0:
            with open(marks / "completed", "a") as f:
                f.write(f"{checkpoint_name(naming, step)} {step}\n")
        if point is KillPoint.AFTER_SAVE and step == at:
            _die(marks)
        if record:
            states.append(full_state(engine, model))
    return states


def _die(marks: Path) -> None:
    (marks / "killed_at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: KillPoint, at: int, marks: Path) -> None:
    """Patch this (victim) process so that it SIGKILLs itself when it reaches ``point`` on step ``at``."""

    def due() -> bool:
        return _working_on["step"] == at

    if point is KillPoint.STEP:
        optimizer_step = torch.optim.AdamW.step

        def step_then_die(self, *args, **kwargs):
            result = optimizer_step(self, *args, **kwargs)
            if due():
                _die(marks)
            return result

        torch.optim.AdamW.step = step_then_die
    elif point is KillPoint.SHARD_WRITTEN:
        write_data = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            written = write_data(self, plan, planner)
            if due():
                written.wait()
                _die(marks)
            return written

        dcp.FileSystemWriter.write_data = write_then_die
    elif point is KillPoint.BEFORE_MANIFEST:
        write_synced = directory._write_synced

        def die_before_manifest(path, write):
            if path.name == directory.MANIFEST and due():
                _die(marks)
            write_synced(path, write)

        directory._write_synced = die_before_manifest
    elif point in (KillPoint.IN_RENAME, KillPoint.AFTER_RENAME):
        rename = Path.rename

        def rename_around_death(self, target):
            publishing = self.name.endswith(".partial") and due()
            if publishing and point is KillPoint.IN_RENAME:
                _die(marks)
            renamed = rename(self, target)
            if publishing:
                _die(marks)
            return renamed

        Path.rename = rename_around_death


def _trial_rank(rank: int, store: Path, root: Path, marks: Path, trial: Trial) -> None:
    """One rank of the run that is killed: an error is written to ``marks/error<rank>`` with its time, so that the
    parent can tell a survivor's error after the kill from a real failure."""
    torch.set_num_threads(1)
    try:
        if rank == trial.victim and trial.point is not KillPoint.TIMER:
            _arm(trial.point, trial.at, marks)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
        (marks / f"joined{rank}").touch()
        model, engine = build(CONFIG)
        point = trial.point if rank == trial.victim else None
        _fit(root, trial.naming, 0, model, engine, marks, point, trial.at)
        dist.destroy_process_group()
    except BaseException:
        # Written whole or not at all: the parent may kill this rank while it writes (once another rank has died).
        (marks / f"error{rank}.tmp").write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(marks / f"error{rank}.tmp", marks / f"error{rank}")
        os._exit(1)


def _reference_rank(rank: int, world_size: int, root: Path) -> dict | None:
    started = time.monotonic()
    model, engine = build(CONFIG)
    states = [full_state(engine, model), *_fit(root, "per_step", 0, model, engine, record=True)]
    return {"states": states, "duration_s": time.monotonic() - started} if rank == 0 else None


def _resume_rank(rank: int, world_size: int, root: Path, naming: str) -> dict | None:
    """The restarted job: load what ``latest`` names (rank 0 decides, so every rank loads the same) and train on;
    when there is nothing left to train, save once more, as the job's final checkpoint."""
    model, engine = build(CONFIG)
    chosen = [latest(root) if rank == 0 else None]
    dist.broadcast_object_list(chosen, group_src=0)
    start, loaded = 0, None
    if chosen[0] is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = load(chosen[0], model, engine)["step"]
        loaded = full_state(engine, model)
    _fit(root, naming, start, model, engine)
    if start == STEPS:
        save(root / checkpoint_name(naming, STEPS), model, engine, extra={"step": STEPS})
    result = {"chosen": chosen[0], "start": start, "loaded": loaded, "final": full_state(engine, model)}
    return result if rank == 0 else None


# -- in this process ----------------------------------------------------------------------------------------------
def reference_run(root: Path) -> dict:
    """The uninterrupted run: ``states[k]`` the parameters after step k (0: initial), and its duration."""
    return run_ranks(_reference_rank, WORLD_SIZE, root)[0]


def run_trial(trial: Trial, workdir: Path, reference: dict) -> TrialResult:
    """Run ``trial`` in the empty directory ``workdir``; the result lists every invariant found broken."""
    started = time.monotonic()
    root, marks = workdir / "checkpoints", workdir / "marks"
    root.mkdir()
    marks.mkdir()
    result = TrialResult(trial)
    exit_codes = _run_until_killed(trial, root, marks, reference["duration_s"])
    _check_kill(trial, marks, exit_codes, result)
    completed = _completed_saves(marks / "completed")
    _check_after_kill(root, reference["states"], completed, result)
    try:
        resumed = run_ranks(_resume_rank, WORLD_SIZE, root, trial.naming)[0]
    except AssertionError as error:
        result.broken.append(f"the restart failed: {error}")
    else:
        _check_restart(root, trial.naming, reference["states"], completed, resumed, result)
    result.wall_s = time.monotonic() - started
    return result


def _run_until_killed(trial: Trial, root: Path, marks: Path, duration_s: float) -> list[int | None]:
    """Start the ranks, kill the victim (TIMER) or wait for it to kill itself, then kill the rest; exit codes."""
    ctx = distributed._start_context()
    procs = [
        ctx.Process(target=_trial_rank, args=(rank, marks / "store", root, marks, trial), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    kill_at, deadline = None, time.monotonic() + _DEADLINE_S
    try:
        for proc in procs:
            proc.start()
        while any(proc.exitcode is None for proc in procs):
            if any(proc.exitcode not in (None, 0) for proc in procs):
                break  # a rank died: the rest are stuck in a collective, and a launcher kills them
            now = time.monotonic()
            if (
                trial.point is KillPoint.TIMER
                and kill_at is None
                and all((marks / f"joined{rank}").exists() for rank in range(WORLD_SIZE))
            ):
                kill_at = now + trial.delay_fraction * duration_s
            if kill_at is not None and now >= kill_at and procs[trial.victim].exitcode is None:
                (marks / "killed_at").write_text(repr(time.time()))
                os.kill(procs[trial.victim].pid, signal.SIGKILL)
                kill_at = float("inf")
            if now > deadline:
                raise AssertionError(f"{trial}: the ranks neither finished nor died within {_DEADLINE_S} s")
            time.sleep(_POLL_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def _check_kill(trial: Trial, marks: Path, exit_codes: list, result: TrialResult) -> None:
    killed_at = float((marks / "killed_at").read_text()) if (marks / "killed_at").exists() else None
    if killed_at is not None and trial.point is KillPoint.TIMER and exit_codes[trial.victim] == 0:
        killed_at = None  # the timer fired as the victim was exiting after its last step: nothing was killed
    result.killed = killed_at is not None
    if not result.killed and trial.point is not KillPoint.TIMER:
        result.broken.append(f"the victim never reached its kill point (exit codes {exit_codes})")
    if result.killed and exit_codes[trial.victim] != -signal.SIGKILL:
        result.broken.append(f"the victim was to be SIGKILLed but exited with {exit_codes[trial.victim]}")
    for rank in range(WORLD_SIZE):
        error = marks / f"error{rank}"
        if error.exists():
            raised_at, text = error.read_text().split("\n", 1)
            if killed_at is None or float(raised_at) < killed_at:
                result.broken.append(f"rank {rank} raised before any rank was killed:\n{text}")
        elif not result.killed and exit_codes[rank] != 0:
            result.broken.append(f"rank {rank} exited with {exit_codes[rank]} and no rank was killed")


def _completed_saves(log: Path) -> dict[str, int]:
    """Checkpoint name: the last step whose save returned on rank 0 before the kill."""
    lines = log.read_text().split() if log.exists() else []
    return {name: int(step) for name, step in zip(lines[::2], lines[1::2], strict=True)}


def _check_after_kill(root: Path, states: list, completed: dict[str, int], result: TrialResult) -> None:
    """Everything the kill left loads bitwise or is refused by name; every returned save survives."""
    candidates = set(root.iterdir()) | {root / name for name in completed}
    candidates |= {root / e.name[1 : -len(".previous")] for e in root.iterdir() if e.name.endswith(".previous")}
    for path in sorted(candidates):
        step = _load_and_compare(path, states, result)
        if step is None:
            result.refused += 1
            if path.name in completed:
                result.broken.append(
                    f"{path.name}, saved at step {completed[path.name]} before the kill, no longer loads"
                )
        elif path.name in completed and step < completed[path.name]:
            result.broken.append(
                f"{path.name} holds step {step}, older than its save of step "
                f"{completed[path.name]} that returned before the kill"
            )
    newest = latest(root)
    result.via_previous = newest is not None and not newest.exists()
    if completed and (newest is None or newest.name.startswith(".")):
        result.broken.append(f"latest({root}) is {newest}, though saves {completed} completed before the kill")
    elif newest is not None and (_load_and_compare(newest, states, result) or 0) < max(completed.values(), default=0):
        result.broken.append(f"latest({root}) is {newest}, older than the newest completed save {completed}")


def _load_and_compare(path: Path, states: list, result: TrialResult) -> int | None:
    """The step the checkpoint at ``path`` loads at (its parameters checked against the reference), or None if
    it was refused with a CheckpointError that names it; anything else is recorded as broken."""
    model, engine = _loader()
    had_manifest = (path / directory.MANIFEST).is_file()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = load(path, model, engine)["step"]
    except CheckpointError as error:
        if str(path) not in str(error):
            result.broken.append(f"loading {path} was refused without naming it: {error}")
        return None
    except Exception as error:  # noqa: BLE001 - any other error type is itself a broken invariant
        result.broken.append(f"loading {path} failed with {type(error).__name__}, not CheckpointError: {error}")
        return None
    if path.name.endswith(".partial") and not had_manifest:
        result.broken.append(f"{path}, a partial directory without a manifest, was loaded")
    loaded = full_state(engine, model)
    wrong = [name for name, value in states[step].items() if not torch.equal(loaded[name], value)]
    if wrong:
        result.broken.append(f"{path} loaded without error but differs from step {step} in {wrong}")
    return step


_loaders: list = []


def _loader():
    """One single-process model and engine to load checkpoints into (a load replaces all of their state)."""
    if not _loaders:
        _loaders.append(build(CONFIG))
    return _loaders[0]


def _check_restart(
    root: Path, naming: str, states: list, completed: dict[str, int], resumed: dict, result: TrialResult
) -> None:
    result.resumed_from = resumed["start"]
    chosen = resumed["chosen"]
    if resumed["start"] < max(completed.values(), default=0):
        result.broken.append(
            f"the restart resumed from step {resumed['start']}, older than the newest completed save {completed}"
        )
    if resumed["loaded"] is not None and any(
        not torch.equal(resumed["loaded"][name], value) for name, value in states[resumed["start"]].items()
    ):
        result.broken.append(f"the restart loaded {chosen} but its parameters differ from step {resumed['start']}")
    if any(not torch.equal(resumed["final"][name], value) for name, value in states[STEPS].items()):
        result.broken.append(
            f"the restarted run (from step {resumed['start']}) did not end bitwise equal to the uninterrupted run"
        )
    expected = sorted({checkpoint_name(naming, step) for step in range(1, STEPS + 1)})
    left = sorted(os.listdir(root))
    if left != expected:
        result.broken.append(f"after the restart's saves {root} holds {left}, not {expected}")
