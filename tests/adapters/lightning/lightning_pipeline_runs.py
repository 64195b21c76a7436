"""One LightningModule trained by the Trainer on ZeroStrategy with and without pipeline parallelism, on real gloo
ranks, and the one-process reference it must match (``pipeline_runs``' models, data and optimizers).

The module's steps call ``self.trainer.strategy.pipeline_step(inputs, target, loss_fn)`` and nothing else, so the
same code runs at any pipeline size. Data-parallel rank r's loader holds the r-th slice of every global batch, the
``pipeline_runs`` split, and every stage of one pipeline reads the same (the strategy's sampler arguments must say
so; the Trainer's own sampler is off because it shuffles training data).
"""

import lightning as L
import torch
import torch.distributed as dist
from distributed import set_lightning_environment
from lightning.pytorch.loggers import Logger
from pipeline_runs import MODELS, batches, full_output, loss_fn, optimizer_for, train_reference
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy

MODEL, BLOCKS, GLOBAL_BATCH, STEPS, ACCUMULATE, VAL_BATCHES = "gpt", 4, 8, 3, 2, 2


class PipelinedLM(L.LightningModule):
    """Any model ``pipeline_layout`` finds; ``forward`` returns what the last stage returns (the logits)."""

    def __init__(self, optimizer: str = "adamw"):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights as pipeline_runs' reference
        self.model = MODELS[MODEL](BLOCKS)
        self.optimizer = optimizer
        self.train_losses, self.val_losses = [], []

    def forward(self, x):
        return full_output(MODEL, self.model, x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.trainer.strategy.pipeline_step(x, y, loss_fn)
        self.train_losses.append(float(loss))
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = self.trainer.strategy.pipeline_step(x, y, loss_fn)
        self.val_losses.append((self.trainer.sanity_checking, float(loss)))
        self.log("val_loss", loss, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        return optimizer_for(self.model, self.optimizer)


class MemoryLogger(Logger):
    """Every metric the Trainer logs on this rank (Lightning's own loggers write on rank 0 only)."""

    def __init__(self):
        super().__init__()
        self.metrics: list[dict] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass


def _loader(data: list, dp: int, dp_rank: int) -> DataLoader:
    """Data-parallel rank ``dp_rank``'s slice of every global batch, in order (the Trainer's sampler would shuffle)."""
    per_rank = GLOBAL_BATCH // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return DataLoader(TensorDataset(*(torch.cat([pair[i][rows] for pair in data]) for i in (0, 1))), per_rank)


def fit(
    rank: int,
    world_size: int,
    pp: int,
    stage: int = 1,
    clip: float | None = None,
    save: str | None = None,
    resume: str | None = None,
    **fields,
) -> dict:
    """Fit ``PipelinedLM`` for ``STEPS`` optimizer steps of ``ACCUMULATE`` batches, validating before (the sanity
    check) and after; return what each rank saw and its parameters under the reference's names."""
    set_lightning_environment(rank)
    torch.set_num_threads(1)
    module = PipelinedLM()
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ds_strategy.ZeroStrategy(stage=stage, pipeline_parallel_size=pp, **fields),
        max_steps=STEPS,
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=clip,
        num_sanity_val_steps=VAL_BATCHES,
        limit_val_batches=VAL_BATCHES,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    dp = world_size // pp
    data = batches(MODEL, STEPS * ACCUMULATE, GLOBAL_BATCH)
    dp_rank = rank % dp  # pipeline stages are the mesh's outer dimension
    trainer.fit(module, _loader(data, dp, dp_rank), _loader(data[:VAL_BATCHES], dp, dp_rank), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    strategy = trainer.strategy
    state = strategy.engine.full_state_dict(rank0_only=False)
    held = dict(module.named_parameters())
    return {
        "train": _mean_over_dp(module.train_losses, strategy),
        "val": dict(zip(("before", "after"), _by_phase(module.val_losses, strategy))),
        "logged": [{k: v for k, v in m.items() if k in ("train_loss", "val_loss")} for m in logger.metrics],
        "params": {_unprefixed(n): v for n, v in state.items() if n in held},
        "tied": {_unprefixed(k): _unprefixed(v) for k, v in strategy.engine.saved_as.items()},
        "sampler": strategy.distributed_sampler_kwargs,
        "mesh": strategy.parallel_mesh.mesh.mesh_dim_names if strategy.parallel_mesh is not None else None,
    }


def _by_phase(val_losses: list[tuple[bool, float]], strategy) -> tuple[list[float], list[float]]:
    """The sanity check's validation losses (initial weights) and the epoch-end ones (trained weights)."""
    values = _mean_over_dp([v for _, v in val_losses], strategy)
    return [v for (s, _), v in zip(val_losses, values) if s], [v for (s, _), v in zip(val_losses, values) if not s]


def _unprefixed(name: str) -> str:
    return name.removeprefix("model.")


def _mean_over_dp(values: list[float], strategy) -> list[float]:
    """The mean over data-parallel ranks (each rank's loss is its slice's mean; slices are equal in size)."""
    if not values:
        return []
    tensor = torch.tensor(values, dtype=torch.float64)
    mesh = strategy.parallel_mesh
    group, size = (mesh.dp_group, mesh.dp_size) if mesh is not None else (None, dist.get_world_size())
    dist.all_reduce(tensor, group=group)
    return (tensor / size).tolist()


def reference(clip: float = 0.0) -> dict:
    """One process on whole global batches: the training losses and parameters, and the mean validation loss over
    the first ``VAL_BATCHES`` global batches before and after training."""
    result = train_reference(MODEL, STEPS, GLOBAL_BATCH, ACCUMULATE, "adamw", clip, BLOCKS)
    val = batches(MODEL, VAL_BATCHES, GLOBAL_BATCH)
    torch.manual_seed(0)
    model = MODELS[MODEL](BLOCKS)
    result["val_before"] = _eval(model, val)
    model.load_state_dict(result["params"], strict=False)
    result["val_after"] = _eval(model, val)
    return result


@torch.no_grad()
def _eval(model, data: list) -> list[float]:
    return [float(loss_fn(full_output(MODEL, model, x), y)) for x, y in data]
