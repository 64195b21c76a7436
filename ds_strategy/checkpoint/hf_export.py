"""A sharded checkpoint as a Hugging Face ``save_pretrained`` directory: ``config.json``, sharded safetensors and
their index, which ``from_pretrained`` loads with nothing missing and nothing left over.

The weights are read as :func:`.consolidate` reads them (one stored tensor at a time, in one process). The model's
config comes from ``config`` (a ``config.json`` or a directory holding one), else from a ``config.json`` beside the
checkpoint (a ZeroTrainer's ``checkpoint-N/`` holds one next to ``zero_checkpoint/``). The model class the config
names is built on the meta device, so its names are known without allocating it, and writes the directory itself
(``save_pretrained`` with the read state dict: its shard sizes, index and tied-weight handling are transformers'
own).

Note: [Matching checkpoint names to the model's]
A Lightning checkpoint names weights by attribute path from the LightningModule (``model.lm_head.weight`` when it
holds the Hugging Face model as ``self.model``; ``net.backbone...`` when it is elsewhere). ``prefix`` is taken off
every name; by default it is found: the dotted prefix ("" included) under which the checkpoint's names are exactly
the model's. Names outside the prefix (another submodule of the LightningModule) are left out and reported. Under
the prefix, a name the model lacks, or a model name the checkpoint lacks (but for one of a group of tied weights,
which share storage), is an error naming them all, before anything is written: ``from_pretrained`` would otherwise
initialise the missing weights randomly and load "successfully".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .consolidate import _MetadataOnceReader, _read_weights
from .directory import open_checkpoint
from .errors import CheckpointError
from .manifest import Kind

CONFIG_NAME = "config.json"


def export_pretrained(
    path: str | os.PathLike,
    out: str | os.PathLike,
    config: str | os.PathLike | None = None,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
) -> dict[str, Any]:
    """Write the checkpoint at ``path`` to the directory ``out`` as ``save_pretrained`` would; returns what was done:
    ``{"prefix": ..., "left_out": [names outside it], "model": class name}``. See the module docstring. The weights
    are the masters, each in the dtype the model gave it unless ``dtype`` says otherwise, as :func:`.consolidate`
    writes them."""

    model_config = _read_config(Path(path), config)
    where, manifest = open_checkpoint(path)
    reader = _MetadataOnceReader(where, manifest.checksums)
    weights = _read_weights(reader, reader.read_metadata(), manifest, dtype, False)
    aliases = {name for name, entry in manifest.entries.items() if entry.kind is Kind.ALIAS}
    with torch.device("meta"):
        model = _build(model_config)
    tied_groups = _name_groups(model)
    chosen = prefix if prefix is not None else _find_prefix(weights, tied_groups)
    under = {name[len(chosen) :]: value for name, value in weights.items() if name.startswith(chosen)}
    _check_names(under, tied_groups, chosen, where, type(model).__name__)
    left_out = sorted(name for name in weights if not name.startswith(chosen))
    state_dict = {name: value for name, value in under.items() if chosen + name not in aliases}
    model.save_pretrained(out, state_dict=state_dict, max_shard_size=max_shard_size)
    return {"prefix": chosen, "left_out": left_out, "model": type(model).__name__}


def _read_config(path: Path, given: str | os.PathLike | None) -> Any:
    import transformers

    candidates = [Path(given)] if given is not None else [path, path.parent]
    for candidate in candidates:
        file = candidate / CONFIG_NAME if candidate.is_dir() else candidate
        if file.is_file():
            options = json.loads(file.read_text(encoding="utf-8"))
            model_type = options.pop("model_type", None)
            if model_type is None:
                raise CheckpointError(f"{file} has no model_type: it is not a Hugging Face model config")
            return transformers.AutoConfig.for_model(model_type, **options)
    if given is not None:
        raise FileNotFoundError(f"--config {str(given)!r}: no such {CONFIG_NAME} (or directory holding one)")
    raise CheckpointError(
        f"no {CONFIG_NAME} in {path} or {path.parent}: pass the model's config (a {CONFIG_NAME}, or the directory "
        f"of the pretrained model it was trained from)"
    )


def _build(config: Any) -> torch.nn.Module:
    """The class ``config.architectures`` names (``save_pretrained`` records it), else ``AutoModel``'s choice."""
    import transformers

    named = getattr(transformers, (config.architectures or [""])[0], None)
    return named._from_config(config) if named is not None else transformers.AutoModel.from_config(config)


def _name_groups(model: torch.nn.Module) -> list[list[str]]:
    """The model's state-dict names, grouped where they share one tensor (tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _problems(names: set[str], groups: list[list[str]]) -> tuple[list[str], list[str]]:
    """(model names the checkpoint lacks, checkpoint names the model lacks)."""
    known = {name for group in groups for name in group}
    missing = [group[0] for group in groups if not any(name in names for name in group)]
    return missing, sorted(names - known)


def _find_prefix(weights: dict[str, Any], groups: list[list[str]]) -> str:
    """The dotted prefix under which the checkpoint's names fit the model best (see Note above)."""
    candidates = {""}
    for name in weights:
        parts = name.split(".")
        candidates.update(".".join(parts[:i]) + "." for i in range(1, len(parts)))

    def misfit(candidate: str) -> tuple[int, int]:
        under = {name[len(candidate) :] for name in weights if name.startswith(candidate)}
        missing, unexpected = _problems(under, groups)
        return len(missing) + len(unexpected), len(candidate)

    return min(candidates, key=misfit)


def _check_names(under: dict[str, Any], groups: list[list[str]], prefix: str, where: Path, model: str) -> None:
    missing, unexpected = _problems(set(under), groups)
    if missing or unexpected:
        found = [f"{label}: {', '.join(names)}" for label, names in (("missing", missing), ("unexpected", unexpected))]
        raise CheckpointError(
            f"{where} under prefix {prefix!r} does not fit {model}; nothing was written. "
            + "; ".join(found)
            + ". Give the prefix the model's names carry in the checkpoint (--prefix), or the right --config"
        )
