"""When the units' full parameters exist: gathered before the forwards that read them (the root by forward pre-hooks,
the others by the stage-3 :class:`~.param_gatherer.ParamGatherer`), freed as their reductions launch and when
backward ends, and held on request (:meth:`Gathering.gathered`, :meth:`Gathering.gathered_parameters`).

One job, taken out of :class:`~.engine.ZeroEngine`, which keeps the public methods and forwards here.
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..profiler_ranges import profiler_range
from .compile_boundary import eager_hook
from .flat_param import FlatParam
from .hpz import WeightGather
from .param_gatherer import ParamGatherer
from .unit import ShardedState, Unit


def _modules_owning(root: nn.Module, flat_params: list[FlatParam]) -> list[nn.Module]:
    """Submodules of ``root`` that hold one of ``flat_params``' parameters directly."""
    held = {id(p) for fp in flat_params for p in fp.params}
    return [m for m in root.modules() if m is not root and any(id(p) in held for p in m.parameters(recurse=False))]


class Gathering:
    """``units``: root first; ``unit_of``: each flat buffer's unit, by ``fp.index`` (Note: [Unit ownership] in
    :mod:`.unit`); ``gatherer``: the stage-3 gatherer (None below stage 3: nothing is ever freed);
    ``weight_gather``: qwZ/hpZ's secondary copies, dropped with the gathered units."""

    def __init__(
        self,
        module: nn.Module,
        units: list[Unit],
        unit_of: list[Unit],
        gatherer: ParamGatherer | None,
        weight_gather: WeightGather | None,
    ):
        self.module = module
        self.units = units
        self.gatherer = gatherer
        self.weight_gather = weight_gather
        self._unit_of = unit_of
        self._launched_per_unit: dict[Unit, int] = {}
        self._hooks: list = []

    def register_hooks(self) -> None:
        """The root module's forward pre-hook, and the gathering of a sharded root before any module holding its
        parameters runs (Note: [Root parameters outside the root's forward])."""
        root = self.units[0].module
        self._hooks = [root.register_forward_pre_hook(eager_hook(lambda module, args: self.before_forward()))]
        self._hooks += [
            module.register_forward_pre_hook(eager_hook(self._gather_root_for))
            for module in _modules_owning(self.module, self.units[0].partitioned)
        ]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def before_forward(self) -> None:
        """See :meth:`.engine.ZeroEngine.before_forward`."""
        self.units[0].wait_gathered()
        if self.gatherer is not None:
            self.gatherer.before_root_forward()

    def _gather_root_for(self, module: nn.Module, args) -> None:
        """Note: [Root parameters outside the root's forward]
        The root unit (parameters no single unit owns: embeddings, final norm, shared weights) is gathered by
        the root module's forward pre-hook, or by ``before_forward`` from adapters whose step functions call
        submodules instead (a LightningModule's ``training_step``). A step may also run a second forward after
        a backward, which released the root (manual optimization: two backwards per step, GANs), without
        either. So every module that holds root parameters gathers the root before it runs if it is sharded;
        a sharded root means a forward is starting, so the prefetch position starts over too. Parameters read
        outside any module's forward (``x @ module.weight`` in the step function) are not covered: call
        ``before_forward`` first.
        """
        if self.units[0].sharded_state is ShardedState.SHARDED:
            self.before_forward()

    def on_flat_param_launched(self, fp: FlatParam) -> None:
        """The reducer launched ``fp``'s reduction: once all of a unit's partitioned buffers are, the gatherer may
        free it."""
        if not fp.policy.params:
            return
        unit = self._unit_of[fp.index]
        count = self._launched_per_unit.get(unit, 0) + 1
        if count == len(unit.partitioned):
            self._launched_per_unit.pop(unit, None)
            self.gatherer.on_flat_params_reduced(unit)
        else:
            self._launched_per_unit[unit] = count

    def end_of_backward(self) -> None:
        with profiler_range("backward.end"):
            self.gatherer.end_of_backward()
            if self.weight_gather is not None:
                self.weight_gather.drop_all()

    def wait_for_params(self) -> None:
        for unit in self.units:
            unit.wait_refreshed()

    def reshard(self) -> None:
        self.wait_for_params()
        if self.gatherer is not None:
            self.gatherer.release_all()
        if self.weight_gather is not None:
            self.weight_gather.drop_all()

    @contextlib.contextmanager
    def gathered(self, unit: Unit):
        was_sharded = unit.sharded_state is ShardedState.SHARDED
        unit.wait_gathered(exact=True)
        try:
            yield unit
        finally:
            if was_sharded:
                unit.release()

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Every unit's full parameters for the block, kept across its no-grad forwards (stage 3; a no-op below).

        For generation: ``generate`` runs one forward per token, and each would otherwise gather and free every
        unit again (correct, at one unit's memory). Inside this block each unit is gathered once, so the whole
        model is held on every rank until the block ends, as DeepSpeed's ``GatheredParameters`` holds it; then
        every unit gathered here is freed. Collective: every rank of the engine's group enters it. Not for
        training: a forward with grad enabled frees its units as usual.
        """
        if self.gatherer is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            for unit in self.units:
                stack.enter_context(self.gathered(unit))
            self.gatherer.holding = True
            try:
                yield
            finally:
                self.gatherer.holding = False
