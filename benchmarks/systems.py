"""The systems compare.py trains, one line each in ``SYSTEMS``, and how each family is built on a rank.

Every system trains the same GPT from the same seed with AdamW (two param groups, weight decay on matrices
only), the same batches and the same gradient clipping, so per-step losses agree across fp32 systems to float
noise; the comparison table shows the difference from DDP's as a check that each system trains what it claims.

Families:
  ddp        torch DistributedDataParallel, ``gradient_as_bucket_view=True``; bf16-mixed = CPU autocast around
             the forward with fp32 parameters, gradients and optimizer (what Lightning's "bf16-mixed" does).
  fsdp2      ``fully_shard`` on every transformer block, then the root; option ``reshard_after_forward``;
             bf16-mixed = ``MixedPrecisionPolicy(param_dtype=bf16)`` (gradients reduced in bf16, its default).
  deepspeed  ``deepspeed.initialize`` with the same torch AdamW as client optimizer (DeepSpeed's fused and CPU
             Adam need compiled ops); buckets and stage-3 thresholds set to ds_strategy's defaults, capped at
             the model size because DeepSpeed's stage 3 preallocates a whole reduce bucket.
  ours       ``ZeroEngine`` with ``ZeroConfig(precision=..., **options)``: the options are ZeroConfig fields, so
             a new configuration (offload, ZeRO++ quantisation, ...) is one more line in ``SYSTEMS``. A line may
             name the ``ds_strategy`` module its feature lives in (``requires``): until that module exists the
             system is reported as not available rather than run with the option silently ignored.

DeepSpeed's offload lines use its ``DeepSpeedCPUAdam`` (a C++ op DeepSpeed compiles on first use), as DeepSpeed
requires for ``offload_optimizer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from accounting import optimizer_state_tensors, reachable_tensors, storage_bytes
from torch import nn

from ds_strategy.models import GPT, GPTConfig, weight_decay_groups

FAMILIES = ("ddp", "fsdp2", "deepspeed", "ours")
STATE_KINDS = ("params", "grads", "optimizer", "buffers")


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One configuration to measure: a family, a precision and that family's options."""

    name: str
    family: str
    precision: str = "32-true"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    requires: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"SystemSpec.family={self.family!r} is not one of {FAMILIES}")
        if self.precision not in ("32-true", "bf16-mixed"):
            raise ValueError(f"SystemSpec.precision={self.precision!r} is not '32-true' or 'bf16-mixed'")

    def unavailable(self) -> str | None:
        """Why this system cannot run here, or None."""
        if self.requires and importlib.util.find_spec(self.requires) is None:
            return f"needs {self.requires}, which has not landed yet"
        if self.family == "deepspeed":
            return deepspeed_available()
        return None


_NVME = {"nvme_path": tempfile.gettempdir()}
SYSTEMS: tuple[SystemSpec, ...] = (
    SystemSpec("ddp", "ddp"),
    SystemSpec("fsdp2", "fsdp2", options={"reshard_after_forward": True}),
    SystemSpec("fsdp2-noreshard", "fsdp2", options={"reshard_after_forward": False}),
    SystemSpec("ds-zero1", "deepspeed", options={"stage": 1}),
    SystemSpec("ds-zero2", "deepspeed", options={"stage": 2}),
    SystemSpec("ds-zero3", "deepspeed", options={"stage": 3}),
    SystemSpec("zero0", "ours", options={"stage": 0}),
    SystemSpec("zero1", "ours", options={"stage": 1}),
    SystemSpec("zero2", "ours", options={"stage": 2}),
    SystemSpec("zero3", "ours", options={"stage": 3}),
    # overlap_comm=False: the same collectives, each waited on where it is launched (the overlap benchmark's pairs).
    SystemSpec("zero1-nooverlap", "ours", options={"stage": 1, "overlap_comm": False}),
    SystemSpec("zero2-nooverlap", "ours", options={"stage": 2, "overlap_comm": False}),
    SystemSpec("zero3-nooverlap", "ours", options={"stage": 3, "overlap_comm": False}),
    SystemSpec("zero3-noreshard", "ours", options={"stage": 3, "reshard_after_forward": False}),
    # Prefetch budgets below DeepSpeed's default 5e7 elements (more than a small model: every unit is prefetched):
    # none, and one GPT-small block (3.15M elements).
    SystemSpec("zero3-noprefetch", "ours", options={"stage": 3, "prefetch_bucket_size": 0}),
    SystemSpec("zero3-prefetch1", "ours", options={"stage": 3, "prefetch_bucket_size": 3_200_000}),
    SystemSpec(
        "zero2-qgz",
        "ours",
        options={"stage": 2, "zero_quantized_gradients": True},
        requires="ds_strategy.comm.quantized",
    ),
    SystemSpec(
        "zero3-qwz", "ours", options={"stage": 3, "zero_quantized_weights": True}, requires="ds_strategy.comm.quantized"
    ),
    # The sharded collectives themselves (reduce-scatter, all-gather) rather than gloo's faster stand-ins:
    # the plain stage 3 that ZeRO++'s byte counts compare with.
    SystemSpec("zero3-rs", "ours", options={"stage": 3, "gradient_reduction": "reduce_scatter"}),
    SystemSpec("zero3-qgz", "ours", options={"stage": 3, "zero_quantized_gradients": True}),
    SystemSpec(
        "zero3-qwz-qgz", "ours", options={"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    ),
    # hpZ in groups of 2 ranks (run with --world-size 4: with 2 ranks the group is everyone).
    SystemSpec("zero3-hpz", "ours", options={"stage": 3, "zero_hpz_partition_size": 2}),
    SystemSpec(
        "zero3-zeropp",
        "ours",
        options={
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
            "zero_hpz_partition_size": 2,
        },
    ),
    SystemSpec(
        "zero2-offload", "ours", options={"stage": 2, "offload_optimizer": "cpu"}, requires="ds_strategy.offload"
    ),
    SystemSpec(
        "zero3-offload",
        "ours",
        options={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
        requires="ds_strategy.offload",
    ),
    SystemSpec(
        "zero3-nvme", "ours", options={"stage": 3, "offload_optimizer": "nvme", **_NVME}, requires="ds_strategy.offload"
    ),
    SystemSpec("ds-zero2-offload", "deepspeed", options={"stage": 2, "offload_optimizer": "cpu"}),
    SystemSpec(
        "ds-zero3-offload", "deepspeed", options={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    ),
    SystemSpec("ddp-bf16", "ddp", "bf16-mixed"),
    SystemSpec("fsdp2-bf16", "fsdp2", "bf16-mixed", {"reshard_after_forward": True}),
    SystemSpec("ds-zero2-bf16", "deepspeed", "bf16-mixed", {"stage": 2}),
    SystemSpec("ds-zero3-bf16", "deepspeed", "bf16-mixed", {"stage": 3}),
    SystemSpec("zero1-bf16", "ours", "bf16-mixed", {"stage": 1}),
    SystemSpec("zero2-bf16", "ours", "bf16-mixed", {"stage": 2}),
    SystemSpec("zero3-bf16", "ours", "bf16-mixed", {"stage": 3}),
)


def deepspeed_available() -> str | None:
    """None if DeepSpeed imports here on the CPU accelerator, else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "skip DeepSpeed"
        return f"DeepSpeed not importable ({type(error).__name__}: {error}); `pip install deepspeed` to include it"
    return None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What every system trains with; ``batch_size`` is per rank."""

    model: GPTConfig
    batch_size: int = 4
    seed: int = 0
    lr: float = 3e-4
    weight_decay: float = 0.1
    clip: float = 1.0


class BuiltSystem:
    """One system built on this rank: a training step split where model states are sampled, plus accounting."""

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for work a step left in flight (so the last timed step pays for it)."""

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, whose forward pre-hooks sample model states while a unit is gathered."""
        raise NotImplementedError

    def state_bytes(self) -> dict[str, int]:
        """Bytes per kind (STATE_KINDS) this rank holds in memory; optionally "nvme": bytes kept on NVMe."""
        raise NotImplementedError

    def own_comm_bytes(self) -> int | None:
        """Bytes the system's own accounting reports since :meth:`reset_own_comm` (ours only)."""
        return None

    def reset_own_comm(self) -> None:
        pass

    def close(self) -> None:
        pass


def _model_and_optimizer(recipe: Recipe) -> tuple[GPT, callable]:
    torch.manual_seed(recipe.seed)
    model = GPT(recipe.model)
    make_optimizer = lambda module: torch.optim.AdamW(  # noqa: E731 - built after any parameter rewrite
        weight_decay_groups(module, recipe.weight_decay), lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8
    )
    return model, make_optimizer


def _autocast(precision: str):
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class _TorchOptimized(BuiltSystem):
    """DDP and FSDP2: autograd, ``clip_grad_norm_`` and a torch optimizer over the (possibly DTensor) parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, recipe: Recipe, autocast: str):
        self.model, self.optimizer, self.recipe, self.autocast = model, optimizer, recipe, autocast

    def forward_backward(self, inputs, targets):
        with _autocast(self.autocast):
            _, loss = self.model(inputs, targets)
        loss.backward()
        return loss.detach().float()

    def blocks(self):
        return list(getattr(self.model, "module", self.model).blocks)

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state_bytes(self):
        seen: set[int] = set()
        params = list(self.model.parameters())
        return {
            "params": storage_bytes(params, seen),
            "grads": storage_bytes((p.grad for p in params), seen),
            "optimizer": storage_bytes(optimizer_state_tensors(self.optimizer), seen),
            "buffers": 0,
        }


def build_ddp(spec: SystemSpec, recipe: Recipe) -> BuiltSystem:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    model, make_optimizer = _model_and_optimizer(recipe)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, allreduce_hook)  # DDP's own algorithm, run from Python so it can be counted
    return _TorchOptimized(ddp, make_optimizer(model), recipe, spec.precision)


def build_fsdp2(spec: SystemSpec, recipe: Recipe) -> BuiltSystem:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, make_optimizer = _model_and_optimizer(recipe)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16) if spec.precision == "bf16-mixed" else MixedPrecisionPolicy()
    )
    reshard = spec.options.get("reshard_after_forward", True)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return _TorchOptimized(model, make_optimizer(model), recipe, "32-true")


class _DeepSpeedSystem(BuiltSystem):
    def __init__(self, engine):
        self.engine = engine

    def forward_backward(self, inputs, targets):
        _, loss = self.engine(inputs, targets)
        self.engine.backward(loss)
        return loss.detach().float()

    def optimizer_step(self):
        self.engine.step()

    def blocks(self):
        return list(self.engine.module.blocks)

    def state_bytes(self):
        """Parameters (or their stage-3 partitions), gradients, then every tensor DeepSpeed's ZeRO optimizer
        references, classed by attribute name: ``*grad*`` as gradients, fp32 partitions and the inner optimizer's
        state as optimizer, anything else (buckets, flat 16-bit copies not already counted) as buffers."""
        seen: set[int] = set()
        params = list(self.engine.module.parameters())
        out = {
            "params": storage_bytes(params + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")], seen),
            "grads": storage_bytes((p.grad for p in params), seen),
            "optimizer": 0,
            "buffers": 0,
        }
        zero = self.engine.optimizer
        inner = getattr(zero, "optimizer", zero)
        out["optimizer"] += storage_bytes(optimizer_state_tensors(inner), seen)
        for path, tensor in reachable_tensors(zero):
            kind = "grads" if "grad" in path else "optimizer" if "fp32" in path else "buffers"
            out[kind] += storage_bytes([tensor], seen)
        return out

    def close(self):
        self.engine.destroy() if hasattr(self.engine, "destroy") else None


_DEEPSPEED_OFFLOAD = {"offload_optimizer": "offload_optimizer", "offload_params": "offload_param"}


def build_deepspeed(spec: SystemSpec, recipe: Recipe) -> BuiltSystem:
    import deepspeed

    from ds_strategy.config import ZeroConfig

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    model, make_optimizer = _model_and_optimizer(recipe)
    numel = sum(p.numel() for p in model.parameters())
    defaults = ZeroConfig()
    offload = {
        deepspeed_key: {"device": spec.options[field]}
        for field, deepspeed_key in _DEEPSPEED_OFFLOAD.items()
        if field in spec.options
    }
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        make_optimizer = lambda module: DeepSpeedCPUAdam(  # noqa: E731
            weight_decay_groups(module, recipe.weight_decay), lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8, adamw_mode=True
        )
    config = {
        "train_micro_batch_size_per_gpu": recipe.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": recipe.clip,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": spec.options["stage"],
            "reduce_bucket_size": min(_elements(defaults.reduce_bucket_size, model), numel),
            "allgather_bucket_size": min(defaults.allgather_bucket_size, numel),
            "stage3_prefetch_bucket_size": min(_elements(defaults.prefetch_bucket_size, model), numel),
            "stage3_param_persistence_threshold": defaults.param_persistence_threshold,
            **offload,
        },
        "bf16": {"enabled": spec.precision == "bf16-mixed"},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
    return _DeepSpeedSystem(engine)


def _elements(size: int | str, model: GPT) -> int:
    """A ZeroConfig bucket size in elements for DeepSpeed: "units" is the largest transformer block."""
    return max(sum(p.numel() for p in block.parameters()) for block in model.blocks) if size == "units" else int(size)


class _OurSystem(BuiltSystem):
    def __init__(self, engine, model: GPT, precision: str, recipe: Recipe):
        self.engine, self.model, self.precision, self.recipe = engine, model, precision, recipe

    def forward_backward(self, inputs, targets):
        with _our_autocast(self.precision):
            _, loss = self.model(inputs, targets)
        self.engine.backward(loss)
        return loss.detach().float()

    def optimizer_step(self):
        self.engine.clip_grad_norm_(self.recipe.clip)
        self.engine.step()

    def finish(self):
        self.engine.wait_for_params()

    def blocks(self):
        return list(self.model.blocks)

    def state_bytes(self):
        """``memory_report()`` per kind in memory (device + host); what sits on NVMe under ``"nvme"``."""
        report = self.engine.memory_report()
        out = {kind: places["device"] + places["host"] for kind, places in report.items()}
        return {**out, "nvme": sum(places["nvme"] for places in report.values())}

    def own_comm_bytes(self):
        """The engine's byte counts over all its process groups, the per-step sequence check's included (which
        ``comm_stats()`` leaves out of its sum), so they can be compared with what torch.distributed saw."""
        return int(sum(c.stats.total_bytes() for c in self._groups()))

    def reset_own_comm(self):
        for collectives in self._groups():
            collectives.stats.reset()

    def _groups(self):
        return getattr(self.engine, "comm_groups", {"world": self.engine.collectives}).values()

    def close(self):
        self.engine.remove_hooks()


def _our_autocast(precision: str):
    try:
        from ds_strategy.precision import autocast_for
    except ImportError:
        return _autocast(precision)
    return autocast_for(precision, "cpu")


def build_ours(spec: SystemSpec, recipe: Recipe) -> BuiltSystem:
    from ds_strategy.config import ZeroConfig
    from ds_strategy.offload import step_runner_for
    from ds_strategy.zero.engine import ZeroEngine

    config = ZeroConfig(precision=spec.precision, **spec.options)
    model, make_optimizer = _model_and_optimizer(recipe)
    engine = ZeroEngine(model, make_optimizer(model), config, step_runner=step_runner_for(config))
    if config.precision != "32-true" and all(fp.compute_dtype == torch.float32 for fp in engine.flat_params):
        engine.remove_hooks()
        raise NotImplementedError(
            f"ZeroEngine ignores ZeroConfig.precision={config.precision!r} here "
            f"(its flat buffers stayed fp32); mixed precision has not landed"
        )
    return _OurSystem(engine, model, config.precision, recipe)


BUILDERS = {"ddp": build_ddp, "fsdp2": build_fsdp2, "deepspeed": build_deepspeed, "ours": build_ours}


def build(spec: SystemSpec, recipe: Recipe) -> BuiltSystem:
    return BUILDERS[spec.family](spec, recipe)
