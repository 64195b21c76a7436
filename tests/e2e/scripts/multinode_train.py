"""A few ZeRO-3 + hpZ + NVMe-offload steps under whatever launcher started this process, and a record per rank of
where it ran and what it ended with: what the simulated multi-node tests compare.

    python -m torch.distributed.run --nnodes 2 --node_rank 0 --nproc_per_node 2 --rdzv_backend c10d \\
        --rdzv_endpoint 127.0.0.1:PORT multinode_train.py engine OUT_DIR            (and node_rank 1 alongside)
    NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python multinode_train.py lightning OUT_DIR 2   (and 1)
    ds-strategy launch --config_file two_machines.yaml multinode_train.py accelerate OUT_DIR  (machine_rank 0, 1)

The entry point is the first argument: "engine" (a bare ``ZeroEngine`` on ``env://``), "lightning" (``Trainer(
num_nodes=2, devices=2)``: Lightning's own launcher, or TorchElasticEnvironment under torchrun) or "accelerate"
(``ZeroAccelerator``, its settings from ``$DS_STRATEGY_CONFIG``); "lightning" takes the number of nodes, of the
four ranks, as a third argument. Every mode trains the same model on the same global batches, each rank its slice
by global rank, so a run on two simulated nodes must end bit for bit where a run on one node of four ranks does.
The test tells each "node" apart by ``$SIM_NODE`` (set per agent) and gives it its own ``$NVME_PATH``, as a real
node has its own local disk.

Writes OUT_DIR/rank<R>.pt (the whole parameters, fp32, by name without the framework's prefix, and the rank's
identity: RANK, LOCAL_RANK, its node, its hpZ group's global ranks, its NVMe directory) and the sharded checkpoint
OUT_DIR/checkpoint, which every rank then loads back and checks against what it saved.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ds_strategy import ZeroConfig, ZeroEngine, checkpoint
from ds_strategy.data import random_token_batch
from ds_strategy.models import GPT, gpt_config
from ds_strategy.offload import step_runner_for

STEPS = 3
PER_RANK_BATCH = 2
MODEL = gpt_config("tiny")
HPZ = 2  # one simulated node's ranks; also on the 1-node run, which must form the same groups to compare with


def zero_settings() -> dict:
    """Stage 3 with hpZ groups of one node's ranks and the optimizer state on this node's "NVMe"."""
    return {
        "stage": 3,
        "zero_hpz_partition_size": HPZ,
        "offload_optimizer": "nvme",
        "nvme_path": os.environ["NVME_PATH"],
    }


def build_model() -> GPT:
    """The same initial weights on every rank and in every mode."""
    torch.manual_seed(0)
    return GPT(MODEL)


def build_optimizer(model: GPT) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.optimizer_param_groups(0.1), lr=1e-2, eps=1e-6)


def my_batches(rank: int, world_size: int):
    """This rank's slice of each global batch: the global batches depend on nothing but the seed."""
    generator = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        inputs, targets = random_token_batch(generator, PER_RANK_BATCH * world_size, MODEL.block_size, MODEL.vocab_size)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        yield inputs[mine], targets[mine]


def record(out: Path, engine, local_rank: int, prefix: str = "") -> None:
    """Save the checkpoint, load it back, and write this rank's identity (``local_rank`` as the framework sees
    it) and final parameters."""
    model = engine.module
    before = engine.full_state_dict(rank0_only=False)
    checkpoint.save(out / "checkpoint", model, engine)
    checkpoint.load(out / "checkpoint", model, engine)
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before), "the checkpoint did not load back as saved"
    hpz = engine.comm_groups["hpz"].group
    identity = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": local_rank,
        "node": os.environ["SIM_NODE"],
        "hpz_group": dist.get_process_group_ranks(hpz),
        "nvme_directory": str(engine.step_runner.directory.path),
    }
    params = {name[len(prefix) :]: before[name] for name, _ in model.named_parameters()}
    torch.save({"identity": identity, "params": params}, out / f"rank{identity['rank']}.pt")
    print("rank record", json.dumps(identity), flush=True)


def train_engine(out: Path) -> None:
    dist.init_process_group("gloo")
    model = build_model()
    config = ZeroConfig(**zero_settings())
    engine = ZeroEngine(model, build_optimizer(model), config, step_runner=step_runner_for(config))
    for inputs, targets in my_batches(dist.get_rank(), dist.get_world_size()):
        _, loss = model(inputs, targets)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
    record(out, engine, int(os.environ["LOCAL_RANK"]))
    engine.remove_hooks()
    dist.destroy_process_group()


def train_lightning(out: Path, nodes: int) -> None:
    import lightning.pytorch as pl

    from ds_strategy import ZeroStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = build_model()

        def training_step(self, batch, batch_idx):
            return self.gpt(*batch)[1]

        def configure_optimizers(self):
            return build_optimizer(self.gpt)

        def train_dataloader(self):
            batches = list(my_batches(self.global_rank, self.trainer.world_size))
            return torch.utils.data.DataLoader(batches, batch_size=None)  # a bare list would be many loaders

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4 // nodes,
        num_nodes=nodes,
        strategy=ZeroStrategy(**zero_settings()),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Module())
    record(out, trainer.strategy.engine, trainer.local_rank, prefix="gpt.")


def train_accelerate(out: Path) -> None:
    from ds_strategy.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator()
    model = build_model()
    model, optimizer = accelerator.prepare(model, build_optimizer(model))
    for inputs, targets in my_batches(accelerator.process_index, accelerator.num_processes):
        _, loss = model(inputs, targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    record(out, accelerator.engine, accelerator.local_process_index)
    accelerator.end_training()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    if mode == "lightning":
        train_lightning(out_dir, int(sys.argv[3]))
    else:
        {"engine": train_engine, "accelerate": train_accelerate}[mode](out_dir)
