"""With parameters and optimizer on NVMe (stage 3), anonymous resident memory per rank does not grow with the model:
two GPTs of one width (so one working set: a unit gathered, its gradient scratch, the swap buffers) and depths
giving ~14M and ~57M parameters peak within 0.25 bytes per added parameter of each other, construction and
training included, and the NVMe run trains exactly as the same run with everything in memory."""

import pytest
import torch
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.host_memory import PeakRssAnon
from ds_strategy.models import GPT, GPTConfig, weight_decay_groups
from ds_strategy.zero.engine import ZeroEngine

WIDTH, TOKENS = 768, 16
DEPTHS = (2, 8)
BOUND_B_PER_PARAM = 0.25


def _train(depth: int, options: dict, steps: int = 2) -> dict:
    sampler, losses = PeakRssAnon().start(), []  # from before construction: the shards are built one unit at a time
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=TOKENS, n_layer=depth, n_head=WIDTH // 64, n_embd=WIDTH))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3, fused=True)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, **options))
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
    nvme = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": nvme_path, "buffer_size": 1 << 20}
    small, large = DEPTHS
    runs = {large: _train(large, nvme)}
    runs[large].pop("state")  # nothing of one run may stay alive while the next is measured
    runs[small] = _train(small, nvme)
    in_memory = _train(small, {})
    return {
        "peak": {d: r["peak"] for d, r in runs.items()},
        "psi": {d: r["psi"] for d, r in runs.items()},
        "same_losses": runs[small]["losses"] == in_memory["losses"],
        "same_params": all(torch.equal(runs[small]["state"][k], v) for k, v in in_memory["state"].items()),
    }


@pytest.fixture(scope="module")
def measured(tmp_path_factory, monkeypatch_module):
    # large blocks are then always mmap-ed and returned on free, so RssAnon is what is alive, not heap slack
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    return run_ranks(nvme_and_in_memory, 2, str(tmp_path_factory.mktemp("nvme")), timeout=300)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_anonymous_memory_per_rank_does_not_grow_with_the_model(measured):
    for rank in measured:
        small, large = DEPTHS
        growth = (rank["peak"][large] - rank["peak"][small]) / (rank["psi"][large] - rank["psi"][small])
        assert growth <= BOUND_B_PER_PARAM, (growth, rank["peak"], rank["psi"])


def test_nvme_training_matches_the_in_memory_run_bitwise(measured):
    for rank in measured:
        assert rank["same_losses"] and rank["same_params"]
