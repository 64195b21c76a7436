"""The user's optimizers as the engine holds them: several may train one model, each pointed at its own shards.

Each trainable parameter belongs to one param group of one optimizer (Muon's hidden matrices and AdamW's
embeddings, head, norms and biases, say). The engine lays each (optimizer, group) pair out in flat buffers of its
own, whole-tensor groups owner by owner (Note: [Elementwise and whole-tensor optimizers] in
:mod:`.optimizer_kinds`), and then retargets every optimizer in place onto what this rank holds of its buffers, so
that Lightning, Fabric, Accelerate and LR schedulers keep driving the very objects they were given: its class,
hyperparameters and param groups stay; each group's ``params`` become the flat masters (or, whole-tensor, one view
per parameter shaped like it), and the state is cleared, to be created lazily on the first step.

Note: [Frozen parameters in an optimizer]
An optimizer built over ``model.parameters()`` of a partly frozen model (LoRA, PEFT, a frozen backbone) holds
parameters with ``requires_grad=False``. Torch's optimizers skip a parameter that never gets a gradient, DDP and
FSDP accept it, and DeepSpeed's ZeRO optimizers keep each group's trainable parameters only. So do these: a frozen
parameter is no optimizer's here (:meth:`ShardedOptimizers.where_in` passes over it), it has no flat buffer, and
retargeting leaves each group its trainable parameters' shards (none, for a group of frozen ones only: such a group
steps nothing, as in one process). Which parameters are frozen is read when the optimizer is given to the engine;
freezing or unfreezing later is a new setup, as under FSDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..parallel.dtensor_params import spec_of
from .chained_optimizer import ChainedOptimizer
from .optimizer_kinds import check_supported, group_is_elementwise
from .owner_layout import assign_owners

if TYPE_CHECKING:
    from ..config.plan import ZeroPlan
    from .flat_param import FlatParam


def as_optimizer_list(optimizer) -> list[torch.optim.Optimizer]:
    """``ZeroEngine``'s ``optimizer`` argument as a list: None, one optimizer, or a sequence of them; a
    :class:`ChainedOptimizer` stands for its members."""
    if optimizer is None:
        return []
    given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for item in given:
        if not isinstance(item, torch.optim.Optimizer):
            raise TypeError(f"expected torch.optim.Optimizer objects, got {type(item).__name__}")
    return [member for item in given for member in _members(item)]


def _members(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return list(optimizer.optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


class ShardedOptimizers:
    """The optimizers training one engine's model, where each parameter is in them, and of which kind."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers: list[torch.optim.Optimizer] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (optimizer index, group index)
        self._elementwise: dict[tuple[int, int], bool] = {}
        self._given: list[list[list[int]]] = []  # per optimizer, per group: id(param) in the order given
        for optimizer in optimizers:
            self.add(optimizer, self.where_in(optimizer))

    def where_in(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """``id(param)`` -> its group index in ``optimizer`` of each trainable parameter it holds, which it must
        hold once and no optimizer already here may hold (frozen ones are passed over: Note: [Frozen parameters in an
        optimizer])."""
        if any(held is optimizer for held in self.optimizers):
            raise ValueError(f"this {type(optimizer).__name__} is already given for this model; give each once")
        check_supported(optimizer)
        index: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if id(p) in index and index[id(p)] != gi:
                    raise ValueError("a parameter appears in two optimizer param groups")
                if id(p) in self._where:
                    other = self.optimizers[self._where[id(p)][0]]
                    raise ValueError(
                        f"a parameter is held by two optimizers ({type(other).__name__} and "
                        f"{type(optimizer).__name__}); each parameter must belong to one optimizer"
                    )
                index[id(p)] = gi
        return index

    def add(self, optimizer: torch.optim.Optimizer, where: dict[int, int]) -> int:
        """Hold ``optimizer`` (``where``: :meth:`where_in`'s answer for it); returns its index."""
        oi = len(self.optimizers)
        self.optimizers.append(optimizer)
        self._given.append([[id(p) for p in group["params"]] for group in optimizer.param_groups])
        self._where.update({key: (oi, gi) for key, gi in where.items()})
        for gi, group in enumerate(optimizer.param_groups):
            self._elementwise[oi, gi] = group_is_elementwise(optimizer, group)
        return oi

    def given_order(self, optimizer_index: int, module: nn.Module) -> list[list[str]]:
        """Per param group of that optimizer, the names (in ``module``) of the parameters it held when given, in its
        order, frozen ones included ("" for one ``module`` does not have): the positions a one-process
        ``optimizer.state_dict()`` keys its state by (Note: [A whole optimizer state] in
        ``ds_strategy.checkpoint.full_optimizer``)."""
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        return [[names.get(key, "") for key in group] for group in self._given[optimizer_index]]

    def __len__(self) -> int:
        return len(self.optimizers)

    def where(self, param: torch.Tensor) -> tuple[int, int] | None:
        """(optimizer index, group index) of ``param``, or None when no optimizer holds it."""
        return self._where.get(id(param))

    def is_whole(self, optimizer_index: int, group_index: int) -> bool:
        """Whether that group's optimizer needs each parameter whole (see :mod:`.optimizer_kinds`)."""
        return not self._elementwise[optimizer_index, group_index]

    def is_whole_param(self, param: torch.Tensor) -> bool:
        """Whether the optimizer holding ``param`` (if any) needs it whole."""
        where = self.where(param)
        return where is not None and self.is_whole(*where)

    def owners(self, params: list[nn.Parameter], world_size: int) -> dict[int, int]:
        """``id(param)`` -> owner rank of each of ``params`` (in model order) that a whole-tensor optimizer keeps
        whole, balanced over all of them (Note: [Whole parameters on owner ranks])."""
        whole = [p for p in params if self.is_whole_param(p)]
        return dict(zip(map(id, whole), assign_owners([p.numel() for p in whole], world_size)))

    def check_whole(self, members: list[tuple[str, nn.Parameter]]) -> None:
        """A whole-tensor optimizer must see whole tensors: a parameter tensor parallelism splits is refused."""
        for name, p in members:
            spec = spec_of(p)
            if spec is not None and not spec.replicated:
                optimizer = self.optimizers[self.where(p)[0]]
                raise ValueError(
                    f"{type(optimizer).__name__} updates each parameter whole, but tensor parallelism splits "
                    f"{name!r} ({spec.placements}); give that parameter to an elementwise optimizer (AdamW), or "
                    f"leave it out of the tensor-parallel plan"
                )

    def holds(self, optimizer: object) -> bool:
        """Whether ``optimizer`` (the object itself, or a chain of them) is held here."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return False
        try:
            self.indices_of(optimizer)
        except ValueError:
            return False
        return True

    def indices_of(self, optimizer: torch.optim.Optimizer) -> set[int]:
        """The positions of ``optimizer`` (the object itself; a chain's members) among these; ValueError when it is
        not one of them."""
        indices = set()
        for member in _members(optimizer):
            found = [oi for oi, held in enumerate(self.optimizers) if held is member]
            if not found:
                raise ValueError(f"this {type(optimizer).__name__} does not train this engine's model")
            indices.update(found)
        return indices

    def global_group(self, optimizer_index: int, group_index: int) -> int:
        """The group's position when every optimizer's groups are listed one optimizer after another (checkpoints
        store the param groups so)."""
        return sum(len(o.param_groups) for o in self.optimizers[:optimizer_index]) + group_index

    def retarget(self, flat_params: list[FlatParam], optimizer_index: int | None = None) -> None:
        """Point each optimizer's groups (or ``optimizer_index``'s only) at this rank's part of their flat buffers,
        in place, and clear the state (see the module docstring)."""
        for oi, optimizer in enumerate(self.optimizers):
            if optimizer_index is not None and oi != optimizer_index:
                continue
            for gi, group in enumerate(optimizer.param_groups):
                group["params"] = [
                    t
                    for fp in flat_params
                    if (fp.optimizer_index, fp.group_index) == (oi, gi)
                    for t in fp.optimizer_params()
                ]
            optimizer.state.clear()

    # -- an optimizer prepared after its model ------------------------------------------------------------------
    def fits(self, optimizer: torch.optim.Optimizer, flat_params: list[FlatParam], plan: ZeroPlan) -> bool:
        """Whether ``optimizer`` (or a chain's every member) can train flat buffers laid out without it: each falls
        inside one of its groups or outside all of them, its step is not offloaded, and it runs elementwise or no
        optimizer state is partitioned (stage 0), so no parameter needs an owner."""
        for member in as_optimizer_list(optimizer):
            where = self.where_in(member)
            fits = all(len({where.get(id(p)) for p in fp.params}) == 1 for fp in flat_params)
            elementwise = all(group_is_elementwise(member, group) for group in member.param_groups)
            if not fits or plan.offloads_optimizer or not (elementwise or not plan.partitions_optimizer):
                return False
        return True

    def attach(self, optimizer: torch.optim.Optimizer, flat_params: list[FlatParam], plan: ZeroPlan) -> None:
        """Hold ``optimizer`` (or a chain's members) for flat buffers laid out without it, when it :meth:`fits`;
        otherwise the caller lays the buffers out anew (a new engine). Whether every trainable parameter ends up in
        some optimizer is the caller's to know: as in one process, a parameter no optimizer holds is not updated."""
        if not self.fits(optimizer, flat_params, plan):
            raise ValueError(
                "the optimizer's param groups split this model's flat buffers (or its step is offloaded, or it "
                "keeps parameters whole on owner ranks): prepare the model together with its optimizers"
            )
        trainable = {id(p) for fp in flat_params for p in fp.params}
        for member in as_optimizer_list(optimizer):
            where = self.where_in(member)
            if not set(where) <= trainable:
                raise ValueError(
                    "the optimizer holds trainable parameters (requires_grad=True) that this model does not have"
                )
            index = self.add(member, where)
            for fp in flat_params:
                if id(fp.params[0]) in where:
                    fp.optimizer_index, fp.group_index = index, where[id(fp.params[0])]
                    fp.whole = self.is_whole(index, fp.group_index)
            self.retarget(flat_params, index)
