"""Several optimizers given where one is expected: ``ChainedOptimizer(muon, adamw)``.

Hugging Face's ``Trainer(optimizers=(optimizer, scheduler))`` and Lightning's automatic optimization take one
optimizer; the Muon recipe trains one model with two (Muon on the hidden matrices, AdamW on the rest). The chain is
one ``torch.optim.Optimizer`` whose param groups are its members' own group dicts, in order, so an LR scheduler
built over the chain sets every member's learning rates, and whose ``step``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` are its members', one after another (as ``torch.optim.lr_scheduler.ChainedScheduler`` chains
schedulers). A ZeRO engine takes the chain apart: each member owns its parameters' shards and keeps its own kind,
exactly as when the members are given separately.
"""

from __future__ import annotations

from typing import Any

import torch


class ChainedOptimizer(torch.optim.Optimizer):
    """``optimizers``, each over its own parameters, as one optimizer (see the module docstring)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        members = [m for o in optimizers for m in (o.optimizers if isinstance(o, ChainedOptimizer) else [o])]
        if not members or not all(isinstance(o, torch.optim.Optimizer) for o in members):
            raise TypeError(f"ChainedOptimizer takes torch.optim.Optimizer objects, got {optimizers!r}")
        self.optimizers = members
        super().__init__([p for o in members for group in o.param_groups for p in group["params"]], {})
        self.param_groups = [group for o in members for group in o.param_groups]  # the members' own dicts

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizers") and self.param_groups:
            raise NotImplementedError("add the param group to one of the chained optimizers, not to the chain")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the state dict holds {len(saved)} optimizers, the chain {len(self.optimizers)}")
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)
        self.param_groups = [group for o in self.optimizers for group in o.param_groups]
