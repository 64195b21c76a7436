"""Sharded construction and unit-by-unit placement through the adapters: a Hugging Face model built in Lightning's
``configure_model``, Fabric's ``init_module(empty_init=True)`` or under Accelerate's ``init_empty_weights()`` with
zero3 equals a normal build and loads pretrained weights sharded, a model built on
the CPU is never moved to the device whole, and a failed setup raises its own error only (not a second one from
teardown moving meta tensors)."""

import os

import hf_models
import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy import ZeroFabricStrategy, ZeroStrategy

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

ZERO3 = {"stage": 3, "param_persistence_threshold": 0}


class Recorded:
    """Counts ``_apply`` on the root module: what ``module.to(device)`` (or ``.cpu()``) runs."""

    applied = 0

    def _apply(self, fn, recurse=True):
        self.applied += 1
        return super()._apply(fn, recurse)


class HFModule(Recorded, L.LightningModule):
    def configure_model(self):
        if not hasattr(self, "model"):
            self.model = hf_models.build("gpt2")  # on the meta device: the strategy's model_sharded_context

    def on_fit_start(self):
        self.at_fit_start = {"applied": self.applied, "state": self.trainer.strategy.engine.full_state_dict(False)}

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return hf_models.adamw(self.model)


class UninitialisableModule(L.LightningModule):
    def configure_model(self):
        self.weight = nn.Parameter(torch.empty(8))  # on meta, and no module initialises it

    def training_step(self, batch, batch_idx):
        return self.weight.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(world_size: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroStrategy(**ZERO3),
        max_steps=2,
        **QUIET,
        use_distributed_sampler=False,
    )


def _lightning(rank: int, world_size: int) -> dict:
    module = HFModule()
    data = DataLoader(TensorDataset(torch.cat(hf_models.batches(2, world_size))), batch_size=2)
    _trainer(world_size).fit(module, data)
    expected = hf_models.build("gpt2").state_dict()
    state = {key.removeprefix("model."): value for key, value in module.at_fit_start["state"].items()}
    with pytest.raises(ValueError) as error:
        _trainer(world_size).fit(UninitialisableModule(), data)
    return {
        "applied": module.at_fit_start["applied"],
        "error": str(error.value),
        "differing": [k for k, v in expected.items() if not torch.equal(state[k], v)],
    }


class RecordedMLP(Recorded, nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])


def _fabric(rank: int, world_size: int, pretrained: str) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(**ZERO3))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        hf = hf_models.build("llama")
    on_meta = all(p.is_meta for p in hf.parameters())
    fabric.setup(hf, hf_models.adamw(hf))
    hf_state = fabric.strategy.engine.full_state_dict(False)
    expected = hf_models.build("llama").state_dict()
    fabric.strategy.load_pretrained(pretrained)
    loaded = fabric.strategy.engine.full_state_dict(False)
    saved = hf_models.build("llama", seed=5).state_dict()
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(**ZERO3, unit_modules=(nn.Linear,))
    )  # a unit per layer
    fabric.launch()
    with fabric.init_module(empty_init=False):
        torch.manual_seed(0)
        mlp = RecordedMLP()
    torch.manual_seed(0)
    normal_mlp = RecordedMLP()
    fabric.setup(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1))
    mlp_state = fabric.strategy.engine.full_state_dict(False)
    return {
        "on_meta": on_meta,
        "hf_differing": [k for k, v in expected.items() if not torch.equal(hf_state[k], v)],
        "loaded_differing": [k for k, v in saved.items() if not torch.equal(loaded[k], v)],
        "mlp_applied": mlp.applied,
        "mlp_equal": all(torch.equal(mlp_state[k], v) for k, v in normal_mlp.state_dict().items()),
    }


def _accelerate(rank: int, world_size: int, pretrained: str) -> dict:
    from accelerate import init_empty_weights

    from ds_strategy.accelerate import ZeroAccelerator

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    accelerator = ZeroAccelerator(ZERO3, cpu=True)
    with init_empty_weights():
        model = hf_models.build("llama")
    on_meta = all(p.is_meta for p in model.parameters())
    model, _ = accelerator.prepare(model, hf_models.adamw(model))
    built = accelerator.engine.full_state_dict(False)
    accelerator.load_pretrained(pretrained)
    loaded = accelerator.engine.full_state_dict(False)
    expected, saved = hf_models.build("llama").state_dict(), hf_models.build("llama", seed=5).state_dict()
    return {
        "on_meta": on_meta,
        "differing": [k for k, v in expected.items() if not torch.equal(built[k], v)],
        "loaded_differing": [k for k, v in saved.items() if not torch.equal(loaded[k], v)],
    }


def _adapters(rank: int, world_size: int, pretrained: str) -> dict:
    set_lightning_environment(rank)
    return {
        "lightning": _lightning(rank, world_size),
        "fabric": _fabric(rank, world_size, pretrained),
        "accelerate": _accelerate(rank, world_size, pretrained),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pretrained = tmp_path_factory.mktemp("llama")
    hf_models.build("llama", seed=5).save_pretrained(pretrained, max_shard_size="20KB")
    return run_ranks(_adapters, 2, str(pretrained), timeout=300)


def test_lightning_configure_model_builds_a_hf_model_sharded_equal_to_a_normal_build(runs):
    for rank in runs:
        assert rank["lightning"]["differing"] == []
        assert rank["lightning"]["applied"] == 0, "the strategy moved the whole model"


def test_lightning_setup_error_is_not_followed_by_a_teardown_error(runs):
    for rank in runs:
        assert "cannot materialise" in rank["lightning"]["error"] and "weight" in rank["lightning"]["error"]


def test_fabric_empty_init_builds_a_hf_model_on_meta_and_materialises_it_equal_to_a_normal_build(runs):
    for rank in runs:
        assert rank["fabric"]["on_meta"]
        assert rank["fabric"]["hf_differing"] == []


def test_fabric_strategy_loads_pretrained_weights_into_the_sharded_model(runs):
    for rank in runs:
        assert rank["fabric"]["loaded_differing"] == []


def test_accelerate_init_empty_weights_builds_sharded_equal_to_a_normal_build_and_loads_pretrained(runs):
    for rank in runs:
        assert rank["accelerate"]["on_meta"]
        assert rank["accelerate"]["differing"] == [] and rank["accelerate"]["loaded_differing"] == []


def test_fabric_zero3_places_a_cpu_built_model_unit_by_unit_never_whole(runs):
    for rank in runs:
        assert rank["fabric"]["mlp_applied"] == 0
        assert rank["fabric"]["mlp_equal"]
