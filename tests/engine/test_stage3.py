"""ZeRO stage 3: partitioned parameters gathered per unit just in time still train exactly like one process."""

import resource

import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from training_loops import Recipe, assert_matches, check_jobs

from ds_strategy.comm.collectives import CollectiveMismatchError
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, gpt_config
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

PARTITION_ALL = {"param_persistence_threshold": 0}


def _block_numel() -> int:
    return sum(p.numel() for p in models.DeepTinyGPT().blocks[0].parameters())


JOBS = {
    "TinyGPT": (Recipe(model="TinyGPT", zero=PARTITION_ALL), 3),
    "MLP": (Recipe(model="MLP", zero=PARTITION_ALL), 3),
    **{
        m: (Recipe(model=m, steps=4, zero=PARTITION_ALL), 3)
        for m in ("FrozenParamModel", "UnusedParamModel", "BatchNormModel", "OddSizeModel")
    },
    "checkpointing": (Recipe(model="CheckpointedTinyGPT", steps=4, zero=PARTITION_ALL), 3),
    "no-reshard": (Recipe(model="TinyGPT", steps=4, zero={**PARTITION_ALL, "reshard_after_forward": False}), 3),
    "persistent": (Recipe(model="TinyGPT", steps=4), 3),  # default threshold: every tiny tensor stays whole
    "deep": (Recipe(model="DeepTinyGPT", steps=3, zero={**PARTITION_ALL, "prefetch_bucket_size": _block_numel()}), 3),
}


@pytest.fixture(scope="module")
def runs():
    return check_jobs(JOBS)


def _matches(runs, name: str) -> list[dict]:
    ranks, reference = runs[name]
    for rank in ranks:
        assert_matches(rank, reference)
    return ranks


@pytest.mark.parametrize("model", ["TinyGPT", "MLP"])
def test_zero3_matches_single_process(runs, model):
    _matches(runs, model)


@pytest.mark.parametrize("model", ["FrozenParamModel", "UnusedParamModel", "BatchNormModel", "OddSizeModel"])
def test_zero3_edge_model_matches_single_process(runs, model):
    _matches(runs, model)


def test_zero3_on_four_ranks_matches_single_process():
    four = check_jobs({"odd": (Recipe(model="OddSizeModel", steps=4, zero=PARTITION_ALL), 3)}, world_size=4)
    _matches(four, "odd")


def test_zero3_with_activation_checkpointing_matches_single_process(runs):
    _matches(runs, "checkpointing")


def test_zero3_without_reshard_after_forward_matches_single_process(runs):
    _matches(runs, "no-reshard")


def test_zero3_small_parameters_stay_replicated_and_still_match(runs):
    ranks = _matches(runs, "persistent")
    assert all(numel == 0 for numel in ranks[0]["unit_numels"])


def test_zero3_holds_one_over_n_of_parameters_between_steps(runs):
    psi = sum(p.numel() for p in models.DeepTinyGPT().parameters())
    for run in _matches(runs, "deep"):
        assert run["gathered_between_steps"] == 0
        params = sum(run["memory"]["params"].values())
        assert abs(params - 4 * psi / 2) <= 0.05 * 4 * psi / 2 + 4 * 2 * len(run["unit_numels"]) * 2


def test_zero3_gathered_parameters_stay_within_the_prefetch_bound(runs):
    for run in _matches(runs, "deep"):
        root, units = run["unit_numels"][0], run["unit_numels"][1:]
        bound = root + 2 * max(units) + _block_numel()  # the unit in use, the one kept for backward, one prefetched
        assert max(units) < run["peak_gathered"] <= bound < root + sum(units)


def _meta_build_and_train(rank: int, world_size: int) -> dict:
    config = gpt_config("medium")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak resident set size
    baseline = _rss_peak_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, param_persistence_threshold=0))
    construction_peak = _rss_peak_bytes() - baseline
    state = engine.full_state_dict()
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    _, loss = model(idx, idx)
    loss.backward()
    engine.step()
    return {"peak": construction_peak, "state": state, "loss": loss.item()}


def _rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_zero3_builds_a_model_larger_than_the_rank_budget_directly_sharded(monkeypatch):
    """Note: [glibc's mmap threshold]
    glibc raises its mmap threshold after a large buffer is freed, so later unit buffers come from the
    heap and are never returned: resident memory then measures the allocator, not the engine. The ranks start
    with a fixed threshold so every unit buffer is mapped and unmapped as the engine allocates and frees it."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    config = gpt_config("medium")
    torch.manual_seed(0)
    normal = GPT(config)
    full_bytes = sum(p.numel() * 4 for p in normal.parameters())
    budget = 0.75 * full_bytes  # the whole model does not fit; half of it plus one block does
    ranks = run_ranks(_meta_build_and_train, 2, timeout=240)
    for rank in ranks:
        assert rank["peak"] < budget, f"construction peaked at {rank['peak'] / 2**20:.0f} MiB"
        assert torch.isfinite(torch.tensor(rank["loss"]))
    expected = normal.state_dict()
    assert ranks[0]["state"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(ranks[0]["state"][key], value), key


def _generate(logits_of, idx: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy decoding: one forward call per new token, as a generation loop makes them."""
    for _ in range(tokens):
        idx = torch.cat([idx, logits_of(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def _eval_after_training(rank: int, world_size: int, tokens_per_rank: tuple, timeout: float) -> dict:
    recipe = Recipe(model="TinyGPT", steps=2, zero=PARTITION_ALL)
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=recipe.lr)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, collective_timeout=timeout, **recipe.zero))
    batch = models.TinyGPT.make_batch(torch.Generator().manual_seed(5), 4)
    for _ in range(recipe.steps):
        model(batch).backward()
        engine.step()
    model.eval()

    def logits_of(idx):  # TinyGPT.forward returns the loss: call GPT's, after the hook the root forward would run
        engine.before_forward()
        return GPT.forward(model, idx)[0]

    with torch.no_grad():
        logits = logits_of(batch[0])
        generated = _generate(logits_of, batch[0][:2, :8], tokens_per_rank[rank])
    engine.reshard()
    dist.barrier()
    return {"logits": logits, "generated": generated}


def _reference_eval() -> dict:
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=Recipe().lr)
    batch = models.TinyGPT.make_batch(torch.Generator().manual_seed(5), 4)
    for _ in range(2):
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        logits_of = lambda idx: GPT.forward(model, idx)[0]  # noqa: E731
        return {"logits": logits_of(batch[0]), "generated": _generate(logits_of, batch[0][:2, :8], 5)}


def test_zero3_evaluation_and_generation_match_the_unsharded_model():
    ranks = run_ranks(_eval_after_training, 2, (5, 5), 60.0)
    reference = _reference_eval()
    for rank in ranks:
        torch.testing.assert_close(rank["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        assert torch.equal(rank["generated"], reference["generated"])


def test_zero3_ranks_running_different_numbers_of_forwards_fail_clearly_instead_of_hanging():
    with pytest.raises(AssertionError, match="different number of forward"):
        run_ranks(_eval_after_training, 2, (2, 4), 5.0, timeout=90)


def test_zero3_mismatch_error_type_is_public():
    assert issubclass(CollectiveMismatchError, RuntimeError)
