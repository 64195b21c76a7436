"""``manifest.json``: a checkpoint's table of contents, written last so that it also marks the checkpoint complete.

It names every entry of the module's ``state_dict`` (in ``state_dict`` order) with its kind and shape, says which
optimizer state each trainable parameter has, lists the checkpoint's files with their sizes and crc32s (see
[Checksums of checkpoint files] in :mod:`.storage`), and records what wrote it. The tensors themselves live in
DCP's files under the keys :func:`model_key` and :func:`optimizer_key`, every one a 1-D tensor of the entry's
``numel`` elements (see :mod:`.flat_piece`), so the entry's shape is only here.

Note: [Tied and shared weights]
A tensor reachable under several ``state_dict`` names (GPT's ``lm_head.weight`` is ``embed.wte.weight``) is
stored once, under the first name in ``state_dict`` order; every later name is an ``ALIAS`` entry pointing at it.
Loading requires the model to tie the same names; consolidation writes every name, so the result loads with
``load_state_dict(strict=True)``: a ``.pt`` file keeps one tensor under both names (``torch.save`` stores it once),
a ``.safetensors`` file, which cannot express sharing, stores a copy and lists the aliases in its header metadata.
A pipeline stage holding a copy of a weight another stage owns describes it the same way, as an alias of the
owner's name (Note: [Pipeline stages in one checkpoint]).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import CheckpointError

FORMAT = "ds_strategy.checkpoint"
VERSION = 1


def model_key(name: str) -> str:
    """The DCP key of a ``state_dict`` entry's values."""
    return f"model.{name}"


def optimizer_key(name: str, state_key: str) -> str:
    """The DCP key of one optimizer state (``exp_avg``, ``step``, ...) of the parameter ``name``."""
    return f"optimizer.{name}.{state_key}"


class Kind(str, enum.Enum):
    """What a ``state_dict`` entry is, which decides who writes it and how it is read back."""

    PARAMETER = "parameter"  # trainable: each rank writes the pieces inside its flat shard (fp32 master values)
    FROZEN = "frozen"  # parameter with requires_grad=False: identical on every rank, written whole by rank 0
    BUFFER = "buffer"  # persistent buffer: written whole by rank 0 (rank 0's buffers are authoritative, as in DDP)
    ALIAS = "alias"  # another name for an earlier entry's tensor (tied weights); no data of its own


class StateKind(str, enum.Enum):
    """How one optimizer state of a parameter is stored."""

    ELEMENTWISE = "elementwise"  # shaped like the parameter (Adam's exp_avg): stored as pieces, like the parameter
    SCALAR = "scalar"  # one value per parameter (Adam's step): written once, by the rank holding its first element
    WHOLE = "whole"  # another shape (Adafactor's row statistics), of a whole-tensor optimizer: written like a scalar


@dataclass(frozen=True)
class Entry:
    """One ``state_dict`` name: its kind, shape, the entry it aliases, and (trainable parameters saved by a ZeRO
    engine) the optimizer param group holding it and the dtype the model gave it (``"float32"``; stored values are
    the masters', fp32 under mixed precision: Note: [What an export returns] in ``ds_strategy.zero.full_state_dict``).
    ``dtype`` came later than version 1 without a new version: a manifest without it consolidates as stored."""

    kind: Kind
    shape: tuple[int, ...] = ()
    alias_of: str | None = None
    group: int | None = None
    dtype: str | None = None

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class Manifest:
    """Everything about a checkpoint except the tensors' values and rank 0's ``meta.pt``.

    ``optimizer_state`` maps each trainable parameter to its optimizer state keys; ``None`` for a weights-only
    checkpoint. ``files`` maps each file of the checkpoint to its size in bytes, ``checksums`` to its crc32.
    ``saved_by`` (world size, stage, precision) is informational: nothing in the layout depends on it.

    ``checksums`` came later than version 1 without a new version: it only adds a check, so a reader that predates
    it loads the checkpoint as before, and a version-1 manifest without it (written before) loads unchecked.
    """

    entries: dict[str, Entry]
    optimizer_state: dict[str, dict[str, StateKind]] | None = None
    saved_by: dict[str, Any] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    checksums: dict[str, int] = field(default_factory=dict)

    def source_of(self, name: str) -> str | None:
        """The entry whose data ``name`` reads (itself, or what it aliases); ``None`` if the checkpoint lacks it."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        return entry.alias_of if entry.kind is Kind.ALIAS else name

    def with_files(self, files: dict[str, int], checksums: dict[str, int]) -> Manifest:
        return replace(self, files=dict(files), checksums=dict(checksums))

    def to_json(self) -> str:
        entries = {
            name: {k: v for k, v in asdict(entry).items() if v not in (None, ())}
            for name, entry in self.entries.items()
        }
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "saved_by": self.saved_by,
                "files": self.files,
                "checksums": self.checksums,
                "entries": entries,
                "optimizer_state": self.optimizer_state,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        """Parse ``text`` read from ``where``; anything malformed is a :class:`CheckpointError` naming it."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')!r} is not the supported version {VERSION}")
            entries = {
                name: Entry(
                    kind=Kind(e["kind"]),
                    shape=tuple(e.get("shape", ())),
                    alias_of=e.get("alias_of"),
                    group=e.get("group"),
                    dtype=e.get("dtype"),
                )
                for name, e in raw["entries"].items()
            }
            optimizer_state = raw.get("optimizer_state")
            if optimizer_state is not None:
                optimizer_state = {
                    name: {key: StateKind(kind) for key, kind in keys.items()} for name, keys in optimizer_state.items()
                }
            return cls(
                entries,
                optimizer_state,
                dict(raw.get("saved_by", {})),
                {str(k): int(v) for k, v in raw["files"].items()},
                {str(k): int(v) for k, v in raw.get("checksums", {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{where} is not a valid ds_strategy checkpoint manifest: {error}") from error

    def check_fits(self, model: dict[str, Entry], where: Path, strict: bool = True) -> None:
        """Raise unless this checkpoint holds every entry of ``model`` (described like ours) with its shape.

        Kinds may differ (a parameter frozen now but trainable then loads the same values), but aliasing may not.
        With ``strict=False`` names missing on either side are allowed; shapes and aliasing must still agree.
        """
        missing = [name for name in model if name not in self.entries]
        unexpected = [name for name in self.entries if name not in model]
        mismatched = []
        for name, wanted in model.items():
            saved = self.entries.get(name)
            if saved is None:
                continue
            if (wanted.kind is Kind.ALIAS) != (saved.kind is Kind.ALIAS) or wanted.alias_of != saved.alias_of:
                mismatched.append(
                    f"{name}: {_describe_alias(saved)} in the checkpoint, {_describe_alias(wanted)} in the model"
                )
            elif wanted.kind is not Kind.ALIAS and wanted.shape != saved.shape:
                mismatched.append(
                    f"{name}: shape {list(saved.shape)} in the checkpoint, {list(wanted.shape)} in the model"
                )
        problems = [f"mismatched: {_listed(mismatched, '; ')}"] if mismatched else []
        if strict and missing:
            problems.append(f"missing from the checkpoint: {_listed(missing)}")
        if strict and unexpected:
            problems.append(f"not in the model: {_listed(unexpected)}")
        if problems:
            raise CheckpointError(f"{where} was saved from a different model; " + " | ".join(problems))


def _listed(items: list[str], separator: str = ", ", limit: int = 10) -> str:
    more = f"{separator}... ({len(items) - limit} more)" if len(items) > limit else ""
    return separator.join(items[:limit]) + more


def _describe_alias(entry: Entry) -> str:
    return f"an alias of {entry.alias_of}" if entry.kind is Kind.ALIAS else "its own tensor"
