"""``ds-strategy launch``: accelerate's launcher, with ZeRO settings taken from the same YAML.

Accelerate's config file rejects keys it does not know, so a ZeRO section cannot live in it as such. This command
reads an ordinary accelerate YAML plus a ``ds_strategy:`` section, validates that section as a ZeroConfig (so a bad
key fails here, before any process starts), hands the rest to ``accelerate launch --config_file`` and the section
to the workers as ``$DS_STRATEGY_CONFIG``, where ``ZeroAccelerator()`` reads it.

A YAML written for accelerate's DeepSpeed back-end (``distributed_type: DEEPSPEED``, ``deepspeed_config:``) runs
on ds_strategy instead: the section becomes the DeepSpeed config accelerate would build
(``ds_strategy.deepspeed.accelerate_yaml``), read with DeepSpeed's meaning, and the processes start as
``MULTI_GPU`` (on CPU-only machines ZeroAccelerator trains them on CPU with gloo). FSDP and Megatron-LM would
shard a second time and are rejected.

Without ``--config_file`` it is DeepSpeed's launcher instead: ``ds-strategy launch --num_gpus 2 train.py
--deepspeed_config ds.json`` runs a ``deepspeed.initialize`` script (``import ds_strategy.deepspeed as deepspeed``)
under torchrun, its options mapped as :mod:`ds_strategy.deepspeed.launcher` says.

A script whose workers never build a ZeroAccelerator (an unmodified ``Accelerator()`` script) fails the launch,
after it ran: each of its processes trained alone (see ``ds_strategy.accelerate.deepspeed_compat``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HELP = (
    "run a script under accelerate's launcher, with ZeRO settings from the config's ds_strategy section; without "
    "--config_file, DeepSpeed's launcher options (--num_gpus, --hostfile, ...) mapped onto torchrun"
)

_OTHER_SHARDING_TYPES = ("FSDP", "MEGATRON_LM")
_OTHER_SHARDING_SECTIONS = ("fsdp_config", "megatron_lm_config")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..deepspeed.launcher import add_deepspeed_arguments

    parser.add_argument(
        "--config_file", default=None, help="accelerate YAML with a ds_strategy: section of ZeroConfig fields"
    )
    add_deepspeed_arguments(parser)
    parser.add_argument("training_script", help="the script each process runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run(args: argparse.Namespace) -> int:
    if args.config_file is None:
        return _run_deepspeed_style(args)
    import yaml
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..optional_packages import needs

    with needs("accelerate", needed_by="ds-strategy launch"):  # imported here: the other commands work without it
        from accelerate.commands.launch import launch_command, launch_command_parser

        from ..accelerate.deepspeed_compat import LAUNCH_MARKERS_VAR, launched_workers
        from ..config.sources import ENV_VAR, load_config

    try:
        loaded = load_config(args.config_file, section_only=True)  # validated here, before any process starts
        settings = dict(loaded.beside)
        if str(settings.get("distributed_type", "")).upper() == "DEEPSPEED" or settings.get("deepspeed_config"):
            if loaded.written:
                raise ValueError("both deepspeed_config: and ds_strategy: configure ZeRO; keep one")
            loaded = load_config(_from_deepspeed_backend(settings, Path(args.config_file).parent), deepspeed=True)
        _check_no_other_sharding(settings)
    except (OSError, ValueError) as error:
        print(f"ds-strategy launch: {args.config_file}: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ds_strategy_launch_") as tmp:
        accelerate_yaml = Path(tmp, "accelerate.yaml")
        accelerate_yaml.write_text(yaml.safe_dump(settings))
        launch_args = launch_command_parser().parse_args(
            ["--config_file", str(accelerate_yaml), args.training_script, *args.training_script_args]
        )
        os.environ[ENV_VAR] = json.dumps(dict(loaded.written))
        markers = Path(tmp, "workers")
        markers.mkdir()
        os.environ[LAUNCH_MARKERS_VAR] = str(markers)
        try:
            launch_command(launch_args)
        except (subprocess.CalledProcessError, ChildFailedError):  # the workers' output already says why
            print(f"ds-strategy launch: {args.training_script} failed", file=sys.stderr)
            return 1
        if launched_workers(markers) == 0:
            print(
                f"ds-strategy launch: error: no worker of {args.training_script} built a ZeroAccelerator, so nothing "
                f"was sharded and each process trained alone with accelerate's Accelerator (on CPU, without a "
                f"process group); replace Accelerator( with ds_strategy.accelerate.ZeroAccelerator( (or Trainer "
                f"with ds_strategy.transformers.ZeroTrainer)",
                file=sys.stderr,
            )
            return 1
    return 0


def _run_deepspeed_style(args: argparse.Namespace) -> int:
    """DeepSpeed's launcher options mapped onto torchrun (:mod:`ds_strategy.deepspeed.launcher`)."""
    from ..deepspeed.launcher import torchrun_arguments

    try:
        torchrun = torchrun_arguments(args)
    except (OSError, ValueError) as error:
        print(f"ds-strategy launch: {error}", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun]).returncode


def _from_deepspeed_backend(settings: dict, config_dir: Path) -> dict | Path:
    """The DeepSpeed config an accelerate DeepSpeed YAML describes (or its JSON file); ``settings`` become a
    MULTI_GPU launch."""
    from ..deepspeed.accelerate_yaml import deepspeed_config_from_accelerate

    ds_config, ignored = deepspeed_config_from_accelerate(settings.pop("deepspeed_config", None) or {}, config_dir)
    settings["distributed_type"] = "MULTI_GPU"
    if ignored:
        print(
            f"ds-strategy launch: running accelerate's DeepSpeed config on ds_strategy; ignored: {'; '.join(ignored)}",
            file=sys.stderr,
        )
    return ds_config


def _check_no_other_sharding(settings: dict) -> None:
    distributed_type = str(settings.get("distributed_type", "")).upper()
    if distributed_type in _OTHER_SHARDING_TYPES:
        raise ValueError(
            f"distributed_type: {distributed_type} is accelerate's own sharding back-end, which would "
            f"shard on top of ZeRO; use MULTI_GPU (or DEEPSPEED, which ds_strategy runs) and put the "
            f"ZeRO settings under ds_strategy:"
        )
    for section in _OTHER_SHARDING_SECTIONS:
        if settings.get(section):
            raise ValueError(
                f"{section}: configures accelerate's own sharding back-end, which conflicts with "
                f"ds_strategy's ZeRO; remove it and put the ZeRO settings under ds_strategy:"
            )
