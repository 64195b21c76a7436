"""One full state dict (``.pt``/``.ckpt`` or ``.safetensors``) from a sharded checkpoint, in one process, no
process group.

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

SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")  # .pth: torch's own (litgpt's); .ckpt: Lightning's
# Key of a Lightning checkpoint's extra state under which the Lightning adapter records, per param group, the names
# of the parameters in the order the user's optimizer listed them (which a torch.optim state dict is keyed by).
OPTIMIZER_ORDER = "ds_strategy_optimizer_parameter_order"
LIGHTNING_VERSION = "pytorch-lightning_version"


def consolidate(
    path: str | os.PathLike,
    out: str | os.PathLike,
    dtype: torch.dtype | None = None,
    weights_only: bool = True,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the checkpoint at ``path`` as one state dict to ``out`` (``.pt``/``.pth``/``.ckpt``, or ``.safetensors``);
    returns ``out``.

    Trainable parameters are the masters the checkpoint stores (fp32 under mixed precision), written in the dtype
    the model gave each (recorded in the manifest; as stored for a checkpoint saved before that record): what the
    engine's ``full_state_dict`` returns (Note: [What an export returns] in ``ds_strategy.zero.full_state_dict``).
    ``dtype`` casts every floating-point weight instead (``torch.float32``: the masters unrounded whatever the
    model's dtype). ``weights_only=False`` (not to ``.safetensors``) writes ``{"state_dict": ..., "optimizer":
    ...}`` with the optimizer in ``torch.optim`` layout keyed by parameter name: ``{"state": {name: {key:
    tensor}}, "param_groups": [{..., "params": [names]}]}``, state tensors shaped like their parameter and not cast.
    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``.

    A checkpoint the Lightning Trainer wrote (``ZeroStrategy``) consolidates into what Lightning itself writes, so
    ``LightningModule.load_from_checkpoint`` takes it: every entry Lightning saved (its version, epoch, global
    step, loops, hyper-parameters, what ``on_save_checkpoint`` added) and ``state_dict``; with ``weights_only``
    without the callbacks', optimizers' and LR schedulers' states, as ``trainer.save_checkpoint(weights_only=True)``
    leaves them out. With ``weights_only=False`` those stay and ``optimizer_states`` is ``[optimizer.state_dict()]``
    keyed by position in the user's optimizer, so a DDP or single-device ``fit(ckpt_path=...)`` resumes from it; the
    by-name ``optimizer`` entry is kept beside them (the same tensors, stored once). To ``.safetensors`` the weights
    alone are written.
    """
    out = Path(out)
    if out.suffix not in SUFFIXES:
        raise ValueError(f"consolidate out={str(out)!r}: the file name must end in one of {', '.join(SUFFIXES)}")
    if not weights_only and out.suffix == ".safetensors":
        raise ValueError(
            f"consolidate out={str(out)!r}: optimizer state (weights_only=False) is written only to .pt, .pth or "
            f".ckpt files"
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
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        _save_safetensors(weights, manifest, out)
    else:
        torch.save(_torch_payload(reader, metadata, manifest, where, weights, weights_only), out)
    return out


def _torch_payload(
    reader, metadata: Metadata, manifest: Manifest, where: Path, weights: dict[str, torch.Tensor], weights_only: bool
) -> dict[str, Any]:
    """What a ``.pt``/``.ckpt`` file holds: the weights, with the optimizer unless ``weights_only``, in Lightning's
    layout for a checkpoint the Lightning Trainer wrote (see :func:`consolidate`)."""
    meta = read_meta(where, manifest)
    extra = meta["extra"]
    if weights_only:
        return _lightning_weights_checkpoint(extra, weights) if LIGHTNING_VERSION in extra else weights
    consolidated = {"state_dict": weights, "optimizer": _read_optimizer(reader, metadata, manifest, where)}
    if LIGHTNING_VERSION not in extra:
        return consolidated
    counts = meta.get("optimizer_param_groups") or [len(consolidated["optimizer"]["param_groups"])]
    return _lightning_checkpoint(extra, consolidated, counts)


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
        wanted = dtype if dtype is not None else getattr(torch, entry.dtype) if entry.dtype is not None else None
        weights[name] = tensor.to(wanted) if wanted is not None and tensor.is_floating_point() else tensor
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


def _lightning_checkpoint(extra: dict[str, Any], consolidated: dict[str, Any], counts: list[int]) -> dict[str, Any]:
    """Lightning's single-file layout: its saved entries, ``state_dict``, and the named optimizer state keyed by
    position as ``torch.optim.Optimizer.state_dict()`` is (in the user's order where the adapter recorded it, else
    in ``state_dict`` order, which is that of ``configure_optimizers`` over ``self.parameters()``), one state dict
    per optimizer (``counts``: how many of the param groups, in order, each optimizer has)."""
    named = consolidated["optimizer"]
    order = extra.get(OPTIMIZER_ORDER) or [group["params"] for group in named["param_groups"]]
    optimizer_states, first = [], 0
    for count in counts:
        state, groups, position = {}, [], 0
        for group, names in zip(named["param_groups"][first : first + count], order[first : first + count]):
            positions = []
            for name in names:
                if name in named["state"]:
                    state[position] = named["state"][name]
                positions.append(position)
                position += 1
            groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": positions})
        optimizer_states.append({"state": state, "param_groups": groups})
        first += count
    lightning = {key: value for key, value in extra.items() if key != OPTIMIZER_ORDER}
    return {**lightning, **consolidated, "optimizer_states": optimizer_states}


def _lightning_weights_checkpoint(extra: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Lightning's single-file layout of a weights-only save: its saved entries but the callbacks', optimizers'
    and LR schedulers' states, and ``state_dict``."""
    left_out = {OPTIMIZER_ORDER, "callbacks", "optimizer_states", "lr_schedulers"}
    return {**{key: value for key, value in extra.items() if key not in left_out}, "state_dict": weights}


def _save_safetensors(weights: dict[str, torch.Tensor], manifest: Manifest, out: Path) -> None:
    """safetensors cannot store one tensor under two names: aliases get a copy, listed in the header metadata."""
    from safetensors.torch import save_file

    aliases = {
        name: entry.alias_of for name, entry in manifest.entries.items() if entry.kind is Kind.ALIAS and name in weights
    }
    tensors = {name: tensor.clone() if name in aliases else tensor.contiguous() for name, tensor in weights.items()}
    save_file(tensors, str(out), metadata={"format": "pt", "ds_strategy.aliases": json.dumps(aliases)})
