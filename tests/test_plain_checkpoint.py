"""Plain (single-file) checkpoints of a ZeRO engine, as Fabric's ``save`` and Accelerate's ``save_state`` write
them: every rank's optimizer shard is kept and each rank gets its own back; what cannot load in place is refused."""
import pytest
import torch
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.plain_checkpoint import check_model_loadable, gather_optimizer_state, load_optimizer_state
from ds_strategy.zero.engine import ZeroEngine


def _trained_engine(seed: int) -> ZeroEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ZeroConfig(stage=2))
    model(torch.randn(4, 6)).pow(2).mean().backward()
    engine.step()
    return engine


def _save_then_load(rank: int, world_size: int) -> bool:
    saved = gather_optimizer_state(_trained_engine(seed=0).optimizer)
    fresh = _trained_engine(seed=1).optimizer
    load_optimizer_state(fresh, saved)
    mine = saved["ds_strategy_rank_states"][rank]["state"]
    return all(torch.equal(fresh.state_dict()["state"][i][k], mine[i][k]) for i in mine for k in ("exp_avg", "exp_avg_sq"))


def test_each_rank_gets_its_own_optimizer_shard_back():
    assert run_ranks(_save_then_load, 2) == [True, True]


def test_optimizer_state_saved_at_another_world_size_is_refused():
    state = {"ds_strategy_rank_states": [{}, {}]}
    with pytest.raises(ValueError, match="optimizer state of 2 ranks but this run has 1"):
        load_optimizer_state(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), state)


@pytest.mark.parametrize("config", [ZeroConfig(stage=3), ZeroConfig(precision="bf16-mixed")], ids=["stage3", "bf16-mixed"])
def test_model_state_that_would_leave_masters_or_shards_stale_is_refused(config):
    with pytest.raises(NotImplementedError, match="cannot be loaded"):
        check_model_loadable(config)
