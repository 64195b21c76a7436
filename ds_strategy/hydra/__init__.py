"""Hydra support: ZeRO's config groups in Hydra's ConfigStore, and the validated ZeroConfig of a composed config.

Importing this module registers the groups (the YAML presets that use them ship in ``pkg://ds_strategy.configs``):

* ``strategy``: one option per ``ds_strategy.adapters.engine_owner.PRESETS`` name (``strategy=zero2``), so new stages
  appear here as they are added; every other ZeroConfig field is a key (``strategy.reduce_bucket_size=1e6``).
* ``precision``: one option per ZeroConfig precision (``precision=bf16-mixed``) and the loss-scaling keys.
* ``model`` (GPT presets tiny/small/medium), ``data`` (stdlib) and ``trainer`` (cpu, auto): what the example
  ``examples/train.py`` trains.

Limitation: Lightning re-launches a Hydra script for each extra process with the single run's output directory,
so ``--multirun`` sweeps with ``trainer.devices`` > 1 are not supported; sweep with one process per run, or launch
each run separately.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..adapters.engine_owner import PRESETS
from ..config import ZeroConfig, ZeroConfigError
from ..config.sources import load_config
from ..config.zero_config import PRECISIONS
from ..models import gpt_config
from ..optional_packages import needs
from .structured import PRECISION_FIELDS, DataConf, ModelConf, PrecisionConf, StrategyConf, TrainerConf

# Hydra's config groups need hydra and omegaconf: without them, fail here saying what to install
with needs("hydra", "omegaconf", needed_by="ds_strategy.hydra"):
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig, OmegaConf

MODEL_PRESETS = ("tiny", "small", "medium")


def register_configs(store: ConfigStore | None = None) -> None:
    """Put every group's options in ``store`` (Hydra's global ConfigStore by default)."""
    store = store or ConfigStore.instance()
    for name, fields in PRESETS.items():
        store.store(group="strategy", name=name, node=StrategyConf(**fields))
    for precision in PRECISIONS:
        store.store(group="precision", name=precision, node=PrecisionConf(precision=precision))
    for name in MODEL_PRESETS:
        store.store(group="model", name=name, node=ModelConf(**dataclasses.asdict(gpt_config(name))))
    store.store(group="data", name="stdlib", node=DataConf())
    store.store(group="trainer", name="cpu", node=TrainerConf())
    store.store(group="trainer", name="auto", node=TrainerConf(accelerator="auto", devices="auto"))


def zero_config(strategy: DictConfig | Mapping, precision: DictConfig | Mapping | None = None) -> ZeroConfig:
    """The ZeroConfig of a composed config's ``strategy`` and ``precision`` nodes.

    A bad value raises ``ValueError`` naming the override that set it (``strategy.stage=5: ...``); call it before
    building the Trainer, so the error comes before any process starts.
    """
    options: dict = {}
    for node in (strategy, precision or {}):
        options.update(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node))
    try:
        return load_config(options).zero
    except ZeroConfigError as error:
        group = "precision" if error.field in PRECISION_FIELDS else "strategy"
        raise ValueError(f"{group}.{error.field}={options.get(error.field)!r}: {error}") from error


register_configs()

__all__ = ["DataConf", "ModelConf", "PrecisionConf", "StrategyConf", "TrainerConf", "register_configs", "zero_config"]
