"""``save_checkpoint``/``load_checkpoint`` of :class:`~.engine.DeepSpeedEngine`, in DeepSpeed's directory layout.

``save_checkpoint(save_dir, tag)`` writes ``save_dir/<tag>`` (``global_step<N>`` by default) as a ds_strategy sharded
checkpoint (:mod:`ds_strategy.checkpoint`: each rank its shards, published atomically, loadable at any world size,
stage, precision or offload setting) and, with ``save_latest``, ``save_dir/latest`` holding the tag, as DeepSpeed
does; rank 0's extra state holds the engine's counters, the LR scheduler's state and the script's ``client_state``.

``load_checkpoint(load_dir, tag)`` reads the tag from ``latest`` when none is given and resumes from ``load_dir/<tag>``
written by this engine, or by DeepSpeed itself: a folder of DeepSpeed's ``*_model_states.pt`` files is converted first
(:func:`~.checkpoint_import.import_deepspeed`, in a child process of each node's first rank, because the converter
runs without a process group: Note: [Resuming an imported checkpoint the way DeepSpeed would]) and then loaded the
same way. DeepSpeed's counters and client state come back; its LR scheduler state is applied to a DeepSpeed schedule
built from the config (``last_batch_iteration``) or loaded as written into a torch scheduler.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import checkpoint
from ..config.deepspeed.lr_schedules import DeepSpeedSchedule
from . import comm

if TYPE_CHECKING:
    from .engine import DeepSpeedEngine

log = logging.getLogger(__name__)
LATEST = "latest"
ENGINE_STATE = "deepspeed_engine"  # our extra-state key for the counters and the LR scheduler
CLIENT_STATE = "client_state"
IMPORTED = "deepspeed"  # where checkpoint_import puts what a DeepSpeed checkpoint held beyond weights and optimizer


def save_engine_checkpoint(
    engine: DeepSpeedEngine, save_dir: Path, tag: str | None, client_state: dict, save_latest: bool
) -> None:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    state = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
    }
    extra = {ENGINE_STATE: state, CLIENT_STATE: client_state}
    checkpoint.save(save_dir / tag, engine.zero.module, engine.zero, extra=extra)
    if save_latest and comm.get_rank() == 0:
        (save_dir / LATEST).write_text(tag)
    comm.barrier()  # a load right after the save reads the new ``latest`` on every rank


def load_engine_checkpoint(
    engine: DeepSpeedEngine, load_dir: Path, tag: str | None, *, strict: bool, optimizer: bool, lr_scheduler: bool
) -> tuple[str | None, dict | None]:
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            log.warning(
                f"Unable to find latest file at {latest}, if trying to load latest checkpoint please ensure "
                f"this file exists or pass an explicit checkpoint tag when loading a checkpoint."
            )
            return None, None
        tag = latest.read_text().strip()
    path = load_dir / str(tag)
    with _as_ours(path) as ours:
        extra = checkpoint.load(ours, engine.zero.module, engine.zero, load_optimizer=optimizer, strict=strict)
    state, client_state = _engine_state(extra)
    engine.global_steps = int(state.get("global_steps") or 0)
    engine.global_samples = int(state.get("global_samples") or engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = int(state.get("skipped_steps") or 0)
    if lr_scheduler and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        _load_scheduler(engine.lr_scheduler, state["lr_scheduler"])
    return str(path), client_state


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a tag folder DeepSpeed's ``save_checkpoint`` wrote."""
    return any(path.glob("*mp_rank_*_model_states.pt"))


@contextlib.contextmanager
def _as_ours(path: Path):
    """``path`` itself, or for a DeepSpeed checkpoint its conversion, made by each node's first rank into a local
    temporary folder (named for the source, so every rank of the node finds it) and removed after the load."""
    if not is_deepspeed_checkpoint(path):
        yield path
        return
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir(), f"ds_strategy_import_{digest}")
    first_on_node = comm.get_local_rank() == 0
    error = None
    if first_on_node:
        error = _convert(path, out)
    comm.barrier()
    failed = _any_rank(error is not None)
    if failed:
        raise ValueError(error or f"converting the DeepSpeed checkpoint {path} failed on another rank")
    try:
        yield out
    finally:
        comm.barrier()
        if first_on_node:
            shutil.rmtree(out, ignore_errors=True)


def _convert(path: Path, out: Path) -> str | None:
    """``ds-strategy import-deepspeed path out`` in a child process; the error it printed, or None."""
    command = [sys.executable, "-c", "import sys; from ds_strategy.cli import main; sys.exit(main(sys.argv[1:]))"]
    command += ["import-deepspeed", str(path), str(out)]
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        return f"load_checkpoint({path}): converting DeepSpeed's checkpoint failed: {result.stderr.strip()}"
    return None


def _any_rank(flag: bool) -> bool:
    count = torch.tensor([float(flag)])
    comm.all_reduce(count)
    return bool(count.item())


def _engine_state(extra: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """The counters and LR scheduler state, and the client state, from our extra state or an imported one's."""
    if ENGINE_STATE in extra:
        return extra[ENGINE_STATE], extra.get(CLIENT_STATE, {})
    imported = extra.get(IMPORTED, {})
    return imported, imported.get("client_state", {})


def _load_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """A state from our save (torch's format) loads as it is; DeepSpeed's own schedules save only
    ``last_batch_iteration``, which places a :class:`DeepSpeedSchedule` at that iteration."""
    if "last_batch_iteration" in state and "last_epoch" not in state:
        if not isinstance(scheduler, DeepSpeedSchedule):
            raise ValueError(
                f"load_checkpoint: the checkpoint's LR scheduler is one of DeepSpeed's schedules "
                f"(last_batch_iteration={state['last_batch_iteration']}) but this engine's is a "
                f"{type(scheduler).__name__}; configure the same schedule, or pass load_lr_scheduler_states=False"
            )
        scheduler.last_epoch = int(state["last_batch_iteration"]) - scheduler.first_iteration
        lrs = scheduler.get_lr()
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
        return
    scheduler.load_state_dict(state)
