"""Fabric end to end: ``Fabric(strategy="zero2")`` trains sharded on 2 real CPU processes through
``examples/train_fabric.py`` (setup, no_backward_sync, backward, clip_gradients, optimizer.step, save), and a bad
config fails when the Fabric is built, before any process starts."""

import lightning as L
import pytest
from e2e_runs import EXAMPLES, PYTHON, assert_sharded_checkpoint, assert_trained_sharded, run

from ds_strategy import ZeroFabricStrategy

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def test_fabric_trains_sharded_by_strategy_name_and_saves_a_sharded_checkpoint(tmp_path):
    run(
        [
            PYTHON,
            EXAMPLES / "train_fabric.py",
            "--strategy",
            "zero2",
            "--accumulate",
            "2",
            "--max-steps",
            "30",
            "--out",
            tmp_path,
        ]
    )
    summary = assert_trained_sharded(tmp_path, stage=2, reference="fabric_accumulate_2")
    assert_sharded_checkpoint(tmp_path / "checkpoint.ckpt", summary)


def test_fabric_strategy_names_come_from_the_presets():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero1")
    assert isinstance(fabric.strategy, ZeroFabricStrategy)
    assert fabric.strategy.config.stage == 1


def test_bad_stage_names_the_field():
    with pytest.raises(ValueError, match="stage=5"):
        L.Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=5))


def test_fabric_precision_conflicting_with_the_config_is_rejected():
    with pytest.raises(ValueError, match="Fabric\\(precision\\)='bf16-mixed' conflicts with ZeroConfig.precision"):
        L.Fabric(
            accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(precision="bf16-true"), precision="bf16-mixed"
        )


def test_fabric_precision_flag_reaches_the_engine_config():
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero2", precision="bf16-mixed")
    assert fabric.strategy.config.precision == "bf16-mixed"


def test_fabric_rejects_gradient_accumulation_steps_it_has_no_loop_to_apply():
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4 is not allowed with Fabric"):
        ZeroFabricStrategy.from_deepspeed_config({"gradient_accumulation_steps": 4})
