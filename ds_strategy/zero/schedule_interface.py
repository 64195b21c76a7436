"""What a pipeline schedule may do with the engine of its stages: the one interface
:class:`~ds_strategy.pipeline.runner.PipelineRunner` uses, in terms of this rank's stages and of opaque handles to
the engine's flat buffers, so the runner never reads a unit, a flat buffer or the reducer.

A schedule runs one backward per micro-batch, interleaved with other micro-batches' forwards, so the engine's own
hooks (reduce when a gradient is ready, gather before a unit's forward) do not fit it:
:meth:`ZeroEngine.driven_by_schedule` removes them and returns this interface, through which the schedule gathers and
releases a stage's stage-3 units around each piece of work and hands gradients over at the boundaries it knows (Note:
[Pipeline gradients] in :mod:`ds_strategy.pipeline.runner`). Everything a step asks for is worked out here once, when
the stages are given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..comm.collectives import Collectives
    from .flat_param import FlatParam
    from .grad_reducer import GradReducer
    from .param_gatherer import ParamGatherer
    from .unit import Unit


class DrivenEngine(Protocol):
    """What the interface drives of an engine (:class:`~.engine.ZeroEngine`, which hands it out): typed here, so
    that no file of ``zero/`` imports the engine back."""

    device: torch.device
    world_size: int
    collectives: Collectives
    units: list[Unit]
    flat_params: list[FlatParam]
    reducer: GradReducer
    gatherer: ParamGatherer | None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def reshard(self) -> None: ...

    def master_pieces(self, name: str) -> list[tuple[FlatParam, torch.Tensor, int]]: ...

    def refresh_from_masters(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class GradientBuffer:
    """One of the engine's flat buffers as a schedule names it: handed out and handed back, never looked into."""

    _index: int


class ScheduleInterface:
    """The engine's units, gradients and masters as a pipeline schedule drives them.

    ``stages``: each of this rank's stages and the parameters it runs (a parameter may be in two, a shared one).
    ``finished_later``: names of parameters whose gradients the schedule completes only after its last backward (a
    weight shared by stages on several ranks, summed over the pipeline group; a copy another part saves is named by
    its saved name), whose buffers therefore wait for the end of the step."""

    def __init__(
        self,
        engine: DrivenEngine,
        stages: Mapping[int, Iterable[nn.Parameter]],
        finished_later: frozenset[str] = frozenset(),
    ):
        self._engine = engine
        held = {stage: {id(p) for p in params} for stage, params in stages.items()}
        self._order = list(engine.reducer.order)
        self._units_of = {stage: self._units_holding(ids) for stage, ids in held.items()}
        self._only_in = {stage: self._buffers_only_in(stage, held, finished_later) for stage in held}

    # -- built once ---------------------------------------------------------------------------------------------
    def _units_holding(self, held: set[int]) -> list:
        """The partitioned units, the root excepted, whose parameters are among ``held`` (a stage's)."""
        return [u for u in self._engine.units[1:] if u.partitioned and id(u.flat_params[0].params[0]) in held]

    def _buffers_only_in(self, stage: int, held: dict[int, set[int]], finished_later: frozenset[str]) -> list:
        """The flat buffers whose parameters ``stage`` alone uses, none finished later, in the reduction order."""
        others = set().union(*(ids for s, ids in held.items() if s != stage))
        return [
            fp
            for fp in self._order
            if all(id(p) in held[stage] and id(p) not in others for p in fp.params)
            and not any(slot.name in finished_later for slot in fp.slots)
        ]

    # -- what the engine is -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def gathers_units(self) -> bool:
        """Whether parameters are partitioned (stage 3): units must be gathered before use."""
        return self._engine.gatherer is not None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on (see ``ZeroEngine.scale_loss``)."""
        return self._engine.scale_loss(loss)

    # -- stage-3 weights ----------------------------------------------------------------------------------------
    def gather_stage(self, stage: int) -> None:
        """Gather ``stage``'s partitioned units (not the root's: :meth:`gather_root`)."""
        for unit in self._units_of[stage]:
            unit.wait_gathered()

    def release_stage(self, stage: int, keep_for_backward: bool) -> None:
        """Free ``stage``'s gathered weights; ``keep_for_backward``: a forward's, whose backward comes later."""
        for unit in self._units_of[stage]:
            unit.release(keep_for_backward=keep_for_backward)

    def gather_all(self) -> None:
        for unit in self._engine.units:
            unit.wait_gathered()

    def gather_root(self) -> None:
        self._engine.units[0].wait_gathered()

    def reshard(self) -> None:
        self._engine.reshard()

    # -- gradients ----------------------------------------------------------------------------------------------
    def buffers(self) -> list[GradientBuffer]:
        """Every flat buffer, in the order every rank reduces them."""
        return [GradientBuffer(fp.index) for fp in self._order]

    def buffers_only_in(self, stage: int) -> list[GradientBuffer]:
        """The buffers ``stage`` alone uses (none finished later), in the reduction order: those a
        schedule may reduce as soon as that stage's micro-batch backward is done."""
        return [GradientBuffer(fp.index) for fp in self._only_in[stage]]

    def reduce(self, buffers: list[GradientBuffer], scale: float) -> None:
        """Move the accumulated ``.grad`` of ``buffers``' parameters into them, times ``scale``, and launch their
        reduction (in :meth:`buffers`' order on every rank)."""
        fps = [self._flat(buffer) for buffer in buffers]
        self._engine.reducer.collect([p for fp in fps for p in fp.params], scale)
        self._engine.reducer.reduce(fps)

    def finish_gradients(self) -> None:
        """The step's last reduction is launched: what the end of a backward does under hooks."""
        self._engine.reducer.finish()

    def _flat(self, buffer: GradientBuffer) -> FlatParam:
        return self._engine.flat_params[buffer._index]

    # -- masters ------------------------------------------------------------------------------------------------
    def read_master(self, name: str, into: torch.Tensor) -> None:
        """Copy this rank's pieces of the trainable parameter ``name``'s master into ``into`` (its local values,
        flattened), leaving the rest of ``into`` as it is."""
        for _, view, start in self._engine.master_pieces(name):
            into.narrow(0, start, view.numel()).copy_(view)

    def write_master(self, name: str, value: torch.Tensor) -> None:
        """Set this rank's pieces of ``name``'s master from ``value`` (flattened); :meth:`refresh_from_masters`
        then updates the compute copies."""
        for _, view, start in self._engine.master_pieces(name):
            view.copy_(value.narrow(0, start, view.numel()))

    def sum_over_zero_group(self, value: torch.Tensor) -> None:
        """Sum ``value`` in place over the engine's group (no-op for one rank)."""
        if self._engine.world_size > 1:
            self._engine.collectives.all_reduce(value).wait()

    def refresh_from_masters(self) -> None:
        self._engine.refresh_from_masters()
