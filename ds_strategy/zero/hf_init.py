"""Hugging Face's own initialisation for a ``PreTrainedModel`` built on the meta device, one module at a time.

Note: [Equal to a normal Hugging Face build]
A normal build ``Model(config)`` draws random numbers in two kinds of place, and a meta build draws none:
(1) construction: every ``nn.Linear``/``nn.Embedding``/``Conv1D`` initialises itself in its constructor, values
that are overwritten later but whose draws move the generator; (2) ``post_init()`` at the end of every
``PreTrainedModel.__init__`` (nested ones included: ``GPT2LMHeadModel`` builds a ``GPT2Model``, whose own
``post_init`` runs before the LM head exists) applies ``_initialize_weights`` to each module of its subtree not yet
initialised, children before parents (transformers' ``smart_apply``), then ties weights.

So the generator state before each module's ``_init_weights`` in a normal build is fixed by everything drawn
before it. :func:`hf_initialisers` computes those states without the model's memory: it rebuilds
``type(model)(model.config)`` on the meta device under a :class:`~.rng_replay.DrawRecorder` (the construction
draws, in order), records each module's ``_init_weights`` draws by running it on that rebuilt meta model (plain
tensors of the whole model's shapes, whatever tensor parallelism or a pipeline cut did to the user's copy),
interleaves the two as ``post_init`` does (a nested model's pass right after its last construction draw), and
replays the whole sequence on scratch tensors, saving the generator state where each module's pass begins.
Materialising a module then restores its state and runs the real ``_init_weights`` on real storage, in any unit
order, and the values are those of a normal build, bitwise. A module the user's copy lacks (cut away by a
pipeline) gets no initialiser: every pass starts from its own saved state, so nothing depends on it having run.
At the end the generator is left where a normal build leaves it.

This holds for models built as ``type(model)(model.config)`` (``Model(config)``, ``from_config``), whose modules
are constructed in the order they are registered and whose ``_init_weights(module)`` writes only the module's own
subtree: every model in transformers that we tried (GPT-2, Llama, Mixtral). Values equal a normal build on the
device the flat buffers live on (CPU here; on CUDA, a build under ``torch.device("cuda")``). Tied weights (the
model's ``all_tied_weights_keys``) are initialised into a scratch tensor standing in for the tied target, as a
normal build initialises the untied target before ``tie_weights()`` replaces it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .rng_replay import Draw, DrawRecorder, generator_state, set_generator_state


@dataclass(frozen=True)
class Initialiser:
    """One call that fills tensors of ``module`` (its own, and possibly its children's) in place."""

    module: nn.Module
    run: Callable[[], None]
    whole_subtree: bool = False  # it initialises every tensor under ``module`` (reset_parameters of a composite)


def is_hf_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (checked without importing transformers when it is not loaded)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def outermost_hf_models(root: nn.Module) -> list[nn.Module]:
    """``root`` itself if it is a ``PreTrainedModel``, else the outermost ones below it (a LightningModule's
    ``self.model``), in module order."""
    if is_hf_model(root):
        return [root]
    return [model for child in root.children() for model in outermost_hf_models(child)]


@dataclass(frozen=True)
class _Pass:
    """One module's ``_init_weights`` call in a normal build: whose method applies, and what it draws."""

    name: str
    owner_name: str
    draws: list[Draw]


def hf_initialisers(model: nn.Module, device: torch.device) -> tuple[list[Initialiser], torch.Tensor]:
    """Initialisers for every module of ``model`` in ``post_init`` order, each starting from the generator
    state a normal build has there, and the state a normal build ends in (restore it after the last one)."""
    construction, owner_index, rebuilt = _construction_draws(model)
    passes = _init_passes(rebuilt)
    names = [name for name, _ in rebuilt.named_modules(remove_duplicate=False)]
    index = {name: i for i, name in enumerate(names)}
    sequence: list[Draw | _Pass] = list(construction)
    for owner_name, segment in reversed(_segments(rebuilt, passes)):  # later insertions first keeps positions valid
        last = _subtree_end(names, index[owner_name], owner_name)
        at = max((i + 1 for i, owner in enumerate(owner_index) if owner <= last), default=0)
        sequence[at:at] = segment
    states: dict[int, torch.Tensor] = {}
    start = generator_state(device)
    for item in sequence:
        if isinstance(item, _Pass):
            if item.draws:
                states[id(item)] = generator_state(device)
            for draw in item.draws:
                draw.replay(device)
        else:
            item.replay(device)
    final = generator_state(device)
    set_generator_state(device, start)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    present = dict(model.named_modules(remove_duplicate=False))
    return [
        Initialiser(
            present[p.name], _runner(p, present[p.name], present[p.owner_name], states.get(id(p)), tied, device)
        )
        for p in sequence
        if isinstance(p, _Pass) and p.name in present
    ], final


def _construction_draws(model: nn.Module) -> tuple[list[Draw], list[int], nn.Module]:
    """The draws of ``type(model)(config)`` in order, for each the module-order index of the module that owns
    the tensor it writes, and that rebuilt model (on meta). A tied target that ``tie_weights()`` replaced is found
    by its shape among the tied targets; a factory's draw (or an ambiguous one) inherits the previous draw's owner."""
    recorder = DrawRecorder()
    with torch.device("meta"), recorder:
        rebuilt = type(model)(copy.deepcopy(model.config))
    owner_of = {}
    for i, (_, module) in enumerate(rebuilt.named_modules(remove_duplicate=False)):
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                owner_of.setdefault(id(tensor), i)
    index = {name: i for i, (name, _) in enumerate(rebuilt.named_modules(remove_duplicate=False))}
    replaced = [
        (index[name.rpartition(".")[0]], rebuilt.get_parameter(name).shape)
        for name in getattr(rebuilt, "all_tied_weights_keys", {}) or {}
    ]
    owners, previous = [], 0
    for draw in recorder.draws:
        if draw.target is not None and id(draw.target) in owner_of:
            previous = owner_of[id(draw.target)]
        elif draw.target is not None:  # a tied target, replaced by tie_weights(): its module, found by shape
            matches = [i for i, (owner, shape) in enumerate(replaced) if shape == draw.target.shape]
            previous = replaced.pop(matches[0])[0] if len(matches) == 1 else previous
        owners.append(previous)
    return recorder.draws, owners, rebuilt


def _init_passes(model: nn.Module) -> dict[str, _Pass]:
    """Each module's ``_init_weights`` pass by module name, its draws recorded on the meta model (no values)."""
    transformers = sys.modules["transformers"]
    passes: dict[str, _Pass] = {}

    def visit(prefix: str, module: nn.Module, owner: tuple[str, nn.Module]) -> None:
        for name, child in module.named_children():
            child_owner = (prefix + name, child) if isinstance(child, transformers.PreTrainedModel) else owner
            visit(f"{prefix}{name}.", child, child_owner)
        recorder = DrawRecorder()
        with torch.no_grad(), recorder:
            owner[1]._init_weights(module)
        passes[prefix.rstrip(".")] = _Pass(prefix.rstrip("."), owner[0], recorder.draws)

    visit("", model, ("", model))
    return passes


def _segments(model: nn.Module, passes: dict[str, _Pass]) -> list[tuple[str, list[_Pass]]]:
    """(model name, its post_init pass in smart_apply order) for every nested PreTrainedModel, innermost first."""
    transformers = sys.modules["transformers"]
    segments: list[tuple[str, list[_Pass]]] = []

    def visit(prefix: str, module: nn.Module, segment: list[_Pass]) -> None:
        for name, child in module.named_children():
            if isinstance(child, transformers.PreTrainedModel):
                inner: list[_Pass] = []
                visit(f"{prefix}{name}.", child, inner)
                inner.append(passes[f"{prefix}{name}"])
                segments.append((f"{prefix}{name}", inner))
            else:
                visit(f"{prefix}{name}.", child, segment)
                segment.append(passes[f"{prefix}{name}"])

    root: list[_Pass] = []
    visit("", model, root)
    root.append(passes[""])
    return [*segments, ("", root)]


def _subtree_end(names: list[str], start: int, name: str) -> int:
    """Module-order index of the last module inside the subtree named ``name`` (which starts at ``start``)."""
    end = start
    while end + 1 < len(names) and (not name or names[end + 1].startswith(name + ".")):
        end += 1
    return end


def _runner(
    item: _Pass,
    module: nn.Module,
    owner: nn.Module,
    state: torch.Tensor | None,
    tied: set[str],
    device: torch.device,
) -> Callable[[], None]:
    """``owner._init_weights(module)`` from ``state``: ``item``'s pass on the user's modules."""
    prefix = f"{item.name}." if item.name else ""
    tied_here = [n for n, p in module._parameters.items() if p is not None and prefix + n in tied]

    def run() -> None:
        if state is not None:
            set_generator_state(device, state)
        real = {n: module._parameters[n] for n in tied_here}
        try:
            for n, p in real.items():  # a normal build initialises the target before tie_weights() replaces it
                module._parameters[n] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
            with torch.no_grad():
                owner._init_weights(module)
        finally:
            module._parameters.update(real)

    return run
