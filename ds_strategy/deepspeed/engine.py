"""DeepSpeedEngine: DeepSpeed's engine methods over a composed :class:`~ds_strategy.zero.engine.ZeroEngine`.

What ``deepspeed.initialize`` returns first. It holds no sharding logic: the ZeroEngine that
:func:`~ds_strategy.compose.compose_model` built shards, reduces and steps; this class keeps DeepSpeed's counters
(``micro_steps``, ``global_steps``, ``global_samples``, ``skipped_steps``) and decides, as DeepSpeed's engine does,
when a ``backward`` reduces and when a ``step`` steps.

Note: [DeepSpeed's accumulation on the ZeroEngine]
DeepSpeed's ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (``scale_wrt_gas``), multiplies it
by the fp16 loss scale and runs backward; gradients are averaged over the data-parallel ranks by the boundary's
backward. Its ``step()`` does nothing but count a micro-step until ``is_gradient_accumulation_boundary()``; at the
boundary it clips to ``gradient_clipping``, steps (or, on fp16 overflow, skips and counts ``skipped_steps``), steps
the LR scheduler after an applied step only, and adds ``train_batch_size()`` to ``global_samples``. Here every
backward before the boundary runs under the ZeroEngine's ``no_sync`` (stage 0/1: nothing is communicated until the
boundary's backward reduces the accumulated sum; stage 2/3 reduce every micro-batch, as DeepSpeed's do), and the
boundary's ``step`` is the ZeroEngine's. So the optimizer reads the same mean of the same summed gradients.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..adapters.engine_owner import release_engine
from ..zero.engine import ZeroEngine
from .engine_checkpoint import load_engine_checkpoint, save_engine_checkpoint
from .missing_methods import missing_method_error


class DeepSpeedEngine(nn.Module):
    """DeepSpeed's ``DeepSpeedEngine`` API over a ZeroEngine: ``engine(batch)``, ``backward(loss)``, ``step()``,
    checkpoints and the queries scripts make (the table in ``docs/deepspeed_initialize.md``). A DeepSpeed method
    this class lacks raises an ``AttributeError`` naming what to use instead (:mod:`.missing_methods`)."""

    def __init__(
        self,
        zero: ZeroEngine,
        module: nn.Module,
        lr_scheduler: Any,
        *,
        data_parallel_size: int,
        local_rank: int,
    ):
        """``zero``: the engine composition built over ``module`` (what the script's model became: compiled, or
        tensor-parallel); ``lr_scheduler``: the script's or the config's, stepped after each applied step."""
        super().__init__()
        self.module = module
        self.zero = zero
        self.config = zero.config
        self.lr_scheduler = lr_scheduler
        self.local_rank = local_rank
        self.device = zero.device
        self.global_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.dp_world_size = data_parallel_size
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._step_applied = False
        self._global_grad_norm: float | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            raise missing_method_error(name) or error from None

    # -- what the script reads ---------------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that trains (the script's, or the config's), stepping this rank's shards."""
        return self.zero.optimizer

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """micro-batch x accumulation x data-parallel size, as DeepSpeed defines it."""
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.dp_world_size

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: keep the micro-batch, change the accumulation to reach ``train_batch_size``."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): not a multiple of train_micro_batch_size_per_gpu x "
                f"data-parallel size = {per_step}"
            )
        self.config = self.config.replace(
            gradient_accumulation_steps=train_batch_size // per_step, train_batch_size=train_batch_size
        )

    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def zero_optimization(self) -> bool:
        return self.config.stage > 0

    def fp16_enabled(self) -> bool:
        return self.config.precision.startswith("16")

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.startswith("bf16")

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping or 0.0

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list[Any]:
        """Each param group's ``betas`` (Adam) or ``momentum`` (SGD), as DeepSpeed reports them."""
        if self.optimizer is None:
            return []
        return [group.get("betas", group.get("momentum")) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping); None before the first."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary's step was skipped for an fp16 overflow (or no boundary was reached)."""
        return self._step_applied

    def cur_scale(self) -> float:
        """The fp16 loss scale (1.0 without loss scaling)."""
        return self.zero.loss_scaler.scale if self.zero.loss_scaler is not None else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-batch's backward reduces and ``step()`` steps: every ``gradient_accumulation_steps``-th
        micro-batch, unless :meth:`set_gradient_accumulation_boundary` said otherwise."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the counter's boundary (DeepSpeed's manual accumulation) until set again."""
        self._boundary = bool(is_boundary)

    # -- training ----------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (``scale_wrt_gas``) and times the fp16 loss scale;
        gradients reduce at the boundary (Note: [DeepSpeed's accumulation on the ZeroEngine]). Returns the loss
        backward ran on, before the loss scale, as DeepSpeed does."""
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        reduce_now = self.is_gradient_accumulation_boundary()
        with contextlib.nullcontext() if reduce_now else self.zero.no_sync():
            self.zero.scale_loss(loss).backward(retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the boundary: clip, step (or skip an fp16 overflow), step the LR scheduler and count the step; a
        micro-step otherwise (Note: [DeepSpeed's accumulation on the ZeroEngine])."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        clip = self.gradient_clipping()
        norm = self.zero.clip_grad_norm_(clip) if clip > 0 else self.zero.grad_norm()
        self._step_applied = self.zero.step()
        if self._step_applied:
            self._global_grad_norm = float(norm)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step."""
        self.zero.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without reducing (stage 0/1); DeepSpeed refuses it at stage 2/3, whose gradients are
        partitioned, and so does this."""
        if self.config.stage >= 2:
            raise AssertionError(
                f"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                f"{self.config.stage}"
            )
        with self.zero.no_sync():
            yield

    def empty_partition_cache(self) -> None:
        """Free every gathered stage-3 parameter (after generation or evaluation)."""
        self.zero.reshard()

    def destroy(self) -> None:
        """Detach the engine from the model: its hooks removed, stage-3 parameters back to shards."""
        release_engine(self.zero)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """``save_dir/<tag>`` (default ``global_step<N>``) as a sharded checkpoint with the counters, the LR
        scheduler and ``client_state``, and ``save_dir/latest`` naming the tag; see :mod:`.engine_checkpoint`."""
        if exclude_frozen_parameters:
            raise NotImplementedError("save_checkpoint(exclude_frozen_parameters=True): frozen parameters are saved")
        save_engine_checkpoint(self, Path(save_dir), tag, dict(client_state or {}), save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict | None]:
        """Resume from ``load_dir/<tag>`` (default: the tag ``load_dir/latest`` names), written by this engine at
        any world size or stage, or by DeepSpeed itself; returns ``(path, client_state)``, ``(None, None)`` when
        there is nothing to load, as DeepSpeed does."""
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...): not supported")
        return load_engine_checkpoint(
            self,
            Path(load_dir),
            tag,
            strict=load_module_strict,
            optimizer=load_optimizer_states and not load_module_only,
            lr_scheduler=load_lr_scheduler_states and not load_module_only,
        )

    def save_16bit_model(
        self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """The whole model's state dict as the forward computes with it (16-bit under mixed precision, gathered
        from every rank) written by rank 0 to ``save_dir/save_filename``, as DeepSpeed's."""
        state = self.zero.full_compute_state_dict(rank0_only=True)
        if self.global_rank == 0:
            if exclude_frozen_parameters:
                trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
                state = {name: value for name, value in state.items() if name in trainable}
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir, save_filename))
        return True

    save_fp16_model = save_16bit_model

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (fp32 masters), on every rank."""
        return self.zero.full_state_dict(rank0_only=False)
