"""The optimizer step over the engine's flat buffers: unscale, clip, norm, step, refresh, zero_grad.

One job, taken out of :class:`~.engine.ZeroEngine` (which keeps the public methods and forwards here): given the
reduced gradients the :class:`~.grad_reducer.GradReducer` leaves, turn them into the master gradients the optimizers
read, agree on their statistics over the ranks, run the optimizers through the step runner and bring every rank's
parameters up to date. It knows nothing of units, layouts or hooks beyond the objects it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..precision import GradStats, LossScaler, unscale_and_check_shards
from ..profiler_ranges import profiler_range
from .flat_param import FlatParam
from .grad_reducer import GradReducer
from .param_gatherer import ParamGatherer
from .param_refresh import ParamRefresh
from .sharded_optimizers import ShardedOptimizers
from .step_runner import StepRunner


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class OptimizerStep:
    """The step's arithmetic and its collectives over ``flat_params``.

    ``collectives``: the ZeRO group, over which sharded gradients' statistics are summed when ``sharded``;
    ``model_parallel``: the further groups (tensor, pipeline) over which every norm is summed; ``gatherer``: the
    stage-3 gatherer, whose units a step makes stale, or None."""

    def __init__(
        self,
        flat_params: list[FlatParam],
        optimizers: ShardedOptimizers,
        reducer: GradReducer,
        runner: StepRunner,
        refresher: ParamRefresh,
        gatherer: ParamGatherer | None,
        loss_scaler: LossScaler | None,
        collectives: Collectives,
        model_parallel: Sequence[Collectives],
        device: torch.device,
        sharded: bool,
    ):
        self.flat_params = flat_params
        self.sharded_optimizers = optimizers
        self.reducer = reducer
        self.runner = runner
        self.refresher = refresher
        self.gatherer = gatherer
        self.loss_scaler = loss_scaler
        self.collectives = collectives
        self.model_parallel = tuple(model_parallel)
        self.device = device
        self.sharded = sharded
        self._grad_stats: dict[tuple[int, ...], GradStats] = {}  # by the flat buffers' indices they cover
        self._master_grads: dict[int, torch.Tensor] = {}  # fp.index -> its optimizer gradient, unscaled once made
        self._unscaled: set[int] = set()

    def flat_params_of(self, optimizer: torch.optim.Optimizer | None = None) -> list[FlatParam]:
        """The flat buffers ``optimizer`` steps, or (None) every flat buffer; ValueError for an optimizer that
        does not train this module."""
        if optimizer is None:
            return self.flat_params
        indices = self.sharded_optimizers.indices_of(optimizer)
        return [fp for fp in self.flat_params if fp.optimizer_index in indices]

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> GradStats:
        """Divide the loss scale out of this rank's reduced gradients (``optimizer``'s, or all), check every rank's
        for inf/nan and take their global norm: one pass and one all-reduce (see
        :mod:`ds_strategy.precision.grad_stats`).

        Call after the step's last backward; ``clip_grad_norm_`` and ``step`` call it when they need it, and later
        calls until those gradients are consumed return the same statistics without touching the gradients again
        (a gradient already unscaled for another selection is only read).
        """
        with profiler_range("step.unscale"):
            fps = self.flat_params_of(optimizer)
            key = tuple(fp.index for fp in fps)
            if key not in self._grad_stats:
                inv_scale = self.loss_scaler.inv_scale if self.loss_scaler is not None else 1.0
                self._grad_stats[key] = unscale_and_check_shards(
                    self.optimizer_grads(fps),
                    [1.0 if fp.index in self._unscaled else inv_scale for fp in fps],
                    self.collectives,
                    sharded=self.sharded,
                    weights=[fp.norm_share for fp in fps],
                    model_parallel=self.model_parallel,
                    device=self.device,
                )
                self._unscaled.update(key)
            return self._grad_stats[key]

    def optimizer_grads(self, fps: list[FlatParam]) -> list[torch.Tensor]:
        """Each of ``fps``' reduced gradient in its master's dtype: what clipping scales and the optimizer reads.

        ``grad_shard`` itself, or at stage 0 ``grad_full``, converted to an fp32 copy under mixed precision; with the
        optimizer offloaded at stage 2/3, the fp32 host buffer the reductions were summed into.
        """
        self.reducer.wait_all()
        for fp in fps:
            if fp.index not in self._master_grads:
                self._master_grads[fp.index] = self.reducer.reduced_grad(fp).to(fp.master_dtype)
        return [self._master_grads[fp.index] for fp in fps]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Scale gradients (``optimizer``'s, or all) so their global norm over all shards of all ranks is at most
        ``max_norm``.

        Returns the norm before clipping, of the unscaled gradients; it equals the unsharded model's gradient norm
        (over every parameter when ``optimizer`` is None, as ``clip_grad_norm_(model.parameters())`` takes it).
        """
        total = self.grad_norm(norm_type, optimizer)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in self._gradients_to_clip(self.flat_params_of(optimizer)):
            grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
        return total

    def clip_grad_value_(self, clip_value: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.loss_scaler is not None:
            self.unscale_gradients(optimizer)
        for grad in self._gradients_to_clip(self.flat_params_of(optimizer)):
            grad.clamp_(-clip_value, clip_value)

    def _gradients_to_clip(self, fps: list[FlatParam]) -> list[torch.Tensor]:
        """Each flat buffer's optimizer gradient or, where that is a slice of ``grad_full`` (stage 1 in one dtype
        with all-reduce), the whole ``grad_full``: the parameters' ``.grad`` view it, and must stay the same
        averaged gradient on every rank (Note: [Accumulation and reduction])."""
        return [
            fp.grad_full if fp.grad_full is not None and _same_storage(grad, fp.grad_full) else grad
            for fp, grad in zip(fps, self.optimizer_grads(fps))
        ]

    def grad_norm(self, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Global ``norm_type``-norm of the unscaled gradients (``optimizer``'s, or all), each flat buffer counted
        by its ``norm_share``; the 2-norm comes from ``unscale_gradients``."""
        if norm_type == 2.0:
            return self.unscale_gradients(optimizer).norm
        if self.loss_scaler is not None:
            self.unscale_gradients(optimizer)
        fps = self.flat_params_of(optimizer)
        grads = [g.float() for g in self.optimizer_grads(fps)]
        shares = [fp.norm_share for fp in fps]
        device = self.device  # gradients an offload keeps on the host are reduced beside the device's
        if math.isinf(norm_type):
            local = (
                torch.stack([(g.abs().max() * bool(w)).to(device) for g, w in zip(grads, shares)]).max()
                if grads
                else torch.zeros((), device=device)
            )
            op = dist.ReduceOp.MAX
        else:
            weighted = [(g.pow(norm_type).sum() * w).to(device) for g, w in zip(grads, shares)]
            local = torch.stack(weighted).sum() if grads else torch.zeros((), device=device)
            op = dist.ReduceOp.SUM
        if self.sharded:
            self.collectives.all_reduce(local, op=op).wait()
        for group in self.model_parallel:
            group.all_reduce(local, op=op).wait()
        return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None, count_step: Callable[[], None]) -> bool:
        """Run ``optimizer`` (None: every optimizer) on this rank's shards, then bring every rank's parameters up
        to date (Note: [Stage 1/2 parameter refresh] in :mod:`.engine`); ``count_step`` closes the step's books, on
        both outcomes.

        Returns False when fp16 loss scaling found an inf/nan in the gradients stepped on some rank: then no rank
        steps them, parameters and optimizer state stay as they were, those gradients are discarded and the loss
        scaler is updated (see :mod:`ds_strategy.precision.loss_scaler`), once per call, as Lightning's and
        Accelerate's ``GradScaler`` update after each optimizer's step. bf16 and fp32 training never skip.
        """
        fps = self.flat_params_of(optimizer)
        if self.loss_scaler is not None:
            overflow = self.unscale_gradients(optimizer).found_inf
            self.loss_scaler.update(overflow)
            if overflow:
                self.zero_grad(optimizer)
                count_step()
                return False
        grads = self.optimizer_grads(fps)
        with profiler_range("step.optimizer"):
            stepped = self.sharded_optimizers.indices_of(optimizer) if optimizer is not None else None
            for index, stepping in enumerate(self.sharded_optimizers.optimizers):
                if stepped is None or index in stepped:
                    pairs = [(fp, grad) for fp, grad in zip(fps, grads) if fp.optimizer_index == index]
                    self.runner.step(stepping, pairs)  # and the write-back (see .step_runner)
        self.zero_grad(optimizer)  # consumes the gradients as DeepSpeed's step does: ``.grad`` None till backward
        if self.gatherer is not None:  # a unit still gathered (a forward after the last backward) is now stale
            self.gatherer.release_all()
        self.refresh_params(fps)
        count_step()
        return True

    def refresh_params(self, fps: list[FlatParam] | None = None) -> None:
        """All-gather the updated shards of the whole (never freed) buffers among ``fps`` (None: all), by buckets
        (:mod:`.param_refresh`)."""
        self.refresher.refresh(None if fps is None or fps is self.flat_params else {fp.index for fp in fps})

    def zero_grad(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Drop the gradients ``optimizer`` (None: every optimizer) steps: as DDP's ``opt.zero_grad()`` drops
        those of its own parameters only."""
        self._grad_stats.clear()
        for fp in self.flat_params_of(optimizer):
            self._master_grads.pop(fp.index, None)
            self._unscaled.discard(fp.index)
            self.reducer.zero_grads(fp)
            for p in fp.params:
                p.grad = None
