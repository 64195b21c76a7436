"""Buckets: runs of consecutive flat buffers that share one collective, across unit boundaries.

Note: [Buckets span units]
Units exist for stage 3's gather and free; the collectives of whole (never freed) buffers need not follow them.
A model of many small units would otherwise pay one collective per unit per step, each bound by latency, not by
bytes (96 blocks of 4k parameters: 1.2 ms per unit per step on gloo). So the gradient reductions of stages 0-2 and
the parameter refresh after a stage 1/2 step go by buckets: consecutive flat buffers, in the order their
collectives are issued, grouped while their elements add up to at most the bucket's capacity (a buffer larger than
the capacity makes a bucket of its own). A bucket's collective is one coalesced launch over its buffers (Note:
[Coalesced collectives] in :mod:`ds_strategy.comm.collectives`), so each buffer keeps its own layout and shard:
nothing is copied in or out, and each rank's slice still lands in its own shard. Buffers that cannot share a
launch stay alone: those with owner regions (a whole-tensor optimizer's), quantised reductions (qgZ), and stage 3's
partitioned buffers, whose reduction frees their unit as soon as it is launched; the whole (persistent) buffers of
a stage-3 unit that has partitioned ones share buckets only among themselves, since a bucket spanning two such units
would stay open while the partitioned buffers between them fill theirs, past the scratch bound.

The capacity is ``reduce_bucket_size`` / ``allgather_bucket_size`` in elements, as in DeepSpeed; "units" (the
default) resolves to the largest unit's elements, but never fewer than :data:`MIN_BUCKET_NUMEL`, so that a model
of small units fits a few buckets while a model of large units keeps one bucket per unit (see [The bound the peak
is held to] in :mod:`.memory_report` for what a bucket costs in memory).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from .flat_param import FlatParam

# 2**18 elements: 1 MiB of fp32 gradients, the size of DDP's first bucket.
MIN_BUCKET_NUMEL = 1 << 18


def plan_buckets(
    flat_params: Sequence[FlatParam], capacity: int, key: Callable[[FlatParam], Hashable | None]
) -> list[list[FlatParam]]:
    """``flat_params`` (in the order their collectives are issued) cut into runs of consecutive buffers with the
    same ``key`` and at most ``capacity`` padded elements together; a buffer whose key is None is alone."""
    buckets: list[list[FlatParam]] = []
    last_key, numel = None, 0
    for fp in flat_params:
        k = key(fp)
        if buckets and k is not None and k == last_key and numel + fp.padded_numel <= capacity:
            buckets[-1].append(fp)
            numel += fp.padded_numel
        else:
            buckets.append([fp])
            numel = fp.padded_numel
        last_key = k
    return buckets


def bucket_label(what: str, bucket: Sequence[FlatParam]) -> str:
    """The label a bucket's collective carries (the sequence check compares them across ranks)."""
    if len(bucket) == 1:
        return f"{what} of {bucket[0].name}"
    return f"{what} of {bucket[0].name} .. {bucket[-1].name} ({len(bucket)} buffers)"
