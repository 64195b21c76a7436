"""ZeRO-3 with ``torch.compile`` on its units trains exactly like eager in one process, and on 2 gloo ranks like one
unsharded process: the engine's hooks run outside the compiled graphs (Note: [Hooks torch.compile must not trace]),
on the host with the ``aot_eager`` backend."""

import models
import pytest
import torch
from distributed import run_ranks
from torch._dynamo.testing import CompileCounterWithBackend

from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # compiling takes seconds per run: not in the fast tier


def train(compile_units: str, precision: str) -> tuple[list[float], dict, int]:
    """Losses, parameters and compiled frames of 3 ZeRO-3 steps with each block compiled ``before`` the engine
    registers its hooks (as the GPU suite does), ``after`` it, or not at all."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.TinyGPT()
    counter = CompileCounterWithBackend("aot_eager")

    def compile_blocks():
        for block in model.blocks:
            block.compile(backend=counter)

    if compile_units == "before":
        compile_blocks()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, param_persistence_threshold=0, precision=precision))
    if compile_units == "after":
        compile_blocks()
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(models.TinyGPT.make_batch(generator, 4))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = engine.full_state_dict()
    engine.remove_hooks()
    return losses, params, counter.frame_count


@pytest.mark.parametrize("compile_units, precision", [("before", "32-true"), ("after", "bf16-mixed")])
def test_zero3_with_compiled_units_trains_like_eager(compile_units, precision):
    eager_losses, eager_params, _ = train("no", precision)
    losses, params, frames = train(compile_units, precision)
    assert frames > 0  # the blocks did run compiled
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    for name, value in eager_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


WORLD, PER_RANK, STEPS, SGD_LR = 2, 4, 3, 0.1


def _global_batches() -> list:
    generator = torch.Generator().manual_seed(1)
    return [models.TinyGPT.make_batch(generator, PER_RANK * WORLD) for _ in range(STEPS)]


def _slice(batch, rank: int):
    return tuple(t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in batch)


def train_compiled_on_ranks(rank: int, world_size: int) -> dict:
    """ZeRO-3 on this rank, each block compiled before the engine hooks it, plain SGD (Note: [An optimizer whose
    update scales with the gradient] in ``test_gradient_scale.py``): the whole parameters and the frames compiled."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.TinyGPT()
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.blocks:
        block.compile(backend=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, param_persistence_threshold=0))
    for batch in _global_batches():
        engine.backward(model(_slice(batch, rank)))
        engine.step()
    return {"params": engine.full_state_dict(rank0_only=False), "frames": counter.frame_count}


def _one_process() -> dict:
    """Eager and unsharded, each step's loss the mean over the ranks' slices of the global batch."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for batch in _global_batches():
        torch.stack([model(_slice(batch, rank)) for rank in range(WORLD)]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_zero3_with_compiled_units_on_two_ranks_trains_like_one_unsharded_process():
    expected = _one_process()
    for rank in run_ranks(train_compiled_on_ranks, WORLD, timeout=600):
        assert rank["frames"] > 0  # the blocks did run compiled
        for name, value in expected.items():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
