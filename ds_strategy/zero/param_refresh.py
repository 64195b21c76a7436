"""Stage 1/2: after a step, all-gather every rank's updated shard into the whole parameter buffers, by buckets."""

from __future__ import annotations

from ..profiler_ranges import profiler_range
from .buckets import bucket_label, plan_buckets
from .flat_param import FlatParam
from .unit import Unit


class ParamRefresh:
    """The all-gathers that bring whole (never freed) flat buffers up to date after a partitioned optimizer step.

    The buffers are cut once into buckets of at most ``bucket_numel`` elements across units (Note: [Buckets span
    units] in :mod:`.buckets`), each all-gathered by one coalesced collective; at most ``in_flight_numel``
    elements (``allgather_bucket_size``) are in flight: past that the refresh waits for what is in flight before
    launching more. Each bucket's collective is handed to the units it covers, whose ``wait_refreshed`` waits.
    A bucket's buffers share their units' group: experts' units gather over theirs (Note: [Expert units] in
    :mod:`.engine`).
    """

    def __init__(self, flat_params: list[FlatParam], unit_of: list[Unit], bucket_numel: int, in_flight_numel: int):
        """``unit_of``: each buffer's unit, by ``fp.index`` (Note: [Unit ownership] in :mod:`.unit`)."""
        self.in_flight_numel = in_flight_numel
        self._unit_of = unit_of
        stale = [fp for fp in flat_params if fp.policy.optimizer and not fp.policy.params]
        self.buckets = plan_buckets(stale, min(bucket_numel, in_flight_numel), self._bucket_key)

    def _bucket_key(self, fp: FlatParam):
        """What buffers sharing a bucket must agree on; None for a buffer gathered alone."""
        if fp.regions is not None:
            return None
        return (fp.compute_dtype, fp.device, id(self._unit_of[fp.index].collectives))

    def refresh(self, chosen: set[int] | None = None) -> None:
        """Launch the all-gathers of the buffers whose ``fp.index`` is in ``chosen`` (None: all), and wait for
        them all (Note: [Stage 1/2 parameter refresh] in :mod:`.engine`)."""
        with profiler_range("step.refresh_params"):
            in_flight: list[Unit] = []
            numel = 0
            for bucket in self.buckets:
                fps = bucket if chosen is None else [fp for fp in bucket if fp.index in chosen]
                if not fps:
                    continue
                size = sum(fp.padded_numel for fp in fps)
                if numel and numel + size > self.in_flight_numel:
                    _wait(in_flight)
                    in_flight, numel = [], 0
                pending = self._launch(fps)
                for unit in dict.fromkeys(self._unit_of[fp.index] for fp in fps):
                    unit.track_refresh(pending)
                    in_flight.append(unit)
                numel += size
            _wait(in_flight)

    def _launch(self, fps: list[FlatParam]):
        label = bucket_label("parameters", fps)
        collectives = self._unit_of[fps[0].index].collectives
        if len(fps) == 1:
            fp = fps[0]
            return collectives.all_gather(fp.full, fp.shard, label=label, regions=fp.regions)
        return collectives.all_gather_many([fp.full for fp in fps], [fp.shard for fp in fps], label=label)


def _wait(units: list[Unit]) -> None:
    for unit in units:
        unit.wait_refreshed()
