"""A checkpoint directory on disk: its files, how it is published atomically and removed, and the checks made
before anything is read from it.

Layout of ``NAME/``::

    __<rank>_0.distcp  one file per rank: that rank's pieces (torch.distributed.checkpoint's FileSystemWriter)
    .metadata          DCP's index of every key: global size, dtype, and which file holds each chunk
    meta.pt            rank 0, torch.save: the optimizer's param-group hyperparameters and the caller's extra
                       state (Lightning's loops, LR schedulers, callbacks, precision plugin, hyperparameters)
    manifest.json      rank 0, written last: see :mod:`.manifest`

Note: [Atomic checkpoint directories]
A checkpoint is written into the temporary sibling ``.NAME.partial`` and renamed to ``NAME`` only when complete:
``dcp.save`` returns on rank 0 only after every rank's shard file and DCP's ``.metadata`` are written and fsynced;
then rank 0 writes ``meta.pt`` and, last, ``manifest.json``, which lists every file with its size and crc32 and
so is the completion marker. An existing ``NAME`` is replaced in three steps: rename it to ``.NAME.previous``,
rename the partial to ``NAME``, delete the previous one. A process killed at any moment therefore leaves either the old
checkpoint at ``NAME`` or, between the two renames, no ``NAME`` and the complete old checkpoint at
``.NAME.previous``, which loading falls back to and the next save moves back into place. A leftover ``.partial``
has no manifest, is never loaded, and is removed by the next save of the same name; a save that fails with an
error (a full disk: see :func:`abandon`) removes its own. Before reading, loading checks that the manifest parses
and that every file it lists exists with its recorded size, so a missing or truncated shard is reported by name
before any training state changes; each file's crc32 is checked as it is first read (:mod:`.storage`).

Note: [Never remove what is not ours]
Replacing or removing ``NAME`` deletes it, so both first check that ``NAME`` is ours: absent, a symbolic link (only
the link goes), an empty directory, or a directory whose ``manifest.json`` parses as ours and which holds nothing
but the files that manifest lists. Anything else (a user's folder ``out/`` with ``notes.txt`` in it, a single-file
checkpoint ``m.ckpt`` written by another strategy, a checkpoint of ours someone added a file to) raises
:class:`CheckpointError` naming the path before anything is written or removed.

Note: [Atomic single files]
A single-file checkpoint (``state_dict_type="full"``) is published as a directory is: written whole into the sibling
``.NAME.partial``, fsynced, then renamed onto ``NAME`` (:func:`publish_file`), which replaces an old file in one step.
A process killed while writing leaves the old ``NAME`` or none, never part of a file; the leftover ``.partial`` is
overwritten by the next save of that name, and a save that fails with an error removes its own.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .manifest import Manifest
from .storage import METADATA, crc32_of, os_error, verify

MANIFEST = "manifest.json"
META = "meta.pt"


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


# -- writing (rank 0) ---------------------------------------------------------------------------------------------
def begin(path: Path) -> Path:
    """Make an empty partial directory for ``path`` (removing a stale one) and return it; refuses a ``path`` that
    is not ours to replace (Note: [Never remove what is not ours])."""
    check_ours(path, "save a checkpoint at")
    _recover(path)
    partial = partial_path(path)
    _remove_tree(partial)
    partial.mkdir(parents=True)
    return partial


def finish(partial: Path, path: Path, manifest: Manifest, meta: dict[str, Any], checksums: dict[str, int]) -> None:
    """Write ``meta.pt`` and the manifest into the complete partial directory, then publish it at ``path``.

    ``checksums`` holds the crc32 of every rank's shard files; rank 0 sums the files it wrote itself here."""
    try:
        _write_synced(partial / META, lambda f: torch.save(meta, f))
        files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
        sums = {name: checksums[name] if name in checksums else crc32_of(partial / name) for name in files}
        text = manifest.with_files(files, sums).to_json()
        _write_synced(partial / MANIFEST, lambda f: f.write(text.encode()))
        _sync_directory(partial)
    except Exception:
        abandon(partial)
        raise
    _publish(partial, path)


def _publish(partial: Path, path: Path) -> None:
    previous = previous_path(path)
    _remove_tree(previous)
    if path.exists() or path.is_symlink():
        path.rename(previous)
    partial.rename(path)
    _sync_directory(path.parent)
    _remove_tree(previous)


def publish_file(path: Path, write: Callable[[Path], None]) -> None:
    """Have ``write`` write the file ``path`` into its partial sibling, then publish it: Note: [Atomic single
    files]. Only the rank that writes calls this."""
    partial = partial_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(partial)
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)


def _recover(path: Path) -> None:
    """Undo a save killed between its two renames: move a complete previous checkpoint back into place."""
    previous = previous_path(path)
    if previous.exists() and not path.exists() and (previous / MANIFEST).is_file():
        previous.rename(path)
        _sync_directory(path.parent)


def abandon(partial: Path) -> None:
    """Remove the partial directory of a save that failed once no rank writes to it any more, so that a full disk
    gets its space back: a later save may have another name and never remove it."""
    shutil.rmtree(partial, ignore_errors=True)


def check_ours(path: Path, action: str) -> None:
    """Raise :class:`CheckpointError` unless ``path`` may be replaced or removed: Note: [Never remove what is not
    ours]. ``action`` says what was asked ("save a checkpoint at")."""
    if path.is_symlink() or not path.exists():
        return
    refusal = f"refusing to {action} {path}: it exists and is not a ds_strategy checkpoint"
    advice = "nothing was written or removed; move it away or choose another path"
    if not path.is_dir():
        raise CheckpointError(f"{refusal} (it is a file); {advice}")
    contents = {entry.name for entry in path.iterdir()}
    if not contents:
        return
    if MANIFEST not in contents:
        raise CheckpointError(f"{refusal} (it has no {MANIFEST} and holds {sorted(contents)[:5]}); {advice}")
    try:
        listed = set(Manifest.from_json((path / MANIFEST).read_text(), path / MANIFEST).files)
    except (CheckpointError, OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{refusal} ({error}); {advice}") from error
    foreign = sorted(contents - listed - {MANIFEST})
    if foreign:
        raise CheckpointError(
            f"refusing to {action} {path}: the checkpoint also holds files it did not write, {foreign[:5]}; {advice}"
        )


def remove(path: Path) -> None:
    """Delete a checkpoint so that no crash leaves a partly deleted one that still looks complete; refuses a
    ``path`` that is not ours (Note: [Never remove what is not ours])."""
    check_ours(path, "remove")
    if path.is_dir() and not path.is_symlink():
        doomed = path.with_name(f".{path.name}.removing")
        _remove_tree(doomed)
        path.rename(doomed)
        _remove_tree(doomed)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _write_synced(path: Path, write) -> None:
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as error:
        raise CheckpointError(f"{path} cannot be written: {os_error(error)}") from error


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ------------------------------------------------------------------------------------------------------
def open_checkpoint(path: str | os.PathLike) -> tuple[Path, Manifest]:
    """The directory to read and its manifest, after checking that it is a complete checkpoint whose files are
    all present at their recorded sizes."""
    path = Path(path)
    if not path.exists():
        previous = previous_path(path)
        if (previous / MANIFEST).is_file():
            warnings.warn(
                f"{path} does not exist but {previous} does: a save was interrupted while replacing "
                f"it; loading the previous checkpoint",
                stacklevel=3,
            )
            path = previous
        else:
            raise CheckpointError(f"{path}: no such checkpoint")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a ds_strategy checkpoint (a directory written by "
            f"ds_strategy.checkpoint.save or ZeroStrategy.save_checkpoint)"
        )
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        interrupted = (path / METADATA).exists() or path.name.endswith(".partial")
        what = (
            "an incomplete checkpoint (the save was interrupted before it finished)"
            if interrupted
            else "not a ds_strategy checkpoint"
        )
        raise CheckpointError(f"{path} is {what}: {manifest_file.name} is missing")
    try:
        text = manifest_file.read_text()
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{manifest_file} is not a valid ds_strategy checkpoint manifest: {error}") from error
    manifest = Manifest.from_json(text, manifest_file)
    for name, size in manifest.files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint {path} lists it as one of its files")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{file} is truncated or was modified: it has {actual} bytes, the manifest records {size}"
            )
    return path, manifest


def latest(root: Path) -> Path | None:
    """The checkpoint directly under ``root`` whose save completed last (by its manifest's modification time), or
    None: what a restarted job resumes from.

    Only complete checkpoints count, so a save killed part way (a ``.NAME.partial``) is never chosen. A checkpoint
    whose replacement was interrupted between its two renames counts under its own name ``NAME``: it exists only
    as ``.NAME.previous``, which :func:`open_checkpoint` falls back to, see Note: [Atomic checkpoint directories].
    """
    completed = {}
    for entry in root.iterdir() if root.is_dir() else ():
        name = entry.name
        if name.startswith(".") and name.endswith(".previous"):
            entry_name = name[1 : -len(".previous")]
            if (root / entry_name).exists():
                continue
        elif name.startswith("."):
            continue
        else:
            entry_name = name
        manifest = entry / MANIFEST
        if manifest.is_file():
            completed[root / entry_name] = manifest.stat().st_mtime_ns
    return max(completed, key=lambda path: (completed[path], path.name), default=None)


def read_meta(directory: Path, manifest: Manifest, weights_only: bool = False) -> dict[str, Any]:
    """Rank 0's ``meta.pt``, checked against ``manifest``: ``{"param_groups": [...] or None, "extra": {...}}``.

    Note: [Unpickling meta.pt]
    What ds_strategy writes there (param groups, the loss scaler's state, the markers of entries in the shard files)
    is plain types that ``torch.load(weights_only=True)`` reads; what the user's program saved beside the model
    (Fabric's other entries, Lightning's loops, callbacks and hyperparameters) may be any object. So it is read
    with ``weights_only=False`` (the checkpoint is trusted, as one's own checkpoint directory is), unless the caller
    asks for ``weights_only=True`` (``fabric.load(..., weights_only=True)``, ``trainer.fit(ckpt_path=...,
    weights_only=True)``): then torch's allow-list applies, and an object outside it fails to load naming it."""
    verify(directory / META, manifest.checksums.get(META))
    try:
        return torch.load(directory / META, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        raise CheckpointError(f"{directory / META} cannot be read: {error}") from error
