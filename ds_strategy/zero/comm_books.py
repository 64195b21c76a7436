"""The engine's communication: the collectives over every group it spans (:func:`connect`), and its books of them
(:class:`CommBooks`): the groups whose traffic ``comm_stats`` counts, the per-step sequence check over them, and what
the last optimizer step's iteration issued.

One job, taken out of :class:`~.engine.ZeroEngine`, which forwards ``comm_stats`` here.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ..comm.accounting import combined
from ..comm.collectives import Collectives
from ..comm.sequence_check import CollectiveSequenceCheck
from ..config import ZeroConfig
from .groups import EngineGroups
from .hpz import WeightGather, hpz_collectives


class CommBooks:
    """``groups``: name -> collectives, in the order they were added ("world" first); "monitor" (the sequence check's
    own all-gather) is kept apart from the sum."""

    def __init__(self, world: Collectives):
        self.groups: dict[str, Collectives] = {"world": world}
        self.sequence_check: CollectiveSequenceCheck | None = None
        self._at_step: dict[str, dict[str, dict[str, float]]] = {}
        self._last_step: dict[str, dict] = {}

    def add(self, name: str, collectives: Collectives | None) -> None:
        """Count ``collectives`` as group ``name`` (None: nothing to count)."""
        if collectives is not None:
            self.groups[name] = collectives

    def start_sequence_check(self, unchecked: dict[str, Collectives]) -> None:
        """The per-step comparison of the collectives each rank issued over the groups added so far
        (``ds_strategy.comm.sequence_check``): after construction's broadcasts, which it must not compare. Then
        ``unchecked`` are counted too, left out of the check (groups whose sizes differ by rank), and the first
        step's books open."""
        if dist.is_initialized() and self.groups["world"].world_size > 1:
            self.sequence_check = CollectiveSequenceCheck(list(self.groups.values()))
            self.groups["monitor"] = self.sequence_check.collectives
        self.groups.update(unchecked)
        self._at_step = self._now()

    def stats(self, group: str | None = None, last_step: bool = False) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds waited per collective kind, summed over the groups that carry training data
        ("world"; under hpZ, "hpz"; and the mesh's model-parallel groups "tp", "sp", "pp", whose counters include the
        model's own traffic over them: tensor-parallel sums, Ulysses all-to-alls, pipeline losses and shared weights;
        under expert parallelism "edp", the experts' gathers and reductions, and "ep", the token all-to-alls),
        or for one of :attr:`groups`, which also holds "monitor" (the per-step sequence check's all-gather of 16
        bytes per rank, left out of the sum).

        ``last_step``: only what the last optimizer step's iteration issued, from the end of the step before it
        (or construction) to the end of that step: its forwards, backwards, clipping and step. The collectives per
        step are the figure to watch on a model of many small units (Note: [Buckets span units] in
        :mod:`.buckets`)."""
        if last_step:
            return self._last_step.get(group or "", {})
        if group is not None:
            return self.groups[group].stats.as_dict()
        return combined(c.stats for name, c in self.groups.items() if name != "monitor")

    def _now(self) -> dict[str, dict[str, dict[str, float]]]:
        """``stats`` summed ("") and per group."""
        return {"": self.stats(), **{name: self.stats(name) for name in self.groups}}

    def count_step(self) -> None:
        """What the step that is ending issued, for ``stats(last_step=True)``."""
        now, before = self._now(), self._at_step
        self._last_step = {
            name: {
                kind: {key: value - before[name][kind][key] if name in before else value for key, value in v.items()}
                for kind, v in stats.items()
            }
            for name, stats in now.items()
        }
        self._at_step = now

    def close(self) -> None:
        if self.sequence_check is not None:
            self.sequence_check.close()


@dataclasses.dataclass(frozen=True)
class EngineComm:
    """``zero``: the ZeRO group's collectives; ``experts``: the expert-data-parallel group's (None without expert
    parallelism); ``tensor_parallel``: the tensor-parallel group's (None without, or of one rank);
    ``model_parallel``: the groups over which every norm is summed besides ``zero`` (tensor, pipeline);
    ``weight_gather``: qwZ/hpZ weight gathering, or None."""

    zero: Collectives
    experts: Collectives | None
    tensor_parallel: Collectives | None
    model_parallel: tuple[Collectives, ...]
    books: CommBooks
    weight_gather: WeightGather | None


def _model_parallel(collectives: Collectives | None) -> Collectives | None:
    """A model-parallel dimension's collectives, or None for none or one rank."""
    return None if collectives is None or collectives.world_size == 1 else collectives


def connect(groups: EngineGroups, config: ZeroConfig) -> EngineComm:
    """The collectives over every group in ``groups``, the books counting them (the model-parallel ones carry the
    model's traffic too), and the ZeRO++ groups and weight gathering (qwZ and hpZ) the units are built with."""
    backend = dist.get_backend(groups.zero) if dist.is_initialized() else "gloo"
    all_reduce = config.plan.gradient_collective(backend) == "all_reduce"
    zero = Collectives(groups.zero, use_all_reduce=all_reduce, timeout=config.collective_timeout)
    experts = None
    if groups.experts is not None:
        experts = Collectives(groups.experts.group, use_all_reduce=all_reduce, timeout=config.collective_timeout)
    tp, pp = _model_parallel(groups.tensor_parallel), _model_parallel(groups.pipeline)
    books = CommBooks(zero)
    books.add("tp", tp)
    books.add("sp", _model_parallel(groups.sequence_parallel))
    books.add("pp", pp)
    if config.zero_hpz_partition_size > 1 and zero.world_size > 1:
        books.add("hpz", hpz_collectives(zero, config.zero_hpz_partition_size))
    weight_gather = None
    if config.zero_quantized_weights or "hpz" in books.groups:
        weight_gather = WeightGather(zero, books.groups.get("hpz"), config.zero_quantized_weights)
    books.add("edp", experts)
    model_parallel = tuple(c for c in (tp, pp) if c is not None)
    return EngineComm(zero, experts, tp, model_parallel, books, weight_gather)
