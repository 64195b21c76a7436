"""What a pipeline schedule may do with the engine of its stages: the one interface
:class:`~ds_strategy.pipeline.runner.PipelineRunner` uses, so the runner never reaches into the reducer, the
units or the gatherer.

A schedule runs one backward per micro-batch, interleaved with other micro-batches' forwards, so the engine's own
hooks (reduce when a gradient is ready, gather before a unit's forward) do not fit it:
:meth:`ZeroEngine.driven_by_schedule` removes them and returns this interface, through which the schedule gathers and
releases stage-3 units around each piece of work and hands gradients over at the boundaries it knows (Note: [Pipeline
gradients] in :mod:`ds_strategy.pipeline.runner`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .engine import ZeroEngine
    from .flat_param import FlatParam
    from .unit import Unit


class ScheduleInterface:
    """The engine's units, gradients and masters as a pipeline schedule drives them."""

    def __init__(self, engine: ZeroEngine):
        self._engine = engine

    # -- what the engine is -------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._engine.module

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def gathers_units(self) -> bool:
        """Whether parameters are partitioned (stage 3): units must be gathered before use."""
        return self._engine.gatherer is not None

    @property
    def tied_copies(self) -> dict[str, str]:
        """This rank's tied copies, by name, mapped to their owners' names (see :mod:`.tied_copies`)."""
        return self._engine.tied_copies

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on (see ``ZeroEngine.scale_loss``)."""
        return self._engine.scale_loss(loss)

    # -- stage-3 weights ----------------------------------------------------------------------------------------
    def units_holding(self, params: Iterable[nn.Parameter]) -> list[Unit]:
        """The partitioned units, the root excepted, whose parameters are among ``params`` (a stage's)."""
        held = {id(p) for p in params}
        return [u for u in self._engine.units[1:] if u.partitioned and id(u.flat_params[0].params[0]) in held]

    @staticmethod
    def gather(units: Iterable[Unit]) -> None:
        for unit in units:
            unit.wait_gathered()

    @staticmethod
    def release(units: Iterable[Unit], keep_for_backward: bool) -> None:
        """Free the units' gathered weights; ``keep_for_backward``: a forward's, whose backward comes later."""
        for unit in units:
            unit.release(keep_for_backward=keep_for_backward)

    def gather_all(self) -> None:
        self.gather(self._engine.units)

    def gather_root(self) -> None:
        self.gather(self._engine.units[:1])

    def reshard(self) -> None:
        self._engine.reshard()

    # -- gradients ----------------------------------------------------------------------------------------------
    def reduction_order(self) -> list[FlatParam]:
        """The flat buffers in the order every rank reduces them."""
        return list(self._engine.reducer.order)

    def take_gradients(self, params: Iterable[nn.Parameter], scale: float) -> None:
        """Move ``params``' accumulated ``.grad`` into their flat buffers, times ``scale``."""
        self._engine.reducer.collect(list(params), scale)

    def reduce(self, flat_params: list[FlatParam]) -> None:
        """Launch the reduction of ``flat_params`` (in :meth:`reduction_order`'s order on every rank)."""
        self._engine.reducer.reduce(flat_params)

    def finish_gradients(self) -> None:
        """The step's last reduction is launched: what the end of a backward does under hooks."""
        self._engine.reducer.finish()

    # -- masters ------------------------------------------------------------------------------------------------
    def master_pieces(self, name: str) -> list[tuple[FlatParam, torch.Tensor, int]]:
        return self._engine.master_pieces(name)

    def sum_over_zero_group(self, value: torch.Tensor) -> None:
        """Sum ``value`` in place over the engine's group (no-op for one rank)."""
        if self._engine.world_size > 1:
            self._engine.collectives.all_reduce(value).wait()

    def refresh_from_masters(self) -> None:
        self._engine.refresh_from_masters()
