"""OffloadedStep: the engine's step runner (``ds_strategy.zero.step_runner``) when something lives off the device.

Built from a :class:`~ds_strategy.zero.step_runner.StepContext` (flat parameters, optimizers, offload policy,
device, rank) and nothing else of the engine. It places parameter shards (:class:`ParamOffload`) and optimizer work
(a :class:`HostOptimizer` per optimizer) on the host or in NVMe files, which share one run directory, and then
answers the engine's five calls: ``on_reduced`` (start a stage-1 gradient's copy to the host), ``step`` (the host
step, the user's ``optimizer.step()`` for what stayed on the device, and the write-back), ``places`` / ``own_tensors`` /
``describe`` (reports) and ``close`` (teardown: threads stopped, NVMe files removed, pinned memory released); its
``gradients`` sum stage 2/3 gradients in host buffers (:mod:`.host_gradients`).

Note: [What NVMe offload keeps in memory]
With stage 3, parameters and optimizer on NVMe, the files hold everything that grows with the model: per rank
Ψ/N parameters in the compute dtype (c bytes), the fp32 master, k optimizer states (Adam: 2) and the reduced
gradient shard, c + 4(1 + k) + g bytes per parameter / N. On a CPU device the gradient shard is accumulated in
place through its file's shared map (file-backed pages the kernel writes back, unmapped after each step, never
anonymous memory); on an accelerator it is copied to the file's map once reduced. What stays in anonymous memory
per rank is the working set, bounded by units (Note: [The bound the peak is held to] in
``ds_strategy.zero.memory_report``): gathered units, root + 2U elements x c; gradient scratch and reduce-scatter
outputs, up to 2U x g + 2U/N x g; the NVMe swap buffers, ``buffer_count`` x S x (4(1 + k) + c) with S the
sub-group size (at most ``buffer_size``); plus parameters below ``param_persistence_threshold``, activations and
a fixed baseline (interpreter, libraries, threads). U is the largest unit's element count, so at fixed width the
peak does not grow with depth: at width 2048 in fp32 (U = 50M, S = 4M) that is 0.4 + 0.4 + 0.27 GB over a ~0.3 GB
baseline, and ``benchmarks/scale.py`` measured 1.37 GiB per rank at 204M parameters and 1.41 GiB at 1.01B;
``tests/offload/test_nvme_flat.py`` holds it to <= 0.25 bytes per added parameter per rank,
which needs glibc to return freed unit buffers (Note: [Large host blocks are mapped and unmapped] in
``ds_strategy.offload.host_memory``): :meth:`OffloadedStep.shard_store`, the first thing an offloading engine calls,
sets that up.
"""

from __future__ import annotations

import torch

from ..config.policies import OffloadPolicy
from ..profiler_ranges import profiler_range
from ..zero.flat_param import FlatParam
from ..zero.memory_report import PLACES
from ..zero.step_runner import DeviceGradients, GradientStore, StepContext, step_on_device
from .host_memory import map_large_blocks
from .host_optimizer import HostOptimizer
from .nvme_swapper import RunDirectory
from .param_offload import ParamOffload, ShardFiles
from .pinned import PinnedHostMemory, pinned_memory_for
from .transfers import Transfers, transfers_for


class _ProfiledGradients:
    """A :class:`~ds_strategy.zero.step_runner.GradientStore` whose adds (a reduced gradient on its way to the host
    step) show in a profile as ``offload.grad_to_host``."""

    def __init__(self, store: GradientStore):
        self._store = store

    def add(self, fp: FlatParam, reduced: torch.Tensor, scale: float) -> None:
        with profiler_range("offload.grad_to_host", fp.name):
            self._store.add(fp, reduced, scale)

    def read(self, fp: FlatParam) -> torch.Tensor:
        return self._store.read(fp)

    def zero(self, fp: FlatParam) -> None:
        self._store.zero(fp)


class OffloadedStep:
    """Parameter shards and optimizer work placed off the device, and the NVMe directory they share."""

    @staticmethod
    def shard_store(offload: OffloadPolicy, rank: int) -> ShardFiles | None:
        """Stage-3 NVMe parameter shards go to files as the engine cuts them (see :class:`ShardFiles`; ZeroConfig
        allows ``offload_params`` at stage 3 only). Called before any unit is built, so large host blocks are
        returned on free from then on (see [What NVMe offload keeps in memory])."""
        map_large_blocks()
        if offload.offload_params == "nvme":
            return ShardFiles(offload.nvme_path, rank)
        return None

    def __init__(
        self, context: StepContext, transfers: Transfers | None = None, pinned: PinnedHostMemory | None = None
    ):
        """``transfers`` and ``pinned``: the device's copies and pinned host buffers, by default those of
        ``context.device`` (none on a CPU device) and of ``pin_memory``; tests pass fakes."""
        offload = self.offload = context.offload
        self.flat_params = context.flat_params
        transfers = transfers or transfers_for(context.device)
        self.pinned = pinned or pinned_memory_for(context.device, offload.pin_memory)
        hosted = range(len(context.optimizers)) if offload.offload_optimizer != "none" else range(0)
        nvme_bytes = ParamOffload.nvme_bytes(context.flat_params) if offload.offload_params == "nvme" else 0
        if offload.offload_optimizer == "nvme":
            nvme_bytes += sum(HostOptimizer.nvme_bytes(context, index) for index in hosted)
        shard_files = context.shard_store
        if isinstance(shard_files, ShardFiles) and shard_files.directory is not None:
            self.directory = shard_files.directory
            self.directory.require(context.rank, nvme_bytes - shard_files.nbytes())
        else:
            self.directory = RunDirectory.create(offload.nvme_path, context.rank, nvme_bytes) if nvme_bytes else None
        self.params: ParamOffload | None = None
        self.optimizers = context.optimizers
        self.hosts: list[HostOptimizer] = []  # one per optimizer, when the optimizer is offloaded
        self._closed = False
        gradients: GradientStore = DeviceGradients()  # each host optimizer's store passes the others' on
        try:
            if offload.offload_params != "none":
                self.params = ParamOffload(context, offload.offload_params, self.directory, self.pinned, transfers)
            for index in hosted:
                host = HostOptimizer(context, index, self.directory, self.params, self.pinned, transfers, gradients)
                self.hosts.append(host)
                gradients = host.gradients
        except BaseException:
            self.close()
            raise
        self.gradients = _ProfiledGradients(gradients)

    def on_reduced(self, fp: FlatParam, grad: torch.Tensor) -> None:
        with profiler_range("offload.grad_to_host", fp.name):
            if self.hosts:
                self.hosts[fp.optimizer_index].on_reduced(fp, grad)

    def step(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[FlatParam, torch.Tensor]]) -> None:
        """The host (or NVMe) step of ``optimizer``'s offloaded flat parameters, its ``step()`` for the rest (and
        for whole-tensor ones on their host masters), and every updated parameter written back where the forward
        pass reads it."""
        with profiler_range("offload.step"):
            if self.params is not None:  # the host is about to rewrite parameter shards
                self.params.wait_device_reads()
            stepped: set[int] = set()
            if self.hosts:
                host = self.hosts[next(i for i, held in enumerate(self.optimizers) if held is optimizer)]
                pairs = [(fp, host.host_grad(fp, grad)) for fp, grad in pairs]
                stepped = host.step(pairs)
            step_on_device(optimizer, [pair for pair in pairs if pair[0].index not in stepped], self._write_params)
            self.trim()

    def _write_params(self, fp: FlatParam) -> None:
        with profiler_range("offload.params_to_device", fp.name):
            file = self.params.file_of(fp) if self.params is not None else None
            if file is not None:
                file.write_converted(fp.master)
            else:
                fp.copy_master_to_params()

    def trim(self) -> None:
        """Drop pages of the NVMe files' memory maps that a checkpoint or gather touched from resident memory."""
        if self.params is not None:
            self.params.trim()
        for host in self.hosts:
            host.trim()

    # -- reporting ------------------------------------------------------------------------------------------------
    def places(self) -> dict[int, str]:
        placed = {}
        if self.params is not None:
            placed.update({file.view.untyped_storage().data_ptr(): "nvme" for file in self.params.files.values()})
            placed.update({t.untyped_storage().data_ptr(): "host" for t in self.params.host_tensors()})
        for host in self.hosts:
            placed.update(host.places())
        return placed

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [owned for host in self.hosts for owned in host.own_tensors()]

    def describe(self, report: dict[str, dict[str, int]]) -> str:
        """Where everything lives, for the setup log line."""
        offload, parts = self.offload, []
        if self.hosts:
            offloaded = sum(len(host.flat_params) for host in self.hosts)
            kernels = ", ".join(host.kernel_name for host in self.hosts)
            parts.append(
                f"optimizer state of {offloaded}/{len(self.flat_params)} flat buffers on "
                f"{offload.offload_optimizer} ({kernels})"
            )
        if self.params is not None:
            parts.append(f"parameter shards on {offload.offload_params}")
        if self.directory is not None:
            parts.append(f"files in {self.directory.path}")
        totals = {place: sum(by_place[place] for by_place in report.values()) / 2**20 for place in PLACES}
        return "offload: " + ", ".join(parts) + "; " + ", ".join(f"{p} {mib:.1f} MiB" for p, mib in totals.items())

    def close(self) -> None:
        """Release threads and files and remove this rank's NVMe directory (teardown; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            host.close()
        if self.params is not None:
            self.params.close()
        if self.directory is not None:
            self.directory.close()
        if self.pinned is not None:
            self.pinned.release()
