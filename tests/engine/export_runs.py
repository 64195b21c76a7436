"""Rank bodies for tests/engine/test_export_masters.py: train under "-mixed" precision through every entry point and
record what each one's export returns beside the masters the optimizer updated, assembled here from every rank's
``FlatParam.master`` (not through the engine's export code), and what ``consolidate`` writes of the same run.

Every run uses a learning rate whose updates (``LR`` per Adam step) stay below half an ulp of the 16-bit compute
copy for nearly every weight, so the compute copy barely moves while the masters move everywhere: an export that
read the compute copy would return (nearly) the initial weights. All runs of one test module share one process
group (starting ranks is the slow part); rank 0 consolidates what the run saved, in the run, so that a DDP resume
can follow in the same process group.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from distributed import set_lightning_environment, set_torchrun_environment
from quiet_trainer import QUIET
from torch import nn

LR = 1e-6  # Adam moves each weight by about LR a step: far below a bf16 (or fp16) half-ulp of a weight near 0.1
STEPS = 3
FP16 = {"initial_scale_power": 8}  # no fp16 overflow of this small model's gradients: every step is taken
EXTRA = {"bf16-mixed": {}, "16-mixed": FP16}


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def _first_names(engine) -> dict[int, str]:
    first: dict[int, str] = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), name)
    return first


def _whole(engine, fp, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (laid out like ``fp.master``) over the whole flat layout: every rank's shard, concatenated."""
    mine = tensor.detach().cpu().clone()
    if not fp.policy.optimizer:
        return mine
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, mine)
    return torch.cat(shards)


def gathered_masters(engine) -> dict[str, torch.Tensor]:
    """Each trainable parameter's master by ``state_dict`` name, in the master's dtype."""
    names, result = _first_names(engine), {}
    for fp in engine.flat_params:
        whole = _whole(engine, fp, fp.master)
        for slot, p in zip(fp.slots, fp.params):
            result[names[id(p)]] = whole.narrow(0, slot.offset, slot.numel).view(slot.shape)
    return result


def gathered_optimizer_state(engine, key: str) -> dict[str, torch.Tensor]:
    """Each trainable parameter's elementwise optimizer state ``key`` (Adam's ``exp_avg``) by name."""
    names, result = _first_names(engine), {}
    for fp in engine.flat_params:
        whole = _whole(engine, fp, engine.optimizer.state[fp.master][key])
        for slot, p in zip(fp.slots, fp.params):
            result[names[id(p)]] = whole.narrow(0, slot.offset, slot.numel).view(slot.shape)
    return result


def compute_copies(engine) -> dict[str, torch.Tensor]:
    """Each trainable parameter as the forward reads it (the 16-bit copy under "-mixed"), by name."""
    names = _first_names(engine)
    with engine.gathered_parameters():
        return {names[id(p)]: p.detach().clone() for fp in engine.flat_params for p in fp.params}


def _outcome(engine, export: dict, initial: dict, **more) -> dict:
    """What every run reports: the export, the masters, the compute copy, the initial weights."""
    return {
        "export": {k: v.detach().cpu().clone() for k, v in export.items()},
        "masters": gathered_masters(engine),
        "compute": compute_copies(engine),
        "initial": initial,
        **more,
    }


def _consolidated(path: Path, out: Path, **options) -> dict | None:
    """Rank 0 consolidates the checkpoint at ``path`` (after every rank wrote it) and returns what it wrote."""
    from ds_strategy.checkpoint import consolidate

    dist.barrier()
    loaded = None
    if dist.get_rank() == 0:
        loaded = torch.load(consolidate(path, out, **options), weights_only=False)
    dist.barrier()
    return loaded


# -- the engine, every stage and both 16-bit precisions, offload -------------------------------------------------
def engine_run(rank: int, tmp: Path, name: str, stage: int, precision: str, dtype=torch.float32, **fields) -> dict:
    from ds_strategy import checkpoint
    from ds_strategy.compose import compose_model
    from ds_strategy.config import ZeroConfig
    from ds_strategy.precision import autocast_for

    model = mlp().to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = ZeroConfig(stage=stage, precision=precision, param_persistence_threshold=0, **fields)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = compose_model(
        model, config, mesh=None, device=torch.device("cpu"), log=lambda _: None, optimizers=[optimizer]
    ).engine
    at_start = engine.full_state_dict(rank0_only=False)
    stepped = []
    for step in range(STEPS):
        with autocast_for(precision, "cpu"):
            engine.backward(loss_of(model(batch(step, rank).to(dtype))))
        stepped.append(engine.step())
    checkpoint.save(tmp / name, model, engine)
    outcome = _outcome(engine, engine.full_state_dict(rank0_only=False), initial, at_start=at_start, stepped=stepped)
    outcome["compute_export"] = engine.full_compute_state_dict(rank0_only=False)  # the named 16-bit export
    outcome["consolidated"] = _consolidated(tmp / name, tmp / f"{name}.pt")
    engine.remove_hooks()
    return outcome


ENGINE_RUNS = {
    **{
        f"{precision}-stage{stage}": {"stage": stage, "precision": precision, **extra}
        for precision, extra in EXTRA.items()
        for stage in (0, 1, 2, 3)
    },
    "bf16-mixed-stage3-nvme": {"stage": 3, "precision": "bf16-mixed", "offload": "nvme"},
    "bf16-mixed-stage2-bf16-model": {"stage": 2, "precision": "bf16-mixed", "dtype": torch.bfloat16},
}


def _engine_runs(rank: int, tmp: Path) -> dict:
    results = {}
    for name, spec in ENGINE_RUNS.items():
        spec = dict(spec)
        if spec.pop("offload", None) == "nvme":
            spec.update(offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp / "nvme"))
        results[name] = engine_run(rank, tmp, name, **spec)
    return results


# -- Lightning: Lightning's FSDP test_strategy_save_optimizer_states, in spirit ------------------------------------
class Mlp(L.LightningModule):
    """The MLP with saved hyperparameters and AdamW (state a DDP resume must get back)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        return loss_of(self.net(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        rows = torch.cat([batch(step, self.global_rank) for step in range(STEPS)])
        return torch.utils.data.DataLoader(rows, batch_size=8)


def _trainer(world_size: int, strategy, **kwargs) -> L.Trainer:
    set_lightning_environment(dist.get_rank())
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        **QUIET,
        use_distributed_sampler=False,
        **kwargs,
    )


def lightning_run(rank: int, world_size: int, tmp: Path, name: str, ddp_resume: bool, **strategy) -> dict:
    """Fit under ``ZeroStrategy(**strategy)``, save, consolidate with and without the optimizer; then (``ddp_resume``)
    fit under DDP from the consolidated file: a resume at the last step, which trains no further."""
    from ds_strategy import ZeroStrategy

    module = Mlp()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = _trainer(world_size, ZeroStrategy(param_persistence_threshold=0, **strategy))
    trainer.fit(module)
    trainer.save_checkpoint(tmp / name)
    engine = trainer.strategy.engine
    outcome = _outcome(engine, trainer.strategy.lightning_module_state_dict(), initial)
    outcome["exp_avg"] = gathered_optimizer_state(engine, "exp_avg")
    outcome["exp_avg_sq"] = gathered_optimizer_state(engine, "exp_avg_sq")
    outcome["weights_only"] = _consolidated(tmp / name, tmp / f"{name}.ckpt")
    _consolidated(tmp / name, tmp / f"{name}-full.ckpt", weights_only=False)
    if rank == 0:
        loaded = Mlp.load_from_checkpoint(tmp / f"{name}.ckpt")
        outcome["loaded"] = {"state": loaded.state_dict(), "hparams": dict(loaded.hparams)}
    if ddp_resume:
        ddp = _trainer(world_size, "ddp")
        ddp.fit(Mlp(), ckpt_path=tmp / f"{name}-full.ckpt")
        outcome["ddp"] = {
            "state": ddp.strategy.lightning_module_state_dict(),
            "optimizer": ddp.strategy.optimizer_state(ddp.optimizers[0]),
            "global_step": ddp.global_step,
        }
    return outcome


# -- Fabric, Accelerate, the Hugging Face Trainer ------------------------------------------------------------------
def fabric_run(rank: int, world_size: int, tmp: Path, name: str, **strategy) -> dict:
    """``precision`` goes to the strategy: on CPU Fabric turns its own "16-mixed" flag into "bf16-mixed"."""
    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(**strategy))
    fabric.launch()
    model = mlp()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    for step in range(STEPS):
        fabric.backward(loss_of(model(batch(step, rank))))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp / name, {"model": model, "optimizer": optimizer})
    outcome = _outcome(fabric.strategy.engine, fabric.strategy.get_module_state_dict(model), initial)
    outcome["consolidated"] = _consolidated(tmp / name, tmp / f"{name}.pt")
    return outcome


def accelerate_run(rank: int, world_size: int, tmp: Path, name: str, mixed_precision: str, zero: dict) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from ds_strategy.accelerate import ZeroAccelerator
    from ds_strategy.accelerate.checkpointing import SHARDED_DIR

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    set_torchrun_environment(rank, world_size)  # as torchrun left it (Lightning's runs changed it)
    accelerator = ZeroAccelerator(zero, cpu=True, mixed_precision=mixed_precision)
    model = mlp()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    for step in range(STEPS):
        accelerator.backward(loss_of(model(batch(step, rank))))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp / name))
    outcome = _outcome(accelerator.engine_of(model), accelerator.get_state_dict(model), initial)
    outcome["consolidated"] = _consolidated(tmp / name / SHARDED_DIR, tmp / f"{name}.pt")
    return outcome


def trainer_run(rank: int, world_size: int, tmp: Path, name: str, precision: dict, zero: dict) -> dict:
    """``ZeroTrainer`` with ``TrainingArguments(**precision)``; ``save_model`` writes the export."""
    import hf_trainer_runs as runs
    from safetensors.torch import load_file

    from ds_strategy.transformers import ZeroTrainer

    runs._fresh_state()
    set_torchrun_environment(rank, world_size)
    args = runs.arguments(
        tmp / name,
        max_steps=STEPS,
        learning_rate=LR,
        warmup_steps=0,
        max_grad_norm=0.0,
        eval_strategy="no",
        save_strategy="no",
        **precision,
    )
    model = runs._model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ZeroTrainer(model=model, args=args, train_dataset=runs.TokenRows(runs.SAMPLES, 1), zero_config=zero)
    trainer.train()
    trainer.save_model(str(tmp / name / "final"))
    dist.barrier()
    saved = load_file(tmp / name / "final" / "model.safetensors") if rank == 0 else {}
    return _outcome(trainer.zero_engine, saved, initial)


def every_entry_point(rank: int, world_size: int, tmp: str) -> dict:
    """Every run of tests/engine/test_export_masters.py, in one process group."""
    torch.set_num_threads(1)
    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    results = {f"engine {name}": outcome for name, outcome in _engine_runs(rank, tmp).items()}
    results["lightning bf16-mixed stage3"] = lightning_run(
        rank, world_size, tmp, "lightning-bf16", ddp_resume=True, stage=3, precision="bf16-mixed"
    )
    results["lightning 16-mixed stage1"] = lightning_run(
        rank, world_size, tmp, "lightning-fp16", ddp_resume=False, stage=1, precision="16-mixed", **FP16
    )
    results["fabric 16-mixed stage2 optimizer on cpu"] = fabric_run(
        rank, world_size, tmp, "fabric", precision="16-mixed", stage=2, offload_optimizer="cpu", **FP16
    )
    results["accelerate bf16 stage3 all on cpu"] = accelerate_run(
        rank,
        world_size,
        tmp,
        "accelerate",
        "bf16",
        {"stage": 3, "param_persistence_threshold": 0, "offload_optimizer": "cpu", "offload_params": "cpu"},
    )
    results["hf trainer bf16 stage3"] = trainer_run(rank, world_size, tmp, "trainer", {"bf16": True}, {"stage": 3})
    return results
