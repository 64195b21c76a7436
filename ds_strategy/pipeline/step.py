"""One step's loss with or without a pipeline schedule: what every adapter's ``pipeline_step`` runs (Lightning's
``ZeroStrategy``, Fabric's ``ZeroFabricStrategy``, ``ZeroAccelerator``), so one training step reads the same at any
``pipeline_parallel_size``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .runner import PipelineRunner


def pipeline_step(
    runner: PipelineRunner | None,
    model: nn.Module,
    inputs: torch.Tensor,
    target: Any,
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    *,
    train: bool,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """The loss of ``loss_fn(output, target)`` on this batch.

    With a ``runner`` (``pipeline_parallel_size > 1``) the batch runs through its schedule in micro-batches: when
    ``train``, forward and backward, the gradients times ``grad_scale`` (``1 / accumulated batches``); otherwise
    forward only. The loss is the mean over the micro-batches on the last stage, the same on every rank, and carries
    no graph: the schedule already ran backward, so the adapter's ``backward`` of it does nothing. Without a runner
    it is ``loss_fn(model(inputs), target)`` with its graph, so ``model``'s forward must return what the last stage
    returns (a causal LM's logits)."""
    if runner is None:
        return loss_fn(model(inputs), target)
    if train:
        return runner.train_step(inputs, target, loss_fn, grad_scale)
    return runner.eval_step(inputs, target, loss_fn)


def ran_its_backward(loss: torch.Tensor, pipelined: bool) -> bool:
    """Whether ``loss`` is one :func:`pipeline_step` returned under pipelining (``pipelined``): its schedule already
    ran backward and it carries no graph, so the adapter's backward of it has nothing left to do."""
    return pipelined and loss.grad_fn is None
