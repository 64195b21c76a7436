"""``from_pretrained`` and ``from_config`` for a model that may not fit on one rank whole: built on the meta device,
its values read or drawn when a ``ZeroAccelerator`` (or ``ZeroTrainer``) prepares it, shard by shard.

``model = sharded_from_pretrained(AutoModelForCausalLM, "path/to/model")`` is transformers' own ``from_pretrained``
with one change: no weight is read. Everything else is transformers' doing, on the checkpoint's headers (names,
shapes, dtypes): the config and its overrides, ``dtype="auto"``, the weight renamings and conversions (a base model's
names under a head, per-expert MoE files fused), tied weights, ``ignore_mismatched_sizes``, the generation config,
``eval()``, and the load report (``output_loading_info=True`` returns it). Weights the checkpoint lacks (a new
head) are initialised by the model's own ``_init_weights``, drawn from the generator exactly as ``from_pretrained``
draws them, and reported as newly initialised; unexpected weights are reported and never read. What each tensor's
value comes from is recorded (:class:`.hf_weights.HfWeights`), and ``prepare`` materialises the model one unit at a
time keeping this rank's shards (:mod:`ds_strategy.zero.sharded_init`), then fills them with ``load_weights``, each
rank reading only the rows of its own shards. So under stage 3 no rank ever holds the whole model.

``model.resize_token_embeddings(...)`` works on such a model until it is prepared: transformers' own resize runs on
the embedding's values (read whole for the call), and its new rows are kept for ``prepare`` (Note: [Memory of a
deferred pretrained model] in :mod:`.hf_weights`).

``sharded_from_config(AutoModelForCausalLM, config)`` builds on meta and records the generator's state: ``prepare``
materialises the values a normal build there would have drawn (on CPU; see ``DeferredBuild``).

Under a stage-3 configuration transformers' own ``from_pretrained`` and ``from_config`` do this (see
:mod:`.build_hook`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import types
from typing import Any

import torch
import transformers
from transformers import modeling_utils
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.integrations import deepspeed as hf_deepspeed

from ..accelerate.accelerator import DEFERRED_BUILD_ATTR, DeferredBuild
from .hf_weights import HfWeights, conversion_plan

_ORIGINAL_LOAD = transformers.PreTrainedModel._load_pretrained_model
_building = threading.local()  # inside a sharded build: nested builds are transformers' own (see .build_hook)


def sharded_from_pretrained(model_class: Any, *args: Any, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(*args, **kwargs)`` (an ``AutoModel...`` class or a model class) built on the
    meta device, its weights read sharded when a ``ZeroAccelerator`` or ``ZeroTrainer`` prepares it; see the
    module docstring."""
    capture = _LoadCapture()
    # transformers >= 5.25 swaps layers for the Hub's kernels after every load unless told not to; a model on the meta
    # device cannot be (kernels refuses the device), so it loads as with USE_HUB_KERNELS=0
    kwargs.setdefault("use_kernels", False)
    with building_sharded(), capture.installed():
        loaded = model_class.from_pretrained(*args, **kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    files, plan = capture.of(model)
    source = HfWeights(files, plan)
    source.keep_real_tensors(model)
    setattr(model, DEFERRED_BUILD_ATTR, DeferredBuild(torch.get_rng_state(), source))
    model.resize_token_embeddings = types.MethodType(_resize_token_embeddings, model)
    return loaded


def sharded_from_config(model_class: Any, config: Any, **kwargs: Any) -> Any:
    """``model_class.from_config(config, **kwargs)`` built on the meta device; ``prepare`` materialises it sharded,
    drawing what a normal build here would have drawn (see the module docstring)."""
    state = torch.get_rng_state()
    with building_sharded(), torch.device("meta"):
        build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
        model = build(config, **kwargs)
    setattr(model, DEFERRED_BUILD_ATTR, DeferredBuild(state))
    return model


def is_building_sharded() -> bool:
    return getattr(_building, "depth", 0) > 0


@contextlib.contextmanager
def building_sharded():
    """Inside, transformers' DeepSpeed ZeRO-3 switch reads off (its ``zero.Init`` and gathered loading never run)
    and builds nested in this one are transformers' own."""
    _building.depth = getattr(_building, "depth", 0) + 1
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
        _building.depth -= 1


class _LoadCapture:
    """Stands in for ``PreTrainedModel._load_pretrained_model`` during a build: the checkpoint's headers are
    "loaded" onto the meta device by transformers' own ``convert_and_load_state_dict_in_model`` (so the loading
    report, missing and mismatched keys and the initialisation of missing weights that follows are
    ``from_pretrained``'s), and where each tensor comes from is recorded for ``prepare``."""

    def __init__(self):
        self._loads: list[tuple[torch.nn.Module, list[str], dict]] = []

    @contextlib.contextmanager
    def installed(self):
        transformers.PreTrainedModel._load_pretrained_model = staticmethod(self._load)
        try:
            yield
        finally:
            transformers.PreTrainedModel._load_pretrained_model = _ORIGINAL_LOAD

    def of(self, model: torch.nn.Module) -> tuple[list[str], dict]:
        """The checkpoint files and plan of ``model``'s own load (nested ``from_pretrained`` calls load too)."""
        found = [(files, plan) for loaded, files, plan in self._loads if loaded is model]
        if not found:
            raise ValueError(
                f"{type(model).__name__} was not loaded from safetensors or .bin checkpoint files (a state_dict "
                f"argument, a GGUF file or a distributed checkpoint), which cannot be read sharded; load it without "
                f"sharded_from_pretrained"
            )
        return found[-1]

    def _load(self, model, state_dict, checkpoint_files, load_config, expected_keys=None):
        if state_dict is not None or checkpoint_files is None or load_config.hf_quantizer is not None:
            if load_config.hf_quantizer is not None:
                raise ValueError("a quantized model cannot be built sharded; load it without a stage-3 configuration")
            return _ORIGINAL_LOAD(model, state_dict, checkpoint_files, load_config, expected_keys)
        stored: dict[str, torch.Tensor] = {}
        for file in checkpoint_files:
            stored.update(modeling_utils.load_state_dict(file, map_location="meta"))
        plan = conversion_plan(model, stored, load_config.weight_mapping)
        self._loads.append((model, list(checkpoint_files), plan))
        on_meta = dataclasses.replace(load_config, device_map={"": "meta"})
        loading_info, _ = convert_and_load_state_dict_in_model(model, stored, on_meta)
        return loading_info, None


def _resize_token_embeddings(model, *args: Any, **kwargs: Any):
    """transformers' ``resize_token_embeddings`` on a model built by :func:`sharded_from_pretrained`: on the
    embeddings' values, the new rows kept for ``prepare``."""
    deferred = model.__dict__.get(DEFERRED_BUILD_ATTR)
    if deferred is None:
        raise RuntimeError(
            "resize_token_embeddings on a model whose weights are already sharded: resize it before the "
            "ZeroTrainer trains (or the ZeroAccelerator prepares) it"
        )
    modules = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    with building_sharded(), deferred.weights.values_in(model, modules):
        return type(model).resize_token_embeddings(model, *args, **kwargs)
