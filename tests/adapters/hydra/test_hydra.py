"""Hydra: the config groups are derived from ZeroConfig and the presets, overrides compose into a validated
ZeroConfig, bad overrides fail before any process starts, and an override run of ``examples/train.py`` trains
sharded on 2 processes (Lightning re-launching the Hydra script)."""

import dataclasses

import pytest
from e2e_runs import EXAMPLES, PYTHON, assert_trained_sharded, output, run
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException

from ds_strategy.config import ZeroConfig
from ds_strategy.hydra import PrecisionConf, StrategyConf, zero_config
from ds_strategy.lightning import PRESETS


def _compose(*overrides: str):
    with initialize_config_module("ds_strategy.configs", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_strategy_group_offers_every_preset_name():
    options = ConfigStore.instance().repo["strategy"]
    assert {name.removesuffix(".yaml") for name in options} == set(PRESETS)


def test_structured_configs_carry_exactly_zero_configs_fields_and_defaults():
    derived = {f.name: f for conf in (StrategyConf, PrecisionConf) for f in dataclasses.fields(conf)}
    assert derived.keys() == {f.name for f in dataclasses.fields(ZeroConfig)}
    composed = {**StrategyConf().__dict__, **PrecisionConf().__dict__}
    assert ZeroConfig.from_dict(composed) == ZeroConfig()


def test_overrides_compose_into_a_validated_zero_config():
    cfg = _compose("strategy=zero1", "strategy.reduce_bucket_size=1e6", "precision=bf16-mixed")
    config = zero_config(cfg.strategy, cfg.precision)
    assert (config.stage, config.reduce_bucket_size, config.precision) == (1, 1_000_000, "bf16-mixed")


def test_unknown_key_fails_in_composition():
    with pytest.raises(ConfigCompositionException, match="strategy.stag"):
        _compose("strategy.stag=1")


def test_bad_value_names_the_override():
    cfg = _compose("strategy.stage=5")
    with pytest.raises(ValueError, match=r"strategy.stage=5: ZeroConfig.stage=5 is not allowed"):
        zero_config(cfg.strategy, cfg.precision)


@pytest.mark.slow
def test_bad_override_fails_before_any_process_starts(tmp_path):
    result = run([PYTHON, EXAMPLES / "train.py", "strategy.stage=5", f"hydra.run.dir={tmp_path}"], check=False)
    assert result.returncode != 0
    assert "strategy.stage=5: ZeroConfig.stage=5 is not allowed" in output(result)
    assert "Initializing distributed" not in output(result)


@pytest.mark.slow
def test_hydra_override_run_trains_sharded_on_two_processes(tmp_path):
    run(
        [
            PYTHON,
            EXAMPLES / "train.py",
            "strategy=zero1",
            "strategy.reduce_bucket_size=1e6",
            "trainer.devices=2",
            "trainer.max_steps=30",
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert_trained_sharded(tmp_path, stage=1, reference="train")
