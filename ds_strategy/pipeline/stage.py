"""One pipeline stage as torch's schedules run it: the stage's forward over the user's own modules
(:class:`StageModule`), and torch's ``PipelineStage`` telling the :class:`~.runner.PipelineRunner` where each
micro-batch's forward and backward run (:class:`ZeroPipelineStage`).

Note: [Why the stage overrides torch's per-micro-batch methods]
  Checked against torch 2.13.0's ``torch.distributed.pipelining.stage``: a schedule runs each micro-batch through
  ``forward_one_chunk`` and each backward piece through ``backward_maybe_with_nosync``, and it tells a data-parallel
  wrapper about them only by ``isinstance`` checks for ``DistributedDataParallel`` and ``FSDPModule`` (calling
  ``set_requires_gradient_sync``, ``set_is_last_backward`` and ``set_reshard_after_backward`` on the latter, and
  ``FSDPParamGroup.post_backward`` in ``perform_reduce_grad``). It offers no public hook for any other engine. The
  nn.Module hooks that exist do not fit: a forward pre/post hook on the stage's module also fires when torch infers
  the stages' shapes by running them (``_forward_metadata_inference``), which must find every unit gathered and
  free none (Note: [Stage-3 weights under a pipeline schedule] in :mod:`.runner`), and no module hook fires around
  the zero-bubble schedules' weight backward (``stage_backward_weight``, ``autograd.grad`` on saved pieces). So
  :class:`ZeroPipelineStage` overrides those two methods, wrapping torch's own and changing nothing in them; the
  benchmark times the same two (``benchmarks/pipeline_parallel.py``). Re-check when torch gains a public stage
  hook or a protocol for data-parallel engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..parallel.pipeline_split import StagePlan

if TYPE_CHECKING:
    from .runner import PipelineRunner


class StageModule(nn.Module):
    """One stage's forward: the embedding on the first stage, its blocks, the norm and head on the last.

    Its children are the model's own modules (no copies), so ``parameters()``, which the schedule's weight
    backward differentiates, is exactly this stage's parameters. ``sequence_rank``: this rank's place in its
    Ulysses group, whose slice's tokens it positions (Note: [Positions of a sequence slice on every stage] in
    :mod:`.runner`)."""

    def __init__(self, root: nn.Module, plan: StagePlan, stage: int, sequence_rank: int = 0):
        super().__init__()
        self.layout = plan.layout
        self.sequence_rank = sequence_rank
        self.first, self.last = stage == 0, stage == plan.num_stages - 1
        owned = [plan.block_names[i] for i in plan.blocks_of[stage]]
        owned += list(plan.layout.before if self.first else ()) + list(plan.layout.after if self.last else ())
        self.parts = nn.ModuleDict({name.replace(".", "/"): root.get_submodule(name) for name in owned})
        self.blocks = [root.get_submodule(plan.block_names[i]) for i in plan.blocks_of[stage]]
        self._root = [root]  # not a child: the root is not this stage's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root = self._root[0]
        offset = self.sequence_rank * x.shape[1]  # ids or hidden states: dimension 1 is the slice's tokens
        h = self.layout.embed(root, x, offset) if self.first else x
        kwargs = self.layout.prepare(root, h, offset)
        for block in self.blocks:
            h = self.layout.run_block(block, h, kwargs)
        return self.layout.head(root, h) if self.last else h


class ZeroPipelineStage(PipelineStage):
    """A ``PipelineStage`` that tells its :class:`~.runner.PipelineRunner` where each micro-batch's forward and
    backward run (Notes: [Pipeline gradients], [Stage-3 weights under a pipeline schedule] in :mod:`.runner`); DDP
    and FSDP get the same from torch's own stage by ``isinstance`` checks (Note: [Why the stage overrides torch's
    per-micro-batch methods])."""

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
