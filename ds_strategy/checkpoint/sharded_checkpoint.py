"""Saving and loading a sharded checkpoint: collectives every rank of the process group calls together.

Each rank writes only its own pieces through ``torch.distributed.checkpoint`` (nothing is gathered anywhere), and
on load reads only the pieces covering what it holds now, so the world size, ZeRO stage and precision may all
change between save and load, and so may the tensor- and pipeline-parallel split (Notes: [Tensor-parallel pieces in
global coordinates], [Pipeline stages in one checkpoint]). See :mod:`.directory` for the files and how a save is
made atomic.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..comm.group_collectives import waiting_as_long_as_the_group
from ..comm.objects import all_gather_object, broadcast_object
from ..comm.peer_failures import PeerFailedError, naming_failed_peers
from ..comm.process_exit import destroy_process_groups_at_exit
from ..zero.engine import ZeroEngine
from . import directory
from .errors import CheckpointError
from .flat_piece import PieceLoadPlanner, PieceSavePlanner, quiet_single_process
from .manifest import Manifest, model_key, optimizer_key
from .pipeline_manifest import described
from .rank_state import model_state, optimizer_state
from .restore import apply_restore, plan_restore
from .storage import METADATA, ChecksummedReader, ChecksummedWriter, dcp_failure


def save(
    path: str | os.PathLike,
    module: nn.Module,
    engine: ZeroEngine | None = None,
    *,
    extra: dict[str, Any] | None = None,
    with_optimizer: bool = True,
) -> None:
    """Write ``module``'s state (sharded by ``engine``, if given), its optimizer's, and rank 0's ``extra`` to the
    checkpoint directory ``path``, atomically. Every rank calls it."""
    if engine is not None:
        engine.adopt_replaced_parameters()  # Note: [Parameters replaced behind the engine's back]
    with_optimizer = with_optimizer and engine is not None and bool(engine.optimizers)
    optimizer = optimizer_state(engine) if with_optimizer else None
    write(
        path,
        model_state(module, engine),
        optimizer,
        manifest_for(module, engine, with_optimizer),
        extra=extra,
        process_group=_checkpoint_group(engine),
    )


def manifest_for(module: nn.Module, engine: ZeroEngine | None, with_optimizer: bool) -> Manifest:
    """The manifest of a checkpoint of ``module`` (its files are added when written); under pipeline parallelism a
    collective over the world, which gathers every stage's entries."""
    if engine is not None:
        saved_by = {
            "world_size": engine.world_size,
            "tensor_parallel_size": engine.tp_collectives.world_size if engine.tp_collectives is not None else 1,
            "pipeline_parallel_size": engine.part.pipeline_size,
            "stage": engine.config.stage,
            "precision": engine.config.precision,
        }
    else:
        saved_by = {"world_size": dist.get_world_size() if dist.is_initialized() else 1}
    return Manifest(*described(module, engine, with_optimizer), saved_by)


def write(
    path: str | os.PathLike,
    model: dict[str, Any],
    optimizer: dict[str, Any] | None,
    manifest: Manifest,
    extra: dict[str, Any] | None = None,
    process_group=None,
) -> None:
    """Write this rank's ``model`` and ``optimizer`` shares (see :mod:`.rank_state`) and rank 0's ``manifest``
    and ``extra`` as one atomic checkpoint directory. Every rank calls it with the same ``path``; a rank that fails
    meanwhile is named (Note: [Collectives a library issues] in ``ds_strategy.comm.peer_failures``)."""
    path = local_path(path)
    with naming_failed_peers(f"saving the checkpoint {path}"):
        _write(path, model, optimizer, manifest, extra, process_group)


def _write(path: Path, model, optimizer, manifest: Manifest, extra, process_group) -> None:
    tensors = {model_key(name): value for name, value in model.items()}
    for name, state in (optimizer or {}).get("state", {}).items():
        tensors.update({optimizer_key(name, key): value for key, value in state.items()})
    partial = directory.partial_path(path)
    _on_rank0(lambda: directory.begin(path), process_group, f"preparing {partial}")
    writer = ChecksummedWriter(partial)
    try:
        with quiet_single_process():
            dcp.save(
                tensors,
                storage_writer=writer,
                planner=PieceSavePlanner(),
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as error:  # raised on every rank, once every rank has stopped writing
        if _rank(process_group) == 0:
            directory.abandon(partial)
        raise dcp_failure(error, f"writing the checkpoint {path}") from None
    if dist.is_initialized():
        destroy_process_groups_at_exit()  # [Why every process group is destroyed at exit]
    checksums = _gathered(writer.checksums, process_group)
    meta = {
        "param_groups": optimizer["param_groups"] if optimizer else None,
        "optimizer_param_groups": optimizer.get("optimizer_param_groups") if optimizer else None,
        "loss_scaler": optimizer["loss_scaler"] if optimizer else None,
        "extra": extra or {},
    }
    _on_rank0(lambda: directory.finish(partial, path, manifest, meta, checksums), process_group, f"publishing {path}")


def load(
    path: str | os.PathLike,
    module: nn.Module,
    engine: ZeroEngine | None = None,
    *,
    load_optimizer: bool = True,
    strict: bool = True,
    weights_only: bool = False,
) -> dict[str, Any]:
    """Restore ``module`` (and ``engine``'s master weights and optimizer) from the checkpoint at ``path``;
    returns the ``extra`` state rank 0 saved. Every rank calls it.

    Everything is checked and read before anything is changed: a checkpoint that is incomplete, damaged or of
    a different model raises :class:`CheckpointError` and leaves the training state as it was. With
    ``strict=False`` names missing on either side are skipped. A weights-only checkpoint leaves the optimizer
    as it is. ``weights_only``: how rank 0's ``meta.pt`` is unpickled (Note: [Unpickling meta.pt]).
    """
    where, manifest = directory.open_checkpoint(local_path(path))
    reader = ChecksummedReader(where, manifest.checksums)
    try:
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"{where / METADATA} cannot be read: {error}") from error
    meta = directory.read_meta(where, manifest, weights_only)
    restore = plan_restore(module, engine, manifest, metadata, meta, where, load_optimizer, strict)
    try:
        with quiet_single_process(), naming_failed_peers(f"loading the checkpoint {where}"):
            dcp.load(
                restore.targets,
                storage_reader=reader,
                planner=PieceLoadPlanner(),
                process_group=_checkpoint_group(engine),
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as error:  # any rank's failure, e.g. a damaged file: see .storage
        raise dcp_failure(error, f"reading the checkpoint {where}") from None
    except PeerFailedError:  # a rank died while reading: Note: [Collectives a library issues]
        raise
    except Exception as error:
        raise CheckpointError(f"reading the checkpoint {where} failed: {error}") from error
    apply_restore(restore, engine)
    return meta["extra"]


def local_path(path: str | os.PathLike) -> Path:
    """``path`` as a local path; a URL (``s3://``, ``memory://``: what fsspec would open) is refused by name rather
    than turned into a local directory called ``s3:``."""
    if "://" in str(path):
        raise CheckpointError(
            f"checkpoint path {str(path)!r} is a URL: ds_strategy checkpoints are written to and read from a local or "
            f"mounted file system (every rank writes its own files), not through fsspec; give a local path (and copy "
            f"the directory to remote storage afterwards) or mount the bucket"
        )
    return Path(path)


def _checkpoint_group(engine: ZeroEngine | None):
    """The ranks that write and read a checkpoint together: the engine's, or every rank under tensor parallelism
    (each tensor-parallel rank holds different pieces of the same data-parallel shard) or pipeline parallelism
    (each stage's ranks hold different parameters)."""
    if engine is None or engine.tp_collectives is not None or engine.part.pipeline_size > 1:
        return None
    return engine.process_group


def remove(path: str | os.PathLike) -> None:
    """Delete the checkpoint at ``path`` (call on one rank)."""
    directory.remove(local_path(path))


def latest(root: str | os.PathLike) -> Path | None:
    """The most recently completed checkpoint directly under ``root`` (to resume a restarted job from), or None
    if there is none; a save that was interrupted never counts. Needs no process group."""
    return directory.latest(Path(root))


def _rank(process_group) -> int:
    return dist.get_rank(process_group) if dist.is_initialized() else 0


def _gathered(checksums: dict[str, int], process_group) -> dict[str, int]:
    """Every rank's ``checksums`` merged (rank 0 publishes them)."""
    if not dist.is_initialized():
        return checksums
    gathered = all_gather_object(checksums, waiting_as_long_as_the_group(process_group), label="checkpoint.checksums")
    return {name: crc for sums in gathered for name, crc in sums.items()}


def _on_rank0(step: Callable[[], None], process_group, what: str) -> None:
    """Run ``step`` on rank 0 only and make every rank raise if it failed there, so that no rank is left waiting
    in the next collective."""
    distributed = dist.is_initialized()
    rank = _rank(process_group)
    error = None
    if rank == 0:
        try:
            step()
        except Exception as raised:
            error = raised
    if distributed:
        message = f"{type(error).__name__}: {error}" if error is not None else None
        message = broadcast_object(
            message, waiting_as_long_as_the_group(process_group), label="checkpoint.rank0_outcome"
        )
        if rank != 0 and message is not None:
            raise CheckpointError(f"{what} failed on rank 0: {message}")
    if error is not None:
        raise error
