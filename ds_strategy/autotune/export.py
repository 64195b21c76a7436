"""The tuned configuration as files a run can use: a Hydra ``strategy`` option and a DeepSpeed-style JSON (written by
``ds_strategy.config.deepspeed.write`` from the key tables that read it)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..config import ZeroConfig
from ..config.deepspeed.write import deepspeed_dict
from ..config.zero_config import PRECISION_SECTION, fields_of

# The fields of the Hydra ``precision`` group (ZeroConfig's precision section); a strategy option leaves them out.
_PRECISION_FIELDS = frozenset(fields_of(PRECISION_SECTION))


def write_deepspeed_json(path: Path, config: ZeroConfig) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(deepspeed_dict(config), indent=2) + "\n")
    return path


def hydra_strategy_fields(config: ZeroConfig, tuned: Iterable[str]) -> dict[str, Any]:
    """The ``strategy``-group fields to write: the tuned ones and the micro-batch size, in ZeroConfig's order."""
    wanted = set(tuned) | {"stage", "train_micro_batch_size_per_gpu"}
    names = [name for name in ZeroConfig.__dataclass_fields__ if name in wanted and name not in _PRECISION_FIELDS]
    return {name: getattr(config, name) for name in names}


def write_hydra_yaml(path: Path, config: ZeroConfig, tuned: Iterable[str], note: str) -> Path:
    """A Hydra option of the ``strategy`` group, built on the ``zero<stage>`` preset so Hydra type-checks it."""
    import yaml

    tuned = list(tuned)
    fields = hydra_strategy_fields(config, tuned)
    header = [
        f"# Autotuned by `ds-strategy autotune`: {note}.",
        f"# Use it as a strategy option, e.g. `python examples/train.py strategy={path.stem} "
        f"data.batch_size={config.train_micro_batch_size_per_gpu}` (the loader must yield the micro-batch).",
        "# Fields left out keep ZeroConfig's defaults.",
    ]
    if "precision" in tuned:
        header.append(f"# precision was tuned too: add `precision={config.precision}`.")
    body = yaml.safe_dump({"defaults": [f"zero{config.stage}", "_self_"], **fields}, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n" + body)
    return path
