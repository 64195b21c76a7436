"""Reading a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, any data-parallel world size) into whole tensors per
parameter name, without DeepSpeed installed.

Note: [DeepSpeed ZeRO checkpoint layouts]
``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag, ``global_stepN`` by default) and ``dir/<tag>/``.
In that folder every file is a ``torch.save`` pickle; the ones read here are:

* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (one): ``module`` (the full ``state_dict`` in the compute dtype,
  which also gives the names' order and the buffers), ``buffer_names``, ``param_shapes`` (one ordered
  ``{name: shape}`` per optimizer param group, in flat-buffer order), ``shared_params`` (``{tied name: name
  holding the data}``), frozen parameters (``frozen_param_shapes`` / ``frozen_param_fragments``, stage 2 only;
  at stage 1 they are only in ``module``), ``global_steps``, ``skipped_steps``, ``lr_scheduler``, the
  ``ds_config`` dict, and any ``client_state`` keys. And ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``,
  one per data-parallel rank ``r``, whose ``optimizer_state_dict`` holds ``single_partition_of_fp32_groups``
  (rank ``r``'s contiguous slice of each param group's flat fp32 master, the trailing padding already cut off),
  ``group_paddings`` (that padding per group, nonzero only on the last ranks), ``param_alignment_paddings``
  (zeros DeepSpeed inserts after a parameter inside the flat buffer; newer versions), ``partition_count``,
  ``loss_scaler`` (a pickled DeepSpeed ``LossScaler``/``DynamicLossScaler``), and ``base_optimizer_state``:
  the torch optimizer's ``state_dict`` over the flat slices, *with* the padding (``elastic_checkpoint`` saves
  per-group states without it and no param groups instead; refused, having no hyperparameters to restore).
  Concatenating the ranks' slices of group ``g`` gives the flat buffer; ``param_shapes[g]`` cuts it.
* ZeRO-3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (``module`` holds empty placeholders for
  partitioned parameters; the rest as above, frozen fragments being rank ``r``'s partition) and the optim files,
  whose ``optimizer_state_dict`` holds ``fp32_flat_groups`` (one flat tensor per sub-group) and
  ``optimizer_state_dict`` (the torch optimizer's ``state_dict`` over those sub-groups; its ``param_groups[g]
  ["params"]`` lists the sub-groups of param group ``g``). Each parameter is partitioned on its own: rank ``r``
  holds elements ``[r * p, (r + 1) * p)`` of the parameter padded to ``p * world_size`` (``p = ceil(numel /
  world_size)``), and a rank's sub-group is its partitions of the sub-group's parameters, in ``param_shapes``
  order, concatenated; optimizer states are laid out the same.

Not read (refused with a message naming the file): tensor-parallel (``mp_rank_01``...), pipeline
(``layer_NN-model_...``) and expert-parallel (``expp_rank_``) files, ZeRO stage 0, and optimizers other than
Adam/AdamW. The pickles name DeepSpeed classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``); they are
unpickled as :class:`DeepSpeedObject` stand-ins that keep their attributes, which is all that is read from them.
"""

from __future__ import annotations

import math
import pickle
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

ADAM_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
ADAM_OPTIMIZER_NAMES = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam", "torch_adam"}
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


class DeepSpeedCheckpointError(ValueError):
    """A path that is not a DeepSpeed ZeRO checkpoint this reader handles; the message names the file and what
    was expected."""


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """Everything a ZeRO checkpoint holds for resuming, as whole tensors by ``state_dict`` name.

    ``names`` is the module's ``state_dict`` order. ``params`` are the trainable parameters' fp32 master values
    and ``groups`` their optimizer param group; ``aliases`` maps a tied name to the name holding its data.
    ``optimizer_state`` gives each trainable parameter's ``exp_avg`` and ``exp_avg_sq`` (shaped like it; also
    ``max_exp_avg_sq`` under amsgrad) and ``step`` (a 0-d float tensor); it is empty for every parameter when no
    optimizer step had been applied yet (a fresh optimizer, as in torch). ``param_groups`` are the optimizer's
    hyperparameters in ``torch.optim.Adam``/``AdamW`` form, without ``params``. ``loss_scaler`` is the DeepSpeed
    scaler's attributes (``cur_scale``, ``cur_iter``, ...), ``None`` unless the run was fp16.
    """

    directory: Path
    stage: int
    world_size: int
    names: list[str]
    params: dict[str, torch.Tensor]
    groups: dict[str, int]
    aliases: dict[str, str]
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    param_groups: list[dict[str, Any]]
    optimizer_name: str
    loss_scaler: dict[str, Any] | None
    counters: dict[str, Any] = field(default_factory=dict)
    lr_scheduler: Any = None
    client_state: dict[str, Any] = field(default_factory=dict)
    ds_config: dict[str, Any] = field(default_factory=dict)


# -- unpickling without DeepSpeed -----------------------------------------------------------------------------
class DeepSpeedObject:
    """Stand-in for a DeepSpeed class named in a checkpoint pickle: keeps constructor arguments (``args``; an
    enum's value is ``args[0]``) and the pickled attributes, readable as attributes."""

    def __init__(self, *args, **kwargs):
        self.__dict__["args"] = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    @property
    def value(self):
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<DeepSpeed {type(self).__qualname__} {self.__dict__}>"


class _Unpickler(pickle.Unpickler):
    """Unpickles ``deepspeed.*`` classes as :class:`DeepSpeedObject` subclasses of the same name."""

    _stand_ins: ClassVar[dict[tuple[str, str], type]] = {}

    def find_class(self, module: str, name: str):
        if module == "deepspeed" or module.startswith("deepspeed."):
            key = (module, name)
            if key not in self._stand_ins:
                self._stand_ins[key] = type(name, (DeepSpeedObject,), {"__module__": module})
            return self._stand_ins[key]
        return super().find_class(module, name)


_PICKLE_MODULE = types.SimpleNamespace(
    Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(), __name__="ds_strategy_deepspeed_pickle"
)


def load_file(path: Path) -> dict[str, Any]:
    """``torch.load`` of one DeepSpeed checkpoint file on the CPU, DeepSpeed classes replaced by stand-ins."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE_MODULE)
    except Exception as error:
        raise DeepSpeedCheckpointError(f"{path} cannot be read as a DeepSpeed checkpoint file: {error}") from error
    if not isinstance(loaded, dict):
        raise DeepSpeedCheckpointError(f"{path} holds a {type(loaded).__name__}, not a DeepSpeed checkpoint dict")
    return loaded


# -- locating the files ---------------------------------------------------------------------------------------
def resolve_tag_directory(path: str | Path, tag: str | None = None) -> Path:
    """The folder holding the rank files: ``path/tag``, ``path/<contents of path/latest>``, or ``path`` itself."""
    path = Path(path)
    if not path.is_dir():
        raise DeepSpeedCheckpointError(
            f"{path}: no such directory (expected a DeepSpeed checkpoint directory "
            f"holding a 'latest' file, or its global_stepN folder)"
        )
    if tag is None and not any(path.glob("*_model_states.pt")) and (path / "latest").is_file():
        tag = (path / "latest").read_text().strip()
    where = path / tag if tag is not None else path
    if not where.is_dir():
        raise DeepSpeedCheckpointError(
            f"{where}: no such checkpoint tag folder (named by {path / 'latest'})"
            if tag is not None
            else f"{where}: no such directory"
        )
    return where


def _rank_files(where: Path) -> tuple[list[Path], list[Path]]:
    """(model state files, optim state files), each in data-parallel rank order; refuses parallelism we do not
    read and a missing or duplicated rank."""
    files = sorted(p.name for p in where.iterdir() if p.is_file() and p.suffix == ".pt")
    for name in files:
        if name.startswith("expp_rank_") or "_expert_" in name:
            raise DeepSpeedCheckpointError(
                f"{where / name} is a mixture-of-experts file: expert-parallel checkpoints cannot be imported"
            )
        if name.startswith("layer_"):
            raise DeepSpeedCheckpointError(
                f"{where / name} is a pipeline-parallel layer file: checkpoints of "
                f"DeepSpeed's PipelineEngine cannot be imported (only data-parallel ZeRO)"
            )
        match = _OPTIM_FILE.match(name) or _MODEL_FILE.match(name)
        if match and int(match.group(2)) != 0:
            raise DeepSpeedCheckpointError(
                f"{where / name} is a tensor-parallel (model-parallel rank "
                f"{int(match.group(2))}) file: only checkpoints saved with one model-"
                f"parallel rank (mp_rank_00) can be imported"
            )
    optim = {int(m.group(1)): where / n for n in files if (m := _OPTIM_FILE.match(n))}
    model = {int(m.group(1) or 0): where / n for n in files if (m := _MODEL_FILE.match(n))}
    if not model:
        raise DeepSpeedCheckpointError(
            f"{where} is not a DeepSpeed checkpoint: it has no mp_rank_00_model_states.pt"
            f" (ZeRO-1/2) or zero_pp_rank_<r>_mp_rank_00_model_states.pt (ZeRO-3)"
        )
    if not optim:
        raise DeepSpeedCheckpointError(
            f"{where} has no zero_pp_rank_<r>_mp_rank_00_optim_states.pt files: "
            f"DeepSpeed writes them for ZeRO stage 1, 2 or 3; a checkpoint without ZeRO "
            f"(stage 0) cannot be imported"
        )
    for kind, found in (("optim", optim), ("model", model)):
        if len(found) > 1 and sorted(found) != list(range(len(found))):
            missing = sorted(set(range(max(found) + 1)) - set(found))
            raise DeepSpeedCheckpointError(
                f"{where}: the {kind} state files of data-parallel rank(s) {missing} "
                f"are missing (found ranks {sorted(found)})"
            )
    return [model[r] for r in sorted(model)], [optim[r] for r in sorted(optim)]


# -- reading --------------------------------------------------------------------------------------------------
def read_checkpoint(path: str | Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read the ZeRO checkpoint at ``path`` (a save directory with ``latest``, or its tag folder)."""
    where = resolve_tag_directory(path, tag)
    model_files, optim_files = _rank_files(where)
    model_states = [load_file(f) for f in model_files]
    optim_states = [_zero_state(load_file(f), f) for f in optim_files]
    first, first_optim = model_states[0], optim_states[0]
    for key in ("module", "param_shapes"):
        if first.get(key) is None:
            raise DeepSpeedCheckpointError(f"{model_files[0]} has no {key!r}: not a ZeRO model state file")
    stage = _stage(first_optim, optim_files[0])
    world_size = _world_size(first_optim, optim_files, stage)
    if stage == 3 and len(model_files) != world_size:
        raise DeepSpeedCheckpointError(
            f"{where}: ZeRO-3 writes one model state file per rank; found {len(model_files)} for {world_size} ranks"
        )
    shapes = [dict(group) for group in first["param_shapes"]]
    name = _optimizer_name(first.get("ds_config"), optim_states[0], optim_files[0])
    if stage <= 2:
        params, optimizer_state, group_of, torch_groups = _read_zero12(optim_states, optim_files, shapes)
    else:
        params, optimizer_state, group_of, torch_groups = _read_zero3(optim_states, optim_files, shapes)
    buffer_names = set(first.get("buffer_names") or [])
    aliases = dict(first.get("shared_params") or {})
    module = first["module"]
    buffers = {n: t.detach().clone() for n, t in module.items() if n in buffer_names}
    frozen = _frozen(model_states, module, set(params) | buffer_names | set(aliases), world_size, stage)
    counters = {key: first.get(key) for key in ("global_steps", "global_samples", "skipped_steps")}
    known = {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
    }
    return DeepSpeedCheckpoint(
        directory=where,
        stage=stage,
        world_size=world_size,
        names=list(module),
        params=params,
        groups=group_of,
        aliases=aliases,
        buffers=buffers,
        frozen=frozen,
        optimizer_state=optimizer_state,
        param_groups=[_torch_adam_group(g, name, optim_files[0]) for g in torch_groups],
        optimizer_name=name,
        loss_scaler=_loss_scaler(first_optim.get("loss_scaler")),
        counters={**counters, "ds_version": first.get("ds_version")},
        lr_scheduler=first.get("lr_scheduler"),
        client_state={k: v for k, v in first.items() if k not in known},
        ds_config=first.get("ds_config") if isinstance(first.get("ds_config"), dict) else {},
    )


def _zero_state(loaded: dict[str, Any], path: Path) -> dict[str, Any]:
    state = loaded.get("optimizer_state_dict")
    if not isinstance(state, dict) or "zero_stage" not in state:
        raise DeepSpeedCheckpointError(
            f"{path} is not a ZeRO optimizer state file: it has no optimizer_state_dict['zero_stage']"
        )
    return state


def _stage(state: dict[str, Any], path: Path) -> int:
    stage = state["zero_stage"]
    stage = int(stage.value if isinstance(stage, DeepSpeedObject) else stage)
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(f"{path} was saved at ZeRO stage {stage}; stages 1, 2 and 3 can be imported")
    return stage


def _world_size(state: dict[str, Any], files: list[Path], stage: int) -> int:
    count = state.get("partition_count")
    count = max(count) if isinstance(count, (list, tuple)) else int(count)
    if count != len(files):
        raise DeepSpeedCheckpointError(
            f"{files[0].parent}: the checkpoint was saved by {count} data-parallel ranks "
            f"but has {len(files)} *_optim_states.pt files; one file per rank is needed"
        )
    return count


def _optimizer_name(ds_config: Any, state: dict[str, Any], path: Path) -> str:
    """ "Adam" or "AdamW"; raises unless the state is an Adam family optimizer's."""
    torch_state = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
    per_param = torch_state if isinstance(torch_state, list) else (torch_state or {}).get("state", {}).values()
    keys = set().union(*(set(s) for s in per_param)) if per_param else set()
    configured = ((ds_config or {}).get("optimizer") or {}) if isinstance(ds_config, dict) else {}
    kind = str(configured.get("type", "")).lower().replace("_", "")
    if kind and kind not in ADAM_OPTIMIZER_NAMES:
        raise DeepSpeedCheckpointError(
            f"{path}: the DeepSpeed config's optimizer is {configured.get('type')!r}; only "
            f"Adam and AdamW checkpoints can be imported"
        )
    if keys and not ({"exp_avg", "exp_avg_sq"} <= keys <= ADAM_STATE_KEYS):
        raise DeepSpeedCheckpointError(
            f"{path}: the optimizer state has keys {sorted(keys)}, not Adam's "
            f"{sorted(ADAM_STATE_KEYS - {'max_exp_avg_sq'})}: only Adam and AdamW "
            f"checkpoints can be imported"
        )
    groups = torch_state.get("param_groups", []) if isinstance(torch_state, dict) else []
    lamb_like = [key for group in groups for key in ("max_coeff", "min_coeff", "lr_decay", "momentum") if key in group]
    if lamb_like:
        raise DeepSpeedCheckpointError(
            f"{path}: the optimizer's param groups have {sorted(set(lamb_like))}, which "
            f"Adam's do not: only Adam and AdamW checkpoints can be imported"
        )
    decoupled = groups[0].get("decoupled_weight_decay") if groups else None
    if decoupled is None:  # DeepSpeed's FusedAdam / CPUAdam: AdamW unless adam_w_mode is off or the type says AdamW
        params = configured.get("params") or {}
        decoupled = kind == "adamw" or bool(params.get("adam_w_mode", True))
    return "AdamW" if decoupled else "Adam"


def _torch_adam_group(group: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    """A param group as ``torch.optim.Adam``/``AdamW`` writes it (their ``load_state_dict`` takes the saved group
    whole, so every key must be there: a missing ``decoupled_weight_decay`` would turn AdamW into Adam)."""
    if group.get("bias_correction", True) is False:
        raise DeepSpeedCheckpointError(
            f"{path}: the optimizer ran without bias correction, which torch's Adam cannot reproduce"
        )
    torch_group = {
        "lr": group["lr"],
        "betas": tuple(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "amsgrad": bool(group.get("amsgrad", False)),
        "maximize": bool(group.get("maximize", False)),
        "foreach": group.get("foreach"),
        "capturable": bool(group.get("capturable", False)),
        "differentiable": bool(group.get("differentiable", False)),
        "fused": group.get("fused"),
        "decoupled_weight_decay": name == "AdamW",
    }
    extra = {k: v for k, v in group.items() if k not in torch_group and k not in ("params", "step", "bias_correction")}
    return {**extra, **torch_group}


def _read_zero12(states: list[dict], files: list[Path], shapes: list[dict[str, torch.Size]]):
    """Concatenate each group's rank slices (fp32 master and moments) and cut them by ``param_shapes``."""
    params, optimizer_state, group_of = {}, {}, {}
    first = states[0]["base_optimizer_state"]
    if isinstance(first, list):  # elastic checkpoint: lean states and the step, no hyperparameters
        raise DeepSpeedCheckpointError(
            f"{files[0]} is an elastic ZeRO checkpoint (zero_optimization."
            f"elastic_checkpoint), which does not record the optimizer's param groups; "
            f"save it again with elastic_checkpoint off to import it"
        )
    torch_groups = first["param_groups"]
    for g, group_shapes in enumerate(shapes):
        flat = torch.cat([_master_slice(s, f, "single_partition_of_fp32_groups", g) for s, f in zip(states, files)])
        moments, step = {}, None
        for state, path in zip(states, files):
            lean, step = _lean_optimizer_state(state, path, g, len(shapes))
            for key, value in lean.items():
                moments.setdefault(key, []).append(value)
        moments = {key: torch.cat(values) for key, values in moments.items()}
        if step is None:
            step = torch_groups[g].get("step")  # FusedAdam keeps it in the group
        paddings = (states[0].get("param_alignment_paddings") or [[0] * len(group_shapes)] * len(shapes))[g]
        offset = 0
        if len(paddings) != len(group_shapes):
            raise DeepSpeedCheckpointError(
                f"{files[0]}: param_alignment_paddings[{g}] has {len(paddings)} entries "
                f"for the {len(group_shapes)} parameters param_shapes lists"
            )
        for (name, shape), padding in zip(group_shapes.items(), paddings):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise DeepSpeedCheckpointError(
                    f"{files[0].parent}: group {g}'s flat buffer has {flat.numel()} "
                    f"elements, too few for the parameters param_shapes lists"
                )
            params[name] = flat.narrow(0, offset, numel).view(shape).clone()
            optimizer_state[name] = {
                key: value.narrow(0, offset, numel).view(shape).clone() for key, value in moments.items()
            }
            if moments:  # none before the first applied step (every earlier fp16 step overflowed)
                optimizer_state[name]["step"] = _step_tensor(step, files[0])
            group_of[name] = g
            offset += numel + padding
    return params, optimizer_state, group_of, torch_groups


def _master_slice(state: dict, path: Path, key: str, group: int) -> torch.Tensor:
    slices = state.get(key)
    if slices is None or group >= len(slices):
        raise DeepSpeedCheckpointError(f"{path} has no {key}[{group}]: not a ZeRO stage 1/2 optimizer state file")
    return slices[group].detach().reshape(-1).float()


def _lean_optimizer_state(state: dict, path: Path, group: int, groups: int):
    """Rank ``path``'s elementwise states of ``group`` without the trailing padding, and the group's step."""
    base = state["base_optimizer_state"]
    if len(base.get("param_groups", [])) != groups:
        raise DeepSpeedCheckpointError(
            f"{path}: the optimizer has {len(base.get('param_groups', []))} param "
            f"groups but param_shapes lists {groups}"
        )
    index = base["param_groups"][group]["params"][0]
    lean = dict(base["state"].get(index, {}))
    step = lean.pop("step", None)
    padding = state["group_paddings"][group]
    lean = {k: v.reshape(-1)[: v.numel() - padding] if torch.is_tensor(v) and v.dim() else v for k, v in lean.items()}
    return {k: v.detach().float() for k, v in lean.items()}, step


def _read_zero3(states: list[dict], files: list[Path], shapes: list[dict[str, torch.Size]]):
    """Zip every parameter's partitions across ranks (fp32 master and moments), dropping each one's padding."""
    world_size = len(states)
    torch_state = states[0]["optimizer_state_dict"]
    torch_groups = torch_state["param_groups"]
    group_of_sub = {sub: g for g, group in enumerate(torch_groups) for sub in group["params"]}
    if len(states[0]["fp32_flat_groups"]) != len(shapes):
        raise DeepSpeedCheckpointError(
            f"{files[0]}: {len(states[0]['fp32_flat_groups'])} fp32 sub-groups but param_shapes lists {len(shapes)}"
        )
    params, optimizer_state, group_of = {}, {}, {}
    for sub, group_shapes in enumerate(shapes):
        flats = {"master": [s["fp32_flat_groups"][sub].detach().reshape(-1).float() for s in states]}
        step = None
        for state in states:
            sub_state = dict(state["optimizer_state_dict"]["state"].get(sub, {}))
            step = sub_state.pop("step", torch_groups[group_of_sub[sub]].get("step"))
            for key, value in sub_state.items():
                flats.setdefault(key, []).append(value.detach().reshape(-1).float())
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)
            whole = {
                key: torch.cat([rank.narrow(0, offset, part) for rank in per_rank])[:numel].view(shape)
                for key, per_rank in flats.items()
            }
            params[name] = whole.pop("master")
            optimizer_state[name] = {**whole, "step": _step_tensor(step, files[0])} if whole else {}
            group_of[name] = group_of_sub[sub]
            offset += part
        if offset != flats["master"][0].numel():
            raise DeepSpeedCheckpointError(
                f"{files[0]}: sub-group {sub} holds {flats['master'][0].numel()} "
                f"elements per rank but its parameters' partitions need {offset}"
            )
    return params, optimizer_state, group_of, torch_groups


def _step_tensor(step: Any, path: Path) -> torch.Tensor:
    if step is None:
        raise DeepSpeedCheckpointError(f"{path}: the optimizer state has no step count")
    return (step.detach().clone() if torch.is_tensor(step) else torch.tensor(float(step))).float().reshape(())


def _frozen(
    model_states: list[dict], module: dict, known: set[str], world_size: int, stage: int
) -> dict[str, torch.Tensor]:
    """Parameters outside the optimizer: whole in ``frozen_param_fragments`` (stage 2) or ``module`` (stage 1);
    partitioned like trainable ones at stage 3."""
    shapes = model_states[0].get("frozen_param_shapes") or {}
    frozen = {}
    for name, shape in shapes.items():
        if stage == 3:
            parts = [s["frozen_param_fragments"][name].reshape(-1) for s in model_states]
            frozen[name] = torch.cat(parts)[: math.prod(shape)].view(shape).clone()
        else:
            frozen[name] = model_states[0]["frozen_param_fragments"][name].detach().clone()
    for name, tensor in module.items():
        if name not in known and name not in frozen:
            if tensor.numel() == 0 and stage == 3:
                raise DeepSpeedCheckpointError(
                    f"{name} is in the module but in no param_shapes or frozen_param_"
                    f"shapes of the checkpoint: its values were not saved"
                )
            frozen[name] = tensor.detach().clone()
    return frozen


def _loss_scaler(scaler: Any) -> dict[str, Any] | None:
    """The attributes of a DeepSpeed loss scaler; ``None`` for the static scale 1 that fp32 and bf16 runs use."""
    if scaler is None:
        return None
    attributes = {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float)) or v is None}
    if not attributes.get("dynamic", False) and float(attributes.get("cur_scale", 1.0)) == 1.0:
        return None
    return attributes
