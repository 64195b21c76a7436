"""Lightning entry points end to end: ``pytorch_lightning``'s Trainer by strategy name and the DeepSpeed-JSON
example, each on 2 real CPU processes; bad strategy configs fail at construction. (``lightning.pytorch``'s Trainer
by name is the example of docs/getting-started.md, run by ``test_docs.py``; Lightning with Hydra is
``test_hydra.py``.)"""

import lightning as L
import pytest
import pytorch_lightning as pl
from e2e_runs import EXAMPLES, PYTHON, SCRIPTS, assert_trained_sharded, run

from ds_strategy import ZeroStrategy

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def test_pytorch_lightning_trainer_trains_sharded_by_strategy_name(tmp_path):
    run([PYTHON, SCRIPTS / "lightning_by_name.py", "pytorch_lightning", "zero1", tmp_path])
    assert_trained_sharded(tmp_path, stage=1, reference="lightning_by_name")


def test_deepspeed_json_example_trains_sharded(tmp_path):
    run([PYTHON, EXAMPLES / "train_deepspeed_json.py", "--max-steps", "30", "--out", tmp_path])
    assert_trained_sharded(tmp_path, stage=2, reference="deepspeed_json")


def test_pytorch_lightning_names_resolve_to_its_own_strategy_class():
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero2", logger=False)
    assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
    assert trainer.strategy.config.stage == 2


def test_bad_stage_names_the_field():
    with pytest.raises(ValueError, match="stage=5"):
        ZeroStrategy(stage=5)


def test_misspelled_deepspeed_key_names_the_key_and_suggests_the_right_one(tmp_path):
    bad = tmp_path / "ds_config.json"
    bad.write_text('{"zero_optimization": {"stage": 2, "overlap_com": true}}')
    with pytest.raises(
        ValueError, match="zero_optimization.overlap_com .*did you mean 'zero_optimization.overlap_comm'"
    ):
        ZeroStrategy.from_deepspeed_config(bad)


def test_trainer_precision_conflicting_with_the_config_is_rejected():
    with pytest.raises(ValueError, match="conflicts with ZeroConfig.precision"):
        L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(precision="bf16-true"), precision="bf16-mixed")
