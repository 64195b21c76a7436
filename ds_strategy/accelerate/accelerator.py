"""ZeroAccelerator: Accelerate's training-loop API translated into ZeroEngine calls; no sharding logic lives here."""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn
from torch.optim import Optimizer

from ..config import ZeroConfig
from ..precision import autocast_for
from ..precision_flag import ACCELERATE_MIXED_PRECISION, reconcile_precision
from ..zero.engine import ZeroEngine
from .checkpointing import ZeroAcceleratorCheckpointing
from .config_source import ENV_VAR, load_zero_config

# Accelerate's own sharding back-ends, by the constructor argument and the environment variable that enable them.
_OTHER_SHARDING = {
    "deepspeed_plugin": "ACCELERATE_USE_DEEPSPEED",
    "deepspeed_plugins": "ACCELERATE_USE_DEEPSPEED",
    "fsdp_plugin": "ACCELERATE_USE_FSDP",
    "megatron_lm_plugin": "ACCELERATE_USE_MEGATRON_LM",
}


class ZeroAccelerator(ZeroAcceleratorCheckpointing, Accelerator):
    """An ``Accelerator`` whose ``prepare`` shards the model and optimizer with a :class:`ZeroEngine` instead of
    wrapping the model in DDP.

    ``zero_config`` is a :class:`ZeroConfig`, a mapping of its fields, or a YAML/JSON file (see
    :mod:`.config_source`); when omitted it is read from ``$DS_STRATEGY_CONFIG``, which ``ds-strategy launch``
    sets. Every other argument is Accelerate's. ``backward``, ``clip_grad_norm_``/``clip_grad_value_``,
    ``no_sync``/``accumulate`` and the prepared optimizer's ``step``/``zero_grad`` go to the engine;
    ``save_state``/``load_state`` write and read the model and optimizer as a sharded checkpoint, loadable at any
    world size or ZeRO stage (see :mod:`.checkpointing`).

    Precision: ``mixed_precision`` ("no", "bf16", "fp16") is folded into ``ZeroConfig.precision`` and the engine
    implements it (16-bit buffers, fp32 masters, loss scaling); ``prepare`` only runs the model's forward in
    autocast to the 16-bit dtype (and converts the model first under "-true"). ``ZeroConfig.gradient_accumulation_steps``
    and ``gradient_clipping`` (as from a DeepSpeed JSON) become Accelerate's accumulation steps and a global-norm
    clip before every optimizer step.

    On a machine without an accelerator the processes run on CPU (``cpu=True``) unless told otherwise: Accelerate
    forms a gloo process group for torchrun-launched ranks only in CPU mode, and ZeRO needs that group.
    Accelerate's own DeepSpeed, FSDP and Megatron-LM back-ends shard too, so configuring one is an error.
    """

    def __init__(self, zero_config: ZeroConfig | Mapping | str | os.PathLike | None = None, **kwargs: Any):
        _reject_other_sharding(kwargs)
        config = load_zero_config(zero_config)
        if config.gradient_accumulation_steps != 1:
            steps = kwargs.setdefault("gradient_accumulation_steps", config.gradient_accumulation_steps)
            if steps != config.gradient_accumulation_steps:
                raise ValueError(f"Accelerator(gradient_accumulation_steps={steps}) conflicts with "
                                 f"ZeroConfig.gradient_accumulation_steps={config.gradient_accumulation_steps}; "
                                 f"set it in one place only")
        kwargs.setdefault("cpu", not torch.accelerator.is_available())
        super().__init__(**kwargs)
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
            raise ValueError(f"ZeroAccelerator shards with ds_strategy's engine, but Accelerate is configured for "
                             f"{self.distributed_type.value}; remove that from the accelerate config")
        mixed = str(self.mixed_precision)
        self.zero_config = reconcile_precision(config, ACCELERATE_MIXED_PRECISION.get(mixed, mixed),
                                               "Accelerator(mixed_precision)")
        self.engine: ZeroEngine | None = None

    # -- prepare ----------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Shard the one model with its one optimizer; data loaders and schedulers are Accelerate's as usual."""
        placement = device_placement or [None] * len(args)
        models = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module)]
        optimizers = [i for i, obj in enumerate(args) if isinstance(obj, Optimizer)]
        if (models or optimizers) and (len(models) != 1 or len(optimizers) != 1 or self.engine is not None):
            raise ValueError("ZeroAccelerator shards one model with its optimizer: pass both to a single prepare() "
                             f"call, once (got {len(models)} model(s) and {len(optimizers)} optimizer(s))")
        result = list(args)
        if models:
            (m,), (o,) = models, optimizers
            result[m], result[o] = self._shard(args[m], args[o], placement[m])
        rest = [i for i in range(len(args)) if i not in models + optimizers]
        if rest:
            prepared = super().prepare(*(args[i] for i in rest),
                                       device_placement=[placement[i] for i in rest] if device_placement else None)
            for i, obj in zip(rest, prepared if len(rest) > 1 else (prepared,)):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def _shard(self, model: nn.Module, optimizer: Optimizer, placement: bool | None) -> tuple[nn.Module, Any]:
        if self.device_placement if placement is None else placement:
            model.to(self.device)
        config = self.zero_config
        if config.has_auto_values:
            from ..auto_values import hidden_size_of
            config = config.resolve_auto(hidden_size_of(model))
        if config.precision in ("bf16-true", "16-true"):
            model.to(dtype=config.compute_dtype)
        self.engine = ZeroEngine(model, optimizer, config)
        if config.compute_dtype != torch.float32:
            model.forward = _in_autocast(model.forward, config.precision, self.device.type)
        self.print(self.engine.summary())
        wrapped = ZeroAcceleratedOptimizer(optimizer, self.engine, config.gradient_clipping)
        self._models.append(model)
        self._optimizers.append(wrapped)
        model._is_accelerate_prepared = wrapped._is_accelerate_prepared = True
        return model, wrapped

    # -- training ---------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale for accumulation as Accelerate does, then the engine's backward."""
        self.engine.backward(loss / self.gradient_accumulation_steps)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Accumulate without gradient communication (stage 0/1; stage 2 still reduces); ``accumulate`` uses it."""
        with self.engine.no_sync():
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every parameter the engine shards to the global norm over all ranks' shards, which equals the
        unsharded model's gradient norm; ``parameters`` is accepted for Accelerate's signature."""
        return self.engine.clip_grad_norm_(float(max_norm), float(norm_type))

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.engine.clip_grad_value_(float(clip_value))

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank, as Accelerate's DDP path returns it, gathered unit by unit.

        Its tensors are copies: the parameters themselves are views of the engine's flat buffers, which
        safetensors would take for shared tensors and drop.
        """
        if self.engine is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return self.engine.full_state_dict(rank0_only=False)

    # -- reporting --------------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes per kind of model state and place; see :func:`ds_strategy.zero.memory_report`."""
        return self.engine.memory_report()


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: on an accumulation boundary ``step`` runs the engine's sharded step (after the
    config's global-norm clip, if any). Its ``state_dict`` is this rank's shard; ``save_state`` saves them all."""

    def __init__(self, optimizer: Optimizer, engine: ZeroEngine, clip_norm: float):
        super().__init__(optimizer, device_placement=False)
        self.engine = engine
        self.clip_norm = clip_norm

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("ZeroAccelerator's optimizer.step() takes no closure: the engine steps on its shards")
        if self.gradient_state.sync_gradients:
            if self.clip_norm:
                self.engine.clip_grad_norm_(self.clip_norm)
            self._is_overflow = not self.engine.step()  # fp16 loss scaling skipped the step: step_was_skipped

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            self.engine.zero_grad()


def _in_autocast(forward: Any, precision: str, device_type: str) -> Any:
    @functools.wraps(forward)
    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with autocast_for(precision, device_type):
            return forward(*args, **kwargs)

    return forward_in_autocast


def _reject_other_sharding(kwargs: Mapping[str, Any]) -> None:
    for argument, variable in _OTHER_SHARDING.items():
        if kwargs.get(argument) is not None:
            raise ValueError(f"ZeroAccelerator shards with ds_strategy's engine; do not also pass {argument}")
        if os.environ.get(variable, "").lower() in ("1", "true"):
            raise ValueError(f"ZeroAccelerator shards with ds_strategy's engine, but {variable} is set (accelerate's "
                             f"own back-end is configured); remove it from the accelerate config and put the ZeRO "
                             f"settings in a ds_strategy section or ${ENV_VAR}")
