"""The composition matrix: {build} x {layout} x {ZeRO stage} x {entry point}, pruned to a pairwise-covering set of
cells, each trained on real gloo ranks and compared with one process training a normally built copy.

Every cell but the expert-parallel ones (``EXPERT_CELLS``, a Qwen3-MoE) builds the same tiny Hugging Face Llama
(``pipeline_runs.tiny_llama``: 4 layers, hidden 16, 4 heads, so that Ulysses inside tensor parallelism has heads to
split over tp x sp), hands it to an entry point under a layout,
records the full state dict right after setup (which must equal a normal build bitwise) and after ``STEPS`` SGD
steps on the global batches of ``pipeline_runs.batches`` (which must match the reference in fp32). The axes are
data, so a new way to build (say another empty-init path) is one more :class:`Build` in ``BUILDS``; a configuration
refused whatever the entry point is listed in ``REFUSED_CONFIGS`` with the words its error must contain, and the
matrix checks that it is refused so. Every entry point runs every layout,
each step as its users write it (:func:`_step_loss`): through the entry point's ``pipeline_step`` under pipelining,
Ulysses' sequence slice and loss under sequence parallelism. Accelerate's cells read their batches through a
prepared data loader, so its split over the data-parallel ranks is part of what they check.

Every Lightning cell's ``configure_model`` also creates tensors that are not parameters (a plain buffer on the
LightningModule, a torchmetrics ``MeanMetric`` updated with each step's loss), which must be real and hold their
values under every stage (Lightning builds parameters only on meta): the outcome's ``extras``. ``BF16_CELLS`` run
``init_module()`` under "bf16-true", which creates 16-bit weights; they are outside the fp32 pairwise set and are
checked against a bf16 reference (see ``test_composition_matrix``). ``EXPORT_CELLS`` train under "bf16-mixed" and
record, besides, what the entry point's own export returns and the checkpoint it writes (Note: [What an export
returns] in ``ds_strategy.zero.full_state_dict``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import moe_models
import torch
import torch.distributed as dist
from distributed import set_lightning_environment
from pipeline_runs import batches, loss_fn, tiny_llama
from quiet_trainer import QUIET

STEPS, GLOBAL_BATCH, BLOCKS, HEADS = 3, 8, 4, 4
MODEL = "llama"


@dataclasses.dataclass(frozen=True)
class Layout:
    """A way to spread the model over ``world`` ranks; the data-parallel size is what the other sizes leave."""

    name: str
    world: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    megatron_sp: bool = False
    long_context: bool = False  # tiled MLPs and every unit checkpointed, its input kept on the host
    ep: int = 1  # expert parallelism, inside the data-parallel ranks (each still reads its own batch)
    model: str = MODEL  # what the cells build: an expert-parallel layout needs a mixture of experts
    settings: tuple[tuple[str, object], ...] = ()  # more ZeroConfig fields (what expert parallelism composes with)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.sp)

    def dp_rank(self, rank: int) -> int:
        """Mesh order (pp, dp, sp, tp): the data-parallel coordinate of global ``rank``."""
        return (rank // (self.sp * self.tp)) % self.dp

    def fields(self) -> dict:
        fields = {}
        if self.tp > 1:
            fields.update(tensor_parallel_size=self.tp, tensor_parallel_plan="auto", sequence_parallel=self.megatron_sp)
        if self.pp > 1:
            fields.update(pipeline_parallel_size=self.pp)
        if self.sp > 1:
            fields.update(sequence_parallel_size=self.sp)
        if self.long_context:
            fields.update(tiled_mlp=True, tile_tokens=3, activation_checkpointing="full", cpu_checkpointing=True)
        if self.ep > 1:
            fields.update(expert_parallel_size=self.ep)
        return {**fields, **dict(self.settings)}


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("dp", 2),
        Layout("tp", 2, tp=2),
        Layout("dp x tp", 4, tp=2),
        Layout("pp", 2, pp=2),
        Layout("pp x dp", 4, pp=2),
        Layout("pp x tp", 4, tp=2, pp=2),
        Layout("pp x ulysses sp", 4, pp=2, sp=2),
        Layout("ulysses sp", 2, sp=2),
        Layout("ulysses sp tiled", 2, sp=2, long_context=True),
        Layout("ulysses sp x tp", 4, tp=2, sp=2),
        Layout("megatron sp", 2, tp=2, megatron_sp=True),
    )
}
# Expert parallelism (issue 47) over a Qwen3-MoE (``moe_models``: 8 experts, top-2), outside the pairwise set (its
# cells are EXPERT_CELLS): alone, under activation checkpointing and with the optimizer offloaded to the host.
EXPERT_LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("ep", 2, ep=2, model="qwen3_moe"),
        Layout("dp x ep", 4, ep=2, model="qwen3_moe"),
        Layout("ep checkpointed", 2, ep=2, model="qwen3_moe", settings=(("activation_checkpointing", "full"),)),
        Layout("ep offloaded", 2, ep=2, model="qwen3_moe", settings=(("offload_optimizer", "cpu"),)),
    )
}
ALL_LAYOUTS = {**LAYOUTS, **EXPERT_LAYOUTS}
STAGES = (0, 1, 2, 3)
ENTRIES = ("engine", "lightning", "fabric", "accelerate")


@dataclasses.dataclass(frozen=True)
class Build:
    """How every rank gets its model. ``empty_on(rank, layout)``: whether that rank builds it empty, in the entry
    point's own way (the engine: ``torch.device("meta")``; Lightning: in ``configure_model``, on meta under stage
    3; Fabric: ``init_module(empty_init=True)`` under stage 3, where it means meta; Accelerate:
    ``init_empty_weights()``), else normally under ``torch.manual_seed(0)``. ``fields``: the ZeroConfig fields it
    needs (over the layout's). ``pretrained_seed``: load, after setup, the weights a normal build under that seed
    saved (``load_pretrained``); the initial state must then equal that build instead. ``sync_module_states`` streams
    over the data-parallel group, as DDP's does: the first data-parallel replica (every tensor-parallel rank and
    pipeline stage of it) builds the model, the other replicas build it empty. ``init_module``: the entry points
    that have one (``entries``) build under ``trainer.init_module`` / ``fabric.init_module``, with
    ``empty_init=True`` under stage 3 (sharded on meta, then initialised) and the default below it (a normal build
    on the device; ``empty_init=True`` there means uninitialised memory, as under DDP). ``user_plan``: the user's
    own ``parallelize_module`` (:func:`user_parallelize`) splits the built model over the tensor-parallel mesh, as
    Lightning's and Fabric's ModelParallelStrategy docs teach: in Lightning's ``configure_model`` (at stage 3 inside
    the strategy's build context, on a model ``__init__`` built), in Fabric between the build and ``setup``; no plan
    is configured. ``layouts``: the layouts it applies to (None: every one)."""

    name: str
    empty_on: Callable[[int, Layout], bool]
    fields: tuple[tuple[str, object], ...] = ()
    pretrained_seed: int | None = None
    entries: tuple[str, ...] = ("engine", "lightning", "fabric", "accelerate")
    user_plan: bool = False
    layouts: tuple[str, ...] | None = None

    @property
    def seed(self) -> int:
        """The seed of the normal build the initial state must equal."""
        return 0 if self.pretrained_seed is None else self.pretrained_seed


# The user's own tensor-parallel plan (issue 42): Lightning and Fabric, tensor-parallel layouts, no configured plan.
USER_PLAN = {
    "fields": (("tensor_parallel_plan", None),),
    "entries": ("lightning", "fabric"),
    "user_plan": True,
    "layouts": ("tp", "dp x tp"),
}
BUILDS = {
    build.name: build
    for build in (
        Build("normal", lambda rank, layout: False),
        Build("meta", lambda rank, layout: True),
        Build("sync_module_states", lambda rank, layout: layout.dp_rank(rank) != 0, (("sync_module_states", True),)),
        Build("load_pretrained", lambda rank, layout: True, pretrained_seed=5),
        Build("init_module", lambda rank, layout: True, entries=("lightning", "fabric")),
        Build("user_plan", lambda rank, layout: False, **USER_PLAN),
        Build("user_plan_init_module", lambda rank, layout: True, **USER_PLAN),
    )
}


# Refused by the configuration itself, whatever the entry point: (fields, words of the error).
REFUSED_CONFIGS = (
    (
        {"tiled_loss": True, "pipeline_parallel_size": 2},
        "tiled_loss=True is not allowed with pipeline_parallel_size=2",
    ),
    # expert parallelism (issue 47) beside what does not compose with it yet; its cells: EXPERT_CELLS
    *(
        ({"stage": 3, "expert_parallel_size": 2, other: value}, f"expert_parallel_size=2 is not allowed with {other}=")
        for other, value in (
            ("tensor_parallel_size", 2),
            ("pipeline_parallel_size", 2),
            ("sequence_parallel_size", 2),
            ("zero_quantized_weights", True),
            ("zero_hpz_partition_size", 2),
        )
    ),
    ({"stage": 0, "expert_parallel_size": 2}, "expert_parallel_size=2 is not allowed with stage=0"),
)


@dataclasses.dataclass(frozen=True)
class Cell:
    build: str
    layout: str
    stage: int
    entry: str
    precision: str = "32-true"
    optimizers: str = "sgd"  # or "whole+sgd", "frozen": see make_optimizers

    @property
    def id(self) -> str:
        suffix = "" if self.precision == "32-true" else f"-{self.precision}"
        suffix += "" if self.optimizers == "sgd" else f"-{self.optimizers}"
        return f"{self.entry}-{self.layout.replace(' ', '')}-stage{self.stage}-{self.build}{suffix}"

    @property
    def axes(self) -> tuple:
        """The values of the four axes the pairwise set covers."""
        return self.build, self.layout, self.stage, self.entry

    def applies(self) -> bool:
        """Whether the entry point has the build path at all (only Lightning and Fabric have ``init_module``), and
        the build the layout (a user's tensor-parallel plan needs a tensor-parallel mesh)."""
        build = BUILDS[self.build]
        return self.entry in build.entries and (build.layouts is None or self.layout in build.layouts)


# The reported cases (a Lightning configure_model build on meta under dp x tp and under pp x dp, stage 3): always run.
REPORTED = (Cell("meta", "dp x tp", 3, "lightning"), Cell("meta", "pp x dp", 3, "lightning"))
# Issue 26, item 1: Lightning's init_module(empty_init=True) at stage 3 builds on meta, here cut over tp: always run.
# Issue 42: parallelize_module in configure_model on a model built in __init__, at stage 3 (it crashed), and the
# user's parallelize_module on a model built under init_module(empty_init=True) at stage 3, Lightning and Fabric.
REQUIRED = (
    *REPORTED,
    Cell("init_module", "tp", 3, "lightning"),
    Cell("user_plan", "tp", 3, "lightning"),
    Cell("user_plan_init_module", "tp", 3, "lightning"),
    Cell("user_plan_init_module", "dp x tp", 3, "fabric"),
)

# init_module() under "bf16-true" (issue 26, item 10): 16-bit weights, built sharded (stage 3) and normally (stage 1).
BF16_CELLS = (
    Cell("init_module", "dp", 3, "lightning", "bf16-true"),
    Cell("init_module", "dp", 1, "lightning", "bf16-true"),
    Cell("init_module", "dp", 3, "fabric", "bf16-true"),
    Cell("init_module", "dp", 1, "fabric", "bf16-true"),
)


# "bf16-mixed" (issue 41): the entry point's export (``full_state_dict``, ``get_module_state_dict``,
# ``get_state_dict``; Lightning's ``lightning_module_state_dict`` takes the same path, tested with the data-parallel
# runs of ``test_export_masters``) under tensor and pipeline parallelism and the builds that keep the model's fp32
# weights, against the file ``consolidate`` writes of the checkpoint the entry point saved.
EXPORT_CELLS = (
    Cell("sync_module_states", "dp x tp", 1, "engine", "bf16-mixed"),
    Cell("load_pretrained", "pp x dp", 2, "accelerate", "bf16-mixed"),
    Cell("normal", "tp", 0, "fabric", "bf16-mixed"),
)


def export_dir(pretrained: str, cell: Cell) -> Path:
    """Where an export cell's entry point saves its checkpoint (beside the pretrained weights)."""
    return Path(pretrained).parent / "exports" / cell.id


# Several optimizers over one model, one of them whole-tensor (issue 39): a NormalizedSGD, which steps each hidden
# matrix by its gradient over the gradient's norm (wrong on any slice of the matrix) beside SGD on the rest, given
# separately to the engine, Fabric and Accelerate and chained (ChainedOptimizer) to Lightning's automatic
# optimization; every entry point, every stage, over dp, pp, pp x dp and Ulysses. Outside the pairwise set.
OPTIMIZER_CELLS = (
    Cell("normal", "dp", 3, "engine", optimizers="whole+sgd"),
    Cell("normal", "dp", 0, "accelerate", optimizers="whole+sgd"),
    Cell("normal", "dp", 1, "lightning", optimizers="whole+sgd"),
    Cell("normal", "pp", 2, "fabric", optimizers="whole+sgd"),
    Cell("meta", "ulysses sp", 3, "accelerate", optimizers="whole+sgd"),
    Cell("normal", "pp x dp", 3, "lightning", optimizers="whole+sgd"),
)
# Frozen parameters in the optimizer (issue 45): the embeddings and the first decoder layer frozen, SGD over
# ``model.parameters()`` (as torch skips a parameter without a gradient, the engine skips a frozen one), given with the
# model (engine, Lightning's configure_optimizers) or after it (Fabric's setup_module then setup_optimizers, litgpt's
# LoRA order; Accelerate's prepare of the model, then of the optimizer). The second half builds on meta at stage 3:
# the frozen decoder layer is an all-frozen module there, which must be initialised as a normal build initialises it.
FROZEN_CELLS = (
    Cell("normal", "dp", 0, "engine", optimizers="frozen"),
    Cell("normal", "dp", 1, "accelerate", optimizers="frozen"),
    Cell("normal", "dp", 2, "fabric", optimizers="frozen"),
    Cell("normal", "dp", 3, "lightning", optimizers="frozen"),
    Cell("meta", "dp", 3, "engine", optimizers="frozen"),
    Cell("meta", "dp", 3, "lightning", optimizers="frozen"),
    Cell("init_module", "dp", 3, "fabric", optimizers="frozen"),
    Cell("meta", "dp", 3, "accelerate", optimizers="frozen"),
)

# A whole-tensor optimizer over matrices tensor parallelism splits is refused, naming a parameter: (cell, words).
REFUSED_OPTIMIZER_CELLS = ((Cell("normal", "tp", 1, "engine", optimizers="whole+sgd"), "tensor parallelism splits"),)


# ``deepspeed.initialize`` (issue 46), outside the pairwise set: its engine's backward/step over a normal build, a
# ``zero.Init`` build on meta at stages 1 and 3, DeepSpeed's automatic tensor parallelism; a pipeline layout refused
# (DeepSpeed pipelines through its own PipelineModule and engine).
DEEPSPEED_CELLS = (
    Cell("normal", "dp", 0, "deepspeed"),
    Cell("meta", "dp", 1, "deepspeed"),
    Cell("meta", "dp", 3, "deepspeed"),
    Cell("normal", "tp", 2, "deepspeed"),
)
REFUSED_DEEPSPEED_CELLS = ((Cell("normal", "pp", 1, "deepspeed"), "pipeline_parallel_size=2"),)


# Expert parallelism (issue 47) at stages 1-3 under every entry point, on 2 ranks (ep2) and 4 (dp4 x ep2: each
# expert sharded over the 2 ranks holding it), under activation checkpointing, with the optimizer offloaded, and built
# on meta (each rank initialising its experts' rows as a normal build draws them).
EXPERT_CELLS = (
    Cell("normal", "ep", 1, "engine"),
    Cell("normal", "ep", 2, "fabric"),
    Cell("normal", "ep", 3, "lightning"),
    Cell("normal", "dp x ep", 3, "accelerate"),
    Cell("normal", "dp x ep", 2, "engine"),
    Cell("normal", "ep checkpointed", 3, "engine"),
    Cell("normal", "ep checkpointed", 2, "lightning"),
    Cell("normal", "ep offloaded", 2, "engine"),
    Cell("normal", "ep offloaded", 3, "fabric"),
    Cell("meta", "ep", 3, "lightning"),
    Cell("init_module", "dp x ep", 3, "fabric"),
    Cell("meta", "ep", 2, "accelerate"),
    Cell("meta", "ep checkpointed", 3, "engine"),
)


def pairwise_cells() -> list[Cell]:
    """A deterministic greedy pairwise-covering set: every pair of values of two axes appears in some cell (a build
    path an entry point does not have pairs with no cell). Starting from ``REQUIRED``, each round takes the cell
    covering most uncovered pairs, on fewer ranks first, then in axis order."""
    axes = (tuple(BUILDS), tuple(LAYOUTS), STAGES, ENTRIES)
    every = [Cell(*values) for values in itertools.product(*axes)]
    candidates = [cell for cell in every if cell.applies()]

    def pairs(cell: Cell) -> set:
        values = cell.axes
        return {(i, values[i], j, values[j]) for i, j in itertools.combinations(range(4), 2)}

    uncovered = set().union(*(pairs(c) for c in candidates)) - set().union(*(pairs(c) for c in REQUIRED))
    chosen: list[Cell] = list(REQUIRED)
    while uncovered:
        best = max(candidates, key=lambda c: (len(pairs(c) & uncovered), -LAYOUTS[c.layout].world))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


# -- one cell on one rank -------------------------------------------------------------------------------------


def build_model(seed: int = 0, model_name: str = MODEL):
    """The Llama every pairwise cell builds, or a layout's ``model``: the MoE of ``moe_models``."""
    if model_name == MODEL:
        torch.manual_seed(seed)
        model = tiny_llama(BLOCKS, HEADS)
    else:  # transformers' build alone, which a build on meta reproduces (no routers drawn again)
        model = moe_models.build(model_name, seed, spread_routers=False)
    model.config.use_cache = False  # training keeps no KV cache; a checkpointed layer's recomputation would extend it
    return model


def user_parallelize(model, tp_mesh) -> None:
    """What a ModelParallelStrategy user writes: torch's ``parallelize_module`` on each decoder layer."""
    from tensor_parallel_llama import LAYER_PLAN
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, LAYER_PLAN)


class NormalizedSGD(torch.optim.Optimizer):
    """Steps each parameter by its gradient divided by that gradient's whole norm: declared whole-tensor, since on a
    slice of the tensor it would divide by the slice's norm."""

    elementwise = False

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"])


def freeze(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """Under ``kind`` "frozen", the embeddings and the first decoder layer frozen (``requires_grad=False``); else
    nothing."""
    if kind == "frozen":
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
    return model


def make_optimizers(model: torch.nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """``kind`` "sgd": SGD at lr 1 on every parameter; "frozen": the same over a model :func:`freeze` froze in part;
    "whole+sgd": NormalizedSGD at lr 0.1 on the decoder layers' matrices and SGD at lr 1 on the rest (a pipeline stage
    may hold no matrix: then SGD alone)."""
    if kind in ("sgd", "frozen"):
        return [torch.optim.SGD(model.parameters(), lr=1.0)]
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.ndim == 2 and ".layers." in n]
    optimizers = [torch.optim.SGD([p for n, p in named if not (p.ndim == 2 and ".layers." in n)], lr=1.0)]
    return [NormalizedSGD(hidden, lr=0.1), *optimizers] if hidden else optimizers


def reference(
    seed: int,
    dtype: torch.dtype = torch.float32,
    autocast: torch.dtype | None = None,
    optimizers: str = "sgd",
    model_name: str = MODEL,
) -> dict:
    """One process, the normally built model (converted to ``dtype``), trained by ``make_optimizers(optimizers)``
    on each whole global batch (mean token loss), its forward in ``torch.autocast`` to ``autocast`` if given."""
    torch.set_num_threads(1)
    model = freeze(build_model(seed, model_name).to(dtype), optimizers)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    stepping = make_optimizers(model, optimizers)
    losses = []
    for x, y in batches(MODEL, STEPS, GLOBAL_BATCH):
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            loss = loss_fn(model(input_ids=x).logits, y)
        loss.backward()
        for optimizer in stepping:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "initial": initial,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "losses": losses,
    }


def _my_batches(layout: Layout, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's data-parallel slice of every global batch (whole sequences)."""
    per_rank = GLOBAL_BATCH // layout.dp
    lo = layout.dp_rank(rank) * per_rank
    return [(x[lo : lo + per_rank], y[lo : lo + per_rank]) for x, y in batches(MODEL, STEPS, GLOBAL_BATCH)]


def _sp_loss(model, x: torch.Tensor, y: torch.Tensor, group) -> torch.Tensor:
    """Ulysses: this rank's slice of the sequence, and the token mean over the whole sequence."""
    from ds_strategy.parallel.ulysses import sequence_parallel_loss, shard_sequence

    local = shard_sequence({"input_ids": x}, group)
    length, r = local["input_ids"].shape[1], dist.get_rank(group)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    return sequence_parallel_loss(logits, y[:, r * length : (r + 1) * length], group)


def _pipeline_args(layout: Layout, x: torch.Tensor, y: torch.Tensor, sp_group) -> tuple:
    """What a pipelined step is handed: the batch and ``loss_fn``, or under Ulysses this rank's slices of both and
    the loss over the whole sequence (each stage positions the slice's tokens itself)."""
    if layout.sp == 1:
        return x, y, loss_fn
    from ds_strategy.parallel.ulysses import sequence_parallel_loss

    length, r = x.shape[1] // layout.sp, dist.get_rank(sp_group)
    piece = slice(r * length, (r + 1) * length)
    return x[:, piece].contiguous(), y[:, piece].contiguous(), functools.partial(sequence_parallel_loss, group=sp_group)


def _plain_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(input_ids=x).logits, y)


def _step_loss(layout: Layout, model, x: torch.Tensor, y: torch.Tensor, pipeline_step, sp_group) -> torch.Tensor:
    """One training step's loss as a user's step under an entry point computes it: ``pipeline_step(x, y, loss_fn)``
    (the entry point's, which already ran backward) under pipelining, Ulysses over ``sp_group`` under sequence
    parallelism, else the model's own forward."""
    if layout.pp > 1:
        return pipeline_step(*_pipeline_args(layout, x, y, sp_group))
    if layout.sp > 1:
        return _sp_loss(model, x, y, sp_group)
    return _plain_loss(model, x, y)


def _make(build: Build, rank: int, layout: Layout, empty: Callable[[], contextlib.AbstractContextManager], kind: str):
    """The model under seed 0, built normally or, where ``build`` says so, under the context ``empty()`` (for
    ``init_module``, the entry point's), then frozen in part as the optimizers' ``kind`` says (:func:`freeze`)."""
    with empty() if build.empty_on(rank, layout) else contextlib.nullcontext():
        return freeze(build_model(0, layout.model), kind)


def run_cell(rank: int, world_size: int, cell: Cell, pretrained: str) -> dict:
    """Build, set up, (load,) record the initial state, train ``STEPS`` steps, record the final state."""
    torch.set_num_threads(1)
    set_lightning_environment(rank)
    build, layout = BUILDS[cell.build], ALL_LAYOUTS[cell.layout]
    fields = {"stage": cell.stage, "precision": cell.precision, **layout.fields(), **dict(build.fields)}
    export_to = export_dir(pretrained, cell) if cell in EXPORT_CELLS else None
    return ENTRY_RUNNERS[cell.entry](rank, build, layout, fields, pretrained, export_to, cell.optimizers)


def _as_built(model: torch.nn.Module) -> dict:
    """Where and in which dtypes the parameters were created, before any setup."""
    return {
        "on_meta": any(p.is_meta for p in model.parameters()),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def _outcome(
    initial: dict, final: dict, held: set[str], built: dict, extras: dict | None = None, export: dict | None = None
) -> dict:
    """The tensors this rank holds (a pipeline stage's), under the uncut model's names; ``export``: what the entry
    point's export returned (export cells)."""
    return {
        "initial": {k: v for k, v in initial.items() if k in held},
        "final": {k: v for k, v in final.items() if k in held},
        **built,
        "extras": extras,
        "export": export,
    }


def _unprefixed(state: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in state.items()}


def _engine_entry(rank: int, build: Build, layout: Layout, fields: dict, pretrained: str, export_to, kind: str) -> dict:
    from ds_strategy import checkpoint
    from ds_strategy.checkpoint.pretrained import load_weights
    from ds_strategy.compose import build_mesh, compose_model
    from ds_strategy.config import ZeroConfig
    from ds_strategy.precision import autocast_for

    config = ZeroConfig(**fields)
    mesh = build_mesh(config, "cpu")
    assert mesh.dp_rank == layout.dp_rank(rank)
    model = _make(build, rank, layout, lambda: torch.device("meta"), kind)
    built = _as_built(model)
    build_optimizers = lambda: make_optimizers(model, kind)  # noqa: E731  over this rank's stages only
    composed = compose_model(
        model, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=build_optimizers
    )
    engine, runner = composed.engine, composed.pipeline
    if build.pretrained_seed is not None:
        load_weights(engine, pretrained)
    initial = engine.full_state_dict(rank0_only=False)
    for x, y in _my_batches(layout, rank):
        with autocast_for(config.precision, "cpu"):
            if runner is not None:
                runner.train_step(*_pipeline_args(layout, x, y, mesh.sp_group), 1.0)
            else:
                engine.backward(_sp_loss(model, x, y, mesh.sp_group) if layout.sp > 1 else _plain_loss(model, x, y))
        engine.step()
    held = set(dict(model.named_parameters())) | set(dict(model.named_buffers()))
    final = engine.full_state_dict(rank0_only=False)
    if export_to is not None:
        checkpoint.save(export_to, model, engine)
    return _outcome(initial, final, held, built, export=final if export_to is not None else None)


BUFFER_VALUE = 0.5  # the plain buffer every Lightning cell's configure_model creates


def _lightning_entry(
    rank: int, build: Build, layout: Layout, fields: dict, pretrained: str, export_to, kind: str
) -> dict:
    import lightning as L
    import torchmetrics
    from torch.utils.data import DataLoader, TensorDataset

    import ds_strategy

    class Module(L.LightningModule):
        """Built in ``__init__`` (normally, or under ``trainer.init_module``) or in ``configure_model`` (in the
        strategy's sharded context), which also creates a buffer and a metric, never parameters, and applies the
        user's tensor-parallel plan for the builds that have one."""

        def __init__(self, empty: bool):
            super().__init__()
            self.empty = empty
            if not self.empty:
                self.model = build_model(0, layout.model)

        def configure_model(self):
            if self.empty and not hasattr(self, "model"):
                self.model = build_model(0, layout.model)
            freeze(self.model, kind)
            if build.user_plan and not hasattr(self, "metric"):
                user_parallelize(self.model, self.device_mesh["tensor_parallel"])
            if not hasattr(self, "metric"):
                self.register_buffer("scale", torch.full((4,), BUFFER_VALUE), persistent=False)
                self.metric = torchmetrics.MeanMetric()
            self.built = _as_built(self.model)

        def on_fit_start(self):
            if build.pretrained_seed is not None:
                self.trainer.strategy.load_pretrained(pretrained, prefix="model.")
            self.initial = self.trainer.strategy.engine.full_state_dict(rank0_only=False)
            self.extras = {"scale": self.scale.clone(), "metric_on_meta": self.metric.mean_value.is_meta}

        def training_step(self, batch, batch_idx):
            x, y = batch
            sp_group = self.device_mesh["sequence_parallel"].get_group() if layout.sp > 1 else None
            loss = _step_loss(layout, self.model, x, y, self.trainer.strategy.pipeline_step, sp_group)
            self.metric.update(loss.detach().float())
            return loss

        def on_train_end(self):
            self.extras["mean_loss"] = self.metric.compute().item()  # over every rank and step

        def configure_optimizers(self):
            several = make_optimizers(self.model, kind)  # chained: automatic optimization takes one optimizer
            return several[0] if len(several) == 1 else ds_strategy.ChainedOptimizer(*several)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=layout.world,
        strategy=ds_strategy.ZeroStrategy(**fields),
        max_steps=STEPS,
        max_epochs=1,
        **QUIET,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    if build.name == "init_module":
        with trainer.init_module(empty_init=True if fields["stage"] == 3 else None):
            module = Module(empty=False)
    else:
        module = Module(empty=build.empty_on(rank, layout))
    mine = _my_batches(layout, rank)
    data = TensorDataset(torch.cat([x for x, _ in mine]), torch.cat([y for _, y in mine]))
    trainer.fit(module, DataLoader(data, batch_size=len(mine[0][0])))
    final = trainer.strategy.engine.full_state_dict(rank0_only=False)
    held = set(dict(module.named_parameters())) | set(dict(module.named_buffers()))
    export = None
    if export_to is not None:
        export = _unprefixed(trainer.strategy.lightning_module_state_dict())
        trainer.save_checkpoint(export_to)
    outcome = _outcome(module.initial, final, held, module.built, module.extras, export)
    return {**outcome, "initial": _unprefixed(outcome["initial"]), "final": _unprefixed(outcome["final"])}


def _fabric_entry(rank: int, build: Build, layout: Layout, fields: dict, pretrained: str, export_to, kind: str) -> dict:
    import lightning as L

    from ds_strategy import ZeroFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=layout.world, strategy=ZeroFabricStrategy(**fields))
    fabric.launch()
    # init_module(empty_init=True) builds on meta under stage 3 only; below it means "leave uninitialised"
    model = _make(
        build, rank, layout, lambda: fabric.init_module(empty_init=True if fields["stage"] == 3 else None), kind
    )
    # (the "meta" and "init_module" builds are one path here: Fabric builds on meta only through init_module)
    built = _as_built(model)
    if build.user_plan:
        user_parallelize(model, fabric.strategy.device_mesh["tensor_parallel"])
    if kind == "frozen":  # litgpt's order: the model, then an optimizer over model.parameters()
        model = fabric.setup_module(model)
        stepping = fabric.setup_optimizers(*make_optimizers(model, kind))
        stepping = stepping if isinstance(stepping, tuple) else [stepping]
    else:
        model, *stepping = fabric.setup(model, *make_optimizers(model, kind))
    if build.pretrained_seed is not None:
        fabric.strategy.load_pretrained(pretrained)
    sp_group = fabric.strategy.device_mesh["sequence_parallel"].get_group() if layout.sp > 1 else None
    pipeline_step = functools.partial(fabric.strategy.pipeline_step, model)
    outcome = _train_prepared(
        fabric.strategy.engine,
        model,
        stepping,
        fabric.backward,
        _my_batches(layout, rank),
        layout,
        built,
        pipeline_step=pipeline_step,
        sp_group=sp_group,
    )
    if export_to is not None:
        outcome["export"] = fabric.strategy.get_module_state_dict(model)
        fabric.save(export_to, {"model": model, **{f"optimizer{i}": o for i, o in enumerate(stepping)}})
    return outcome


def _train_prepared(
    engine, model, optimizers, backward, my_batches, layout: Layout, built: dict, *, pipeline_step, sp_group
) -> dict:
    """The steps of a Fabric or Accelerate cell once the entry point has set the model up, over this rank's
    ``my_batches``: its own ``backward`` of the loss :func:`_step_loss` computes with its ``pipeline_step`` (bound
    to the model) and the mesh's ``sp_group`` (None without Ulysses), and each wrapped optimizer's
    ``step``/``zero_grad``, as a user's loop under it calls them."""
    initial = engine.full_state_dict(rank0_only=False)
    for x, y in my_batches:
        backward(_step_loss(layout, model, x, y, pipeline_step, sp_group))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    held = set(engine.module.state_dict())
    return _outcome(initial, engine.full_state_dict(rank0_only=False), held, built)


def _accelerate_entry(
    rank: int, build: Build, layout: Layout, fields: dict, pretrained: str, export_to, kind: str
) -> dict:
    from accelerate import init_empty_weights
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    from ds_strategy.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(layout.world), LOCAL_WORLD_SIZE=str(layout.world))
    accelerator = ZeroAccelerator(fields, cpu=True)
    model = _make(build, rank, layout, init_empty_weights, kind)
    built = _as_built(model)
    # the global batches in order, one data-parallel slice per loader batch: the prepared loader must hand this rank
    # its slice of each (the ranks of one sequence-parallel group or pipeline reading the same)
    every = batches(MODEL, STEPS, GLOBAL_BATCH)
    rows = TensorDataset(torch.cat([x for x, _ in every]), torch.cat([y for _, y in every]))
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // layout.dp)
    if kind == "frozen":  # the model first, then an optimizer over model.parameters()
        model, loader = accelerator.prepare(model, loader)
        stepping = [accelerator.prepare(*make_optimizers(model, kind))]
    else:
        model, *stepping, loader = accelerator.prepare(model, *make_optimizers(model, kind), loader)
    if build.pretrained_seed is not None:
        accelerator.load_pretrained(pretrained)
    sp_group = accelerator.torch_device_mesh["sp"].get_group() if layout.sp > 1 else None
    pipeline_step = functools.partial(accelerator.pipeline_step, model)
    outcome = _train_prepared(
        accelerator.engine,
        model,
        stepping,
        accelerator.backward,
        loader,
        layout,
        built,
        pipeline_step=pipeline_step,
        sp_group=sp_group,
    )
    if export_to is not None:
        outcome["export"] = accelerator.get_state_dict(model)
        accelerator.save_state(str(export_to))
    return outcome


def _deepspeed_entry(
    rank: int, build: Build, layout: Layout, fields: dict, pretrained: str, export_to, kind: str
) -> dict:
    """A ``deepspeed.initialize`` script: the model built under ``zero.Init`` for an empty build, the script's own
    optimizer, ``engine.backward``/``engine.step`` per batch."""
    import ds_strategy.deepspeed as deepspeed
    from ds_strategy.config import ZeroConfig

    config = ZeroConfig(**fields, train_micro_batch_size_per_gpu=GLOBAL_BATCH // layout.dp)
    with deepspeed.zero.Init(enabled=build.empty_on(rank, layout)):
        model = build_model(0)
    built = _as_built(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizers(model, kind)[0], config=config)
    initial = engine.zero.full_state_dict(rank0_only=False)
    for x, y in _my_batches(layout, rank):
        engine.backward(_plain_loss(engine, x, y))
        engine.step()
    final = engine.zero.full_state_dict(rank0_only=False)
    engine.destroy()
    return _outcome(initial, final, set(engine.module.state_dict()), built)


ENTRY_RUNNERS = {
    "deepspeed": _deepspeed_entry,
    "engine": _engine_entry,
    "lightning": _lightning_entry,
    "fabric": _fabric_entry,
    "accelerate": _accelerate_entry,
}


def run_cells(rank: int, world_size: int, cells: list[Cell], pretrained: str) -> dict:
    """Every cell in turn in one process group (starting ranks is the slow part); a cell refused (one of
    ``REFUSED_OPTIMIZER_CELLS``) gives the error it raised."""
    refused = {cell for cell, _ in (*REFUSED_OPTIMIZER_CELLS, *REFUSED_DEEPSPEED_CELLS)}
    outcomes = {}
    for cell in cells:
        if cell not in refused:
            outcomes[cell.id] = run_cell(rank, world_size, cell, pretrained)
            continue
        try:
            run_cell(rank, world_size, cell, pretrained)
            outcomes[cell.id] = {"refused": None}
        except (ValueError, NotImplementedError) as error:
            outcomes[cell.id] = {"refused": str(error)}
    return outcomes
