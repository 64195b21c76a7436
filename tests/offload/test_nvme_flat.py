"""With parameters and optimizer on NVMe (stage 3), anonymous resident memory per rank does not grow with the model:
two GPTs of one width (so one working set: units gathered, their gradient scratch, the swap buffers) and depths
giving ~7M and ~50M parameters peak within 0.5 bytes per added parameter per rank of each other, construction and
training included, and the NVMe run trains exactly as the same run with everything in memory.

The ranks start with glibc's default allocator settings (no ``MALLOC_MMAP_THRESHOLD_``): returning freed unit
buffers is the engine's job (Note: [Large host blocks are mapped and unmapped] in ``ds_strategy.offload.host_memory``);
without it this slope is 4-7 bytes per parameter, with it -0.3 to 0.1 when this test was written and 0.27 to 0.40 on
2026-12-05 on a quiet machine (issue 48's goal of 0.25 is open; the bound here catches the unmapping lost).
Two tokens keep activations, which do grow with depth, near 0.03 bytes per parameter, and the depths differ by 24
blocks so that what a peak catches in flight moves the slope little."""

import pytest
import torch
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig, weight_decay_groups
from ds_strategy.offload import step_runner_for
from ds_strategy.offload.host_memory import PeakRssAnon
from ds_strategy.zero.engine import ZeroEngine

WIDTH, TOKENS = 384, 2
DEPTHS = (4, 28)
BOUND_B_PER_PARAM = 0.5

pytestmark = pytest.mark.slow


def _train(depth: int, options: dict, steps: int = 2) -> dict:
    sampler, losses = PeakRssAnon().start(), []  # from before construction: the shards are built one unit at a time
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=depth, n_head=WIDTH // 64, n_embd=WIDTH))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3, fused=True)
    config = ZeroConfig(stage=3, **options)
    engine = ZeroEngine(model, optimizer, config, step_runner=step_runner_for(config))
    generator = torch.Generator().manual_seed(engine.rank)
    for _ in range(steps):
        x = torch.randint(0, 256, (1, TOKENS), generator=generator)
        _, loss = model(x, x)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        losses.append(loss.item())
    peak = sampler.stop()
    state = engine.full_state_dict(rank0_only=False)
    psi = sum(fp.numel for fp in engine.flat_params)
    engine.remove_hooks()
    return {"peak": peak, "psi": psi, "losses": losses, "state": state}


def nvme_and_in_memory(rank: int, world_size: int, nvme_path: str) -> dict:
    """The in-memory run, then the same run on NVMe (compared bitwise; it also takes the one-time costs of a first
    NVMe run in a process: threads, pools, lazily imported code), then the two measured NVMe runs, smaller first,
    so that whatever one leaves behind can only raise the slope."""
    nvme = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": nvme_path, "buffer_size": 1 << 18}
    nvme["overlap_comm"] = False  # each reduction finished before the next: a peak that does not hang on timing
    small, large = DEPTHS
    in_memory = _train(small, {})
    first = _train(small, nvme)
    same_losses = first["losses"] == in_memory["losses"]
    same_params = all(torch.equal(first["state"][k], v) for k, v in in_memory["state"].items())
    del first, in_memory
    peak, psi = {}, {}
    for depth in (small, small, large, large):  # each measured twice, its lower peak kept: a growth with the model
        run = _train(depth, nvme)  # shows in both, a block caught in flight by one sample seldom twice
        peak[depth], psi[depth] = min(peak.get(depth, run["peak"]), run["peak"]), run["psi"]
        del run  # nothing of one run may stay alive while the next is measured
    return {
        "peak": peak,
        "psi": psi,
        "same_losses": same_losses,
        "same_params": same_params,
    }


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_ranks(nvme_and_in_memory, 2, str(tmp_path_factory.mktemp("nvme")), timeout=300)


def test_anonymous_memory_per_rank_does_not_grow_with_the_model(measured):
    small, large = DEPTHS
    for rank in measured:
        growth = (rank["peak"][large] - rank["peak"][small]) / (rank["psi"][large] - rank["psi"][small])
        assert growth <= BOUND_B_PER_PARAM, (growth, rank["peak"], rank["psi"])


def test_nvme_training_matches_the_in_memory_run_bitwise(measured):
    for rank in measured:
        assert rank["same_losses"] and rank["same_params"]
