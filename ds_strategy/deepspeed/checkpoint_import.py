"""A DeepSpeed ZeRO checkpoint rewritten as a ds_strategy sharded checkpoint, which then loads at any world size.

:func:`import_deepspeed` reads the DeepSpeed files into whole tensors per name (:mod:`.checkpoint_reader`) and
writes them through :func:`ds_strategy.checkpoint.write` from this one process: each tensor becomes a single DCP
chunk covering all of it, which ``ds_strategy.checkpoint.load`` on any number of ranks reads its shards' ranges
out of (see :mod:`ds_strategy.checkpoint.flat_piece`). Trainable parameters are the fp32 master values, with
Adam's moments and step; the param groups' hyperparameters and an fp16 run's loss scaler go into ``meta.pt`` as a
ds_strategy save would put them; DeepSpeed's counters, LR scheduler state and client state go into the extra
state under ``"deepspeed"``.

Note: [Resuming an imported checkpoint the way DeepSpeed would]
What DeepSpeed continues with is fixed by the checkpoint *and* by its config; only the checkpoint travels. To
take the same steps, build the model with the same parameter names, the optimizer with the same param groups
in the same order (``load`` checks both) and the same type (Adam or AdamW: the hyperparameters are restored
from the checkpoint, and with them ``decoupled_weight_decay``), and pick the precision DeepSpeed ran in
("bf16-mixed" for ``bf16``, "16-mixed" for ``fp16``) with its loss scale settings (``loss_scale_window``,
``hysteresis``, ``min_loss_scale``: the scaler's *state* is restored, its *settings* come from the config; they
are reported under ``extra["deepspeed"]["loss_scaler"]``). DeepSpeed's LR scheduler state is kept, not
applied: it is DeepSpeed's own schedule's ``state_dict``.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from ..checkpoint import write
from ..checkpoint.manifest import Entry, Kind, Manifest, StateKind
from .checkpoint_reader import DeepSpeedCheckpoint, DeepSpeedCheckpointError, read_checkpoint


def import_deepspeed(source: str | os.PathLike, out: str | os.PathLike, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Convert the DeepSpeed checkpoint at ``source`` (the save directory, whose ``latest`` names the tag, or the
    tag folder itself; ``tag`` picks another) into a ds_strategy checkpoint at ``out``; returns what was read.

    Runs in one process without a process group; raises :class:`DeepSpeedCheckpointError` for input it cannot
    convert, before writing anything.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "import_deepspeed runs in a single process: call it before init_process_group, or use "
            "the `ds-strategy import-deepspeed` command"
        )
    checkpoint = read_checkpoint(source, tag)
    tensors = {**checkpoint.params, **checkpoint.buffers, **checkpoint.frozen}
    model = {name: tensors[name].detach().reshape(-1).contiguous() for name in _stored_names(checkpoint)}
    state = {
        name: {
            key: value.reshape(-1).contiguous() if key != "step" else value
            for key, value in checkpoint.optimizer_state[name].items()
        }
        for name in checkpoint.params
    }
    optimizer = {"state": state, "param_groups": checkpoint.param_groups, "loss_scaler": _scaler_state(checkpoint)}
    write(out, model, optimizer, manifest_of(checkpoint), extra={"deepspeed": _provenance(checkpoint)})
    return checkpoint


def manifest_of(checkpoint: DeepSpeedCheckpoint) -> Manifest:
    """The manifest a ds_strategy save of the same module would write (entries in ``state_dict`` order)."""
    entries: dict[str, Entry] = {}
    for name in checkpoint.names:
        if name in checkpoint.aliases:
            entries[name] = Entry(Kind.ALIAS, alias_of=checkpoint.aliases[name])
        elif name in checkpoint.params:
            entries[name] = Entry(Kind.PARAMETER, tuple(checkpoint.params[name].shape), group=checkpoint.groups[name])
        elif name in checkpoint.buffers:
            entries[name] = Entry(Kind.BUFFER, tuple(checkpoint.buffers[name].shape))
        elif name in checkpoint.frozen:
            entries[name] = Entry(Kind.FROZEN, tuple(checkpoint.frozen[name].shape))
    unnamed = sorted(set(checkpoint.params) - set(entries))
    if unnamed:
        raise DeepSpeedCheckpointError(
            f"{checkpoint.directory}: param_shapes lists {unnamed}, which the saved module state_dict does not name"
        )
    optimizer_state = {
        name: {
            key: StateKind.SCALAR if key == "step" else StateKind.ELEMENTWISE
            for key in checkpoint.optimizer_state[name]
        }
        for name in checkpoint.params
    }
    saved_by = {
        "world_size": checkpoint.world_size,
        "stage": checkpoint.stage,
        "imported_from": f"deepspeed {checkpoint.counters.get('ds_version')}",
    }
    return Manifest(entries, optimizer_state, saved_by)


def _stored_names(checkpoint: DeepSpeedCheckpoint) -> list[str]:
    return [name for name in checkpoint.names if name not in checkpoint.aliases]


def _scaler_state(checkpoint: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed's loss scaler as :class:`ds_strategy.precision.LossScaler` state (the same schedule; see its
    module docstring). DeepSpeed has no count of consecutive overflows at the minimum scale; it starts at 0."""
    scaler = checkpoint.loss_scaler
    if scaler is None:
        return None
    last_overflow = scaler.get("last_overflow_iter")
    return {
        "cur_scale": float(scaler["cur_scale"]),
        "cur_iter": int(scaler.get("cur_iter", 0) or 0),
        "last_overflow_iter": -1 if last_overflow is None else int(last_overflow),
        "cur_hysteresis": int(scaler.get("cur_hysteresis", 1) or 1),
        "skipped_steps": int(checkpoint.counters.get("skipped_steps") or 0),
        "consecutive_min_scale_skips": 0,
    }


def _provenance(checkpoint: DeepSpeedCheckpoint) -> dict[str, Any]:
    """What the ds_strategy checkpoint cannot hold in its own terms: kept under ``extra["deepspeed"]``."""
    scaler = checkpoint.loss_scaler or {}
    settings = (
        {
            "loss_scale_window": scaler.get("scale_window"),
            "hysteresis": scaler.get("delayed_shift"),
            "min_loss_scale": scaler.get("min_scale"),
            "consecutive_hysteresis": scaler.get("consecutive_hysteresis"),
        }
        if scaler
        else None
    )
    return {
        "source": str(checkpoint.directory),
        "stage": checkpoint.stage,
        "world_size": checkpoint.world_size,
        "optimizer": checkpoint.optimizer_name,
        **checkpoint.counters,
        "loss_scaler": settings,
        "precision": _precision(checkpoint.ds_config),
        "lr_scheduler": checkpoint.lr_scheduler,
        "client_state": checkpoint.client_state,
    }


def _precision(ds_config: dict[str, Any]) -> str:
    """The ds_strategy precision matching the DeepSpeed config's (see [Resuming an imported checkpoint ...])."""
    enabled = {key for key in ("bf16", "bfloat16", "fp16") if (ds_config.get(key) or {}).get("enabled")}
    return "bf16-mixed" if enabled & {"bf16", "bfloat16"} else "16-mixed" if "fp16" in enabled else "32-true"


def describe(checkpoint: DeepSpeedCheckpoint) -> str:
    """One paragraph for the command line: what was imported and how to resume it."""
    info = _provenance(checkpoint)
    numel = sum(t.numel() for t in checkpoint.params.values())
    lines = [
        (
            f"ZeRO-{checkpoint.stage} checkpoint of {checkpoint.world_size} rank(s), DeepSpeed "
            f"{info['ds_version']}: {len(checkpoint.params)} trainable parameters ({numel:,} elements, fp32 "
            f"master), {checkpoint.optimizer_name} state after {info['global_steps']} steps "
            f"({info['skipped_steps'] or 0} skipped for fp16 overflow)"
        ),
        (
            f"resume with precision={info['precision']!r} and torch.optim.{checkpoint.optimizer_name} over "
            f"{len(checkpoint.param_groups)} param group(s)"
        ),
    ]
    if info["loss_scaler"]:
        lines.append("loss scaler settings: " + ", ".join(f"{k}={v}" for k, v in info["loss_scaler"].items()))
    if checkpoint.lr_scheduler is not None:
        lines.append("DeepSpeed's LR scheduler state is kept in the extra state, not applied")
    return "\n".join(lines)


__all__ = ["DeepSpeedCheckpointError", "describe", "import_deepspeed", "manifest_of"]
