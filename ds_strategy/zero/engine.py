"""ZeroEngine: one engine for ZeRO stages 0-3, independent of any training framework."""
from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import Collectives
from ..config import ZeroConfig
from .flat_param import FlatParam, ShardPolicy
from .grad_reducer import GradReducer
from .memory_report import memory_report
from .optimizer_retarget import param_group_index, retarget_optimizer
from .unit import Unit
from .wrap_policy import select_unit_modules

log = logging.getLogger(__name__)


class ZeroEngine:
    """Shards a module's trainable parameters, gradients and optimizer state across the ranks of a process group.

    The module is cut into units (see :mod:`.wrap_policy`); each unit's trainable parameters, split by optimizer
    param group, live in :class:`FlatParam` buffers whose :class:`ShardPolicy` is derived from ``config.stage``.
    The host framework drives it with ``backward`` (or a plain ``loss.backward()``), ``clip_grad_norm_``,
    ``step`` and ``no_sync``; nothing here knows about Lightning, Fabric or Accelerate.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, config: ZeroConfig,
                 process_group=None):
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.process_group = process_group
        backend = dist.get_backend(process_group) if dist.is_initialized() else "gloo"
        self.collectives = Collectives(process_group, use_all_reduce=config.gradient_collective(backend) == "all_reduce")
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self._sync_buffers_and_params()
        self.units = self._build_units()
        self.flat_params = [fp for unit in self.units for fp in unit.flat_params]
        self.reducer = GradReducer(self.flat_params, self.collectives, overlap=config.overlap_comm,
                                   bucket_numel=int(config.reduce_bucket_size))
        self.reducer.register_hooks()
        self._unit_of_module = {id(u.module): u for u in self.units}
        self._hooks = [u.module.register_forward_pre_hook(self._before_unit_forward) for u in self.units]
        if optimizer is not None:
            retarget_optimizer(optimizer, self.flat_params)

    # -- construction -------------------------------------------------------------------------------------------
    def _build_units(self) -> list[Unit]:
        """Root first, then the unit modules in module order; a parameter shared by two units goes to the root."""
        chosen = select_unit_modules(self.module, self.config.unit_modules, self.config.unit_min_params)
        owners: dict[int, list[int]] = {}
        for i, (_, module) in enumerate(chosen):
            for p in module.parameters():
                owners.setdefault(id(p), []).append(i)
        group_of = param_group_index(self.optimizer) if self.optimizer is not None else {}
        members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(chosen) + 1)]
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            if self.optimizer is not None and id(p) not in group_of:
                raise ValueError(f"parameter {name!r} requires grad but is in no optimizer param group; "
                                 f"freeze it (requires_grad=False) or add it to the optimizer")
            where = owners.get(id(p), [])
            members[where[0] + 1 if len(where) == 1 else 0].append((name, p))
        names = [""] + [name for name, _ in chosen]
        modules = [self.module] + [module for _, module in chosen]
        return [Unit(name or "<root>", module, self._flat_params_of(name or "<root>", params, group_of),
                     self.collectives)
                for name, module, params in zip(names, modules, members)]

    def _flat_params_of(self, unit_name: str, params: list[tuple[str, nn.Parameter]],
                        group_of: dict[int, int]) -> list[FlatParam]:
        """One flat buffer per (param group, persistent?) among ``params``, in first-appearance order."""
        cfg = self.config
        threshold = int(cfg.param_persistence_threshold) if cfg.stage >= 3 else 0
        buckets: dict[tuple[int, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in params:
            key = (group_of.get(id(p), 0), p.numel() < threshold)
            buckets.setdefault(key, []).append((name, p))
        flat = []
        for (group, persistent), members in buckets.items():
            policy = ShardPolicy.for_stage(cfg.stage, persistent=persistent)
            fp = FlatParam(f"{unit_name}/group{group}{'/persistent' if persistent else ''}", members, group, policy,
                           self.rank, self.world_size, compute_dtype=members[0][1].dtype,
                           grad_dtype=members[0][1].dtype)
            fp.adopt_params()
            flat.append(fp)
        return flat

    def _sync_buffers_and_params(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                self.collectives.broadcast(tensor.data, src=0).wait()

    # -- forward ----------------------------------------------------------------------------------------------
    def _before_unit_forward(self, module: nn.Module, args) -> None:
        self._unit_of_module[id(module)].wait_gathered()

    def wait_for_params(self) -> None:
        """Block until every unit's parameters are up to date (call before reading them outside forward)."""
        for unit in self.units:
            unit.wait_gathered()

    # -- backward ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (stage 0/1); stage 2/3 still reduce every micro-batch."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    # -- optimizer step ---------------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global norm over all shards of all ranks is at most ``max_norm``.

        Returns the norm before clipping; it equals the unsharded model's gradient norm.
        """
        total = self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for fp in self.flat_params:
            self.reducer.reduced_grad(fp).mul_(coef.to(fp.grad_dtype))
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        for fp in self.flat_params:
            self.reducer.reduced_grad(fp).clamp_(-clip_value, clip_value)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        self.reducer.wait_all()
        grads = [self.reducer.reduced_grad(fp).float() for fp in self.flat_params]
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros(())
            op = dist.ReduceOp.MAX
        else:
            local = torch.stack([g.pow(norm_type).sum() for g in grads]).sum() if grads else torch.zeros(())
            op = dist.ReduceOp.SUM
        if self.config.partitions_optimizer:
            self.collectives.all_reduce(local, op=op).wait()
        return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)

    def step(self) -> None:
        """Run the optimizer on this rank's shards, then bring every rank's parameters up to date.

        Note: stage 1/2 parameter refresh. After the step each rank holds updated values only in its own shard.
        The all-gathers that fill in the rest are launched here and waited on by each unit's forward pre-hook
        (or ``wait_for_params``), so they overlap with the next forward. With ``overlap_comm=False`` they are
        waited on here.
        """
        self.reducer.wait_all()
        for fp in self.flat_params:
            fp.master.grad = self.reducer.reduced_grad(fp)
        self.optimizer.step()
        for fp in self.flat_params:
            fp.master.grad = None
            fp.copy_master_to_params()
            self.reducer.zero_grads(fp)
        for unit in self.units:
            unit.refresh([fp for fp in unit.flat_params if fp.policy.optimizer and not fp.policy.params])
        if not self.config.overlap_comm:
            self.wait_for_params()

    def zero_grad(self) -> None:
        for fp in self.flat_params:
            self.reducer.zero_grads(fp)
            for p in fp.params:
                p.grad = None

    # -- reporting --------------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int]]:
        return memory_report(self)

    def comm_stats(self) -> dict[str, dict[str, float]]:
        return self.collectives.stats.as_dict()

    def summary(self) -> str:
        report = self.memory_report()
        mib = {k: sum(v.values()) / 2**20 for k, v in report.items()}
        return (f"ZeRO stage {self.config.stage} on {self.world_size} ranks, {len(self.units)} units, "
                f"{sum(fp.numel for fp in self.flat_params):,} trainable params; per rank: "
                + ", ".join(f"{k} {v:.1f} MiB" for k, v in mib.items()))

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
