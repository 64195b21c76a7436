"""Accelerate's ``LocalSGD`` (``accelerate.local_sgd``, the ``local_sgd.py`` example's loop) under ZeroAccelerator.

LocalSGD keeps the prepared model's ``no_sync()`` open for its whole block, so every rank steps its own replica
with its own gradients, and every ``local_sgd_steps`` steps it averages the replicas' parameters (``param.data =
accelerator.reduce(param.data, "mean")``). That is meaningful at stage 0 only, where every rank holds and steps
the whole model as under DDP. From stage 1 each rank steps only its shard, from gradients reduced over all ranks,
and the all-gather after the step makes every rank's parameters equal again: there are no per-rank models to
average, and a step inside ``no_sync`` at stage 1 would update each shard from nothing that was reduced. So at
stage 0 the run must equal local SGD computed by hand (one process per replica, fp32, 1e-6 relative: see
tests/support/training_loops.py), and at stages 1-3 the first step inside LocalSGD must be refused, naming the stage.

Without ``ZeroEngine.adopt_replaced_parameters`` stage 0 drifted by 1% (LocalSGD's ``param.data =`` swapped the
parameters off the engine's flat buffers, whose later steps the model then never saw) and stages 1-3 ran on,
computing something else.
"""

import models
import pytest
import torch
from distributed import run_ranks, set_torchrun_environment

WORLD, STEPS, LOCAL_STEPS, LR = 2, 4, 2, 0.05


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [models.MLP.make_batch(generator, 4 * WORLD) for _ in range(STEPS)]


def _model() -> models.MLP:
    torch.manual_seed(0)
    return models.MLP()


def _local_sgd_by_hand() -> torch.Tensor:
    """Each rank's replica trained on its slice alone, the replicas averaged every LOCAL_STEPS steps."""
    replicas = [_model() for _ in range(WORLD)]
    optimizers = [torch.optim.SGD(replica.parameters(), lr=LR) for replica in replicas]
    for step, (x, y) in enumerate(_batches(), 1):
        for rank, (replica, optimizer) in enumerate(zip(replicas, optimizers)):
            replica((x[rank::WORLD], y[rank::WORLD])).backward()
            optimizer.step()
            optimizer.zero_grad()
        if step % LOCAL_STEPS == 0:
            with torch.no_grad():
                for same in zip(*(replica.parameters() for replica in replicas)):
                    mean = torch.stack(same).mean(0)
                    for p in same:
                        p.copy_(mean)
    return torch.nn.utils.parameters_to_vector(replicas[0].parameters()).detach()


def _local_sgd_loop(rank: int, world_size: int, stage: int) -> torch.Tensor | str:
    """The example's loop with ``ZeroAccelerator(`` in place of ``Accelerator(``; its weights, or the error."""
    from accelerate.local_sgd import LocalSGD

    from ds_strategy.accelerate import ZeroAccelerator

    set_torchrun_environment(rank, world_size)
    accelerator = ZeroAccelerator({"stage": stage}, cpu=True)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    try:
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=LOCAL_STEPS) as local_sgd:
            for x, y in _batches():
                with accelerator.accumulate(model):
                    accelerator.backward(model((x[rank::WORLD], y[rank::WORLD])))
                    optimizer.step()
                    optimizer.zero_grad()
                local_sgd.step()
    except ValueError as error:
        return str(error)
    state = accelerator.get_state_dict(model)
    return torch.cat([state[name].flatten() for name, _ in _model().named_parameters()])


@pytest.mark.slow
def test_local_sgd_at_stage_0_averages_the_replicas_as_by_hand():
    want = _local_sgd_by_hand()
    for got in run_ranks(_local_sgd_loop, WORLD, 0, timeout=300):
        assert (got - want).norm() <= 1e-6 * want.norm()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_local_sgd_is_refused_at_stages_that_shard_the_optimizer(stage):
    for got in run_ranks(_local_sgd_loop, WORLD, stage, timeout=300):
        assert isinstance(got, str) and f"ZeRO stage {stage}" in got and "LocalSGD" in got
