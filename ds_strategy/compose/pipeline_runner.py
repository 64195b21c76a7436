"""Pipeline parallelism: torch.distributed.pipelining's schedules running stages that a ZeRO engine shards.

Each rank runs one stage (two for the interleaved and zero-bubble schedules) of a model cut by
:mod:`.pipeline_split`; one :class:`~ds_strategy.zero.engine.ZeroEngine` per rank shards all of its stages'
parameters, gradients and optimizer state over the rank's data-parallel group, at any ZeRO stage. The schedule
is torch's; :class:`ZeroPipelineStage` is its ``PipelineStage`` told where micro-batches end.

Note: [Pipeline gradients]
  Schedules do not run one backward per optimizer step: every stage runs one per micro-batch, interleaved with
  other micro-batches' forwards, and the zero-bubble ones split it into an input part (``autograd.grad`` on the
  inputs) and a weight part that assigns ``.grad`` by hand, so post-accumulate-grad hooks fire for some
  parameters and not others. The engine's hooks are therefore removed (``ZeroEngine.driven_by_schedule``):
  autograd accumulates every parameter's ``.grad`` as it would without ZeRO, and the engine takes it over at
  boundaries the schedule reports, scaled by ``1 / (micro-batches x accumulated batches)`` since each
  micro-batch's loss is a mean (the schedule's own ``scale_grads`` is off):
  - ``pipeline_grad_reduction="once"`` (the default): after the schedule's last backward, every gradient goes
    into the flat buffers and each buffer is reduced once, in the engine's order. One reduction per optimizer
    step, the stage's full gradients held across its micro-batches (torchtitan's FSDP + PP choice).
  - ``"per_microbatch"`` (stage 2/3): after each micro-batch's backward (its weight part under zero-bubble) the
    buffers that belong to that stage alone are reduce-scattered and their ``.grad`` dropped: ZeRO-2 gradient
    memory for n_microbatches times the traffic. Buffers spanning this rank's two stages, and tied copies, wait
    for the end.
  Every rank of a data-parallel group runs the same stages through the same schedule, so they reduce the same
  buffers in the same order. Tied parameters (an LM head tied to the embedding on another rank's stage) have
  their gradients summed over the pipeline group first, zeros from ranks that hold no copy, as DeepSpeed's
  ``_exec_reduce_tied_grads`` does; the owner's copy counts in the norm, the others' do not.

Note: [Stage-3 weights under a pipeline schedule]
  The engine's stage-3 hooks assume forward, then backward; a schedule runs forward of micro-batch k+1 before
  the backward of k. So the schedule's stages gather and free units themselves:
  - ``pipeline_keep_gathered=True`` (default): all of this rank's units are gathered before the schedule and
    freed once their gradients are reduced: one all-gather per unit per step, the whole stage's weights live
    through the step (torchtitan's ``reshard_after_forward=False`` under PP).
  - ``False``: a stage's units are gathered for each micro-batch's forward and backward and freed after, so at
    most one stage's weights are whole at a time, for 2 x n_microbatches all-gathers per unit per step. The
    storage autograd saved views of is re-filled in place before backward reads it (Note: [When a gathered
    buffer may be freed] in :mod:`ds_strategy.zero.param_gatherer`).
  The root unit (embedding, final norm, head) stays gathered from the step's start to the optimizer step, as
  without pipelining. The first step, and the first after a switch between training and evaluation, gathers
  everything either way: torch's stages then infer their activations' shapes by running the modules once.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..comm.group_collectives import collectives_for
from ..config.policies import ParallelismPolicy
from ..parallel.dtensor_params import local_tensor
from ..parallel.mesh import ParallelMesh
from ..parallel.pipeline_schedules import schedule_class, stages_per_rank
from ..parallel.pipeline_split import StagePlan
from ..zero.schedule_interface import ScheduleInterface


class StageModule(nn.Module):
    """One stage's forward: the embedding on the first stage, its blocks, the norm and head on the last.

    Its children are the model's own modules (no copies), so ``parameters()``, which the schedule's weight
    backward differentiates, is exactly this stage's parameters."""

    def __init__(self, root: nn.Module, plan: StagePlan, stage: int):
        super().__init__()
        self.layout = plan.layout
        self.first, self.last = stage == 0, stage == plan.num_stages - 1
        owned = [plan.block_names[i] for i in plan.blocks_of[stage]]
        owned += list(plan.layout.before if self.first else ()) + list(plan.layout.after if self.last else ())
        self.parts = nn.ModuleDict({name.replace(".", "/"): root.get_submodule(name) for name in owned})
        self.blocks = [root.get_submodule(plan.block_names[i]) for i in plan.blocks_of[stage]]
        self._root = [root]  # not a child: the root is not this stage's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root = self._root[0]
        h = self.layout.embed(root, x) if self.first else x
        kwargs = self.layout.prepare(root, h)
        for block in self.blocks:
            h = self.layout.run_block(block, h, kwargs)
        return self.layout.head(root, h) if self.last else h


class ZeroPipelineStage(PipelineStage):
    """A ``PipelineStage`` that tells its :class:`PipelineRunner` where each micro-batch's forward and backward
    run (Notes: [Pipeline gradients], [Stage-3 weights under a pipeline schedule]); DDP and FSDP get the same
    from torch's own stage by ``isinstance`` checks."""

    def __init__(self, module: StageModule, stage: int, num_stages: int, device, group, runner: PipelineRunner):
        super().__init__(module, stage, num_stages, device, group=group)
        self.runner = runner

    def forward_one_chunk(self, *args, **kwargs):
        with self.runner.weights_for(self.stage_index, free_after=True, keep_for_backward=True):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        with self.runner.weights_for(self.stage_index, free_after=backward_type != "input"):
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "input":
            self.runner.after_microbatch_backward(self.stage_index)
        return result


class PipelineRunner:
    """Runs training and evaluation steps of one rank's pipeline stages through a torch schedule.

    ``train_step`` returns the mean loss over the batch's micro-batches, the same on every rank (the last stage's,
    broadcast over the pipeline group); the gradients are in the engine, which steps as without pipelining. The
    engine is driven through its :class:`~ds_strategy.zero.schedule_interface.ScheduleInterface` only; the pipeline
    group's own traffic (the loss, tied weights and their gradients) goes through :class:`Collectives` too.
    """

    def __init__(
        self,
        root: nn.Module,
        engine: ScheduleInterface,
        plan: StagePlan,
        mesh: ParallelMesh,
        policy: ParallelismPolicy,
        device: torch.device,
    ):
        self.engine = engine
        self.plan = plan
        self.policy = policy
        self.num_microbatches = policy.microbatch_count
        self.pp = collectives_for(mesh.pp_group)  # its timeout set by compose_model
        self.last_stage_rank = plan.rank_of_stage[-1]
        self.modules = {s: StageModule(root, plan, s) for s in plan.stage_ids}
        stages = [
            ZeroPipelineStage(self.modules[s], s, plan.num_stages, device, mesh.pp_group, self) for s in plan.stage_ids
        ]
        self._loss_fn: Callable | None = None
        self.schedule = schedule_class(policy.pipeline_schedule)(
            stages if stages_per_rank(policy.pipeline_schedule) > 1 else stages[0],
            n_microbatches=self.num_microbatches,
            loss_fn=self._scaled_loss,
            scale_grads=False,
        )
        self._units_of = {s: self._units_in(self.modules[s]) for s in plan.stage_ids}
        self._alone_in = {s: self._flat_params_only_in(s) for s in plan.stage_ids}
        self._params_of = {s: [p for fp in self._alone_in[s] for p in fp.params] for s in plan.stage_ids}
        self._reduced: set[int] = set()
        self._regather = engine.gathers_units and not policy.pipeline_keep_gathered
        self._last_run_trained: bool | None = None  # torch re-infers shapes on the first run and on every switch
        self._microbatch_shape: tuple[int, ...] | None = None
        self._scale = 1.0
        self._tie_copies_to_owner()

    # -- bookkeeping built once ------------------------------------------------------------------------------------
    def _units_in(self, module: StageModule) -> list:
        return self.engine.units_holding(module.parameters())

    def _flat_params_only_in(self, stage: int) -> list:
        """The flat buffers whose parameters this stage alone uses (reduced after each of its micro-batches under
        ``per_microbatch``), in the engine's reduction order."""
        if self.policy.pipeline_grad_reduction != "per_microbatch":
            return []
        mine = {id(p) for p in self.modules[stage].parameters()}
        others = {id(p) for s, m in self.modules.items() if s != stage for p in m.parameters()}
        return [
            fp
            for fp in self.engine.reduction_order()
            if not fp.tied_copy
            and all(id(p) in mine and id(p) not in others for p in fp.params)
            and not any(t.name in {slot.name for slot in fp.slots} for t in self.plan.tied)
        ]

    # -- what the stages call ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def weights_for(self, stage: int, free_after: bool, keep_for_backward: bool = False):
        """The stage's units gathered around one forward or backward piece and, when regathering, freed after it
        if ``free_after`` (not after the input part of a split backward: the weight part follows);
        ``keep_for_backward``: a forward, whose backward comes later."""
        if not self._regather:
            yield
            return
        units = self._units_of[stage]  # not the root, which stays gathered (Note: [Stage-3 weights under ...])
        self.engine.gather(units)
        yield
        if free_after:
            self.engine.release(units, keep_for_backward)

    def after_microbatch_backward(self, stage: int) -> None:
        """Reduce the buffers this stage alone uses, under ``per_microbatch`` (Note: [Pipeline gradients])."""
        fps = self._alone_in[stage]
        if fps:
            self.engine.take_gradients(self._params_of[stage], self._scale)
            self.engine.reduce(fps)
            self._reduced.update(fp.index for fp in fps)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.engine.scale_loss(self._loss_fn(output, target))

    # -- steps ------------------------------------------------------------------------------------------------------
    def _check_batch(self, inputs: torch.Tensor) -> None:
        """The batch must split into equal micro-batches, of the shape the stages were set up with: torch's stages
        size their activation buffers from the first step's micro-batch and cannot change them."""
        size = inputs.shape[0]
        if size % self.num_microbatches:
            allowed = [n for n in range(1, size + 1) if size % n == 0]
            raise ValueError(
                f"pipeline_microbatches={self.num_microbatches} does not divide the batch size {size}; "
                f"micro-batch counts allowed for this batch: {allowed}"
            )
        shape = (size // self.num_microbatches, *inputs.shape[1:])
        if self._microbatch_shape is not None and shape != self._microbatch_shape:
            raise ValueError(
                f"this batch has shape {tuple(inputs.shape)}, giving micro-batches of {shape}, but the pipeline "
                f"stages were set up for micro-batches of {self._microbatch_shape}; every training and validation "
                f"batch must have the same shape (e.g. DataLoader(drop_last=True), the same batch size for both)"
            )
        self._microbatch_shape = shape

    def _run(self, train: bool, inputs, target, loss_fn) -> torch.Tensor:
        self._check_batch(inputs)
        self._loss_fn, losses = loss_fn, []
        loss_scale = float(self.engine.scale_loss(torch.ones((), device=self.engine.device)))
        if not self._regather or self._last_run_trained is not train:  # the schedule runs every module to infer shapes
            self.engine.gather_all()
        else:
            self.engine.gather_root()
        if train:
            self.schedule.step(inputs, target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.eval(inputs, target=target, losses=losses)
        self._last_run_trained = train
        return self._mean_loss(losses, loss_scale)

    def train_step(self, inputs, target, loss_fn: Callable, grad_scale: float = 1.0) -> torch.Tensor:
        """One forward and backward of ``inputs`` (batch-first; the first stage reads it) against ``target`` (the
        last stage's ``loss_fn(output, target)``, a mean over the micro-batch). The gradients, times
        ``grad_scale`` (``1 / accumulated batches``), are reduced into the engine (Note: [Pipeline gradients])."""
        self._scale = grad_scale / self.num_microbatches
        self._reduced.clear()
        loss = self._run(True, inputs, target, loss_fn)
        self._sum_tied_gradients()
        remaining = [fp for fp in self.engine.reduction_order() if fp.index not in self._reduced]
        self.engine.take_gradients([p for fp in remaining for p in fp.params], self._scale)
        self.engine.reduce(remaining)
        self.engine.finish_gradients()
        return loss

    @torch.no_grad()
    def eval_step(self, inputs, target, loss_fn: Callable) -> torch.Tensor:
        """The schedule's forward-only path: the mean loss over micro-batches, the same on every rank."""
        loss = self._run(False, inputs, target, loss_fn)
        self.engine.reshard()
        return loss

    def _mean_loss(self, losses: list[torch.Tensor], loss_scale: float) -> torch.Tensor:
        """The schedule's micro-batch losses (times ``scale_loss``'s factor ``loss_scale``) as their unscaled mean,
        broadcast from the last stage."""
        holds_last = self.plan.num_stages - 1 in self.plan.stage_ids
        device = self.engine.device
        loss = (
            torch.stack([x.detach().float() for x in losses]).mean() / loss_scale
            if holds_last
            else torch.zeros((), device=device)
        )
        self.pp.broadcast(loss, src=self.last_stage_rank, label="pipeline loss").wait()
        return loss

    @torch.no_grad()
    def _tie_copies_to_owner(self) -> None:
        """Give every tied copy its owner's master values: stages initialise their pieces on their own (a model
        built on the meta device gives an LM head its Linear init, not the embedding's). The owner's data-parallel
        ranks each hold a piece of its master; a sum over dp, then over the pipeline group, puts it whole everywhere."""
        copies = set(self.engine.tied_copies.values())
        for tied in self.plan.tied:
            value = torch.zeros(math.prod(tied.shape), dtype=torch.float32, device=self.engine.device)
            pieces = self.engine.master_pieces(tied.name)
            if tied.name not in copies:
                for _, view, start in pieces:
                    value.narrow(0, start, view.numel()).copy_(view)
            self.engine.sum_over_zero_group(value)
            self.pp.all_reduce(value, label=f"tied {tied.name}").wait()
            if tied.name in copies:
                for _, view, start in pieces:
                    view.copy_(value.narrow(0, start, view.numel()))
        if self.plan.tied:
            self.engine.refresh_from_masters()

    def _sum_tied_gradients(self) -> None:
        """Sum each tied parameter's gradient over the pipeline group (zeros where a rank holds no copy)."""
        present = dict(self.engine.module.named_parameters(remove_duplicate=False))
        for tied in self.plan.tied:
            held = [present[n] for n in tied.names if n in present]
            param = held[0] if held else None
            summed = torch.zeros(tied.shape, dtype=torch.float32, device=self.engine.device)  # one dtype everywhere
            if param is not None and param.grad is not None:
                summed.copy_(local_tensor(param.grad))
            self.pp.all_reduce(summed, label=f"tied gradient {tied.name}").wait()
            if param is None:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local_tensor(param.grad).copy_(summed)
