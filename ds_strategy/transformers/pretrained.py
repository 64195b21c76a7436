"""``sharded_from_pretrained``: ``from_pretrained`` for a model that may not fit on one rank whole.

``model = sharded_from_pretrained(AutoModelForCausalLM, "path/to/model")`` builds the model from the directory's
config on the meta device (no storage) and records the directory on it. When a ``ZeroAccelerator`` prepares the
model (a ``ZeroTrainer`` does so in ``train``), the engine materialises it one unit at a time keeping this rank's
shards (:mod:`ds_strategy.zero.sharded_init`) and then fills them from the checkpoint with ``load_weights``, each
rank reading only the rows of its own shards (:mod:`ds_strategy.checkpoint.pretrained`). So under stage 3 no rank
ever holds the whole model, from construction to the first step.

What ``from_pretrained`` does besides, done here too: the parameters take the config's ``dtype`` (transformers 5's
``dtype="auto"``) unless ``dtype`` is given; the model is returned in ``eval()`` mode; ``generation_config.json``,
when present, becomes the model's generation config. Names are matched as stored: a checkpoint whose names
transformers converts while loading (per-expert MoE files into fused experts) is reported as missing/unexpected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers

from ..accelerate.accelerator import PRETRAINED_WEIGHTS_ATTR


def sharded_from_pretrained(
    model_class: Any, path: str | os.PathLike, *, dtype: torch.dtype | None = None, **config_changes: Any
) -> transformers.PreTrainedModel:
    """The model saved at ``path`` (a local ``save_pretrained`` directory), built on the meta device; its weights
    are read, sharded, when a ``ZeroAccelerator`` (or ``ZeroTrainer``) prepares it.

    ``model_class``: an ``AutoModel...`` class or a concrete model class (``LlamaForCausalLM``).
    ``config_changes``: overrides of the stored config, as ``from_pretrained`` takes them.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"sharded_from_pretrained(path={str(path)!r}): expected a local directory written by save_pretrained "
            f"(download a hub model first, e.g. with huggingface_hub.snapshot_download)"
        )
    config = transformers.AutoConfig.from_pretrained(path, **config_changes)
    dtype = dtype or _config_dtype(config)
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    with torch.device("meta"):
        model = build(config, dtype=dtype)
    if model.can_generate() and (path / transformers.utils.GENERATION_CONFIG_NAME).is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    setattr(model, PRETRAINED_WEIGHTS_ATTR, str(path))
    return model.eval()


def _config_dtype(config: transformers.PretrainedConfig) -> torch.dtype:
    """The dtype ``from_pretrained(dtype="auto")`` loads in: the config's, else the default."""
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored)
    return stored if isinstance(stored, torch.dtype) else torch.get_default_dtype()
