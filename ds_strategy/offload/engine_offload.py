"""EngineOffload: what ``ZeroEngine`` delegates when ``offload_optimizer`` or ``offload_params`` is set.

The engine calls it at four points: construction (after the optimizer is retargeted), ``step`` (instead of
``optimizer.step()`` and ``copy_master_to_params``), ``memory_report``/``summary`` (where things live) and
``remove_hooks`` (teardown: NVMe files are removed). ``GradReducer.on_reduced`` and ``FlatParam.gather_source``
are its two hooks inside backward and gathers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .host_optimizer import HostOptimizer
from .nvme_swapper import RunDirectory
from .param_offload import ParamOffload

if TYPE_CHECKING:
    from ..zero.engine import ZeroEngine
    from ..zero.flat_param import FlatParam

PLACES = ("device", "host", "nvme")


class EngineOffload:
    """Parameter shards (:class:`ParamOffload`) and optimizer work (:class:`HostOptimizer`) placed off the device,
    and the NVMe directory they share."""

    def __init__(self, engine: "ZeroEngine"):
        cfg = engine.config
        self.engine = engine
        pin = cfg.pin_memory and engine.device.type == "cuda"
        has_optimizer = engine.optimizer is not None and cfg.offload_optimizer != "none"
        nvme_bytes = ParamOffload.nvme_bytes(engine) if cfg.offload_params == "nvme" else 0
        nvme_bytes += HostOptimizer.nvme_bytes(engine) if has_optimizer and cfg.offload_optimizer == "nvme" else 0
        shard_files = engine.shard_files
        if shard_files is not None and shard_files.directory is not None:
            self.directory = shard_files.directory
            self.directory.require(engine.rank, nvme_bytes - shard_files.nbytes())
        else:
            self.directory = RunDirectory.create(cfg.nvme_path, engine.rank, nvme_bytes) if nvme_bytes else None
        self.params: ParamOffload | None = None
        self.host: HostOptimizer | None = None
        self._closed = False
        try:
            if cfg.offload_params != "none":
                self.params = ParamOffload(engine, cfg.offload_params, self.directory, pin)
            if has_optimizer:
                self.host = HostOptimizer(engine, self.directory, self.params, pin)
        except BaseException:
            self.close()
            raise
        if self.host is not None:
            engine.reducer.on_reduced = self.host.on_reduced

    def step(self, grads: list[torch.Tensor]) -> None:
        """The host (or NVMe) step of the offloaded flat parameters, the user's ``optimizer.step()`` for the rest,
        and every updated parameter written back where the forward pass reads it."""
        flat_params = self.engine.flat_params
        if self.host is not None:
            grads = [self.host.host_grad(fp, grad) for fp, grad in zip(flat_params, grads)]
        stepped = self.host.step({id(fp): g for fp, g in zip(flat_params, grads)}) if self.host else set()
        rest = [(fp, grad) for fp, grad in zip(flat_params, grads) if id(fp) not in stepped]
        for fp, grad in rest:
            fp.master.grad = grad
        self.engine.optimizer.step()  # also for its hooks and LR-scheduler bookkeeping when `rest` is empty
        for fp, _ in rest:
            fp.master.grad = None
            self._write_params(fp)
        self.trim()

    def _write_params(self, fp: "FlatParam") -> None:
        file = self.params.file_of(fp) if self.params is not None else None
        if file is not None:
            file.write_converted(fp.master)
        else:
            fp.copy_master_to_params()

    def trim(self) -> None:
        """Drop pages of the NVMe files' memory maps that a checkpoint or gather touched from resident memory."""
        if self.params is not None:
            self.params.trim()
        if self.host is not None:
            self.host.trim()

    # -- reporting ------------------------------------------------------------------------------------------------
    def places(self) -> dict[int, str]:
        placed = {}
        if self.params is not None:
            placed.update({file.view.untyped_storage().data_ptr(): "nvme" for file in self.params.files.values()})
            placed.update({t.untyped_storage().data_ptr(): "host" for t in self.params.host_tensors()})
        if self.host is not None:
            placed.update(self.host.places())
        return placed

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.host.own_tensors() if self.host is not None else []

    def describe(self, report: dict[str, dict[str, int]]) -> str:
        """Where everything lives, for the setup log line."""
        cfg, parts = self.engine.config, []
        if self.host is not None:
            parts.append(f"optimizer state of {len(self.host.flat_params)}/{len(self.engine.flat_params)} flat "
                         f"buffers on {cfg.offload_optimizer} ({self.host.kernel_name})")
        if self.params is not None:
            parts.append(f"parameter shards on {cfg.offload_params}")
        if self.directory is not None:
            parts.append(f"files in {self.directory.path}")
        totals = {place: sum(by_place[place] for by_place in report.values()) / 2**20 for place in PLACES}
        return "offload: " + ", ".join(parts) + "; " + ", ".join(f"{p} {mib:.1f} MiB" for p, mib in totals.items())

    def close(self) -> None:
        """Release threads and files and remove this rank's NVMe directory (teardown; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self.host is not None:
            self.host.close()
        if self.params is not None:
            self.params.close()
        if self.directory is not None:
            self.directory.close()
