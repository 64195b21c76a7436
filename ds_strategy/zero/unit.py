"""A unit: a module whose flat parameters are gathered and released together, with a named state machine."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from torch import nn

from ..comm.collectives import Collectives, PendingCollective
from ..profiler_ranges import profiler_range
from .flat_param import FlatParam
from .hpz import WeightGather


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


# Which training-state changes are legal; anything else is an engine bug and is asserted.
_LEGAL = {
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.IDLE},
    TrainingState.FORWARD: {TrainingState.IDLE},
    TrainingState.BACKWARD: {TrainingState.IDLE},
}


class Unit:
    """The flat parameters of one module (all its param groups) plus their gather state.

    Note: [Gather lifetime]
    ``gather()`` launches the all-gathers into the full buffers and returns at once;
    ``wait_gathered()`` must run before any parameter of the unit is read, because until then the full buffers
    (which the parameters view) are being written by the collective. Under stage 3 ``release()`` frees the full
    buffers and points the parameters at empty tensors; it is only legal once nothing that autograd saved still
    needs them (after forward with ``reshard_after_forward``, or after the unit's backward has finished).

    ``weight_gather`` (ZeRO++, when qwZ or hpZ is on) decides how partitioned buffers are gathered and may keep
    a secondary piece when they are freed; see :mod:`.hpz`. None: plain all-gathers.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        flat_params: list[FlatParam],
        collectives: Collectives,
        weight_gather: WeightGather | None = None,
    ):
        self.name = name
        self.module = module
        self.flat_params = flat_params
        self.collectives = collectives
        self.partitioned = [fp for fp in flat_params if fp.policy.params]
        self.partitioned_numel = sum(fp.padded_numel for fp in self.partitioned)  # what gathering it holds
        self.sharded_state = ShardedState.SHARDED if self.partitioned else ShardedState.GATHERED
        # elements of partitioned parameters held in full now: partitioned_numel unless SHARDED, kept as a plain
        # attribute because the gatherer sums it over every unit after every gather
        self.gathered_numel = 0
        self.training_state = TrainingState.IDLE
        self._pending: list[PendingCollective] = []
        self._refreshing: list[PendingCollective] = []
        self.weight_gather = weight_gather

    @property
    def numel(self) -> int:
        return sum(fp.numel for fp in self.flat_params)

    def set_training_state(self, state: TrainingState) -> None:
        assert state in _LEGAL[self.training_state], f"unit {self.name}: {self.training_state} -> {state}"
        self.training_state = state

    # -- gather / release ----------------------------------------------------------------------------------------
    def track_refresh(self, pending: PendingCollective) -> None:
        """An all-gather bringing some of this unit's whole (never freed) buffers up to date after a partitioned
        optimizer step is in flight (:mod:`.param_refresh`): the unit's parameters are read only after it."""
        self._refreshing.append(pending)

    def wait_refreshed(self) -> None:
        """Block until the whole buffers' refresh is done (partitioned parameters are left as they are)."""
        for pending in self._refreshing:
            pending.wait()
        self._refreshing.clear()

    def gather(self, exact: bool = False) -> None:
        """Launch the all-gathers of the partitioned flat params without waiting (a prefetch).

        ``exact``: never quantised (ZeRO++ qwZ), for exports; it has no effect on a unit already gathered.
        """
        if self.sharded_state is not ShardedState.SHARDED:
            return
        for fp in self.partitioned:
            fp.alloc_full()
            label = f"unit {self.name} ({fp.name})"
            self._pending.append(
                self.weight_gather.launch(fp, label, exact)
                if self.weight_gather is not None
                else self.collectives.all_gather(fp.full, fp.gather_source(), label=label, regions=fp.regions)
            )
        self.sharded_state = ShardedState.GATHERING
        self.gathered_numel = self.partitioned_numel

    def wait_gathered(self, exact: bool = False) -> None:
        """Block until every launched gather is done; partitioned parameters then view the full buffers."""
        self.gather(exact)
        self.wait_refreshed()
        for pending in self._pending:
            pending.wait()
        self._pending.clear()
        if self.sharded_state is ShardedState.GATHERING:
            for fp in self.partitioned:
                fp.point_params_at_full()
            self.sharded_state = ShardedState.GATHERED

    def release(self, keep_for_backward: bool = False) -> None:
        """Free the full buffers of the partitioned flat params (stage 3).

        ``keep_for_backward``: autograd will run this unit's backward (under hpZ a secondary piece is kept).
        """
        with profiler_range("unit.free", self.name):
            if not self.partitioned or self.sharded_state is ShardedState.SHARDED:
                return
            assert not self._pending, f"unit {self.name}: release while a gather is in flight"
            for fp in self.partitioned:
                if self.weight_gather is not None:
                    self.weight_gather.before_free(fp, keep_for_backward)
                fp.point_params_at_empty()
                fp.free_full()
            self.sharded_state = ShardedState.SHARDED
            self.gathered_numel = 0

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, numel={self.numel}, {self.sharded_state.value}/{self.training_state.value})"


def units_by_flat_param(units: Sequence[Unit]) -> list[Unit]:
    """Each flat buffer's unit, by ``fp.index``.

    Note: [Unit ownership]
    The engine's flat buffers are its units' in unit order, so ``fp.index`` indexes this list. It is the one map
    from a buffer to its unit: the gradient reducer reads a buffer's group (experts' units reduce over theirs) and
    whether its unit is partitioned from it, the stage 1/2 refresh which units a bucket's gather completes, the
    stage-3 gathering which unit a launched reduction frees. Built once, after the units exist.
    """
    return [unit for unit in units for _ in unit.flat_params]
