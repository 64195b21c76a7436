"""How many bytes of model state one rank holds under each ZeRO stage, before running anything.

The core is the ZeRO paper's accounting (Rajbhandari et al. 2020, section 3 and Figure 1). With Ψ parameters,
N ranks and mixed-precision Adam, a rank holds 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and
12Ψ of fp32 optimizer state (master weights, momentum, variance), and each stage divides one more of those
three terms by N:

    stage 0 (baseline)   2Ψ   + 2Ψ   + 12Ψ        7.5B params on 64 ranks: 120 GB
    stage 1 (P_os)       2Ψ   + 2Ψ   + 12Ψ/N                                31.4 GB
    stage 2 (P_os+g)     2Ψ   + 2Ψ/N + 12Ψ/N                                16.6 GB
    stage 3 (P_os+g+p)   2Ψ/N + 2Ψ/N + 12Ψ/N                                 1.9 GB

``estimate_memory(7.5e9, 64)`` reproduces that table exactly. Other precisions change the bytes per parameter
(fp32: 4 + 4 + 8; "-true" half precision: 2 + 2 + 4, no master copy, half-precision moments).

Note: [What a real model adds]
Given a module or a ``config`` (or ``largest_layer`` / ``reduce_bucket_size``), the
estimate adds what the engine really allocates beyond the paper's terms, as peaks within a step:
  * stage 3 gathers a unit in full while it computes, plus up to ``prefetch_bucket_size`` elements of the units
    that follow, the whole bounded by ``max_live_parameters`` (never below one unit) and by the model; the
    parameters under ``param_persistence_threshold`` stay whole on every rank.
  * stage >= 2 reduces gradients from scratch buckets: at most ``reduce_bucket_size`` elements in flight plus the
    flat buffer being filled, never more than the whole gradient. This is an upper bound: when reductions keep
    up with backward (small buckets, fast links) fewer are alive. Buckets are reported under ``"buffers"``, as
    ``memory_report()`` does.
Activations are not model state and are not estimated.

Note: [What a whole-tensor optimizer adds]
A whole-tensor optimizer (Muon) keeps each of its parameters whole on one owner rank, balanced by size, so a rank
owns at most Ψ_w/N + P of its Ψ_w elements, P the largest such parameter (Note: [Whole parameters on owner ranks]
in ``ds_strategy.zero.owner_layout``). Given ``largest_whole_param`` = P, every partitioned term (optimizer state
from stage 1, gradients from stage 2, parameters at stage 3) grows by at most P elements' bytes; the replicated
terms do not change. With P = 0 (elementwise optimizers only) the paper's formulas stand.

Note: [Offload (DeepSpeed's ZeRO-Offload and ZeRO-Infinity semantics)]
``offload_optimizer="cpu"`` (stage >= 1) moves the optimizer state to host memory, together with the fp32 gradient
partition the host optimizer reads; ``"nvme"`` (stage >= 1, as the engine allows) moves the optimizer state to NVMe.
At stage 2/3 the device then keeps no gradient: each reduced slice is summed into the host partition as it is
reduced (Note: [Reduced gradients leave the device] in ``ds_strategy.offload.host_gradients``), so device gradients
count 0 and only the reduction buckets remain; at stage 1 the whole gradient stays on the device, where it is
accumulated. ``offload_params="cpu"|"nvme"`` (stage 3) keeps each rank's parameter partition there; the gathered
working set stays on the device. Staging buffers of the NVMe path are not counted. With ``pin_memory`` the host
buffers the device copies (parameter and gradient partitions, staging) are pinned within a budget, the rest stays
pageable (Note: [Pinned host memory is bounded] in ``ds_strategy.offload.pinned``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from .config import OFFLOAD_MODES, UNITS, ZeroConfig
from .zero.memory_report import KINDS, PLACES
from .zero.wrap_policy import select_unit_modules

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What the estimator needs to know about a model, counted in elements.

    ``params``: trainable parameters (a tied weight counts once); ``frozen``: parameters without gradients,
    kept whole on every rank and never given optimizer state. ``largest_unit``: trainable elements of the
    biggest unit stage 3 gathers at once (0 = unknown, no working set added). ``persistent``: trainable elements
    in parameters below the persistence threshold, which stage 3 leaves whole. ``largest_whole``: elements of the
    largest parameter a whole-tensor optimizer keeps whole on one rank (0: none; Note: [What a whole-tensor
    optimizer adds]).
    """

    params: int
    frozen: int = 0
    largest_unit: int = 0
    persistent: int = 0
    largest_whole: int = 0

    @classmethod
    def of_module(cls, module: nn.Module, config: ZeroConfig | None = None) -> ModelSize:
        """Count ``module``'s parameters and cut it into units the way :class:`ZeroEngine` does.

        Works on a model built on the ``meta`` device, so a model too big to materialise can be estimated.
        """
        config = config or ZeroConfig()
        threshold = config.param_persistence_threshold
        threshold = (
            ZeroConfig.__dataclass_fields__["param_persistence_threshold"].default if threshold == "auto" else threshold
        )
        unique = {id(p): p for p in module.parameters()}
        trainable = {k: p for k, p in unique.items() if p.requires_grad}
        units = select_unit_modules(module, config.unit_modules, config.unit_min_params)
        owners: dict[int, int] = {}
        for index, (_, unit) in enumerate(units):
            for p in unit.parameters():
                owners[id(p)] = -1 if id(p) in owners else index  # shared by two units: the root keeps it
        unit_sizes = [0] * (len(units) + 1)  # slot -1 is the root
        for key, p in trainable.items():
            unit_sizes[owners.get(key, -1)] += p.numel()
        return cls(
            params=sum(p.numel() for p in trainable.values()),
            frozen=sum(p.numel() for k, p in unique.items() if k not in trainable),
            largest_unit=max(unit_sizes),
            persistent=sum(p.numel() for p in trainable.values() if p.numel() < int(threshold)),
        )


@dataclasses.dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model state for a precision and an optimizer with ``states`` moments."""

    params: int
    grads: int
    optimizer: int

    @classmethod
    def of(cls, precision: str, optimizer_states: int = 2) -> BytesPerParam:
        precision = ZeroConfig(precision=precision).precision  # validates and normalises Lightning's aliases
        if precision == "32-true":
            return cls(params=4, grads=4, optimizer=4 * optimizer_states)
        if precision.endswith("-mixed"):
            return cls(params=2, grads=2, optimizer=4 + 4 * optimizer_states)  # fp32 master + fp32 moments
        return cls(params=2, grads=2, optimizer=2 * optimizer_states)  # "-true" half: no master copy


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds, laid out as ``ZeroEngine.memory_report()``: ``bytes[kind][place]``."""

    stage: int
    world_size: int
    precision: str
    offload_optimizer: str
    offload_params: str
    bytes: Mapping[str, Mapping[str, int]]

    def total(self, place: str | None = None, kinds: tuple[str, ...] = KINDS) -> int:
        """Bytes summed over ``kinds``, in one place or (None) everywhere."""
        places = PLACES if place is None else (place,)
        return sum(self.bytes[kind][p] for kind in kinds for p in places)

    @property
    def device(self) -> int:
        return self.total("device")

    @property
    def host(self) -> int:
        return self.total("host")

    @property
    def nvme(self) -> int:
        return self.total("nvme")

    @property
    def label(self) -> str:
        """The ZeRO paper's name for the stage (baseline, P_os, P_os+g, P_os+g+p)."""
        return STAGE_NAMES[self.stage]


def estimate_memory(
    model_or_param_count: nn.Module | int | float | ModelSize,
    world_size: int,
    stage: int | None = None,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    precision: str = "bf16-mixed",
    largest_layer: int | None = None,
    *,
    optimizer_states: int = 2,
    reduce_bucket_size: int | None = None,
    config: ZeroConfig | None = None,
    largest_whole_param: int = 0,
) -> MemoryEstimate | dict[int, MemoryEstimate]:
    """Bytes per rank on device / host / nvme for ``stage``, or a ``{stage: estimate}`` dict when stage is None.

    ``model_or_param_count``: a module (its units and persistent parameters are counted, and the bucket sizes of
    ``config``, or ZeroConfig's defaults, added), a parameter count (the paper's pure formulas unless
    ``largest_layer``, ``reduce_bucket_size`` or ``config`` are given), or a :class:`ModelSize`.
    ``optimizer_states``: moments per parameter (Adam 2, SGD with momentum 1, Muon 1). ``largest_whole_param``:
    elements of the largest parameter a whole-tensor optimizer (Muon) trains, which a rank may hold beyond its 1/N
    (Note: [What a whole-tensor optimizer adds]). ``config`` supplies the bucket
    sizes, ``prefetch_bucket_size``, ``max_live_parameters`` and the unit policy; ``stage`` and ``precision`` are
    the arguments' own. See the module docstring for the formulas and offload rules.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate_memory world_size={world_size!r} is not allowed; expected an integer >= 1")
    if isinstance(largest_whole_param, bool) or not isinstance(largest_whole_param, int) or largest_whole_param < 0:
        raise ValueError(
            f"estimate_memory largest_whole_param={largest_whole_param!r} is not allowed; expected an integer >= 0"
        )
    size, buckets = _model_size(model_or_param_count, largest_layer, reduce_bucket_size, config)
    size = dataclasses.replace(size, largest_whole=largest_whole_param or size.largest_whole)
    per_param = BytesPerParam.of(precision, optimizer_states)
    precision = ZeroConfig(precision=precision).precision
    if stage is None:
        return {
            s: _estimate(size, world_size, s, offload_optimizer, offload_params, precision, per_param, buckets)
            for s in STAGES
            if _offload_error(s, offload_optimizer, offload_params) is None
        }
    return _estimate(size, world_size, stage, offload_optimizer, offload_params, precision, per_param, buckets)


def valid_offloads(stage: int) -> list[tuple[str, str]]:
    """The (offload_optimizer, offload_params) pairs DeepSpeed allows at ``stage``."""
    return [(o, p) for o in OFFLOAD_MODES for p in OFFLOAD_MODES if _offload_error(stage, o, p) is None]


@dataclasses.dataclass(frozen=True)
class _Buckets:
    """Element counts that bound the working buffers; None where the caller gave nothing to go on."""

    reduce: int | None = None
    prefetch: int = 0
    max_live: int | None = None


def _model_size(model, largest_layer, reduce_bucket_size, config) -> tuple[ModelSize, _Buckets]:
    if isinstance(model, nn.Module):
        size = ModelSize.of_module(model, config)
        config = config or ZeroConfig()
    elif isinstance(model, ModelSize):
        size = model
    elif isinstance(model, (int, float)) and not isinstance(model, bool) and model >= 1:
        size = ModelSize(params=int(model))
    else:
        raise ValueError(
            f"estimate_memory model_or_param_count={model!r} is not allowed; expected an nn.Module, "
            f"a ModelSize or a parameter count >= 1"
        )
    if largest_layer is not None:
        if largest_layer < 0:
            raise ValueError(f"estimate_memory largest_layer={largest_layer!r} is not allowed; expected >= 0")
        size = dataclasses.replace(size, largest_unit=int(largest_layer))
    if reduce_bucket_size is not None and reduce_bucket_size < 1:
        raise ValueError(f"estimate_memory reduce_bucket_size={reduce_bucket_size!r} is not allowed; expected >= 1")
    if config is None:
        return size, _Buckets(reduce=reduce_bucket_size)
    defaults = ZeroConfig()

    def known(name: str) -> int:
        """The size in elements: "auto" estimated at the default, "units" as the largest unit (the engine's rule)."""
        value = getattr(config if getattr(config, name) != "auto" else defaults, name)
        return size.largest_unit if value == UNITS else int(value)

    return size, _Buckets(
        reduce=reduce_bucket_size if reduce_bucket_size is not None else known("reduce_bucket_size"),
        prefetch=known("prefetch_bucket_size"),
        max_live=config.max_live_parameters,
    )


def _offload_error(stage: int, offload_optimizer: str, offload_params: str) -> str | None:
    """Why ZeroConfig refuses this stage and these offload places (its validation is the one home of those rules),
    or None."""
    try:
        nvme = "nvme" in (offload_optimizer, offload_params)
        ZeroConfig(
            stage=stage,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            nvme_path="." if nvme else None,
        )
    except ValueError as error:
        return str(error)
    return None


def _estimate(
    size: ModelSize,
    n: int,
    stage: int,
    offload_optimizer: str,
    offload_params: str,
    precision: str,
    per_param: BytesPerParam,
    buckets: _Buckets,
) -> MemoryEstimate:
    error = _offload_error(stage, offload_optimizer, offload_params)
    if error is not None:
        raise ValueError(f"estimate_memory {error}")
    psi = size.params
    out = {kind: dict.fromkeys(PLACES, 0.0) for kind in KINDS}
    whole = min(size.largest_whole, psi)  # a whole-tensor optimizer's owner may hold this much beyond its 1/N
    # parameters: whole below stage 3; at stage 3 a 1/N partition, plus what stays or becomes whole
    frozen = per_param.params * size.frozen
    if stage < 3:
        out["params"]["device"] = per_param.params * psi + frozen
    else:
        partitioned = psi - size.persistent
        out["params"][_place(offload_params)] += per_param.params * (partitioned / n + whole)
        out["params"]["device"] += per_param.params * (size.persistent + _gathered(size, partitioned, buckets)) + frozen
    # gradients: whole below stage 2, else a 1/N partition; the optimizer's host copy when it is offloaded
    grads = per_param.grads * (psi / n + whole if stage >= 2 else psi)
    if offload_optimizer == "none":
        out["grads"]["device"] = grads
    else:
        out["grads"]["device"] = grads if stage < 2 else 0.0
        out["grads"]["host"] = 4 * (psi / n + whole)
    # optimizer state: whole at stage 0, else a 1/N partition, wherever it is offloaded to
    out["optimizer"][_place(offload_optimizer)] = per_param.optimizer * (psi / n + whole if stage >= 1 else psi)
    # gradient buckets: scratch that stage 2/3 reduce from, bounded by the bucket size and the whole gradient
    if stage >= 2 and buckets.reduce is not None:
        out["buffers"]["device"] = per_param.grads * min(psi, buckets.reduce + size.largest_unit)
    report = {kind: {place: int(round(value)) for place, value in places.items()} for kind, places in out.items()}
    return MemoryEstimate(stage, n, precision, offload_optimizer, offload_params, report)


def _gathered(size: ModelSize, partitioned: int, buckets: _Buckets) -> int:
    """Stage 3's peak of gathered elements: the unit computing plus what is prefetched, within the bounds."""
    gathered = size.largest_unit + (buckets.prefetch if size.largest_unit else 0)
    if buckets.max_live is not None:
        gathered = min(gathered, max(size.largest_unit, buckets.max_live))
    return min(gathered, partitioned)


def _place(offload: str) -> str:
    return {"none": "device", "cpu": "host", "nvme": "nvme"}[offload]


def meta_model(factory) -> nn.Module:
    """Build ``factory()`` on the meta device: its shapes without its memory, for estimating big models."""
    with torch.device("meta"):
        return factory()
