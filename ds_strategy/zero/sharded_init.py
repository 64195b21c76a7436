"""Materialise a model built on the meta device one unit at a time, keeping only this rank's shards.

Initialisers, in order of precedence: the user's ``param_init_fn(module)`` (FSDP's name), called once per module
that owns parameters or buffers, in module order; Hugging Face's own ``_init_weights`` for a ``PreTrainedModel``
(see :mod:`.hf_init`, which makes the values equal a normal build); or each module's ``reset_parameters()``.

Note: [Sharded materialisation]
Each unit's full buffer exists from the first initialiser that writes it until the last; then rank 0's values are
broadcast (so ranks agree even without a common seed), the rank keeps its shard and the buffer is freed. Peak
memory is therefore about the units whose initialisers are interleaved (usually one, plus the root) above the
shards, never the full model. Buffers and frozen parameters, which every rank keeps whole, get storage right
before the first initialiser whose module contains them (an all-frozen module has one of its own: Note: [Frozen
parameters built on meta]). An initialiser must fill tensors in place; one that
gives a parameter new storage (``module.to_empty(...)``) has its values copied back into the flat buffer.

Note: [A sharded build equals a normal build]
Invariant: whatever the layout (tensor parallel with a user or automatic plan, Megatron SP, Ulysses, any pipeline
schedule including two stages per rank, times data parallel and every ZeRO stage), the values a rank keeps are its
pieces of the whole model a normal build makes under the same seed, bitwise, and the generator is left where a
normal build leaves it (Hugging Face models) or has advanced by the same draws (``reset_parameters``,
``param_init_fn``). Two things make it so. (1) Every initialiser runs on whole tensors: while a unit is being
initialised its tensor-parallel (DTensor) parameters, and under expert parallelism its experts containers' stacked
rows (of which the rank keeps its experts'), are replaced, in every module that registers them, by plain
scratch tensors of the global shape, so a random initialiser draws what it draws in a normal build (on a local
shard every tensor-parallel rank would draw the same numbers: identical halves); when the unit's last initialiser
has run, ``distribute_tensor`` keeps this rank's piece of tensor-parallel rank 0's tensor (as
``parallelize_module`` does for a normal build) and the scratch goes, so memory stays one unit, counted whole.
(2) Every initialiser of the whole model runs, in the whole model's order: the meta pieces a pipeline cut away are put
back for the duration (``ModelPart.cut_pieces``, which the engine is handed), and while an initialiser runs, the cut
tensors it writes (its module's own, or its subtree's for a ``reset_parameters`` that initialises a whole subtree) are
whole scratch tensors too, dropped right after, so the generator advances exactly as in a normal build, also across an
initialiser that writes a kept unit and a cut piece at once (our GPT's embeddings, whose weight the head on the last
stage shares). Memory: those tensors of one initialiser, at most what a normal build's initialiser touches. Hugging Face
passes restore their own recorded generator state besides (Note: [Equal to a normal Hugging Face build]), so a pass
reaching into a cut child (GPT-2's ``c_proj``) changes nothing after it. Ranks must start from the same seed, as for a
normal build (the broadcasts make data-parallel ranks agree regardless).

Note: [Values built before the meta build]
Part of a model may arrive with values: a LightningModule whose ``__init__`` built (or loaded) the backbone and whose
``configure_model`` adds a head inside the stage-3 build context, which puts only the head on meta (Note: [What the
build context moves to meta]). Those values are the user's, and no initialiser would draw them now: a unit holding
only such parameters is placed as a normally built one is (copied in, broadcast from rank 0), a unit holding some
brings them into its buffer beside the meta ones' storage, and no initialiser runs whose module's parameters all
have values, so the generator draws only for the new parameters, as it does when a single process builds them there
(its ``reset_parameters`` at construction). A Hugging Face model gets its own initialisation (Note: [Equal to a
normal Hugging Face build]) only when none of its parameters has values, since that replays a build of the whole
model; new modules in a model that has values are initialised by their ``reset_parameters``, as they were built.
Buffers and frozen parameters with values are moved to the device as they are. PEFT adapters built on meta are
refused: PEFT initialises them its own way (LoRA's ``lora_B`` at zero), which none of these reproduces.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor

from ..parallel.dtensor_params import local_tensor, point_param_at
from ..parallel.expert_parallel import expert_rows, is_expert_parallel
from .hf_init import Initialiser, hf_initialisers, outermost_hf_models
from .model_part import CutPiece
from .param_types import parameter_like
from .rng_replay import set_generator_state
from .unit import Unit


def reset_parameters_initialisers(
    root: nn.Module,
    units: list[Unit],
    skip: tuple[nn.Module, ...] = (),
    cut_away: tuple[nn.Module, ...] = (),
    valued: frozenset[int] = frozenset(),
) -> list[Initialiser]:
    """In module order, the outermost modules below the root (or the root itself when it has no children, a bare
    ``nn.Linear``) whose ``reset_parameters`` initialises parameters of at most one unit and any frozen parameters
    built on meta (Note: [Frozen parameters built on meta]), skipping modules whose
    parameters are already covered (an LM head sharing the weight the embedding already initialised) or all have
    values (their ids in ``valued``: Note: [Values built before the meta build]), and the subtrees in ``skip``
    (initialised otherwise). Parameters only the ``cut_away`` pieces hold belong to no unit: an initialiser may
    write them besides one unit, on scratch, for the generator's sake (Note: [A sharded build equals a normal
    build])."""
    unit_of: dict[int, object] = _unit_of(units, valued)
    elsewhere, loose = object(), object()
    unit_of.update({id(p): elsewhere for piece in cut_away for p in piece.parameters() if id(p) not in unit_of})
    unit_of.update({id(p): loose for p in _loose_meta_parameters(root) if id(p) not in unit_of})
    covered = {id(p) for module in skip for p in module.parameters()}
    plan: list[Initialiser] = []

    def visit(module: nn.Module) -> None:
        if any(module is s for s in skip):
            return
        params = [p for p in module.parameters() if id(p) in unit_of]
        owners = {id(unit_of[id(p)]) for p in params if unit_of[id(p)] not in (elsewhere, loose)}
        eligible = module is not root or next(root.children(), None) is None
        if eligible and callable(getattr(module, "reset_parameters", None)) and len(owners) <= 1 and params:
            if any(id(p) not in covered for p in params):
                plan.append(Initialiser(module, module.reset_parameters, whole_subtree=True))
                covered.update(id(p) for p in params)
            return
        for child in module.children():
            visit(child)

    visit(root)
    missing = [
        name
        for name, p in root.named_parameters()
        if unit_of.get(id(p), elsewhere) is not elsewhere and id(p) not in covered
    ]
    if missing:
        raise ValueError(
            f"cannot materialise parameters built on the meta device: no module with "
            f"reset_parameters() initialises {missing[:5]}{' ...' if len(missing) > 5 else ''}. "
            f"Give their modules a reset_parameters() method, pass param_init_fn, or build the "
            f"model normally."
        )
    return plan


def _loose_meta_parameters(root: nn.Module) -> list[nn.Parameter]:
    """Note: [Frozen parameters built on meta]
    A frozen parameter (``requires_grad=False``) is in no unit's flat buffer: every rank keeps it whole, with storage
    given right before the first initialiser whose module contains it. A module whose parameters are all frozen (the
    base weights of a LoRA model, a frozen embedding) holds no unit's parameter, yet its ``reset_parameters`` must run
    as in a normal build, both for its values and for the generator's draws after it. So the initialisers are
    planned over frozen meta parameters too, as parameters of no unit: they may share an initialiser with one unit's,
    or have one of their own."""
    return [p for p in root.parameters() if p.is_meta and not p.requires_grad]


def param_init_fn_initialisers(
    root: nn.Module, param_init_fn: Callable[[nn.Module], None], valued: frozenset[int] = frozenset()
) -> list[Initialiser]:
    """``param_init_fn(module)`` for every module owning parameters or buffers itself, in module order, except one
    whose parameters all have values (ids in ``valued``: Note: [Values built before the meta build])."""
    return [
        Initialiser(module, lambda module=module: param_init_fn(module))
        for module in root.modules()
        if any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])
        and not _all_valued(module, valued)
    ]


def _all_valued(module: nn.Module, valued: frozenset[int]) -> bool:
    own = [p for p in module._parameters.values() if p is not None]
    return bool(own) and all(id(p) in valued for p in own)


def materialise_sharded(
    root: nn.Module,
    units: list[Unit],
    broadcast,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    cut_pieces: tuple[CutPiece, ...] = (),
) -> None:
    """Run the whole model's initialisers unit by unit; ``broadcast(tensor, collectives)`` makes every rank of the
    unit's group hold its first rank's values; ``cut_pieces``: the meta pieces a pipeline cut from ``root``. See
    Note: [A sharded build equals a normal build]."""
    with _restored(cut_pieces):
        _materialise(root, units, broadcast, device, param_init_fn, tuple(piece.module for piece in cut_pieces))
    _move_valued_loose_tensors(root, device)
    still_meta = [name for name, t in [*root.named_buffers(), *root.named_parameters()] if t.is_meta]
    if still_meta:
        raise ValueError(
            f"no initialiser gave storage to {still_meta[:5]}{' ...' if len(still_meta) > 5 else ''} "
            f"(built on the meta device); create them on a real device or pass param_init_fn"
        )


@contextlib.contextmanager
def _restored(pieces: tuple[CutPiece, ...]) -> Iterator[None]:
    """Inside, ``pieces`` are back in their parents, so that code walking the model sees the whole model in its
    order; on exit they are cut again."""
    for piece in pieces:
        setattr(piece.parent, piece.name, piece.module)
    try:
        yield
    finally:
        for piece in pieces:
            setattr(piece.parent, piece.name, None)


def _materialise(
    root: nn.Module,
    units: list[Unit],
    broadcast,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    cut_away: tuple[nn.Module, ...],
) -> None:
    valued = frozenset(id(p) for p in root.parameters() if not p.is_meta)  # Note: [Values built before the meta build]
    plan, final_rng_state = _initialisers(root, units, device, param_init_fn, cut_away, valued)
    unit_of = _unit_of(units, valued)
    needs = [_units_written(init.module, unit_of) for init in plan]
    remaining = {id(u): sum(1 for needed in needs for v in needed if v is u) for u in units}
    unused = [u for u in units if u.flat_params and not remaining[id(u)]]
    if any(p.is_meta for u in unused for fp in u.flat_params for p in fp.params):
        raise ValueError(_no_initialiser_message(root, [u for u in unused if u.flat_params]))
    for unit in unused:  # every parameter has values: placed as a normally built unit
        for fp in unit.flat_params:
            fp.adopt_params()
            broadcast(fp.full, unit.collectives)
            fp.finish_sharding()
    scratch = WholeTensorScratch(root, cut_away, device, valued)
    started: set[int] = set()
    for init, needed in zip(plan, needs):
        for unit in needed:
            if id(unit) not in started:
                started.add(id(unit))
                for fp in unit.flat_params:
                    fp.adopt_meta_params()
                scratch.substitute(unit)
        with scratch.for_cut_away_tensors(init.module, init.whole_subtree):
            give_loose_tensors_storage(init.module, device, init.whole_subtree)
            init.run()
        for unit in needed:
            for fp in unit.flat_params:
                _repoint(fp)
            remaining[id(unit)] -= 1
            if remaining[id(unit)] == 0:
                scratch.keep_local_pieces(unit)
                for fp in unit.flat_params:
                    broadcast(fp.full, unit.collectives)  # over the ranks holding the same experts, for experts
                    fp.finish_sharding()
    if final_rng_state is not None:
        set_generator_state(device, final_rng_state)


def _initialisers(
    root: nn.Module,
    units: list[Unit],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    cut_away: tuple[nn.Module, ...],
    valued: frozenset[int],
) -> tuple[list[Initialiser], torch.Tensor | None]:
    """The initialisers in the order they run, and the generator state to leave (Hugging Face models), for the
    parameters without values: ``param_init_fn``'s, else Hugging Face's for each whole model built on meta then
    ``reset_parameters``."""
    if param_init_fn is not None:
        return param_init_fn_initialisers(root, param_init_fn, valued), None
    _refuse_peft_adapters_on_meta(root)
    whole = [m for m in outermost_hf_models(root) if not any(id(p) in valued for p in m.parameters())]
    plan, final_rng_state = _hf_initialisers(whole, device)
    plan += reset_parameters_initialisers(root, units, tuple(whole), cut_away, valued)
    return plan, final_rng_state


def _refuse_peft_adapters_on_meta(root: nn.Module) -> None:
    """PEFT initialises an adapter in its layer's own way (LoRA: ``lora_B`` zero, ``lora_A`` drawn again after
    construction), which none of our initialisers reproduces: refuse adapters built on meta rather than train
    differently initialised ones."""
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    if peft_tuners is None:
        return
    adapters = [
        f"{layer_name}.{name}" if layer_name else name
        for layer_name, layer in root.named_modules()
        if isinstance(layer, peft_tuners.BaseTunerLayer)
        for name, p in layer.named_parameters()
        if p.is_meta and not name.startswith("base_layer.")
    ]
    if adapters:
        raise ValueError(
            f"PEFT adapter weights {adapters[:3]}{' ...' if len(adapters) > 3 else ''} were built on the meta device "
            f"(get_peft_model inside the ZeRO stage-3 build context: configure_model, or init_module(empty_init="
            f"True)); ZeRO cannot initialise them as PEFT does. Apply get_peft_model outside that context to a "
            f"model with values (built in LightningModule.__init__, or without empty_init), or pass param_init_fn"
        )


class WholeTensorScratch:
    """Plain tensors of the global shape standing in for what an initialiser must see whole but this rank keeps
    in part: a unit's tensor-parallel parameters and an experts container's stacked rows under expert parallelism
    (those without values, ids not in ``valued``), and the tensors of the pieces a pipeline cut away (Note: [A
    sharded build equals a normal build])."""

    def __init__(self, root: nn.Module, cut_away: tuple[nn.Module, ...], device: torch.device, valued: frozenset[int]):
        self.device = device
        self.cut_modules = {id(m) for piece in cut_away for m in piece.modules()}
        self.valued = valued
        self.registered: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in root.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    self.registered.setdefault(id(p), []).append((module, name))
        self.cutters: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # by parameter: its piece of the whole

    def _whole(self, like: torch.Tensor, shape: torch.Size | None = None) -> nn.Parameter:
        """Uninitialised storage of ``like``'s global shape (a DTensor's ``shape`` is global), or of ``shape``."""
        shape = like.shape if shape is None else shape
        return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=self.device), like.requires_grad)

    def _piece_of(self, slot, p: nn.Parameter) -> tuple[torch.Size, Callable[[torch.Tensor], torch.Tensor]] | None:
        """For a parameter built on meta of which this rank keeps a piece: its global shape and how the piece is cut
        from the whole. A tensor-parallel (DTensor) one's is cut from tensor-parallel rank 0's tensor, as
        ``parallelize_module`` does; an experts container's rows are this rank's experts, as ``shard_experts``
        cuts a normally built container. None for a parameter this rank keeps whole (or that has values)."""
        if id(p) in self.valued:
            return None
        if slot.tp is not None:
            return p.shape, lambda whole: distribute_tensor(whole, slot.tp.mesh, slot.tp.placements).to_local()
        module, name = self.registered[id(p)][0]
        if is_expert_parallel(module) and name in expert_rows(module):
            rows = (module.first_expert, module.num_experts)
            return torch.Size((module.global_experts, *p.shape[1:])), lambda whole: whole.narrow(0, *rows)
        return None

    def substitute(self, unit: Unit) -> None:
        """Register a whole-shape scratch tensor wherever each of ``unit``'s parameters built on meta of which this
        rank keeps a piece is registered (one with values keeps them: Note: [Values built before the meta build])."""
        for fp in unit.flat_params:
            for slot, p in zip(fp.slots, fp.params):
                piece = self._piece_of(slot, p)
                if piece is None:
                    continue
                shape, self.cutters[id(p)] = piece
                whole = self._whole(p, shape)
                for module, name in self.registered[id(p)]:
                    module._parameters[name] = whole

    def keep_local_pieces(self, unit: Unit) -> None:
        """Copy this rank's piece of each scratch tensor into its parameter's flat view and register the
        parameter again."""
        for fp in unit.flat_params:
            for p, view in zip(fp.params, fp.param_views()):
                cut = self.cutters.pop(id(p), None)
                if cut is None:
                    continue
                module, name = self.registered[id(p)][0]
                view.copy_(cut(module._parameters[name].detach()).reshape(view.shape))
                for module, name in self.registered[id(p)]:
                    module._parameters[name] = p

    @contextlib.contextmanager
    def for_cut_away_tensors(self, module: nn.Module, recurse: bool) -> Iterator[None]:
        """Inside, the meta tensors of ``module`` (with ``recurse``, of its subtree) that belong to cut-away pieces
        are scratch an initialiser can fill, drawing what it draws in a normal build; on exit the values are
        dropped and the meta tensors return."""
        saved: list[tuple[dict, str, torch.Tensor]] = []
        wholes: dict[int, nn.Parameter] = {}
        for sub in module.modules() if recurse else (module,):
            if id(sub) not in self.cut_modules:
                continue
            for table in (sub._parameters, sub._buffers):
                for name, tensor in table.items():
                    if tensor is not None and tensor.is_meta:
                        saved.append((table, name, tensor))
                        whole = wholes.setdefault(id(tensor), self._whole(tensor))
                        table[name] = whole if table is sub._parameters else whole.detach()
        try:
            yield
        finally:
            for table, name, tensor in saved:
                table[name] = tensor


def _hf_initialisers(models: list[nn.Module], device: torch.device) -> tuple[list[Initialiser], torch.Tensor | None]:
    """Hugging Face's initialisers for each of ``models`` (outermost ``PreTrainedModel``s) in turn, each replayed
    from where a normal build of the previous one leaves the generator; and where the last one leaves it."""
    plan: list[Initialiser] = []
    final = None
    for model in models:
        if final is not None:
            set_generator_state(device, final)
        initialisers, final = hf_initialisers(model, device)
        plan += initialisers
    return plan, final


def give_loose_tensors_storage(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Uninitialised storage on ``device`` for the meta buffers and frozen parameters of ``module`` (and with
    ``recurse`` its submodules): tensors every rank keeps whole, outside the flat buffers. ``swap_tensors`` keeps
    each Parameter object, so ties hold, and its type (Note: [Parameter types the engine shards])."""
    for sub in module.modules() if recurse else (module,):
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty_like(buffer, device=device)
        for p in sub._parameters.values():
            if p is not None and p.is_meta and not p.requires_grad:
                torch.utils.swap_tensors(p, parameter_like(p, torch.empty_like(p, device=device)))


def _no_initialiser_message(root: nn.Module, units: list[Unit]) -> str:
    """What to do about units built on meta that no initialiser writes, naming the classes that hold them."""
    parents = {id(child): module for module in root.modules() for child in module.children()}
    around = {_qualified(parents[id(u.module)]) for u in units if id(u.module) in parents}
    names = [u.name for u in units]
    return (
        f"cannot materialise units {names[:4]}{' ...' if len(names) > 4 else ''} built on the meta device (inside "
        f"{sorted(around)}): no initialiser writes them. A parameter built where stage 3 builds on meta is "
        f"initialised by its module's reset_parameters(), by param_init_fn, or by Hugging Face's own "
        f"initialisation of a whole PreTrainedModel built there; build a module initialised otherwise outside that "
        f"context, or pass param_init_fn"
    )


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _unit_of(units: list[Unit], valued: frozenset[int] = frozenset()) -> dict[int, Unit]:
    """The unit of each parameter an initialiser must write (those without values)."""
    return {id(p): u for u in units for fp in u.flat_params for p in fp.params if id(p) not in valued}


def _move_valued_loose_tensors(root: nn.Module, device: torch.device) -> None:
    """Buffers and frozen parameters that have values (built for real) onto ``device``, where a normally built
    model's are placed (:mod:`.placement`)."""
    for module in root.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device and not buffer.is_meta:
                module._buffers[name] = buffer.to(device)
        for p in module._parameters.values():
            if p is not None and not p.requires_grad and p.device != device and not p.is_meta:
                p.data = p.data.to(device)


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
