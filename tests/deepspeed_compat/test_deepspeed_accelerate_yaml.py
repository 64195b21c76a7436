"""accelerate configs written for its DeepSpeed back-end run on ds_strategy through ``ds-strategy launch``: the
section becomes the DeepSpeed config accelerate's own ``DeepSpeedPlugin`` builds, and accelerate's template launches
2-process training. Inputs are accelerate's template and docs example, verbatim (``tests/data/accelerate_configs``)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from e2e_runs import DS_STRATEGY, EXAMPLES, free_port, run

from ds_strategy import cli
from ds_strategy.config.sources import config_from_deepspeed
from ds_strategy.deepspeed.accelerate_yaml import deepspeed_config_from_accelerate

DATA = Path(__file__).resolve().parents[1] / "data"
TEMPLATE = DATA / "accelerate_configs" / "accelerate__examples__config_yaml_templates__deepspeed.yaml"
DOCS_EXAMPLE = DATA / "accelerate_configs" / "accelerate__docs__usage_guides__deepspeed_zero3_cpu_offload.yaml"
STAGE1_JSON = DATA / "deepspeed_configs" / "accelerate__examples__deepspeed_config_templates__zero_stage1_config.json"


def _section(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["deepspeed_config"]


def test_docs_example_becomes_the_config_accelerates_deepspeed_plugin_builds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed's first import, which picks its accelerator
    import deepspeed  # noqa: F401  accelerate's DeepSpeedPlugin needs it; the test extra installs it, never skipped
    from accelerate.utils import DeepSpeedPlugin

    section = _section(DOCS_EXAMPLE)
    ours, ignored = deepspeed_config_from_accelerate(section, DOCS_EXAMPLE.parent)
    theirs = dict(DeepSpeedPlugin(**section).deepspeed_config)
    theirs.pop("steps_per_print")  # accelerate silences DeepSpeed's logging; a no-op here
    assert ours == theirs
    assert ignored == [
        ("deepspeed_config.zero3_init_flag=True (ZeroAccelerator shards the model when prepare() receives it)")
    ]
    config = config_from_deepspeed(ours)
    assert (config.stage, config.offload_optimizer, config.offload_params, config.pin_memory) == (3, "cpu", "cpu", True)
    assert (config.gradient_clipping, config.gradient_accumulation_steps) == (1.0, 1)


def test_keys_that_do_not_map_fail_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"deepspeed_config\.deepspeed_hostfile='/job/hostfile' is not supported"):
        deepspeed_config_from_accelerate({"zero_stage": 2, "deepspeed_hostfile": "/job/hostfile"}, tmp_path)
    with pytest.raises(ValueError, match=r"deepspeed_config\.zero_stag is not a key accelerate's DeepSpeed plugin"):
        deepspeed_config_from_accelerate({"zero_stag": 2}, tmp_path)
    with pytest.raises(ValueError, match=r"deepspeed_config\.zero_stage cannot be combined with deepspeed_config_file"):
        deepspeed_config_from_accelerate({"zero_stage": 2, "deepspeed_config_file": str(STAGE1_JSON)}, tmp_path)


@pytest.mark.slow
def test_accelerates_deepspeed_template_launches_two_process_training(tmp_path):
    """The template names its JSON relative to its own directory, as in accelerate's repository."""
    templates = tmp_path / "config_yaml_templates"
    templates.mkdir()
    (tmp_path / "deepspeed_config_templates").mkdir()
    shutil.copy(STAGE1_JSON, tmp_path / "deepspeed_config_templates" / "zero_stage1_config.json")
    config = templates / "deepspeed.yaml"
    config.write_text(TEMPLATE.read_text() + f"\nmain_process_port: {free_port()}\n")
    result = run(
        [
            DS_STRATEGY,
            "launch",
            "--config_file",
            config,
            EXAMPLES / "train_accelerate.py",
            "--max-steps",
            "12",
            "--out",
            tmp_path / "out",
        ],
        timeout=240,
    )
    assert "ignored: deepspeed_config.zero3_init_flag=False" in result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["stage"], summary["world_size"]) == (1, 2)
    assert summary["final_loss"] < summary["first_loss"], summary["losses"]
    psi = summary["trainable_params"]  # the JSON's fp16: Adam's moments (+ fp32 master) sharded over 2 ranks
    assert all(0.95 * 8 * psi / 2 <= r["optimizer"] <= 1.05 * 12 * psi / 2 for r in summary["bytes_per_rank"])


def test_launch_rejects_a_template_whose_json_is_missing(tmp_path, capsys):
    config = tmp_path / "deepspeed.yaml"
    config.write_text(TEMPLATE.read_text())
    assert cli.main(["launch", "--config_file", str(config), str(EXAMPLES / "train_accelerate.py")]) == 2
    assert (
        "deepspeed_config.deepspeed_config_file='../deepspeed_config_templates/zero_stage1_config.json' does not "
        "exist" in capsys.readouterr().err
    )
