"""The composition matrix: {build} x {layout} x {ZeRO stage} x {entry point}, pruned to a pairwise-covering set of
cells, each trained on real gloo ranks and compared with one process training a normally built copy.

Every cell builds the same tiny Hugging Face Llama (``pipeline_runs.tiny_llama``: 4 layers, hidden 16, 4 heads, so
that Ulysses inside tensor parallelism has heads to split over tp x sp), hands it to an entry point under a layout,
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
checked against a bf16 reference (see ``test_composition_matrix``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from pipeline_runs import batches, loss_fn, tiny_llama

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
        return fields


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
STAGES = (0, 1, 2, 3)
ENTRIES = ("engine", "lightning", "fabric", "accelerate")


@dataclasses.dataclass(frozen=True)
class Build:
    """How every rank gets its model. ``empty_on(rank, layout)``: whether that rank builds it empty, in the entry
    point's own way (the engine: ``torch.device("meta")``; Lightning: in ``configure_model``, on meta under stage
    3; Fabric: ``init_module(empty_init=True)`` under stage 3, where it means meta; Accelerate:
    ``init_empty_weights()``), else normally under ``torch.manual_seed(0)``. ``fields``: the ZeroConfig fields it
    needs. ``pretrained_seed``: load, after setup, the weights a normal build under that seed saved
    (``load_pretrained``); the initial state must then equal that build instead. ``sync_module_states`` streams
    over the data-parallel group, as DDP's does: the first data-parallel replica (every tensor-parallel rank and
    pipeline stage of it) builds the model, the other replicas build it empty. ``init_module``: the entry points
    that have one (``entries``) build under ``trainer.init_module`` / ``fabric.init_module``, with
    ``empty_init=True`` under stage 3 (sharded on meta, then initialised) and the default below it (a normal build
    on the device; ``empty_init=True`` there means uninitialised memory, as under DDP)."""

    name: str
    empty_on: Callable[[int, Layout], bool]
    fields: tuple[tuple[str, object], ...] = ()
    pretrained_seed: int | None = None
    entries: tuple[str, ...] = ("engine", "lightning", "fabric", "accelerate")

    @property
    def seed(self) -> int:
        """The seed of the normal build the initial state must equal."""
        return 0 if self.pretrained_seed is None else self.pretrained_seed


BUILDS = {
    build.name: build
    for build in (
        Build("normal", lambda rank, layout: False),
        Build("meta", lambda rank, layout: True),
        Build("sync_module_states", lambda rank, layout: layout.dp_rank(rank) != 0, (("sync_module_states", True),)),
        Build("load_pretrained", lambda rank, layout: True, pretrained_seed=5),
        Build("init_module", lambda rank, layout: True, entries=("lightning", "fabric")),
    )
}


# Refused by the configuration itself, whatever the entry point: (fields, words of the error).
REFUSED_CONFIGS = (
    (
        {"tiled_loss": True, "pipeline_parallel_size": 2},
        "tiled_loss=True is not allowed with pipeline_parallel_size=2",
    ),
)


@dataclasses.dataclass(frozen=True)
class Cell:
    build: str
    layout: str
    stage: int
    entry: str
    precision: str = "32-true"

    @property
    def id(self) -> str:
        suffix = "" if self.precision == "32-true" else f"-{self.precision}"
        return f"{self.entry}-{self.layout.replace(' ', '')}-stage{self.stage}-{self.build}{suffix}"

    @property
    def axes(self) -> tuple:
        """The values of the four axes the pairwise set covers."""
        return self.build, self.layout, self.stage, self.entry

    def applies(self) -> bool:
        """Whether the entry point has the build path at all (only Lightning and Fabric have ``init_module``)."""
        return self.entry in BUILDS[self.build].entries


# The reported cases (a Lightning configure_model build on meta under dp x tp and under pp x dp, stage 3): always run.
REPORTED = (Cell("meta", "dp x tp", 3, "lightning"), Cell("meta", "pp x dp", 3, "lightning"))
# Issue 26, item 1: Lightning's init_module(empty_init=True) at stage 3 builds on meta, here cut over tp: always run.
REQUIRED = (*REPORTED, Cell("init_module", "tp", 3, "lightning"))

# init_module() under "bf16-true" (issue 26, item 10): 16-bit weights, built sharded (stage 3) and normally (stage 1).
BF16_CELLS = (
    Cell("init_module", "dp", 3, "lightning", "bf16-true"),
    Cell("init_module", "dp", 1, "lightning", "bf16-true"),
    Cell("init_module", "dp", 3, "fabric", "bf16-true"),
    Cell("init_module", "dp", 1, "fabric", "bf16-true"),
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


def build_model(seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_llama(BLOCKS, HEADS)
    model.config.use_cache = False  # training keeps no KV cache; a checkpointed layer's recomputation would extend it
    return model


def reference(seed: int, dtype: torch.dtype = torch.float32) -> dict:
    """One process, the normally built model (converted to ``dtype``), SGD at lr 1 on each whole global batch (mean
    token loss)."""
    torch.set_num_threads(1)
    model = build_model(seed).to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    losses = []
    for x, y in batches(MODEL, STEPS, GLOBAL_BATCH):
        loss = loss_fn(model(input_ids=x).logits, y)
        loss.backward()
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


def _make(build: Build, rank: int, layout: Layout, empty: Callable[[], contextlib.AbstractContextManager]):
    """The model under seed 0, built normally or, where ``build`` says so, under the context ``empty()`` (for
    ``init_module``, the entry point's)."""
    with empty() if build.empty_on(rank, layout) else contextlib.nullcontext():
        return build_model(0)


def run_cell(rank: int, world_size: int, cell: Cell, pretrained: str) -> dict:
    """Build, set up, (load,) record the initial state, train ``STEPS`` steps, record the final state."""
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes already exist: no entry point may launch
    build, layout = BUILDS[cell.build], LAYOUTS[cell.layout]
    fields = {"stage": cell.stage, "precision": cell.precision, **layout.fields(), **dict(build.fields)}
    return ENTRY_RUNNERS[cell.entry](rank, build, layout, fields, pretrained)


def _as_built(model: torch.nn.Module) -> dict:
    """Where and in which dtypes the parameters were created, before any setup."""
    return {
        "on_meta": any(p.is_meta for p in model.parameters()),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def _outcome(initial: dict, final: dict, held: set[str], built: dict, extras: dict | None = None) -> dict:
    """The tensors this rank holds (a pipeline stage's), under the uncut model's names."""
    return {
        "initial": {k: v for k, v in initial.items() if k in held},
        "final": {k: v for k, v in final.items() if k in held},
        **built,
        "extras": extras,
    }


def _unprefixed(state: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in state.items()}


def _engine_entry(rank: int, build: Build, layout: Layout, fields: dict, pretrained: str) -> dict:
    from ds_strategy.checkpoint.pretrained import load_weights
    from ds_strategy.compose import build_mesh, compose_model
    from ds_strategy.config import ZeroConfig

    config = ZeroConfig(**fields)
    mesh = build_mesh(config, "cpu")
    assert mesh.dp_rank == layout.dp_rank(rank)
    model = _make(build, rank, layout, lambda: torch.device("meta"))
    built = _as_built(model)
    optimizer = lambda: torch.optim.SGD(model.parameters(), lr=1.0)  # noqa: E731  over this rank's stages only
    composed = compose_model(model, optimizer, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None)
    engine, runner = composed.engine, composed.pipeline
    if build.pretrained_seed is not None:
        load_weights(engine, pretrained)
    initial = engine.full_state_dict(rank0_only=False)
    for x, y in _my_batches(layout, rank):
        if runner is not None:
            runner.train_step(*_pipeline_args(layout, x, y, mesh.sp_group), 1.0)
        else:
            engine.backward(_sp_loss(model, x, y, mesh.sp_group) if layout.sp > 1 else _plain_loss(model, x, y))
        engine.step()
    held = set(dict(model.named_parameters())) | set(dict(model.named_buffers()))
    return _outcome(initial, engine.full_state_dict(rank0_only=False), held, built)


BUFFER_VALUE = 0.5  # the plain buffer every Lightning cell's configure_model creates


def _lightning_entry(rank: int, build: Build, layout: Layout, fields: dict, pretrained: str) -> dict:
    import lightning as L
    import torchmetrics
    from torch.utils.data import DataLoader, TensorDataset

    import ds_strategy

    class Module(L.LightningModule):
        """Built in ``__init__`` (normally, or under ``trainer.init_module``) or in ``configure_model`` (in the
        strategy's sharded context), which also creates a buffer and a metric, never parameters."""

        def __init__(self, empty: bool):
            super().__init__()
            self.empty = empty
            if not self.empty:
                self.model = build_model(0)

        def configure_model(self):
            if self.empty and not hasattr(self, "model"):
                self.model = build_model(0)
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
            return torch.optim.SGD(self.model.parameters(), lr=1.0)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=layout.world,
        strategy=ds_strategy.ZeroStrategy(**fields),
        max_steps=STEPS,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
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
    outcome = _outcome(module.initial, final, held, module.built, module.extras)
    return {**outcome, "initial": _unprefixed(outcome["initial"]), "final": _unprefixed(outcome["final"])}


def _fabric_entry(rank: int, build: Build, layout: Layout, fields: dict, pretrained: str) -> dict:
    import lightning as L

    from ds_strategy import ZeroFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=layout.world, strategy=ZeroFabricStrategy(**fields))
    fabric.launch()
    # init_module(empty_init=True) builds on meta under stage 3 only; below it means "leave uninitialised"
    model = _make(build, rank, layout, lambda: fabric.init_module(empty_init=True if fields["stage"] == 3 else None))
    # (the "meta" and "init_module" builds are one path here: Fabric builds on meta only through init_module)
    built = _as_built(model)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    if build.pretrained_seed is not None:
        fabric.strategy.load_pretrained(pretrained)
    sp_group = fabric.strategy.device_mesh["sequence_parallel"].get_group() if layout.sp > 1 else None
    pipeline_step = functools.partial(fabric.strategy.pipeline_step, model)
    return _train_prepared(
        fabric.strategy.engine,
        model,
        optimizer,
        fabric.backward,
        _my_batches(layout, rank),
        layout,
        built,
        pipeline_step=pipeline_step,
        sp_group=sp_group,
    )


def _train_prepared(
    engine, model, optimizer, backward, my_batches, layout: Layout, built: dict, *, pipeline_step, sp_group
) -> dict:
    """The steps of a Fabric or Accelerate cell once the entry point has set the model up, over this rank's
    ``my_batches``: its own ``backward`` of the loss :func:`_step_loss` computes with its ``pipeline_step`` (bound
    to the model) and the mesh's ``sp_group`` (None without Ulysses), and the wrapped optimizer's
    ``step``/``zero_grad``, as a user's loop under it calls them."""
    initial = engine.full_state_dict(rank0_only=False)
    for x, y in my_batches:
        backward(_step_loss(layout, model, x, y, pipeline_step, sp_group))
        optimizer.step()
        optimizer.zero_grad()
    held = set(engine.module.state_dict())
    return _outcome(initial, engine.full_state_dict(rank0_only=False), held, built)


def _accelerate_entry(rank: int, build: Build, layout: Layout, fields: dict, pretrained: str) -> dict:
    from accelerate import init_empty_weights
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    from ds_strategy.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(layout.world), LOCAL_WORLD_SIZE=str(layout.world))
    accelerator = ZeroAccelerator(fields, cpu=True)
    model = _make(build, rank, layout, init_empty_weights)
    built = _as_built(model)
    # the global batches in order, one data-parallel slice per loader batch: the prepared loader must hand this rank
    # its slice of each (the ranks of one sequence-parallel group or pipeline reading the same)
    every = batches(MODEL, STEPS, GLOBAL_BATCH)
    rows = TensorDataset(torch.cat([x for x, _ in every]), torch.cat([y for _, y in every]))
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // layout.dp)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), loader)
    if build.pretrained_seed is not None:
        accelerator.load_pretrained(pretrained)
    sp_group = accelerator.torch_device_mesh["sp"].get_group() if layout.sp > 1 else None
    pipeline_step = functools.partial(accelerator.pipeline_step, model)
    return _train_prepared(
        accelerator.engine,
        model,
        optimizer,
        accelerator.backward,
        loader,
        layout,
        built,
        pipeline_step=pipeline_step,
        sp_group=sp_group,
    )


ENTRY_RUNNERS = {
    "engine": _engine_entry,
    "lightning": _lightning_entry,
    "fabric": _fabric_entry,
    "accelerate": _accelerate_entry,
}


def run_cells(rank: int, world_size: int, cells: list[Cell], pretrained: str) -> dict:
    """Every cell in turn in one process group (starting ranks is the slow part)."""
    return {cell.id: run_cell(rank, world_size, cell, pretrained) for cell in cells}
