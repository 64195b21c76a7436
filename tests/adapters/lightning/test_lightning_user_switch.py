"""What a Lightning user switching from ``deepspeed_stage_3``, ``fsdp`` or ``ModelParallelStrategy`` to ``zero*``
does, on Lightning's own ``BoringModel`` (issue 26): each test is the user's code from the issue, on 2 gloo ranks
wherever it claims something of sharding (one rank shards nothing), on one process where what it checks is a path or
a refusal."""

import copy
import json
import os
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from lightning.pytorch.demos.boring_classes import BoringModel
from quiet_trainer import QUIET

import ds_strategy
from ds_strategy.checkpoint import CheckpointError


def _trainer(world_size: int, strategy="zero3", **kwargs) -> L.Trainer:
    """A quiet CPU Trainer over the ranks ``run_ranks`` already started (Lightning must not launch any)."""
    set_lightning_environment(torch.distributed.get_rank())
    settings = dict(max_steps=2, limit_val_batches=1, limit_test_batches=1, num_sanity_val_steps=0)
    settings.update(kwargs)
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        **QUIET,
        **settings,
    )


# -- 1: init_module(empty_init=True) under stage 3 ---------------------------------------------------------------
class _WeightsAtFitStart(L.Callback):
    def on_fit_start(self, trainer, module):
        engine = trainer.strategy.engine
        self.weights = engine.full_state_dict(rank0_only=False)
        self.held = sum(fp.shard.numel() for fp in engine.flat_params)  # what this rank keeps between steps
        self.total = sum(fp.numel for fp in engine.flat_params)


def _init_module_empty_init(rank: int, world_size: int) -> dict:
    seen = _WeightsAtFitStart()
    trainer = _trainer(world_size, callbacks=[seen])
    with trainer.init_module(empty_init=True):
        module = BoringModel()
    built_on = module.layer.weight.device.type
    trainer.fit(module)
    return {"built_on": built_on, "weight": seen.weights["layer.weight"], "held": seen.held, "total": seen.total}


def test_init_module_empty_init_at_stage3_builds_sharded_and_initialised():
    """Trainer(strategy="zero3") + init_module(empty_init=True) is configure_model's build: on meta, then each of
    the 2 ranks holds half of the weights, initialised by ``reset_parameters`` shard by shard (uninitialised memory
    reached |w| ~ 1e34 before), one model on both."""
    ranks = run_ranks(_init_module_empty_init, 2)
    bound = 1 / 32**0.5  # nn.Linear(32, 2).reset_parameters: uniform in +-1/sqrt(fan_in)
    for rank in ranks:
        assert rank["built_on"] == "meta"
        assert rank["held"] == -(-rank["total"] // 2), (rank["held"], rank["total"])
        assert torch.equal(rank["weight"], ranks[0]["weight"])
        assert rank["weight"].abs().max() <= bound
        assert rank["weight"].std() > bound / 4  # not zeros either


# -- 2: a save never deletes a user's files --------------------------------------------------------------------
def _save_over_user_folder(rank: int, world_size: int, out: Path) -> str:
    trainer = _trainer(world_size)
    trainer.fit(BoringModel())
    with pytest.raises(CheckpointError) as refused:
        trainer.save_checkpoint(out)
    return str(refused.value)


def test_save_checkpoint_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (message,) = run_ranks(_save_over_user_folder, 1, out)
    assert str(out) in message and "notes.txt" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing written beside it
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


# -- 4: save after fit and test ----------------------------------------------------------------------------------
class _AdamOnOneBatch(BoringModel):
    """Adam (moments a resume must get back) on the same batch every step, so a resumed run sees exactly the
    batches an uninterrupted one does wherever Lightning restarts its epoch."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self):
        row = torch.randn(1, 32, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(row.expand(8, 32), batch_size=2)


def _model(seed: int = 0) -> BoringModel:
    torch.manual_seed(seed)
    return _AdamOnOneBatch()


def _fit_test_save(rank: int, world_size: int, strategy: str, out: Path) -> dict:
    trainer = _trainer(world_size, strategy)
    module = _model()
    trainer.fit(module)
    trainer.test(module, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_checkpoint(out / "a.ckpt")
    resumed = _trainer(world_size, strategy, max_steps=4)
    resumed.fit(_model(seed=1), ckpt_path=out / "a.ckpt")
    uninterrupted = _trainer(world_size, strategy, max_steps=4)
    uninterrupted.fit(_model())
    return {
        "warnings": [str(w.message) for w in caught],
        "resumed": resumed.strategy.lightning_module_state_dict(),
        "uninterrupted": uninterrupted.strategy.lightning_module_state_dict(),
    }


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_save_checkpoint_after_fit_and_test_keeps_the_optimizer_state(tmp_path, strategy):
    """As under DDP, the save after ``trainer.test`` has the fit's Adam moments, so resuming from it equals an
    uninterrupted run. Before, the test's engine (no optimizer) made it a weights-only save, warned, and a resume
    restarted Adam's moments."""
    for outcome in run_ranks(_fit_test_save, 2, strategy, tmp_path):  # 2 ranks: the moments are sharded
        assert not [w for w in outcome["warnings"] if "without optimizer state" in w], outcome["warnings"]
        for name, value in outcome["uninterrupted"].items():
            torch.testing.assert_close(outcome["resumed"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    manifest = json.loads((tmp_path / "a.ckpt" / "manifest.json").read_text())
    assert manifest["optimizer_state"]["layer.weight"].keys() == {"exp_avg", "exp_avg_sq", "step"}


# -- 7: lightning_module_state_dict ------------------------------------------------------------------------------
def _module_state_dict(rank: int, world_size: int) -> dict:
    trainer = _trainer(world_size)
    trainer.fit(BoringModel())
    return trainer.strategy.lightning_module_state_dict()


def test_lightning_module_state_dict_is_every_key_whole_on_every_rank():
    """As DDP, FSDP and DeepSpeed give it: before, each rank had only the keys its shard touches, as pieces."""
    ranks = run_ranks(_module_state_dict, 2)
    for state in ranks:
        assert {k: tuple(v.shape) for k, v in state.items()} == {"layer.weight": (2, 32), "layer.bias": (2,)}
        for key, value in state.items():
            assert torch.equal(value, ranks[0][key]), key


# -- 14: remote paths ----------------------------------------------------------------------------------------------
def _save_to_url(rank: int, world_size: int, cwd: Path) -> str:
    os.chdir(cwd)
    trainer = _trainer(world_size)
    trainer.fit(BoringModel())
    with pytest.raises(CheckpointError) as refused:
        trainer.save_checkpoint("memory://bucket/run/ckpt")
    return str(refused.value)


def test_save_checkpoint_to_a_url_is_refused_by_name(tmp_path):
    """Before, ``memory://bucket/run/ckpt`` silently became a local directory ``memory:/bucket/run/ckpt``."""
    (message,) = run_ranks(_save_to_url, 1, tmp_path)
    assert "memory://bucket/run/ckpt" in message and "URL" in message
    assert list(tmp_path.iterdir()) == []


# -- 13: timeout -------------------------------------------------------------------------------------------------
def test_timeout_is_accepted_and_given_to_the_process_group_by_trainer_and_fabric():
    """As DDP's, FSDP's and DeepSpeed's: it reaches ``init_process_group`` through DDPStrategy's ``_timeout``."""
    from ds_strategy.fabric import ZeroFabricStrategy

    for strategy in (ds_strategy.ZeroStrategy(timeout=timedelta(seconds=30)), ZeroFabricStrategy(timeout=30)):
        assert strategy._timeout == timedelta(seconds=30)
    assert ds_strategy.ZeroStrategy()._timeout == timedelta(minutes=30)  # torch's default_pg_timeout
    with pytest.raises(ValueError, match="timeout"):
        ds_strategy.ZeroStrategy(timeout=timedelta(seconds=-1))


# -- 3: non-parameter tensors built in configure_model under stage 3 ----------------------------------------------
class _MetricModel(BoringModel):
    """Builds everything in configure_model: the layer, a torchmetrics metric and a plain buffer on the root."""

    def __init__(self):
        super().__init__()
        del self.layer

    def configure_model(self):
        from torchmetrics.classification import BinaryAccuracy

        self.layer = torch.nn.Linear(32, 2)
        self.accuracy = BinaryAccuracy()
        self.register_buffer("scale", torch.tensor(0.5))

    def validation_step(self, batch, batch_idx):
        output = self(batch) * self.scale
        self.accuracy(output[:, 0].sigmoid(), (batch[:, 0] > 0).int())
        self.log("accuracy", self.accuracy)
        return super().validation_step(batch, batch_idx)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_validation_rows(), batch_size=VALIDATION_BATCH)


VALIDATION_BATCH = 8


def _validation_rows() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(5))


def _accuracy_of(state: dict, rows: torch.Tensor, scale: float) -> float:
    """The metric computed by hand: the trained layer's first output, scaled, against the sign of the first input."""
    output = (rows @ state["layer.weight"].T + state["layer.bias"]) * scale
    return ((output[:, 0].sigmoid() > 0.5) == (rows[:, 0] > 0)).float().mean().item()


def _fit_with_metric(rank: int, world_size: int) -> dict:
    trainer = _trainer(world_size, val_check_interval=2)
    module = _MetricModel()
    trainer.fit(module)  # validates once, after the last step: with the final weights
    return {
        "scale": module.scale.item(),
        "accuracy": trainer.callback_metrics["accuracy"].item(),
        "state": trainer.strategy.lightning_module_state_dict(),
    }


def test_metrics_and_buffers_built_in_configure_model_at_stage3_are_real():
    """Only parameters go to meta: before, the metric's states and the buffer stayed there ("Cannot copy out of
    meta tensor" when the metric was logged, a buffer with its value lost). On 2 ranks the logged accuracy is the
    metric synced over both ranks' first validation batch (rows 0-15: the distributed sampler deals rank r every
    other row from r), equal to the accuracy computed by hand from the trained weights."""
    ranks = run_ranks(_fit_with_metric, 2)
    expected = _accuracy_of(ranks[0]["state"], _validation_rows()[: 2 * VALIDATION_BATCH], 0.5)
    for rank in ranks:
        assert rank["scale"] == 0.5
        assert rank["accuracy"] == pytest.approx(expected, abs=1e-6)


# -- 5: a single-file checkpoint from DDP or one device -----------------------------------------------------------
class _CountSteps(L.Callback):
    steps = 0

    def on_train_batch_end(self, trainer, *args):
        self.steps += 1


def _load_single_file(rank: int, world_size: int, out: Path) -> dict:
    plain = _trainer(world_size, strategy="auto")
    trained = BoringModel()
    plain.fit(trained)
    plain.save_checkpoint(out / "m.ckpt")
    saved = {k: v.clone() for k, v in trained.state_dict().items()}

    tested = _trainer(world_size)
    tested.test(BoringModel(), ckpt_path=out / "m.ckpt", verbose=False)
    counted = _CountSteps()
    resumed = _trainer(world_size, max_steps=4, callbacks=[counted])
    resumed.fit(BoringModel(), ckpt_path=out / "m.ckpt")  # its optimizer state too (test_full_state_dict_lightning)
    return {
        "saved": saved,
        "tested": tested.strategy.lightning_module_state_dict(),
        "global_step": resumed.global_step,
        "steps_run": counted.steps,
    }


def test_single_file_checkpoint_of_one_device_loads_for_test_and_fit(tmp_path):
    """FSDP loads it; before, "is a file, not a ds_strategy checkpoint"."""
    for rank in run_ranks(_load_single_file, 2, tmp_path):  # DDP's file, loaded into weights sharded over 2 ranks
        assert rank["tested"].keys() == rank["saved"].keys()
        for key, value in rank["saved"].items():
            assert torch.equal(rank["tested"][key], value), key
        assert rank["global_step"] == 4 and rank["steps_run"] == 2  # resumed at step 2 of 4


# -- 6: from a sharded checkpoint back to plain Lightning ----------------------------------------------------------
class _AdamModel(BoringModel):
    """BoringModel with an optimizer that has state to carry over (SGD without momentum has none)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class _OptimizerAtTrainStart(L.Callback):
    def on_train_start(self, trainer, module):
        self.state = copy.deepcopy(trainer.optimizers[0].state_dict())  # the steps update it in place


def _save_sharded(rank: int, world_size: int, out: Path) -> None:
    trainer = _trainer(world_size)
    trainer.fit(_AdamModel())
    trainer.save_checkpoint(out / "ck")


def _resume_with_ddp(rank: int, world_size: int, file: Path) -> dict:
    seen = _OptimizerAtTrainStart()
    trainer = _trainer(world_size, strategy="ddp", max_steps=4, callbacks=[seen])
    trainer.fit(_AdamModel(), ckpt_path=file)
    return {"optimizer": seen.state, "global_step": trainer.global_step}


def test_consolidated_trainer_checkpoint_loads_into_plain_lightning(tmp_path):
    """``ds-strategy consolidate --with-optimizer`` writes Lightning's layout: before, load_from_checkpoint and a
    DDP resume raised KeyError: 'pytorch-lightning_version'."""
    from ds_strategy.cli import main

    run_ranks(_save_sharded, 2, tmp_path)
    assert main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "ck.pt"), "--with-optimizer"]) == 0
    consolidated = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert consolidated["global_step"] == 2
    assert {"epoch", "loops", "callbacks", "lr_schedulers", "pytorch-lightning_version"} <= consolidated.keys()

    loaded = _AdamModel.load_from_checkpoint(tmp_path / "ck.pt")
    for key, value in consolidated["state_dict"].items():
        assert torch.equal(loaded.state_dict()[key], value), key

    (resumed,) = run_ranks(_resume_with_ddp, 1, tmp_path / "ck.pt")
    assert resumed["global_step"] == 4
    saved = consolidated["optimizer_states"][0]
    assert resumed["optimizer"]["param_groups"][0]["params"] == [0, 1]  # layer.weight, layer.bias
    for position, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][position][key], value), (position, key)
    assert saved["state"][0]["exp_avg"].shape == (2, 32)


# -- 15: tensor_parallel_size without tensor-parallel layers; self.device_mesh at tp=1 ---------------------------
class _MeshModel(BoringModel):
    """configure_model code written for ModelParallelStrategy: reads the mesh by Lightning's dimension names."""

    def configure_model(self):
        self.mesh_sizes = {name: self.device_mesh[name].size() for name in ("data_parallel", "tensor_parallel")}


def _fit_on_mesh(rank: int, world_size: int, tensor_parallel_size: int) -> dict:
    trainer = _trainer(world_size, ds_strategy.ZeroStrategy(stage=2, tensor_parallel_size=tensor_parallel_size))
    torch.manual_seed(rank)  # ranks built apart must still train one model (tp rank 0's, as DDP's rank 0's)
    module = _MeshModel()
    torch.manual_seed(0)  # BoringModel's data comes from the generator: the same batches on every rank
    trainer.fit(module)
    return {"mesh": module.mesh_sizes, "state": trainer.strategy.lightning_module_state_dict()}


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_device_mesh_by_lightning_names_and_a_model_without_tp_layers_runs_replicated(tensor_parallel_size):
    """Before: no ``self.device_mesh`` at tp=1, and tp=2 refused a model without tensor-parallel layers."""
    ranks = run_ranks(_fit_on_mesh, 2, tensor_parallel_size)
    for rank in ranks:
        assert rank["mesh"] == {"data_parallel": 2 // tensor_parallel_size, "tensor_parallel": tensor_parallel_size}
        for key, value in rank["state"].items():
            assert torch.equal(value, ranks[0]["state"][key]), key


# -- 17: a checkpoint path ending in .ckpt is a directory, said once -----------------------------------------------
def _save_twice_as_ckpt(rank: int, world_size: int, out: Path) -> list[str]:
    trainer = _trainer(world_size, "zero2")
    trainer.fit(BoringModel())
    with pytest.warns(UserWarning) as caught:
        trainer.save_checkpoint(out / "a.ckpt")
        trainer.save_checkpoint(out / "b.ckpt")
    return [str(warning.message) for warning in caught if "will be a directory" in str(warning.message)]


def test_a_checkpoint_path_ending_in_ckpt_is_a_directory_and_says_so_once(tmp_path):
    (warnings,) = run_ranks(_save_twice_as_ckpt, 1, tmp_path)
    assert len(warnings) == 1 and str(tmp_path / "a.ckpt") in warnings[0]
    assert (tmp_path / "a.ckpt").is_dir() and (tmp_path / "b.ckpt").is_dir()
