"""Fabric users' tensor-parallel code runs on ZeroFabricStrategy as on Fabric's ModelParallelStrategy: a
``parallelize_fn(module, device_mesh)`` (or the strategy's ``tensor_parallel_plan``) splits a Hugging Face Llama over
the mesh's "tensor_parallel" dimension, ``setup_dataloaders`` splits batches over the data-parallel ranks only, and
training matches one process. The model and data are the Lightning test's, and so is its single-process reference."""

import hf_models
import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from tensor_parallel_llama import LAYER_PLAN, LLAMA, PER_RANK, STEPS, outcome, reference_run, token_data, train_loop
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy import ZeroFabricStrategy

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def parallelize(model, device_mesh):
    """What a ModelParallelStrategy user passes as ``parallelize_fn``."""
    for layer in model.model.layers:
        parallelize_module(layer, device_mesh["tensor_parallel"], LAYER_PLAN)
    return model


def _fit(rank: int, world_size: int, stage: int, module_first: bool, **tensor_parallel) -> dict:
    """``module_first``: ModelParallelStrategy's order, ``setup_module``, then the optimizer over its parameters."""
    set_lightning_environment(rank)
    strategy = ZeroFabricStrategy(stage=stage, tensor_parallel_size=2, **tensor_parallel)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = hf_models.build("llama", **LLAMA)
    if module_first:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(hf_models.adamw(model))
    else:
        model, optimizer = fabric.setup(model, hf_models.adamw(model))
    initial = strategy.engine.full_state_dict(rank0_only=False)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(token_data(dp=1)), batch_size=PER_RANK, shuffle=True))
    losses = train_loop(model, optimizer, loader, fabric.backward)
    names, sampler = strategy.device_mesh.mesh_dim_names, strategy.distributed_sampler_kwargs
    return outcome(strategy.engine, model, initial, losses, names, sampler=sampler)


@pytest.mark.parametrize(
    "stage, module_first, tensor_parallel",
    [
        (2, False, {"parallelize_fn": parallelize}),
        (3, True, {"parallelize_fn": parallelize}),
        (2, False, {"tensor_parallel_plan": "auto"}),
    ],
    ids=["stage2-parallelize-fn", "stage3-parallelize-fn-setup-module-first", "stage2-auto-plan"],
)
def test_parallelize_fn_or_plan_matches_single_process(stage, module_first, tensor_parallel):
    ranks = run_ranks(_fit, 2, stage, module_first, timeout=300, **tensor_parallel)
    reference = reference_run(dp=1, initial=ranks[0]["initial"])
    assert len(reference["losses"]) == STEPS
    for run in ranks:
        assert run["names"] == ("data_parallel", "tensor_parallel")
        assert run["sampler"] == {"num_replicas": 1, "rank": 0}  # both tensor-parallel ranks read every batch
        assert run["dtensors"] == 2 * len(LAYER_PLAN)  # the planned weights of both layers (Llama: no biases)
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0)
        for name, expected in reference["state"].items():
            error = ((run["state"][name] - expected).norm() / expected.norm()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
