"""Tensor-parallel plans for ``parallelize_module``: found from a model's structure, or checked from a user's dict.

``tensor_parallel_plan(model, tp_size)`` recognises attention and MLP modules by their children, not by class, so
it covers our GPT, HF GPT-2 and the Llama family (Llama, Mistral, Qwen2, Qwen3, Mixtral) and any model built the
same way. Megatron's pairing shards heads and the MLP's intermediate dimension: the projections into them are
colwise, the projections out of them rowwise, so each layer costs one all-reduce forward and one backward per
half. Embeddings and the LM head stay replicated: a vocab-parallel head needs ``loss_parallel`` in the user's
loss, so it is left to a user's plan. Every check (module names, head and intermediate counts, style names) runs
here, before any process group is touched.

Note: [Sequence parallelism and partial gradients]
    With ``sequence_parallel=True`` the residual stream between layers is sharded on the sequence dimension
    (Megatron-LM's SP): norms run on each rank's tokens (``SequenceParallel``), the input of attention and of the
    MLP is all-gathered and their output reduce-scattered instead of all-reduced. The sharding starts at the first
    layer's input (after the model has made positions and masks from the full sequence) and ends at the final
    norm's input, so what the model returns is as without SP. A norm's weight then sees only this rank's tokens,
    so its gradient is a ``Partial`` DTensor: whoever reduces gradients must sum it over the TP group before use.
    Qwen3's per-head ``q_norm``/``k_norm`` are the same case without SP: each rank normalises only its own heads.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ds_strategy.comm.collectives import Collectives
from ds_strategy.parallel.tp_styles import (
    Conv1DRowwiseParallel,
    FusedExpertsParallel,
    HiddenStatesLayout,
    LocalHeadCount,
    PackedColwiseParallel,
    is_conv1d,
)

STYLE_NAMES = ("colwise", "rowwise", "sequence_parallel", "replicate")
_GATHER_SEQUENCE = (Shard(1), Replicate())
_SHARD_SEQUENCE = (Replicate(), Shard(1))


class Replicated(ParallelStyle):
    """The ``"replicate"`` entry: the module keeps its ordinary full parameters and runs the same on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


@dataclass(frozen=True)
class _Part:
    """A recognised attention or MLP module: styles for it ('') and its children, and the counts TP must divide."""

    styles: dict[str, ParallelStyle]
    counts: dict[str, int]


def tensor_parallel_plan(
    model: nn.Module, tp_size: int, *, sequence_parallel: bool = False, plan: str | dict = "auto"
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan for ``model`` over ``tp_size`` ranks, keyed by module name or pattern.

    ``plan="auto"`` derives it from the model's structure (see the module docstring); a dict maps module names or
    fnmatch patterns (matched per dotted atom, as ``parallelize_module`` does) to a ``ParallelStyle`` or one of
    ``STYLE_NAMES``, and is returned with names resolved to styles. Raises ValueError for anything that would fail
    or silently compute the wrong thing later.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive int")
    if isinstance(plan, dict):
        if sequence_parallel:
            raise ValueError("sequence_parallel=True applies to plan='auto' only; a plan dict states its own layouts")
        return resolve_plan(model, plan)
    if plan != "auto":
        raise ValueError(f"plan={plan!r} must be 'auto' or a dict of module name -> style")
    return _auto_plan(model, tp_size, sequence_parallel)


def apply_tensor_parallel_plan(
    model: nn.Module, tp_mesh: DeviceMesh, plan: dict, collectives: Collectives | None = None
) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` by ``plan`` (as from ``tensor_parallel_plan``); returns it.

    Attribute fix-ups (GPT-2's per-rank ``split_size``) are styles in the plan, so this is ``parallelize_module``
    after the same checks as a dict plan gets. ``collectives``: the mesh's tensor-parallel ``Collectives``, through
    which the styles that issue collectives of their own (fused experts' sums) run them.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (the tensor-parallel dimension), got a {tp_mesh.ndim}-D mesh")
    resolved = resolve_plan(model, plan)
    if collectives is not None:
        resolved = {
            key: style.over(collectives) if isinstance(style, FusedExpertsParallel) else style
            for key, style in resolved.items()
        }
    return parallelize_module(model, tp_mesh, resolved)


def resolve_plan(model: nn.Module, plan: dict) -> dict[str, ParallelStyle]:
    """``plan`` with every key checked against ``model`` and every style name replaced by its style.

    A name becomes the style that fits each matched module ("colwise" on a GPT-2 ``Conv1D`` is
    ``PackedColwiseParallel``), so a pattern matching both kinds is expanded into module names.
    """
    modules = dict(model.named_modules())
    names = [name for name in modules if name]
    resolved: dict[str, ParallelStyle] = {}
    for key, value in plan.items():
        matches = [name for name in names if _matches(name, key)]
        if not matches:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            hint = f"; close names: {close}" if close else f"; module names look like {names[:3]}"
            raise ValueError(f"tensor-parallel plan key {key!r} matches no module of {type(model).__name__}{hint}")
        if isinstance(value, ParallelStyle):
            resolved[key] = value
        elif isinstance(value, str):
            by_module = {name: _named_style(value, modules[name], key) for name in matches}
            if len({type(style) for style in by_module.values()}) == 1:
                resolved[key] = by_module[matches[0]]
            else:
                resolved.update(by_module)
        else:
            raise ValueError(
                f"tensor-parallel plan value for {key!r} is a {type(value).__name__}; "
                f"allowed: a torch ParallelStyle or one of {list(STYLE_NAMES)}"
            )
    return resolved


def _matches(name: str, key: str) -> bool:
    """``parallelize_module``'s rule: each dotted atom of ``key`` fnmatches the atom of ``name`` at that depth."""
    atoms, pattern = name.split("."), key.split(".")
    return len(atoms) == len(pattern) and all(fnmatch(atom, part) for atom, part in zip(atoms, pattern))


def _named_style(name: str, module: nn.Module, key: str) -> ParallelStyle:
    conv1d = is_conv1d(module)
    if name == "colwise":
        return PackedColwiseParallel() if conv1d else ColwiseParallel()
    if name == "rowwise":
        return Conv1DRowwiseParallel() if conv1d else RowwiseParallel()
    if name == "sequence_parallel":
        return SequenceParallel()
    if name == "replicate":
        return Replicated()
    raise ValueError(f"tensor-parallel plan style {name!r} for {key!r} is unknown; allowed: {list(STYLE_NAMES)}")


def _auto_plan(model: nn.Module, tp_size: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for every recognised attention and MLP, then the sequence-parallel boundaries if asked for."""
    plan: dict[str, ParallelStyle] = {}
    counts: list[tuple[str, str, int]] = []
    attention_names = []
    for name, module in model.named_modules():
        for kind, recognise in _RECOGNISERS:
            part = recognise(module, sequence_parallel)
            if part is None:
                continue
            if kind == "attention":
                attention_names.append(name)
            plan.update({_join(name, child): style for child, style in part.styles.items()})
            counts.extend((name, what, count) for what, count in part.counts.items())
            break
    if not attention_names:
        raise ValueError(
            f"plan='auto' does not recognise the attention modules of {type(model).__name__}; pass plan= a dict "
            f"of module name -> style (one of {list(STYLE_NAMES)} or a torch ParallelStyle)"
        )
    _check_counts(counts, tp_size)
    if sequence_parallel:
        plan.update(_sequence_parallel_boundaries(model, attention_names))
    return plan


def _check_counts(counts: list[tuple[str, str, int]], tp_size: int) -> None:
    allowed = _divisors(math.gcd(*(count for _, _, count in counts)))
    for name, what, count in counts:
        if count % tp_size:
            raise ValueError(
                f"tp_size={tp_size} does not divide {what}={count} of {name!r}; allowed tp sizes: {allowed}"
            )


def _divisors(value: int) -> list[int]:
    return [size for size in range(1, value + 1) if value % size == 0]


def _join(prefix: str, child: str) -> str:
    return ".".join(part for part in (prefix, child) if part)


def _has_children(module: nn.Module, *names: str, kind: Callable[[nn.Module], bool]) -> bool:
    return all(kind(getattr(module, name, None)) for name in names)


def _linear(module) -> bool:
    return isinstance(module, nn.Linear)


def _hf_attention(module: nn.Module, sp: bool) -> _Part | None:
    """Llama, Mistral, Qwen2/3, Mixtral: separate q/k/v/o projections, shapes from ``head_dim`` and ``-1``."""
    if not (
        _has_children(module, "q_proj", "k_proj", "v_proj", "o_proj", kind=_linear) and hasattr(module, "head_dim")
    ):
        return None
    styles: dict[str, ParallelStyle] = {
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
    }
    if sp:
        styles[""] = HiddenStatesLayout(_GATHER_SEQUENCE)
    for norm in ("q_norm", "k_norm"):  # per-head norms (Qwen3) on (batch, seq, heads, head_dim): heads are dim 2
        if isinstance(getattr(module, norm, None), nn.Module):
            styles[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    head_dim = module.head_dim
    counts = {
        "num_attention_heads": module.q_proj.out_features // head_dim,
        "num_key_value_heads": module.k_proj.out_features // head_dim,
    }
    return _Part(styles, counts)


def _gpt_attention(module: nn.Module, sp: bool) -> _Part | None:
    """Our GPT (Linear) and HF GPT-2 (Conv1D): one packed q|k|v projection ``c_attn`` and ``c_proj``."""
    conv1d = _has_children(module, "c_attn", "c_proj", kind=is_conv1d)
    if not (conv1d or _has_children(module, "c_attn", "c_proj", kind=_linear)) or hasattr(module, "q_attn"):
        return None
    heads_attribute = "num_heads" if conv1d else "n_head"
    if not hasattr(module, heads_attribute):
        return None
    rowwise = Conv1DRowwiseParallel if conv1d else RowwiseParallel
    styles: dict[str, ParallelStyle] = {
        "c_attn": PackedColwiseParallel(packs=3, input_layouts=Shard(1) if sp else None),
        "c_proj": rowwise(output_layouts=Shard(1) if sp else Replicate()),
    }
    if conv1d:  # GPT-2 splits c_attn's output by split_size, the global width of q
        styles[""] = LocalHeadCount("split_size", "num_heads")
    return _Part(styles, {heads_attribute: getattr(module, heads_attribute)})


def _gated_mlp(module: nn.Module, sp: bool) -> _Part | None:
    """The Llama family's SwiGLU MLP."""
    if not _has_children(module, "gate_proj", "up_proj", "down_proj", kind=_linear):
        return None
    styles: dict[str, ParallelStyle] = {
        "gate_proj": ColwiseParallel(),
        "up_proj": ColwiseParallel(),
        "down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
    }
    if sp:
        styles[""] = HiddenStatesLayout(_GATHER_SEQUENCE)
    return _Part(styles, {"intermediate_size": module.gate_proj.out_features})


def _gpt_mlp(module: nn.Module, sp: bool) -> _Part | None:
    """Our GPT's and GPT-2's MLP: ``c_fc`` then ``c_proj``."""
    conv1d = _has_children(module, "c_fc", "c_proj", kind=is_conv1d)
    if not (conv1d or _has_children(module, "c_fc", "c_proj", kind=_linear)):
        return None
    styles: dict[str, ParallelStyle] = {
        "c_fc": PackedColwiseParallel(input_layouts=Shard(1) if sp else None),
        "c_proj": (Conv1DRowwiseParallel if conv1d else RowwiseParallel)(
            output_layouts=Shard(1) if sp else Replicate()
        ),
    }
    width = module.c_fc.nf if conv1d else module.c_fc.out_features
    return _Part(styles, {"intermediate_size": width})


def _fused_experts_block(module: nn.Module, sp: bool) -> _Part | None:
    """A mixture-of-experts block whose ``experts`` hold fused 3-D ``gate_up_proj``/``down_proj`` (Mixtral)."""
    experts = getattr(module, "experts", None)
    params = dict(experts.named_parameters(recurse=False)) if isinstance(experts, nn.Module) else {}
    if set(params) != {"gate_up_proj", "down_proj"} or any(p.dim() != 3 for p in params.values()):
        return None
    styles: dict[str, ParallelStyle] = {"experts": FusedExpertsParallel()}
    if sp:
        styles[""] = HiddenStatesLayout(_GATHER_SEQUENCE, out_of=_SHARD_SEQUENCE)
    return _Part(styles, {"intermediate_size": params["down_proj"].shape[-1]})


_RECOGNISERS = (
    ("attention", _hf_attention),
    ("attention", _gpt_attention),
    ("mlp", _gated_mlp),
    ("mlp", _gpt_mlp),
    ("mlp", _fused_experts_block),
)


def _sequence_parallel_boundaries(model: nn.Module, attention_names: list[str]) -> dict[str, ParallelStyle]:
    """Shard the sequence into the first layer, run each layer's norms on shards, gather before the final norm.

    See Note: [Sequence parallelism and partial gradients].
    """
    layer_names = sorted({name.rpartition(".")[0] for name in attention_names}, key=_layer_order)
    stacks = {name.rpartition(".")[0] for name in layer_names}
    stack_name = layer_names[0].rpartition(".")[0]
    modules = dict(model.named_modules())
    if len(stacks) != 1 or not isinstance(modules.get(stack_name), nn.ModuleList):
        raise ValueError(
            f"sequence_parallel=True needs the layers in one nn.ModuleList; {type(model).__name__} has them at "
            f"{layer_names}; pass plan= a dict instead"
        )
    styles: dict[str, ParallelStyle] = {layer_names[0]: HiddenStatesLayout(_SHARD_SEQUENCE)}
    for layer in layer_names:
        for child, _ in _norms(modules[layer]):
            styles[_join(layer, child)] = SequenceParallel(use_local_output=True)
    final_norm = _final_norm(modules, stack_name)
    if final_norm is None:
        raise ValueError(
            f"sequence_parallel=True needs a norm after the layers of {type(model).__name__} (beside "
            f"{stack_name!r}) to gather the sequence at; pass plan= a dict instead"
        )
    styles[final_norm] = HiddenStatesLayout(_GATHER_SEQUENCE)
    return styles


def _layer_order(name: str) -> tuple[str, int]:
    parent, _, index = name.rpartition(".")
    return parent, int(index) if index.isdigit() else -1


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith("Norm")


def _norms(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((name, child) for name, child in layer.named_children() if _is_norm(child))


def _final_norm(modules: dict[str, nn.Module], stack_name: str) -> str | None:
    """The first norm registered after the layer stack, beside it."""
    parent_name, _, stack = stack_name.rpartition(".")
    children = list(modules[parent_name].named_children())
    after = [name for name, _ in children][[name for name, _ in children].index(stack) + 1 :]
    norm = next((name for name in after if _is_norm(modules[_join(parent_name, name)])), None)
    return None if norm is None else _join(parent_name, norm)
