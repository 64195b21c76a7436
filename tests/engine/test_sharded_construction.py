"""Sharded construction under stage 3: a model built on the meta device is materialised one unit at a time and
equals a normal build bitwise (Hugging Face's own init, a user param_init_fn, or rank 0's real model), then trains
like DDP on a normally built copy."""

from types import SimpleNamespace

import hf_models
import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.placement import modules_by_unit

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

STEPS = 5
STAGE3 = ZeroConfig(stage=3, param_persistence_threshold=0)


def _differing(state: dict, expected: dict) -> list[str]:
    assert state.keys() == expected.keys()
    return [name for name, value in expected.items() if not torch.equal(state[name], value)]


def _hf_meta_build_and_train(rank: int, world_size: int, name: str) -> dict:
    normal = hf_models.build(name)
    after_normal_build = torch.rand(4)
    meta = hf_models.build(name, meta=True)
    engine = ZeroEngine(meta, hf_models.sgd(meta), STAGE3)
    after_meta_build = torch.rand(4)
    differing = _differing(engine.full_state_dict(rank0_only=False), normal.state_dict())
    steps = hf_models.batches(STEPS, world_size)
    return {
        "differing": differing,
        "same_rng": torch.equal(after_meta_build, after_normal_build),
        "zero": hf_models.train_zero(meta, engine, rank, world_size, steps),
        "ddp": hf_models.train_ddp(normal, rank, world_size, steps),
        "sharded": all(p.numel() == 0 for p in meta.parameters()),
    }


def _fsdp_style_init(module: nn.Module) -> None:
    """What FSDP users pass as param_init_fn: fresh storage for the module's own tensors, then its own reset."""
    module.to_empty(device="cpu", recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _other_modes(rank: int, world_size: int) -> dict:
    """param_init_fn on our MLP, and rank 0's real Llama streamed to a rank that built it on meta."""
    torch.manual_seed(0)
    normal_mlp = models.MLP()
    torch.manual_seed(0)
    with torch.device("meta"):
        mlp = models.MLP()
    engine = ZeroEngine(mlp, None, STAGE3.replace(param_init_fn=_fsdp_style_init))
    init_fn = _differing(engine.full_state_dict(rank0_only=False), normal_mlp.state_dict())
    normal = hf_models.build("llama", seed=3)
    llama = hf_models.build("llama", seed=3, meta=rank != 0)
    engine = ZeroEngine(llama, hf_models.adamw(llama), STAGE3.replace(sync_module_states=True))
    return {
        "param_init_fn": init_fn,
        "rank0": _differing(engine.full_state_dict(rank0_only=False), normal.state_dict()),
        "buffers_real": all(not b.is_meta for b in llama.buffers()),
    }


def _mismatched_builds(rank: int, world_size: int) -> str:
    with torch.device("meta" if rank else "cpu"):
        model = models.MLP()
    with pytest.raises(ValueError) as error:
        ZeroEngine(model, None, STAGE3)
    dist.barrier()
    return str(error.value)


def _all_scenarios(rank: int, world_size: int) -> dict:
    """Every scenario in one process group: spawning ranks is the slow part."""
    return {
        **{name: _hf_meta_build_and_train(rank, world_size, name) for name in hf_models.MODEL_CLASSES},
        "modes": _other_modes(rank, world_size),
        "mismatch": _mismatched_builds(rank, world_size),
    }


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all_scenarios, 2, timeout=300)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hf_model_built_on_meta_equals_a_normal_build_bitwise(runs, name):
    for rank in runs:
        assert rank[name]["differing"] == []
        assert rank[name]["same_rng"], "the generator must be left where a normal build leaves it"
        assert rank[name]["sharded"]


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hf_model_built_on_meta_trains_like_ddp_on_a_normal_build(runs, name):
    for rank in runs:
        hf_models.assert_trains_like_ddp(rank[name]["zero"], rank[name]["ddp"], name)


def test_param_init_fn_and_rank0_source_equal_a_normal_build(runs):
    for rank in runs:
        assert rank["modes"]["param_init_fn"] == []
        assert rank["modes"]["rank0"] == []
        assert rank["modes"]["buffers_real"]


def test_ranks_building_differently_fail_clearly_instead_of_hanging(runs):
    for rank in runs:
        assert "1 of 2 ranks built the model on the meta device" in rank["mismatch"]
        assert "sync_module_states" in rank["mismatch"]


def test_each_module_is_placed_with_the_innermost_unit_containing_it():
    model = models.TinyGPT()
    units = [SimpleNamespace(module=m) for m in (model, model.embed, model.blocks[0], model.blocks[1])]
    owned = modules_by_unit(model, units)
    assert owned[2] == list(model.blocks[0].modules()) and owned[3] == list(model.blocks[1].modules())
    assert model.ln_f in owned[0] and model.embed.wte in owned[1]
    assert sum(len(o) for o in owned) == len(list(model.modules()))
