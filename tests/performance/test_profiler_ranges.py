"""A profiled training step shows ZeRO's hooks, collectives, step phases and offload transfers by name (see
``ds_strategy/profiler_ranges.py``, Note: [Profiler range names]), on 2 gloo ranks so that every collective runs."""

import models
import pytest
import torch
from distributed import run_ranks
from torch.profiler import ProfilerActivity, profile

from ds_strategy.config import ZeroConfig
from ds_strategy.offload import step_runner_for
from ds_strategy.profiler_ranges import PREFIX
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def _profiled_step(rank: int, world_size: int, zero: dict) -> set[str]:
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(**zero)
    engine = ZeroEngine(model, optimizer, config, step_runner=step_runner_for(config))
    batch = model.make_batch(torch.Generator().manual_seed(0), 2)
    model(batch).backward()
    engine.step()  # the first step records the forward order that stage 3 prefetches by
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(batch).backward()
        engine.clip_grad_norm_(1.0)  # the norm comes from step.unscale
        engine.step()
    engine.remove_hooks()
    return {event.name.split("[")[0] for event in prof.events() if event.name.startswith(PREFIX)}


def profiled_step_names(**zero) -> set[str]:
    """Range names (without ``[which]``) that ``torch.profiler`` recorded over the second of two training steps,
    on both ranks."""
    return set.union(*run_ranks(_profiled_step, 2, zero))


def test_a_stage_3_step_shows_every_hook_collective_and_step_phase_by_name():
    names = profiled_step_names(stage=3, param_persistence_threshold=0)  # gloo reduces by all-reduce
    expected = {
        "unit.pre_forward",
        "unit.post_forward",
        "unit.pre_backward",
        "unit.gather",
        "unit.free",
        "grad.reduce",
        "grad.finish",
        "backward.end",
        "comm.all_gather",
        "comm.wait.all_gather",
        "comm.all_reduce",
        "comm.wait.all_reduce",
        "step",
        "step.unscale",
        "step.optimizer",
    }
    assert expected <= {name.removeprefix(PREFIX) for name in names}, sorted(names)
    assert PREFIX + "grad.hook" not in names  # no range per parameter: one costs microseconds on every gradient


@pytest.mark.parametrize("stage", [1, 2])
def test_a_stage_1_or_2_step_shows_the_reduction_and_the_parameter_refresh(stage):
    names = {name.removeprefix(PREFIX) for name in profiled_step_names(stage=stage)}
    assert {
        "grad.reduce",
        "grad.finish",
        "backward.end",
        "step",
        "step.optimizer",
        "step.refresh_params",
        "comm.all_gather",
    } <= names, sorted(names)


def test_an_offloaded_step_shows_its_transfers_and_host_step():
    names = {name.removeprefix(PREFIX) for name in profiled_step_names(stage=2, offload_optimizer="cpu")}
    assert {"offload.grad_to_host", "offload.step", "step.optimizer"} <= names, sorted(names)
