"""Accelerate's ``ParallelismConfig(tp_size=...)`` runs on ZeroAccelerator: ``prepare`` splits an unsplit Hugging Face
Llama with the auto plan (or keeps the user's own split over ``accelerator.torch_device_mesh["tp"]``), its data
loaders give a tensor-parallel group the same batches, and training matches one process. The model and the
single-process reference are the Lightning test's; the dimensions ds_strategy lacks are refused by name."""

import hf_models
import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from distributed import run_ranks, set_torchrun_environment
from tensor_parallel_llama import LAYER_PLAN, LLAMA, PER_RANK, STEPS, outcome, reference_run, token_data, train_loop
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ds_strategy.accelerate import ZeroAccelerator
from ds_strategy.accelerate.parallelism import with_parallelism
from ds_strategy.config import ZeroConfig


def _fit(rank: int, world_size: int, stage: int, own_plan: bool) -> dict:
    """``own_plan``: the script splits the model itself (ZeroConfig.tensor_parallel_size); else ParallelismConfig
    and the auto plan ``prepare`` applies to a model that arrives unsplit."""
    set_torchrun_environment(rank, world_size)
    if own_plan:
        accelerator = ZeroAccelerator({"stage": stage, "tensor_parallel_size": 2}, cpu=True)
    else:
        accelerator = ZeroAccelerator({"stage": stage}, cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    model = hf_models.build("llama", **LLAMA)
    for layer in model.model.layers if own_plan else ():
        parallelize_module(layer, accelerator.torch_device_mesh["tp"], LAYER_PLAN)
    tokens = TensorDataset(token_data(dp=1))
    order = list(DistributedSampler(tokens, num_replicas=1, rank=0, seed=0))  # the reference's (Lightning's) order
    loader = DataLoader(tokens, batch_size=PER_RANK, sampler=order)
    model, optimizer, loader = accelerator.prepare(model, hf_models.adamw(model), loader)
    initial = accelerator.engine.full_state_dict(rank0_only=False)
    losses = train_loop(model, optimizer, loader, accelerator.backward)
    return outcome(accelerator.engine, model, initial, losses, accelerator.torch_device_mesh.mesh_dim_names)


@pytest.mark.parametrize(
    "stage, own_plan", [(2, False), (3, True)], ids=["stage2-parallelism-config-auto-plan", "stage3-own-plan"]
)
def test_tensor_parallel_matches_single_process(stage, own_plan):
    ranks = run_ranks(_fit, 2, stage, own_plan, timeout=300)
    reference = reference_run(dp=1, initial=ranks[0]["initial"])
    assert len(reference["losses"]) == STEPS
    for run in ranks:
        assert run["names"] == ("dp_shard", "tp")
        assert run["dtensors"] == 2 * len(LAYER_PLAN)  # the auto plan splits the same weights as LAYER_PLAN
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0)
        for name, expected in reference["state"].items():
            error = ((run["state"][name] - expected).norm() / expected.norm()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize(
    "sizes, named",
    [
        ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, "dp_replicate_size=2"),
        ({"cp_size": 2, "tp_size": 2}, "cp_size=2"),
    ],
)
def test_parallelism_config_dimensions_without_a_zero_meaning_are_refused_by_name(sizes, named):
    with pytest.raises(ValueError, match=f"tp_size, sp_size and dp_shard_size only, not {named}"):
        with_parallelism(ZeroConfig(), ParallelismConfig(**sizes), num_processes=8)


def test_parallelism_config_tp_size_is_tensor_parallel_size_when_it_covers_the_processes():
    assert with_parallelism(ZeroConfig(), ParallelismConfig(dp_shard_size=2, tp_size=2), 4).tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"covers 2 processes but there are 4"):
        with_parallelism(ZeroConfig(), ParallelismConfig(tp_size=2), num_processes=4)


def test_parallelism_config_sp_size_is_sequence_parallel_size_and_pipeline_stages_count_in_the_processes():
    assert with_parallelism(ZeroConfig(), ParallelismConfig(sp_size=2), 2).sequence_parallel_size == 2
    staged = with_parallelism(ZeroConfig(pipeline_parallel_size=2), ParallelismConfig(tp_size=2), 4)
    assert (staged.tensor_parallel_size, staged.pipeline_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match=r"ParallelismConfig\(sp_size=2\) conflicts with ZeroConfig.sequence_parallel"):
        with_parallelism(ZeroConfig(sequence_parallel_size=4), ParallelismConfig(sp_size=2), 2)
