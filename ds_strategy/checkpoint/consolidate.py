"""One full state dict (``.pt`` or ``.safetensors``) from a sharded checkpoint, in one process, no process group.

Each stored tensor is read whole, one at a time, through DCP (which assembles it from the pieces in whichever rank
files hold them), reshaped and, if asked, cast; so peak memory is about the output plus the largest tensor, never
the whole checkpoint. Tied names are written as the manifest describes (see [Tied and shared weights] in
:mod:`.manifest`), so the result loads into the plain module with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .directory import open_checkpoint, read_meta
from .errors import CheckpointError
from .flat_piece import quiet_single_process
from .manifest import Kind, Manifest, StateKind, model_key, optimizer_key
from .storage import METADATA, ChecksummedReader, dcp_failure

SUFFIXES = (".pt", ".safetensors")


def consolidate(
    path: str | os.PathLike,
    out: str | os.PathLike,
    dtype: torch.dtype | None = None,
    weights_only: bool = True,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the checkpoint at ``path`` as one state dict to ``out`` (``.pt`` or ``.safetensors``); returns ``out``.

    ``dtype`` casts floating-point weights (default: as stored, fp32 for trainable parameters, which are saved from
    the fp32 master copy). ``weights_only=False`` (``.pt`` only) writes ``{"state_dict": ..., "optimizer": ...}``
    with the optimizer in ``torch.optim`` layout keyed by parameter name: ``{"state": {name: {key: tensor}},
    "param_groups": [{..., "params": [names]}]}``, state tensors shaped like their parameter and not cast.
    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``.
    """
    out = Path(out)
    if out.suffix not in SUFFIXES:
        raise ValueError(f"consolidate out={str(out)!r}: the file name must end in one of {', '.join(SUFFIXES)}")
    if not weights_only and out.suffix != ".pt":
        raise ValueError(
            f"consolidate out={str(out)!r}: optimizer state (weights_only=False) is written only to .pt files"
        )
    where, manifest = open_checkpoint(path)
    if not weights_only and manifest.optimizer_state is None:
        raise CheckpointError(f"{where} is a weights-only checkpoint: it has no optimizer state to consolidate")
    reader = _MetadataOnceReader(where, manifest.checksums)
    try:
        metadata = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"{where / METADATA} cannot be read: {error}") from error
    weights = _read_weights(reader, metadata, manifest, dtype, exclude_frozen_parameters)
    if weights_only:
        torch_payload: dict[str, Any] = weights
    else:
        torch_payload = {"state_dict": weights, "optimizer": _read_optimizer(reader, metadata, manifest, where)}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".pt":
        torch.save(torch_payload, out)
    else:
        _save_safetensors(weights, manifest, out)
    return out


class _MetadataOnceReader(ChecksummedReader):
    """A checksummed reader (each file is checked once) that parses DCP's ``.metadata`` once for all the
    one-tensor loads."""

    def read_metadata(self) -> Metadata:
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata()
        return self._metadata


def _read(reader: _MetadataOnceReader, metadata: Metadata, key: str) -> Any:
    stored = metadata.state_dict_metadata.get(key)
    if stored is None:
        raise CheckpointError(f"{reader.path} lists {key!r} in its manifest but DCP's .metadata has no such key")
    target = {
        key: torch.empty(stored.size, dtype=stored.properties.dtype)
        if isinstance(stored, TensorStorageMetadata)
        else None
    }
    try:
        with quiet_single_process():
            dcp.load(target, storage_reader=reader, no_dist=True)
    except CheckpointException as error:  # e.g. a damaged file: [Checksums of checkpoint files] in .storage
        raise dcp_failure(error, f"reading {key!r} from {reader.path}") from None
    except Exception as error:
        raise CheckpointError(f"reading {key!r} from {reader.path} failed: {error}") from error
    return target[key]


def _read_weights(
    reader, metadata: Metadata, manifest: Manifest, dtype: torch.dtype | None, exclude_frozen: bool
) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, entry in manifest.entries.items():
        if entry.kind is Kind.ALIAS:
            if entry.alias_of in weights:
                weights[name] = weights[entry.alias_of]
            continue
        if exclude_frozen and entry.kind is Kind.FROZEN:
            continue
        tensor = _read(reader, metadata, model_key(name)).view(entry.shape)
        weights[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return weights


def _read_optimizer(reader, metadata: Metadata, manifest: Manifest, where: Path) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for name, kinds in manifest.optimizer_state.items():
        shape = manifest.entries[name].shape
        state[name] = {
            key: _read(reader, metadata, optimizer_key(name, key)).view(shape)
            if kind is StateKind.ELEMENTWISE
            else _read(reader, metadata, optimizer_key(name, key))
            for key, kind in kinds.items()
        }
    groups = read_meta(where, manifest)["param_groups"]
    for index, group in enumerate(groups):
        group["params"] = [
            name for name, entry in manifest.entries.items() if entry.kind is Kind.PARAMETER and entry.group == index
        ]
    return {"state": state, "param_groups": groups}


def _save_safetensors(weights: dict[str, torch.Tensor], manifest: Manifest, out: Path) -> None:
    """safetensors cannot store one tensor under two names: aliases get a copy, listed in the header metadata."""
    from safetensors.torch import save_file

    aliases = {
        name: entry.alias_of for name, entry in manifest.entries.items() if entry.kind is Kind.ALIAS and name in weights
    }
    tensors = {name: tensor.clone() if name in aliases else tensor.contiguous() for name, tensor in weights.items()}
    save_file(tensors, str(out), metadata={"format": "pt", "ds_strategy.aliases": json.dumps(aliases)})
