"""Parameters two stages on different ranks both use (an LM head tied to the embedding): the owner's stage and each
copy's are made equal once, and their gradients summed over the pipeline group after every step's schedule, as
DeepSpeed's ``_exec_reduce_tied_grads`` does (Note: [Pipeline gradients] in :mod:`.runner`; the engine's side is
Note: [Parameters another part saves] in :mod:`ds_strategy.zero.model_part`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm.collectives import Collectives
from ..parallel.dtensor_params import local_tensor
from ..parallel.pipeline_split import StagePlan
from ..zero.schedule_interface import ScheduleInterface


class TiedWeights:
    """The tied parameters of ``plan`` as ``root`` (this rank's cut of the model) holds them, each with this rank's
    parameter for it (None where it holds none), looked up once."""

    def __init__(self, root: nn.Module, plan: StagePlan, engine: ScheduleInterface, pp: Collectives):
        self.engine = engine
        self.pp = pp
        self.tied = plan.tied
        self._copies = set(plan.tied_copies(root).values())  # the owners' names of this rank's copies
        present = dict(root.named_parameters(remove_duplicate=False))
        self._held = [next((present[n] for n in tied.names if n in present), None) for tied in self.tied]

    @torch.no_grad()
    def make_copies_equal(self) -> None:
        """Give every tied copy its owner's master values: stages initialise their pieces on their own (a model
        built on the meta device gives an LM head its Linear init, not the embedding's). The owner's data-parallel
        ranks each hold a piece of its master; a sum over dp, then over the pipeline group, puts it whole everywhere."""
        for tied in self.tied:
            value = torch.zeros(math.prod(tied.shape), dtype=torch.float32, device=self.engine.device)
            if tied.name not in self._copies:
                self.engine.read_master(tied.name, value)
            self.engine.sum_over_zero_group(value)
            self.pp.all_reduce(value, label=f"tied {tied.name}").wait()
            if tied.name in self._copies:
                self.engine.write_master(tied.name, value)
        if self.tied:
            self.engine.refresh_from_masters()

    def sum_gradients(self) -> None:
        """Sum each tied parameter's gradient over the pipeline group (zeros where a rank holds no copy)."""
        for tied, param in zip(self.tied, self._held):
            summed = torch.zeros(tied.shape, dtype=torch.float32, device=self.engine.device)  # one dtype everywhere
            if param is not None and param.grad is not None:
                summed.copy_(local_tensor(param.grad))
            self.pp.all_reduce(summed, label=f"tied gradient {tied.name}").wait()
            if param is None:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local_tensor(param.grad).copy_(summed)
