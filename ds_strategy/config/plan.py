"""ZeroPlan: every decision ZeRO derives from a ZeroConfig, made once; components and adapters ask it.

``ZeroConfig`` holds what the user chose; this holds what that means for sharding (per stage), dtypes (per
precision) and communication. ``config.plan`` is the one place these are decided: the engine, the reducer, the
precision plugins and the three adapters read it instead of re-deriving them from ``stage`` or ``precision``.

It sits beside ``ds_strategy.config``, not in ``ds_strategy.zero``, because the config builds it and the engine
reads it; and it is built from the config's policy sections, never the config itself, so it imports neither: the
config and the engine both depend on it without a circle (``tests/architecture/test_import_graph.py``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ds_strategy.config.policies import CommPolicy, OffloadPolicy, PrecisionPolicy

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # the config's short dtype names
_COMPUTE_DTYPES = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}  # by precision prefix


@dataclasses.dataclass(frozen=True)
class ShardPolicy:
    """What a flat buffer keeps partitioned across ranks (the ZeRO paper's P_os, P_g, P_p).

    ``params``: the full buffer exists only while gathered (stage 3); otherwise every rank keeps it.
    ``grads``: gradients are reduced into a 1/N shard as soon as they are produced (stage >= 2); otherwise a
    full gradient buffer accumulates locally and is reduced once per optimizer step.
    ``optimizer``: the optimizer updates only this rank's shard (stage >= 1); otherwise the whole buffer.
    """

    params: bool
    grads: bool
    optimizer: bool

    @classmethod
    def for_stage(cls, stage: int, persistent: bool = False) -> ShardPolicy:
        """Stage 3 parameters below the persistence threshold stay whole, like stage 2."""
        return cls(params=stage >= 3 and not persistent, grads=stage >= 2, optimizer=stage >= 1)


class FlatDtypes(NamedTuple):
    """The dtypes of one flat buffer: compute (parameters and autograd's gradients), master (what the
    optimizer updates) and the reduced gradient shard (where micro-batches accumulate)."""

    compute: torch.dtype
    master: torch.dtype
    grad_shard: torch.dtype


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """What a ZeroConfig means, derived once (``ZeroConfig.plan``).

    Sharding: ``sharding`` is the stage's :class:`ShardPolicy`; stage-3 parameters smaller than
    ``persistence_threshold`` get ``persistent_sharding`` (whole on every rank, like stage 2).
    Precision: "-mixed" keeps an fp32 master beside 16-bit compute weights (``separate_master``); a 16-bit
    "-true" keeps only the 16-bit copy and converts the whole module and its floating inputs
    (``converts_module``); "32-true" keeps the module's own dtype with an fp32 master. Every 16-bit precision
    runs forward in autocast (``autocasts``); fp16 scales the loss (``loss_scaling``).
    Communication: gradients travel in ``comm_dtype`` (fp32 for fp32 and fp16 training, whose sums would
    overflow fp16; bf16 for bf16) unless ``communication_dtype`` says otherwise; ``gradient_collective`` picks
    the reduction per backend.
    """

    stage: int
    sharding: ShardPolicy
    persistent_sharding: ShardPolicy
    persistence_threshold: int | str  # stays "auto" until ZeroConfig.resolve_auto
    precision: str
    compute_dtype: torch.dtype
    keeps_module_dtype: bool
    separate_master: bool
    converts_module: bool
    loss_scaling: bool
    comm_dtype: torch.dtype
    grad_accum_dtype: torch.dtype | None  # None: the compute dtype
    gradient_reduction: str
    offloads_optimizer: bool
    offloads_params: bool

    @classmethod
    def of(
        cls,
        stage: int,
        persistence_threshold: int | str,
        precision_policy: PrecisionPolicy,
        comm_policy: CommPolicy,
        offload_policy: OffloadPolicy,
    ) -> ZeroPlan:
        """The plan of a validated ZeroConfig's ``stage``, ``param_persistence_threshold`` and policy sections."""
        precision = precision_policy.precision
        compute = _COMPUTE_DTYPES[precision.split("-")[0]]
        if precision_policy.communication_dtype is not None:
            comm = DTYPES[precision_policy.communication_dtype]
        else:
            comm = torch.bfloat16 if precision.startswith("bf16") else torch.float32
        accumulation = precision_policy.grad_accum_dtype
        return cls(
            stage=stage,
            sharding=ShardPolicy.for_stage(stage),
            persistent_sharding=ShardPolicy.for_stage(stage, persistent=True),
            persistence_threshold=persistence_threshold if stage >= 3 else 0,
            precision=precision,
            compute_dtype=compute,
            keeps_module_dtype=precision == "32-true",
            separate_master=precision.endswith("-mixed"),
            converts_module=precision.endswith("-true") and compute != torch.float32,
            loss_scaling=precision.startswith("16-"),
            comm_dtype=comm,
            grad_accum_dtype=DTYPES[accumulation] if accumulation is not None else None,
            gradient_reduction=comm_policy.gradient_reduction,
            offloads_optimizer=offload_policy.offload_optimizer != "none",
            offloads_params=offload_policy.offload_params != "none",
        )

    # -- sharding -----------------------------------------------------------------------------------------------
    @property
    def partitions_optimizer(self) -> bool:
        """Each rank holds optimizer state (and fp32 master weights) for its shard only (stage >= 1)."""
        return self.sharding.optimizer

    @property
    def partitions_gradients(self) -> bool:
        """Each rank keeps only its shard of the reduced gradients (stage >= 2)."""
        return self.sharding.grads

    @property
    def partitions_parameters(self) -> bool:
        """Each rank holds only its parameter shard between uses (stage >= 3)."""
        return self.sharding.params

    def is_persistent(self, numel: int) -> bool:
        return self.stage >= 3 and numel < int(self.persistence_threshold)

    @property
    def offloads(self) -> bool:
        """Some model state lives off the device: ``offload_optimizer`` or ``offload_params`` is set."""
        return self.offloads_optimizer or self.offloads_params

    # -- dtypes -------------------------------------------------------------------------------------------------
    @property
    def autocasts(self) -> bool:
        """Forward runs in ``torch.autocast`` to the 16-bit compute dtype."""
        return self.compute_dtype != torch.float32

    @property
    def accumulation_dtype(self) -> torch.dtype:
        """Dtype of the reduced gradient shard, for a compute dtype of ``compute_dtype``."""
        return self.grad_accum_dtype or self.compute_dtype

    def dtypes(self, param_dtype: torch.dtype) -> FlatDtypes:
        """The dtypes of a flat buffer whose parameters are ``param_dtype``.

        Note: [What each precision keeps]
        One rule for every entry point (Lightning's and Fabric's ``precision``, Accelerate's ``mixed_precision``
        "bf16"/"fp16" = "bf16-mixed"/"16-mixed", the Hugging Face Trainer's ``bf16``/``fp16`` = the same, a DeepSpeed
        JSON's ``bf16``/``fp16`` sections = the same). With Adam, bytes per parameter before sharding:

        ================  ======================  ==================  ==================  =====================
        precision         module's parameters     master              Adam states         bytes (params+grads+
                          (compute weights)                                               master+states)
        ================  ======================  ==================  ==================  =====================
        "32-true"         as given (fp32)         the parameters      fp32                4 + 4 + 0 + 8 = 16
        "bf16-mixed"      bf16 copies             fp32, separate      fp32                2 + 2 + 4 + 8 = 16
        "16-mixed"        fp16 copies             fp32, separate      fp32                2 + 2 + 4 + 8 = 16
        "bf16-true"       bf16 (module converted) the parameters      bf16                2 + 2 + 0 + 4 = 8
        ================  ======================  ==================  ==================  =====================

        Stage 1 shards master and states (2 + 2 + 12/N under "-mixed"), stage 2 also gradients, stage 3 all.
        "-true" and "32-true" match their host frameworks: the module trains in that dtype, as under DDP.
        "-mixed" follows DeepSpeed's bf16/fp16 mode rather than torch AMP's (fp32 weights, 16-bit only inside
        autocast): the module's parameters are 16-bit compute copies during training, rounded from the fp32
        masters after every step, as FSDP's ``MixedPrecisionPolicy(param_dtype=bf16)`` (what Lightning's FSDP
        "bf16-mixed" uses) gathers them and Lightning's DeepSpeed strategy keeps them. That halves what stays whole
        on every rank (2 bytes a parameter instead of 4 at stages 1-2: at stage 1 on N ranks 4 + 12/N instead of
        8 + 8/N) and the bytes every stage-3 gather moves. The price is that the module's own parameters are not
        the weights that train, so nothing that hands weights out reads them: exports read the masters (Note:
        [What an export returns] in ``ds_strategy.zero.full_state_dict``), and the masters start from the model's
        own values (Note: [Masters start from the model's own values] in ``ds_strategy.zero.flat_param``).
        "32-true" over a 16-bit module keeps an fp32 master too.
        """
        compute = param_dtype if self.keeps_module_dtype else self.compute_dtype
        master = torch.float32 if self.separate_master or self.keeps_module_dtype else compute
        return FlatDtypes(compute, master, self.grad_accum_dtype or compute)

    # -- communication ------------------------------------------------------------------------------------------
    def gradient_collective(self, backend: str) -> str:
        """``gradient_reduction`` with auto resolved for a process-group backend: all_reduce on gloo
        (measured faster there than its reduce_scatter), reduce_scatter elsewhere."""
        if self.gradient_reduction != "auto":
            return self.gradient_reduction
        return "all_reduce" if backend == "gloo" else "reduce_scatter"
