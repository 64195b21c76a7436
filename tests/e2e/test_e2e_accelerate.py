"""Accelerate end to end: ``ZeroAccelerator`` under a real 2-process ``accelerate launch`` configured through
``$DS_STRATEGY_CONFIG``, and ``ds-strategy launch`` with an accelerate YAML plus a ``ds_strategy:`` section; bad
ZeRO settings and accelerate's own sharding back-ends are rejected before any worker starts."""

import pytest
from e2e_runs import (
    DS_STRATEGY,
    EXAMPLES,
    REPO,
    accelerate_launch,
    assert_sharded_checkpoint,
    assert_trained_sharded,
    free_port,
    run,
)

from ds_strategy import cli
from ds_strategy.accelerate import ZeroAccelerator, load_zero_config

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def _yaml_with(tmp_path, extra: str) -> str:
    """configs/accelerate/zero2.yaml with ``extra`` lines appended (a free port keeps parallel runs apart)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        (REPO / "configs/accelerate/zero2.yaml").read_text() + f"main_process_port: {free_port()}\n" + extra
    )
    return str(path)


def test_zero_accelerator_trains_sharded_under_accelerate_launch_with_env_config(tmp_path):
    run(
        accelerate_launch("--accumulate", "2", "--max-steps", "30", "--out", tmp_path),
        env={"DS_STRATEGY_CONFIG": '{"stage": 1}'},
    )
    summary = assert_trained_sharded(tmp_path, stage=1, reference="accelerate_accumulate_2")
    assert_sharded_checkpoint(tmp_path / "checkpoint" / "zero_checkpoint", summary)


def test_ds_strategy_launch_trains_with_the_yaml_ds_strategy_section(tmp_path):
    run(
        [
            DS_STRATEGY,
            "launch",
            "--config_file",
            _yaml_with(tmp_path, ""),
            EXAMPLES / "train_accelerate.py",
            "--max-steps",
            "30",
            "--out",
            tmp_path,
        ]
    )
    assert_trained_sharded(tmp_path, stage=2, reference="accelerate")


def test_ds_strategy_launch_rejects_a_bad_zero_setting_before_starting_workers(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs/accelerate/zero2.yaml").read_text().replace("stage: 2", "stage: 5"))
    assert cli.main(["launch", "--config_file", str(bad), str(EXAMPLES / "train_accelerate.py")]) == 2
    assert "ZeroConfig.stage=5 is not allowed" in capsys.readouterr().err


def test_ds_strategy_launch_rejects_a_deepspeed_section_beside_a_ds_strategy_section(tmp_path, capsys):
    config = _yaml_with(tmp_path, "deepspeed_config:\n  zero_stage: 2\n")
    assert cli.main(["launch", "--config_file", config, str(EXAMPLES / "train_accelerate.py")]) == 2
    assert "both deepspeed_config: and ds_strategy: configure ZeRO; keep one" in capsys.readouterr().err


def test_zero_accelerator_rejects_accelerates_own_deepspeed_plugin():
    with pytest.raises(ValueError, match="do not also pass deepspeed_plugin"):
        ZeroAccelerator(deepspeed_plugin=object())


def test_env_config_error_names_the_variable_and_the_field(monkeypatch):
    monkeypatch.setenv("DS_STRATEGY_CONFIG", '{"stage": 5}')
    with pytest.raises(ValueError, match=r"\$DS_STRATEGY_CONFIG: ZeroConfig.stage=5"):
        load_zero_config()


def test_config_file_may_hold_a_deepspeed_json_config():
    config = load_zero_config(EXAMPLES / "ds_config.json")
    assert (config.stage, config.gradient_accumulation_steps, config.gradient_clipping) == (2, 2, 1.0)
