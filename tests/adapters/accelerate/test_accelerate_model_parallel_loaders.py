"""ZeroAccelerator's prepared data loaders under Ulysses and pipelining hand every rank of a sequence-parallel group,
and every stage of a pipeline, the batches of its data-parallel position (Accelerate's own split from the mesh
knows tensor and context parallelism only); what cannot work is refused by name; ``pipeline_step`` of a model in
eval mode runs the schedule's forward only. Training under both is the composition matrix's
(``test_composition_matrix``: Accelerate cells for pp, pp x dp, pp x tp and Ulysses)."""

import copy
import re

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from distributed import run_ranks, set_torchrun_environment
from pipeline_runs import batches, loss_fn, tiny_llama
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy.accelerate import ZeroAccelerator

ROWS, PER_RANK = 16, 2
LAYOUTS = {  # world 4: (ZeroConfig fields, ParallelismConfig sizes) and each rank's data-parallel position
    "sp x dp": ({}, {"dp_shard_size": 2, "sp_size": 2}, [0, 0, 1, 1]),
    "pp x dp": ({"pipeline_parallel_size": 2}, {"dp_shard_size": 2}, [0, 1, 0, 1]),
}


def _accelerator(rank: int, fields: dict, sizes: dict, **kwargs) -> ZeroAccelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return ZeroAccelerator(fields, cpu=True, parallelism_config=ParallelismConfig(**sizes), **kwargs)


def _under_each_layout(rank: int, world_size: int) -> dict:
    """Per layout: the rows this rank's prepared loader reads, and the errors of what is refused; under pp x dp, the
    loss ``pipeline_step`` gives in evaluation beside the loss of an unsharded copy on the same rows."""
    set_torchrun_environment(rank, world_size)
    torch.set_num_threads(1)
    read, refused = {}, {}
    for name, (fields, sizes, _) in LAYOUTS.items():
        accelerator = _accelerator(rank, fields, sizes)
        loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=PER_RANK))
        read[name] = [batch.tolist() for (batch,) in loader]
        dispatching = _accelerator(
            rank, fields, sizes, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)
        )
        with pytest.raises(ValueError) as dispatched:
            dispatching.prepare(DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=PER_RANK))
        refused[f"{name} dispatch_batches"] = str(dispatched.value)
    accelerator = _accelerator(rank, *LAYOUTS["pp x dp"][:2])
    torch.manual_seed(0)
    model = tiny_llama()
    whole = copy.deepcopy(model)
    accelerator.prepare(model)  # cut to this rank's stage
    with pytest.raises(ValueError) as late:
        accelerator.prepare(torch.optim.SGD(model.parameters(), lr=1.0))
    refused["pp optimizer prepared after its model"] = str(late.value)
    x, y = batches("llama", 1, 2 * PER_RANK)[0]
    mine = slice(PER_RANK * LAYOUTS["pp x dp"][2][rank], PER_RANK * (LAYOUTS["pp x dp"][2][rank] + 1))
    model.eval()
    with torch.no_grad():
        evaluated = accelerator.pipeline_step(model, x[mine], y[mine], loss_fn).item()
        expected = loss_fn(whole(input_ids=x[mine]).logits, y[mine]).item()
    return {"read": read, "refused": refused, "evaluated": evaluated, "expected": expected}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_under_each_layout, 4, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prepared_loader_splits_batches_over_the_data_parallel_ranks_only(ranks, layout):
    positions = LAYOUTS[layout][2]
    for rank, run in enumerate(ranks):
        dp = positions[rank]
        expected = [[row, row + 1] for row in range(dp * PER_RANK, ROWS, 2 * PER_RANK)]
        assert run["read"][layout] == expected, f"rank {rank} (data-parallel position {dp})"


@pytest.mark.parametrize(
    "refusal, words",
    [
        ("sp x dp dispatch_batches", r"dispatch_batches=True with model parallelism .*dispatch_batches=False"),
        ("pp x dp dispatch_batches", r"dispatch_batches=True with model parallelism .*dispatch_batches=False"),
        (
            "pp optimizer prepared after its model",
            r"pipeline_parallel_size > 1 an optimizer must be prepared together with its model",
        ),
    ],
)
def test_what_cannot_work_is_refused_naming_it(ranks, refusal, words):
    for run in ranks:
        assert re.search(words, run["refused"][refusal]), run["refused"][refusal]


def test_pipeline_step_in_eval_mode_is_the_unsharded_models_loss(ranks):
    for run in ranks:
        assert run["evaluated"] == pytest.approx(run["expected"], rel=1e-5)
