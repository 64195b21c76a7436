"""The runs the communication tests measure, several ZeroConfigs per process group (spawning ranks is the slow
part): each step's bytes per collective kind and process group, the order of gradient hooks and collective
launches, the losses and final parameters; and a Lightning fit with its logged metrics.

``two_rank_runs()`` and ``four_rank_runs()`` run everything once per pytest session; the test modules read
the results.
"""

import functools
import time
from dataclasses import dataclass

import lightning as L
import models
import torch
import torch.nn.functional as F
from distributed import run_ranks, set_lightning_environment
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy.comm.quantized import BLOCK_SIZE
from ds_strategy.config import ZeroConfig
from ds_strategy.data import stdlib_tokens
from ds_strategy.zero.engine import ZeroEngine

NATIVE = {"gradient_reduction": "reduce_scatter"}  # the sharded collectives themselves, not their all-reduce stand-ins
PARTITION_ALL = {"param_persistence_threshold": 0}
# In the recorded step rank 1 pauses at its first gradient, before it launches any reduction, so rank 0's first
# reduction cannot have completed when rank 0 checks it right after launching it. Without the pause, whether a
# reduction is still in flight at that check is a race gloo often wins on an idle machine (the engine retires
# completed reductions at once), and "a reduction overlaps backward" could not be observed reliably.
PEER_DELAY_S = 0.2
# The tiny GPT (29.5k elements) fits one default bucket, which launches at the last gradient: buckets of about one of
# its blocks (12.7k) make several, the first launched while backward still produces gradients.
BLOCK_BUCKETS = {"reduce_bucket_size": 13_000}


@dataclass(frozen=True)
class Run:
    """One training run: model, steps, ZeroConfig fields, and at which step to record hook/launch events."""

    zero: dict
    steps: int = 3
    model: str = "TinyGPT"
    per_rank_batch: int = 4
    lr: float = 1e-2
    record_step: int | None = None
    text: bool = False  # learnable text (the standard library's source) instead of random tokens


def train(rank: int, world_size: int, run: Run) -> dict:
    """Train ``run``; return per-step comm stats deltas per group, events, losses, params and the unit layout."""
    torch.manual_seed(0)
    model = getattr(models, run.model)()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=run.lr, betas=(0.9, 0.99), eps=1e-6)
    engine = ZeroEngine(model, optimizer, ZeroConfig(**run.zero))
    events, recording = [], [False]

    def on_collective(event: str, kind: str, label: str, nbytes: int) -> None:
        if recording[0]:
            events.append((event, kind, label))

    def note(what: str, name: str) -> None:
        if recording[0]:
            if what == "grad" and rank == 1 and not any(event[0] == "grad" for event in events):
                time.sleep(PEER_DELAY_S)  # see PEER_DELAY_S
            events.append((what, name))

    engine.collectives.observers.append(on_collective)
    for name, p in model.named_parameters():  # registered after the engine's: each runs after the engine's hook
        p.register_post_accumulate_grad_hook(lambda p, name=name: note("grad", name))
    for i, block in enumerate(model.blocks):  # likewise after the engine's gather in the forward pre-hook
        block.register_forward_pre_hook(lambda module, args, i=i: note("forward", f"blocks.{i}"))
    generator = torch.Generator().manual_seed(1234)
    last = {group: engine.comm_stats(group) for group in engine.comm_groups}
    steps, losses = [], []
    for step in range(run.steps):
        batch = (_text_batch if run.text else model.make_batch)(generator, run.per_rank_batch * world_size)
        mine = tuple(t[rank * run.per_rank_batch : (rank + 1) * run.per_rank_batch] for t in batch)
        recording[0] = step == run.record_step
        loss = model(mine)
        loss.backward()
        if recording[0]:
            events.append(("backward returned",))
        recording[0] = False
        engine.step()
        losses.append(loss.item())
        now = {group: engine.comm_stats(group) for group in engine.comm_groups}
        steps.append(
            {
                group: {kind: now[group][kind]["bytes"] - last[group][kind]["bytes"] for kind in now[group]}
                for group in now
            }
        )
        last = now
    return {
        "steps": steps,
        "events": events,
        "losses": losses,
        "params": engine.full_state_dict(rank0_only=False),
        "units": [[(fp.numel, fp.padded_numel, fp.shard_numel) for fp in unit.flat_params] for unit in engine.units],
    }


@functools.cache
def _text_tokens() -> torch.Tensor:
    return stdlib_tokens(vocab_size=96, byte_budget=200_000)


def _text_batch(generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the tiny GPT's block size from the standard library's source."""
    tokens, block = _text_tokens(), models.TinyGPT().config.block_size
    starts = torch.randint(len(tokens) - block - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + block + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def train_all(rank: int, world_size: int, runs: dict) -> dict:
    torch.set_num_threads(1)
    return {
        name: train(rank, world_size, run) if isinstance(run, Run) else run(rank, world_size)
        for name, run in runs.items()
    }


# -- qgZ by value -------------------------------------------------------------------------------------------------
PER_RANK_QGZ = 4
QGZ_VARIANTS = {
    "plain": {},
    "int4": {"zero_quantized_gradients": True},
    "int8": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 8},
}


def _local_flat_gradients(engine: ZeroEngine, model: torch.nn.Module, batch, world_size: int) -> list[list]:
    """Per rank, per flat buffer of ``engine``: the gradient that rank's slice gives on its own, laid out flat as the
    buffer lays out its parameters (zero padding), from a normally built copy in this process."""
    names = {id(p): name for name, p in model.named_parameters()}
    flats = []
    for rank in range(world_size):
        torch.manual_seed(0)
        plain = models.TinyGPT()
        plain(tuple(t[rank * PER_RANK_QGZ : (rank + 1) * PER_RANK_QGZ] for t in batch)).backward()
        grads = {name: p.grad for name, p in plain.named_parameters()}
        per_buffer = []
        for fp in engine.flat_params:
            flat = torch.zeros(fp.padded_numel)
            for p, slot in zip(fp.params, fp.slots):
                flat[slot.offset : slot.offset + slot.numel] = grads[names[id(p)]].reshape(-1)
            per_buffer.append(flat)
        flats.append(per_buffer)
    return flats


def qgz_one_backward(rank: int, world_size: int) -> dict:
    """One backward of the tiny GPT under stage 3, unquantised and under qgZ at 4 and 8 bits: per flat buffer, the
    reduced gradient shard the optimizer would step with, the exact mean of the ranks' local gradients over that
    shard, and the bound quantisation may move it by (each rank's chunk is off by at most half a step of its block's
    scale, ``max|x| / qmax / 2``; the shard is their sum over the ranks, divided by their number)."""
    torch.set_num_threads(1)
    batch = models.TinyGPT.make_batch(torch.Generator().manual_seed(1234), PER_RANK_QGZ * world_size)
    mine = tuple(t[rank * PER_RANK_QGZ : (rank + 1) * PER_RANK_QGZ] for t in batch)
    return {name: _reduced_shards(rank, world_size, batch, mine, options) for name, options in QGZ_VARIANTS.items()}


def _reduced_shards(rank: int, world_size: int, batch, mine, options: dict) -> list[dict]:
    torch.manual_seed(0)
    model = models.TinyGPT()
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), ZeroConfig(stage=3, **NATIVE, **options))
    model(mine).backward()
    bits = options.get("zero_quantized_gradients_bits", 4)
    qmax = 2 ** (bits - 1) - 1
    shards = []
    for fp, local in zip(engine.flat_params, zip(*_local_flat_gradients(engine, model, batch, world_size))):
        window = slice(fp.shard_offset, fp.shard_offset + fp.shard_numel)
        chunks = torch.stack([flat[window] for flat in local])  # [ranks, shard]
        blocks = -(-fp.shard_numel // BLOCK_SIZE) * BLOCK_SIZE
        block_max = F.pad(chunks.abs(), (0, blocks - fp.shard_numel)).view(world_size, -1, BLOCK_SIZE).amax(dim=2)
        bound = (block_max / qmax / 2).repeat_interleave(BLOCK_SIZE, dim=1)[:, : fp.shard_numel].sum(dim=0)
        shards.append(
            {
                "name": fp.name,
                "reduced": engine.reducer.reduced_grad(fp).float().clone(),
                "exact": chunks.mean(dim=0),
                "bound": bound / world_size,
            }
        )
    engine.remove_hooks()
    return shards


# -- Lightning ---------------------------------------------------------------------------------------------------
class MetricsLogger(Logger):
    """Keeps what Lightning logs, step by step."""

    def __init__(self):
        super().__init__()
        self.metrics: list[dict] = []

    name = "memory"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class GPTModule(L.LightningModule):
    def configure_model(self):
        if not hasattr(self, "gpt"):
            torch.manual_seed(0)
            self.gpt = models.TinyGPT()

    def training_step(self, batch, batch_idx):
        return self.gpt(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(models.param_groups(self.gpt), lr=1e-2)


def fit_logging(rank: int, world_size: int, log_comm_stats: bool = True, steps: int = 3) -> dict:
    """A Trainer fit of the tiny GPT under stage 2 (sharded collectives); what its logger received."""
    import ds_strategy

    set_lightning_environment(rank)
    idx, targets = models.TinyGPT.make_batch(torch.Generator().manual_seed(rank), 4 * steps)
    logger = MetricsLogger()
    strategy = ds_strategy.ZeroStrategy(stage=2, log_comm_stats=log_comm_stats, **NATIVE)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(GPTModule(), DataLoader(TensorDataset(idx, targets), batch_size=4))
    return {
        "metrics": logger.metrics,
        "comm_stats": trainer.strategy.comm_stats(),
        "padded": sum(fp.padded_numel for fp in trainer.strategy.engine.flat_params),
    }


def lightning_runs(rank: int, world_size: int) -> dict:
    return {"on": fit_logging(rank, world_size, True), "off": fit_logging(rank, world_size, False)}


# -- the sessions' runs ------------------------------------------------------------------------------------------
def _two_rank_plan() -> dict:
    plan = {f"accounting stage {s}": Run({"stage": s, **NATIVE, **PARTITION_ALL}) for s in (1, 2, 3)}
    plan["accounting stage 2, all-reduce"] = Run({"stage": 2, "gradient_reduction": "all_reduce"})
    for stage in (1, 2, 3):
        for overlap in (True, False):
            plan[f"overlap stage {stage} {overlap}"] = Run(
                {"stage": stage, "overlap_comm": overlap, **PARTITION_ALL, **BLOCK_BUCKETS}, steps=4, record_step=2
            )
    for name, options in {
        "plain": {},
        "qwZ": {"zero_quantized_weights": True},
        "qgZ": {"zero_quantized_gradients": True},
        "qgZ int8": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 8},
        "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    }.items():
        plan[f"zero++ {name}"] = Run({"stage": 3, **NATIVE, **PARTITION_ALL, **options}, steps=50, text=True)
    plan["zero++ plain bf16"] = Run({"stage": 3, "precision": "bf16-mixed", **NATIVE, **PARTITION_ALL})
    plan["lightning"] = lightning_runs
    return plan


def _four_rank_plan() -> dict:
    plan = {f"accounting stage {s}": Run({"stage": s, **NATIVE, **PARTITION_ALL}, per_rank_batch=2) for s in (1, 2, 3)}
    for name, options in {
        "plain": {},
        "hpZ": {"zero_hpz_partition_size": 2},
        "qwZ": {"zero_quantized_weights": True},
        "qwZ+hpZ": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
    }.items():
        plan[f"zero3 {name}"] = Run({"stage": 3, **NATIVE, **PARTITION_ALL, **options}, steps=4, per_rank_batch=2)
    return plan


@functools.cache
def two_rank_runs() -> list[dict]:
    return run_ranks(train_all, 2, _two_rank_plan(), timeout=400)


@functools.cache
def four_rank_runs() -> list[dict]:
    return run_ranks(train_all, 4, _four_rank_plan(), timeout=400)


def model_numels(model_name: str = "TinyGPT") -> dict:
    """Ψ of the whole model, of the root unit (what no block owns) and of each block, counted from the model."""
    model = getattr(models, model_name)()
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "root": total - sum(blocks), "blocks": blocks}
