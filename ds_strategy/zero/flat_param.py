"""One flat buffer holding the parameters of one unit and one optimizer param group, and its shards.

A :class:`FlatParam` is the engine's atom: the parameters of a unit that share an optimizer param group are laid
end to end in one 1-D buffer, padded so that every rank owns an equal contiguous shard. The module's parameters
become views into the full buffer; the optimizer sees only this rank's shard. Which of the three states (full
parameters, gradients, optimizer state) are partitioned is a :class:`ShardPolicy`, so stages 0-3 are one code path.
The parameters of a whole-tensor optimizer are laid out owner by owner instead, each rank's region holding the
whole parameters it owns (Note: [Whole parameters on owner ranks] in :mod:`.owner_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config.plan import FlatDtypes, ShardPolicy
from ..parallel.dtensor_params import TensorParallelSpec, local_tensor, point_param_at, spec_of
from .owner_layout import owned_elements
from .param_types import parameter_like

__all__ = ["FlatParam", "ParamSlot", "ShardPolicy"]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside the unpadded flat layout. ``shape`` and ``numel`` are those of what the
    buffer holds: a tensor-parallel parameter's local shard, whose global view ``tp`` describes (else None).
    ``dtype`` is the dtype the parameter had when the engine took it, which exports return it in (Note: [What an
    export returns] in :mod:`.full_state_dict`); the buffer holds it in the compute dtype."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    dtype: torch.dtype
    tp: TensorParallelSpec | None = None

    @property
    def tp_sharded(self) -> bool:
        """Whether tensor-parallel ranks hold different parts of this parameter (else each holds all of it)."""
        return self.tp is not None and not self.tp.replicated


class FlatParam:
    """The parameters of one (unit, param group) pair as one padded flat buffer plus this rank's shard.

    Tensors it owns:
      ``full``: the whole padded buffer in the compute dtype; module parameters are views of it. Freed (storage
        resized to 0) while sharded under stage 3.
      ``shard``: this rank's slice of the parameters. A view of ``full`` unless parameters are partitioned.
      ``master``: what the optimizer updates, in ``master_dtype``: this rank's shard (or the whole buffer at stage
        0). It is ``shard`` itself when the two dtypes agree (fp32 training, or a "-true" 16-bit precision), else
        a separate copy (mixed precision: fp32 master beside 16-bit compute weights, refreshed into them after
        each step by ``copy_master_to_params``).
      ``grad_full`` / ``grad_shard``: gradient accumulation, see :class:`~ds_strategy.zero.grad_reducer.GradReducer`.
        ``grad_full`` holds autograd's gradients in ``grad_dtype`` (the compute dtype); ``grad_shard``, the
        reduced gradient the optimizer reads, is in ``master_dtype``.
    """

    def __init__(
        self,
        index: int,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        group_index: int,
        policy: ShardPolicy,
        rank: int,
        world_size: int,
        dtypes: FlatDtypes,
        device: torch.device,
        shard_store: Callable[[FlatParam, torch.Tensor], torch.Tensor] | None = None,
        norm_share: float = 1.0,
        whole: bool = False,
        owners: list[int] | None = None,
        optimizer_index: int = 0,
    ):
        """``group_index``: the param group, of optimizer ``optimizer_index``, that holds ``params``. ``whole``:
        the optimizer steps each parameter whole (views shaped like them), not the flat shard. ``owners``: the
        owner rank of each of ``params`` (a whole-tensor optimizer's, partitioned): the buffer is laid out owner
        by owner and each rank's region is what it owns; None: equal padded shards."""
        if owners is not None:
            order = sorted(range(len(params)), key=lambda i: owners[i])
            params, owners = [params[i] for i in order], [owners[i] for i in order]
        self.index = index  # position in the engine's flat_params: the key of per-buffer state elsewhere
        self.name = name
        self.shard_store = shard_store  # (fp, values) -> where a partitioned shard lives; None: a clone in memory
        self.norm_share = norm_share  # the share of the global gradient norm its gradients carry (0: counted elsewhere)
        self.params = [p for _, p in params]
        self.group_index = group_index
        self.optimizer_index = optimizer_index
        self.policy = policy
        self.rank = rank
        self.world_size = world_size
        self.compute_dtype = dtypes.compute
        self.grad_dtype = dtypes.compute
        self.master_dtype = dtypes.master
        self.grad_shard_dtype = dtypes.grad_shard
        self.slots: list[ParamSlot] = []
        offset = 0
        for pname, p in params:
            local = local_tensor(p)
            self.slots.append(ParamSlot(pname, local.shape, offset, local.numel(), local.dtype, spec_of(p)))
            offset += local.numel()
        self.numel = offset
        self.whole = whole
        # (offset, length) of every rank's region when they differ (owner layout), else None: equal shards
        self.regions: tuple[tuple[int, int], ...] | None = None
        if owners is None:
            self.shard_numel = max(1, math.ceil(offset / world_size))
            self.padded_numel = self.shard_numel * world_size
            self.shard_offset = rank * self.shard_numel
        else:
            self.regions = _owner_regions([slot.numel for slot in self.slots], owners, world_size)
            self.shard_offset, self.shard_numel = self.regions[rank]
            self.padded_numel = offset
        self.device = device
        self.full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
        self.is_full_allocated = False
        self.free_full()  # storage comes one unit at a time, when the unit is adopted (see zero.placement)
        self.shard: torch.Tensor
        self.master: torch.Tensor
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._shard_source: Callable[[], torch.Tensor] | None = None  # see relocate_shard
        self._optimizer_params: list[torch.Tensor] | None = None  # see optimizer_params

    # -- construction -----------------------------------------------------------------------------------------
    def adopt_params(self) -> torch.Tensor:
        """Note: [Masters start from the model's own values]
        Lay the parameters' current values out flat (zero padding, which stays zero for ever) and make the
        parameters views of ``full``. Returns the buffer holding the values, for the broadcast of rank 0's and
        :meth:`finish_sharding`: ``full`` itself, or, when the master is kept in a wider dtype than the compute
        copy ("-mixed": an fp32 master beside bf16 or fp16 weights), a buffer in the master's dtype, from which
        ``finish_sharding`` rounds ``full`` and cuts the master. Rounding the model's fp32 weights into the 16-bit
        ``full`` first and widening them back would start the masters a rounding away from the weights the user
        gave (up to half a bf16 ulp, 2**-9 relative), which DDP under autocast keeps exactly. Cost: one unit in
        the master's dtype for the duration, and twice the broadcast bytes, at construction only. A model built on
        the meta device is initialised in the compute dtype (its initialisers write the 16-bit ``full``), as
        DeepSpeed's ``zero.Init`` initialises in its dtype; weights loaded afterwards (``load_pretrained``, a
        checkpoint) are written to the masters whole."""
        self.alloc_full()
        staged = self.master_dtype != self.compute_dtype
        values = torch.empty(self.padded_numel, dtype=self.master_dtype, device=self.device) if staged else self.full
        with torch.no_grad():
            values.zero_()
            for slot, p in zip(self.slots, self.params):
                values.narrow(0, slot.offset, slot.numel).copy_(local_tensor(p).reshape(-1))
        self.point_params_at_full()
        return values

    def held_values(self) -> torch.Tensor:
        """What ``full`` holds after :meth:`adopt_meta_params` (zeros, and the values of parameters that had some),
        as :meth:`adopt_params` returns values: ``full``, or a copy in the master's dtype under mixed precision."""
        return self.full if self.master_dtype == self.compute_dtype else self.full.to(self.master_dtype)

    def adopt_meta_params(self) -> None:
        """Give parameters built on the meta device real (uninitialised) storage: views of ``full``; a parameter
        that has values (built before the rest, Note: [Values built before the meta build]) brings them.

        ``swap_tensors`` keeps each Parameter object, so optimizers and tied modules still refer to it, and its type
        and attributes (Note: [Parameter types the engine shards]).
        """
        self.alloc_full()
        self.full.zero_()
        for slot, p, view in zip(self.slots, self.params, self.param_views()):
            if not p.is_meta:
                with torch.no_grad():
                    view.copy_(local_tensor(p).reshape(view.shape))
                point_param_at(p, view)
            elif slot.tp is not None:
                torch.utils.swap_tensors(p, slot.tp.wrap(view, p.requires_grad))
            else:
                torch.utils.swap_tensors(p, parameter_like(p, torch.empty(0, dtype=view.dtype, device=view.device)))
                p.data = view

    def finish_sharding(self, values: torch.Tensor | None = None) -> None:
        """Cut this rank's shard out of ``full`` and set up the optimizer's master; free ``full`` at stage 3.

        ``values``: what :meth:`adopt_params` returned (holding rank 0's values by now), when it is not ``full``:
        ``full`` is rounded from it and the master cut from it (Note: [Masters start from the model's own
        values])."""
        exact = values is not None and values is not self.full
        if exact:
            with torch.no_grad():
                self.full.copy_(values)
        self.shard = self.full.narrow(0, self.shard_offset, self.shard_numel)
        if self.policy.params:
            self.shard = self.shard.clone() if self.shard_store is None else self.shard_store(self, self.shard)
        self.master = self._make_master(values if exact else None)
        if self.policy.params:
            self.point_params_at_empty()
            self.free_full()

    def allocate_grads(self, comm_dtype: torch.dtype, all_reduce: bool) -> None:
        """The gradient buffers the reducer accumulates into (see Note: [Accumulation and reduction] in
        :mod:`.grad_reducer`): ``grad_full`` unless gradients are partitioned, and a stage-1 ``grad_shard`` that
        is a view of it when an all-reduce in one dtype leaves the mean there. Partitioned gradients get their
        shard at the first reduction (``reduced_grad_shard``), so building a model holds only parameter shards."""
        if not self.policy.grads:
            self.grad_full = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.device)
        if self.policy.optimizer and not self.policy.grads:
            if all_reduce and self.grad_dtype == self.grad_shard_dtype == comm_dtype:
                self.grad_shard = self.grad_full.narrow(0, self.shard_offset, self.shard_numel)
            else:
                self.grad_shard = torch.zeros(self.shard_numel, dtype=self.grad_shard_dtype, device=self.device)

    def reduced_grad_shard(self) -> torch.Tensor:
        """``grad_shard``, allocated (zeroed) at its first use."""
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.shard_numel, dtype=self.grad_shard_dtype, device=self.device)
        return self.grad_shard

    # -- offload: where the shard, master and gradient shard live ------------------------------------------------
    def relocate_shard(self, shard: torch.Tensor, device_copy: Callable[[], torch.Tensor] | None = None) -> None:
        """The parameter shard now lives in ``shard`` (host memory, or an NVMe file's map); ``device_copy``, when
        given, returns the copy on the device that a gather sends. ``master``, if it was the old shard, stays."""
        self.shard, self._shard_source = shard, device_copy

    def relocate_master(self, master: torch.Tensor) -> None:
        """The optimizer's master now lives in ``master`` (host memory, or an NVMe file's map)."""
        self.master = master
        self._optimizer_params = None

    def relocate_grad_shard(self, grad_shard: torch.Tensor) -> None:
        """The reduced gradient shard now lives in ``grad_shard`` (an NVMe file's map, on a CPU device)."""
        self.grad_shard = grad_shard

    def _make_master(self, values: torch.Tensor | None) -> torch.Tensor:
        """The master: ``shard`` (or ``full`` at stage 0) itself when the dtypes agree, else this rank's range of
        ``values`` (in the master's dtype) or, without them, of the compute copy widened."""
        source = self.shard if self.policy.optimizer else self.full
        if source.dtype == self.master_dtype:
            return source
        if values is None:
            return source.detach().to(self.master_dtype)
        return values.narrow(0, self.shard_offset, self.shard_numel).clone() if self.policy.optimizer else values

    # -- views ------------------------------------------------------------------------------------------------
    def param_views(self) -> list[torch.Tensor]:
        return [self.full.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def gather_source(self) -> torch.Tensor:
        """What an all-gather of ``full`` sends: ``shard``, or its device copy when the shard is offloaded."""
        return self.shard if self._shard_source is None else self._shard_source()

    def point_params_at_full(self) -> None:
        for p, view in zip(self.params, self.param_views()):
            point_param_at(p, view, storage_kept=not self.policy.params)

    def point_params_at_empty(self) -> None:
        """Outside a gather a partitioned parameter is an empty tensor, never stale memory."""
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for p in self.params:
            point_param_at(p, empty)

    # -- full buffer lifetime (stage 3) -----------------------------------------------------------------------
    def alloc_full(self) -> None:
        """Give ``full`` its storage. ``full``'s storage changes only here and in :meth:`free_full`, so
        ``is_full_allocated`` is kept as a plain flag: the stage-3 working-set accounting reads it for every buffer
        after every gather, where asking the storage cost microseconds per buffer."""
        storage = self.full.untyped_storage()
        nbytes = self.padded_numel * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        self.is_full_allocated = True

    def free_full(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.is_full_allocated = False

    # -- master <-> shard ---------------------------------------------------------------------------------------
    @property
    def master_base(self) -> int:
        """Offset in the flat layout of ``master[0]``: the shard's start, or 0 where ``master`` is the whole buffer
        (the optimizer is not partitioned, stage 0)."""
        return self.shard_offset if self.policy.optimizer else 0

    def master_region(self) -> torch.Tensor:
        """The slice of ``full`` (or ``shard``) that ``master`` stands for."""
        return self.shard if self.policy.optimizer else self.full

    def copy_master_to_params(self) -> None:
        """After a step on a separate fp32 master, refresh the compute-dtype copy it stands for."""
        region = self.master_region()
        if region.data_ptr() != self.master.data_ptr():
            region.copy_(self.master)

    # -- what the optimizer steps -------------------------------------------------------------------------------
    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer holds for this buffer: ``master`` itself, or for a whole-tensor optimizer a
        view of ``master`` per whole parameter in it, shaped like the parameter. The same objects every call (the
        optimizer keys its state by them) until the master is relocated."""
        if self._optimizer_params is None:
            self._optimizer_params = self.optimizer_views(self.master)
        return self._optimizer_params

    def optimizer_views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor``, laid out like ``master`` (its gradient, a state), as the optimizer sees it: itself, or one
        view per whole parameter (see :meth:`optimizer_params`)."""
        if not self.whole:
            return [tensor]
        views = []
        for slot, start, length in self.master_slots():
            assert start == 0 and length == slot.numel, f"{self.name}: {slot.name} is not whole on this rank"
            views.append(tensor.narrow(0, slot.offset - self.master_base, slot.numel).view(slot.shape))
        return views

    # -- introspection ------------------------------------------------------------------------------------------
    def slot_pieces(self, lo: int, hi: int) -> list[tuple[ParamSlot, int, int]]:
        """(slot, start within the slot, length) for each parameter piece inside flat positions ``[lo, hi)``."""
        pieces = []
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                pieces.append((slot, start - slot.offset, end - start))
        return pieces

    def shard_slots(self) -> list[tuple[ParamSlot, int, int]]:
        """(slot, start within the slot, length) for each parameter piece inside this rank's shard."""
        return self.slot_pieces(self.shard_offset, self.shard_offset + self.shard_numel)

    def master_slots(self) -> list[tuple[ParamSlot, int, int]]:
        """(slot, start within the slot, length) for each parameter piece inside the range ``master`` covers; the
        piece is at ``slot.offset + start - master_base`` in ``master``."""
        return self.slot_pieces(self.master_base, self.master_base + self.master.numel())

    def __repr__(self) -> str:
        shards = f"{self.shard_numel}x{self.world_size}" if self.regions is None else f"owned {self.regions}"
        return f"FlatParam({self.name}, numel={self.numel}, shard={shards}, policy={self.policy})"


def _owner_regions(sizes: list[int], owners: list[int], world_size: int) -> tuple[tuple[int, int], ...]:
    """(offset, length) of each rank's region of a buffer whose parameters (of ``sizes``) are sorted by owner."""
    lengths = owned_elements(sizes, owners, world_size)
    starts = [sum(lengths[:r]) for r in range(world_size)]
    return tuple(zip(starts, lengths))
