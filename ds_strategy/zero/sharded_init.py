"""Materialise a model built on the meta device one unit at a time, keeping only this rank's shards.

Initialisers, in order of precedence: the user's ``param_init_fn(module)`` (FSDP's name), called once per module
that owns parameters or buffers, in module order; Hugging Face's own ``_init_weights`` for a ``PreTrainedModel``
(see :mod:`.hf_init`, which makes the values equal a normal build); or each module's ``reset_parameters()``.

Note: [Sharded materialisation]
Each unit's full buffer exists from the first initialiser that writes it until the last; then rank 0's values are
broadcast (so ranks agree even without a common seed), the rank keeps its shard and the buffer is freed. Peak
memory is therefore about the units whose initialisers are interleaved (usually one, plus the root) above the
shards, never the full model. Buffers and frozen parameters, which every rank keeps whole, get storage right
before the first initialiser whose module contains them. An initialiser must fill tensors in place; one that
gives a parameter new storage (``module.to_empty(...)``) has its values copied back into the flat buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..parallel.dtensor_params import local_tensor, point_param_at
from .hf_init import Initialiser, hf_initialisers, outermost_hf_models
from .rng_replay import set_generator_state
from .unit import Unit


def reset_parameters_initialisers(
    root: nn.Module, units: list[Unit], skip: tuple[nn.Module, ...] = ()
) -> list[Initialiser]:
    """In module order, the outermost modules below the root whose ``reset_parameters`` initialises parameters
    of exactly one unit, skipping modules whose parameters are already covered (a tied LM head whose weight the
    embedding already initialised) and the subtrees in ``skip`` (initialised otherwise)."""
    unit_of = _unit_of(units)
    covered = {id(p) for module in skip for p in module.parameters()}
    plan: list[Initialiser] = []

    def visit(module: nn.Module) -> None:
        if any(module is s for s in skip):
            return
        params = [p for p in module.parameters() if id(p) in unit_of]
        owners = {id(unit_of[id(p)]) for p in params}
        if module is not root and callable(getattr(module, "reset_parameters", None)) and len(owners) == 1:
            if any(id(p) not in covered for p in params):
                plan.append(Initialiser(module, module.reset_parameters, whole_subtree=True))
                covered.update(id(p) for p in params)
            return
        for child in module.children():
            visit(child)

    visit(root)
    missing = [name for name, p in root.named_parameters() if id(p) in unit_of and id(p) not in covered]
    if missing:
        raise ValueError(
            f"cannot materialise parameters built on the meta device: no module with "
            f"reset_parameters() initialises {missing[:5]}{' ...' if len(missing) > 5 else ''}. "
            f"Give their modules a reset_parameters() method, pass param_init_fn, or build the "
            f"model normally."
        )
    return plan


def param_init_fn_initialisers(root: nn.Module, param_init_fn: Callable[[nn.Module], None]) -> list[Initialiser]:
    """``param_init_fn(module)`` for every module owning parameters or buffers itself, in module order."""
    return [
        Initialiser(module, lambda module=module: param_init_fn(module))
        for module in root.modules()
        if any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])
    ]


def materialise_sharded(
    root: nn.Module,
    units: list[Unit],
    broadcast,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> None:
    """Run the initialisers unit by unit; ``broadcast(tensor)`` makes every rank hold rank 0's values."""
    final_rng_state = None
    if param_init_fn is not None:
        plan = param_init_fn_initialisers(root, param_init_fn)
    else:
        plan, final_rng_state = _hf_initialisers(root, device)
        plan += reset_parameters_initialisers(root, units, skip=tuple(outermost_hf_models(root)))
    unit_of = _unit_of(units)
    needs = [_units_written(init.module, unit_of) for init in plan]
    remaining = {id(u): sum(1 for needed in needs for v in needed if v is u) for u in units}
    unused = [u.name for u in units if u.flat_params and not remaining[id(u)]]
    if unused:
        raise ValueError(f"cannot materialise units {unused} built on the meta device: no initialiser writes them")
    started: set[int] = set()
    for init, needed in zip(plan, needs):
        for unit in needed:
            if id(unit) not in started:
                started.add(id(unit))
                for fp in unit.flat_params:
                    fp.adopt_meta_params()
        give_loose_tensors_storage(init.module, device, init.whole_subtree)
        init.run()
        for unit in needed:
            for fp in unit.flat_params:
                _repoint(fp)
            remaining[id(unit)] -= 1
            if remaining[id(unit)] == 0:
                for fp in unit.flat_params:
                    broadcast(fp.full)
                    fp.finish_sharding()
    if final_rng_state is not None:
        set_generator_state(device, final_rng_state)
    still_meta = [name for name, t in [*root.named_buffers(), *root.named_parameters()] if t.is_meta]
    if still_meta:
        raise ValueError(
            f"no initialiser gave storage to {still_meta[:5]}{' ...' if len(still_meta) > 5 else ''} "
            f"(built on the meta device); create them on a real device or pass param_init_fn"
        )


def _hf_initialisers(root: nn.Module, device: torch.device) -> tuple[list[Initialiser], torch.Tensor | None]:
    """Hugging Face's initialisers for each outermost ``PreTrainedModel`` in turn, each replayed from where a
    normal build of the previous one leaves the generator; and where the last one leaves it."""
    plan: list[Initialiser] = []
    final = None
    for model in outermost_hf_models(root):
        if final is not None:
            set_generator_state(device, final)
        initialisers, final = hf_initialisers(model, device)
        plan += initialisers
    return plan, final


def give_loose_tensors_storage(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Uninitialised storage on ``device`` for the meta buffers and frozen parameters of ``module`` (and with
    ``recurse`` its submodules): tensors every rank keeps whole, outside the flat buffers. ``swap_tensors`` keeps
    each Parameter object, so ties hold."""
    for sub in module.modules() if recurse else (module,):
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device=device)
        for p in sub._parameters.values():
            if p is not None and p.is_meta and not p.requires_grad:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=False))


def _unit_of(units: list[Unit]) -> dict[int, Unit]:
    return {id(p): u for u in units for fp in u.flat_params for p in fp.params}


def _units_written(module: nn.Module, unit_of: dict[int, Unit]) -> list[Unit]:
    """The units an initialiser of ``module`` may write: those holding its parameters, when they are one unit
    (an initialiser may reach into children, as GPT-2's does for ``c_proj``); else those of its own parameters."""
    owners = {id(unit_of[id(p)]): unit_of[id(p)] for p in module.parameters() if id(p) in unit_of}
    if len(owners) > 1:
        owners = {id(unit_of[id(p)]): unit_of[id(p)] for p in module.parameters(recurse=False) if id(p) in unit_of}
    return list(owners.values())


def _repoint(fp) -> None:
    """Copy back a parameter an initialiser gave new storage, and point it at its flat buffer again."""
    for p, view in zip(fp.params, fp.param_views()):
        local = local_tensor(p)
        if local.data_ptr() != view.data_ptr():
            view.copy_(local.reshape(view.shape))
            point_param_at(p, view)
