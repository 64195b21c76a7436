"""Pipeline parallelism: torch.distributed.pipelining's schedules running stages that a ZeRO engine shards.

Each rank runs one stage (two for the interleaved and zero-bubble schedules) of a model cut by
:mod:`ds_strategy.parallel.pipeline_split`; one :class:`~ds_strategy.zero.engine.ZeroEngine` per rank shards all
of its stages' parameters, gradients and optimizer state over the rank's data-parallel group, at any ZeRO stage.
The schedule is torch's; :class:`~.stage.ZeroPipelineStage` is its ``PipelineStage`` telling this runner where
micro-batches end.

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

Note: [Positions of a sequence slice on every stage]
  Under Ulysses each rank of a sequence-parallel group feeds the pipeline its slice of every sequence
  (``shard_sequence``), and the ranks of one group run the same stages in step. A stage receives only hidden
  states, and computed its positions from them: 0..slice-1 on every rank, so rank r's rotary (or learned) position
  embeddings were those of the first slice (measured: first loss 4.9034867 against 4.9034605 in one process). Each
  stage now counts from ``sp_rank x slice length``, the absolute index of its first token, on the first stage (a
  learned position embedding) and on every other (the positions its blocks take). Attention masks causally over
  the whole sequence itself, after its all-to-all, so nothing else depends on where a token sits; the loop's loss
  function combines the slices (``sequence_parallel_loss``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..comm.peer_failures import naming_failed_peers
from ..config.policies import ParallelismPolicy
from ..parallel.mesh import ParallelMesh
from ..parallel.pipeline_schedules import schedule_class, stages_per_rank
from ..parallel.pipeline_split import StagePlan
from ..zero.engine import ZeroEngine
from ..zero.schedule_interface import GradientBuffer, ScheduleInterface
from .stage import StageModule, ZeroPipelineStage
from .tied_weights import TiedWeights


class PipelineRunner:
    """Runs training and evaluation steps of one rank's pipeline stages through a torch schedule.

    ``train_step`` returns the mean loss over the batch's micro-batches, the same on every rank (the last stage's,
    broadcast over the pipeline group); the gradients are in the engine, which steps as without pipelining. The
    engine is driven through the :class:`~ds_strategy.zero.schedule_interface.ScheduleInterface` it hands over for
    this rank's stages only; the pipeline
    group's own traffic (the loss, tied weights and their gradients) goes through :class:`Collectives` too.
    """

    def __init__(
        self,
        root: nn.Module,
        engine: ZeroEngine,
        plan: StagePlan,
        mesh: ParallelMesh,
        policy: ParallelismPolicy,
        device: torch.device,
    ):
        self.plan = plan
        self.policy = policy
        self.num_microbatches = policy.microbatch_count
        self.pp = mesh.pp_collectives
        self.last_stage_rank = plan.rank_of_stage[-1]
        self.modules = {s: StageModule(root, plan, s, mesh.sp_rank) for s in plan.stage_ids}
        stage_params = {s: list(module.parameters()) for s, module in self.modules.items()}
        tied_names = frozenset(tied.name for tied in plan.tied)  # their gradients are summed after the schedule
        self.engine: ScheduleInterface = engine.driven_by_schedule(stage_params, tied_names)
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
        self._alone_in = {
            s: self.engine.buffers_only_in(s) if policy.pipeline_grad_reduction == "per_microbatch" else []
            for s in plan.stage_ids
        }
        self._buffers = self.engine.buffers()
        self._reduced: set[GradientBuffer] = set()
        self._holds_last = plan.num_stages - 1 in plan.stage_ids
        self._regather = self.engine.gathers_units and not policy.pipeline_keep_gathered
        self._last_run_trained: bool | None = None  # torch re-infers shapes on the first run and on every switch
        self._microbatch_shape: tuple[int, ...] | None = None
        self._scale = 1.0
        self.tied = TiedWeights(root, plan, self.engine, self.pp)
        self.tied.make_copies_equal()

    # -- what the stages call ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def weights_for(self, stage: int, free_after: bool, keep_for_backward: bool = False):
        """The stage's units gathered around one forward or backward piece and, when regathering, freed after it
        if ``free_after`` (not after the input part of a split backward: the weight part follows);
        ``keep_for_backward``: a forward, whose backward comes later."""
        if not self._regather:
            yield
            return
        self.engine.gather_stage(stage)  # not the root, which stays gathered (Note: [Stage-3 weights under ...])
        yield
        if free_after:
            self.engine.release_stage(stage, keep_for_backward)

    def after_microbatch_backward(self, stage: int) -> None:
        """Reduce the buffers this stage alone uses, under ``per_microbatch`` (Note: [Pipeline gradients])."""
        buffers = self._alone_in[stage]
        if buffers:
            self.engine.reduce(buffers, self._scale)
            self._reduced.update(buffers)

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

    @naming_failed_peers("the pipeline's training step")  # torch's send/recv: Note: [Collectives a library issues]
    def train_step(self, inputs, target, loss_fn: Callable, grad_scale: float = 1.0) -> torch.Tensor:
        """One forward and backward of ``inputs`` (batch-first; the first stage reads it) against ``target`` (the
        last stage's ``loss_fn(output, target)``, a mean over the micro-batch). The gradients, times
        ``grad_scale`` (``1 / accumulated batches``), are reduced into the engine (Note: [Pipeline gradients])."""
        self._scale = grad_scale / self.num_microbatches
        self._reduced.clear()
        loss = self._run(True, inputs, target, loss_fn)
        self.tied.sum_gradients()
        remaining = [buffer for buffer in self._buffers if buffer not in self._reduced]
        self.engine.reduce(remaining, self._scale)
        self.engine.finish_gradients()
        return loss

    @torch.no_grad()
    @naming_failed_peers("the pipeline's evaluation step")
    def eval_step(self, inputs, target, loss_fn: Callable) -> torch.Tensor:
        """The schedule's forward-only path: the mean loss over micro-batches, the same on every rank."""
        loss = self._run(False, inputs, target, loss_fn)
        self.engine.reshard()
        return loss

    def _mean_loss(self, losses: list[torch.Tensor], loss_scale: float) -> torch.Tensor:
        """The schedule's micro-batch losses (times ``scale_loss``'s factor ``loss_scale``) as their unscaled mean,
        broadcast from the last stage."""
        loss = (
            torch.stack([x.detach().float() for x in losses]).mean() / loss_scale
            if self._holds_last
            else torch.zeros((), device=self.engine.device)
        )
        self.pp.broadcast(loss, src=self.last_stage_rank, label="pipeline loss").wait()
        return loss
