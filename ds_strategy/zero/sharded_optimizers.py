"""The user's optimizers as the engine holds them: several may train one model, each pointed at its own shards.

Each trainable parameter belongs to one param group of one optimizer (Muon's hidden matrices and AdamW's
embeddings, head, norms and biases, say). The engine lays each (optimizer, group) pair out in flat buffers of its
own, whole-tensor groups owner by owner (Note: [Elementwise and whole-tensor optimizers] in
:mod:`.optimizer_kinds`), and then retargets every optimizer in place onto what this rank holds of its buffers, so
that Lightning, Fabric, Accelerate and LR schedulers keep driving the very objects they were given: its class,
hyperparameters and param groups stay; each group's ``params`` become the flat masters (or, whole-tensor, one view
per parameter shaped like it), and the state is cleared, to be created lazily on the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .chained_optimizer import ChainedOptimizer
from .optimizer_kinds import check_supported, group_is_elementwise

if TYPE_CHECKING:
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
        for optimizer in optimizers:
            self.add(optimizer, self.where_in(optimizer))

    def where_in(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """``id(param)`` -> its group index in ``optimizer``, which must hold each parameter once and none that an
        optimizer already here holds."""
        if any(held is optimizer for held in self.optimizers):
            raise ValueError(f"this {type(optimizer).__name__} is already given for this model; give each once")
        check_supported(optimizer)
        index: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
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
        self._where.update({key: (oi, gi) for key, gi in where.items()})
        for gi, group in enumerate(optimizer.param_groups):
            self._elementwise[oi, gi] = group_is_elementwise(optimizer, group)
        return oi

    def __len__(self) -> int:
        return len(self.optimizers)

    def where(self, param: torch.Tensor) -> tuple[int, int] | None:
        """(optimizer index, group index) of ``param``, or None when no optimizer holds it."""
        return self._where.get(id(param))

    def is_whole(self, optimizer_index: int, group_index: int) -> bool:
        """Whether that group's optimizer needs each parameter whole (see :mod:`.optimizer_kinds`)."""
        return not self._elementwise[optimizer_index, group_index]

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
