"""ZeRO-Offload's optimizer side: masters, gradient copies and optimizer state on the host (or NVMe), and the step.

Note: [The user's optimizer stays the optimizer]
Offload moves the flat ``FlatParam.master`` tensors to the host (or makes them memory maps of NVMe files) before
the engine points the user's optimizer at them (once, in place), so Lightning, LR schedulers and checkpoints keep
holding and reading that same object: its ``param_groups`` (learning rate included) are read at
every step and its ``state`` holds torch's own state layout. For Adam, AdamW, Adagrad and SGD the offloaded
masters are stepped by :mod:`.cpu_adam`'s kernels; their ``.grad`` stays None, so the ``optimizer.step()`` that
follows (for masters kept on the device, and for the optimizer's hooks and its LR scheduler's bookkeeping) skips
them. Any other optimizer is stepped by its own ``step`` on the host tensors, and so is a whole-tensor optimizer
(Muon): each rank's host step runs on the whole parameters it owns. Each of several optimizers training one model
has a host optimizer of its own, over its own flat parameters.

Note: [Gradients to the host]
On a CUDA device, at stage 2/3, every reduced gradient slice goes to the flat buffer's fp32 host buffer as soon as it
is reduced and the device keeps none (Note: [Reduced gradients leave the device] in :mod:`.host_gradients`). At
stage 1 the gradient is accumulated whole on the device (``grad_full``) and its reduced shard is copied to the host
on the side stream when the accumulation boundary's reduction finishes (the step runner's ``on_reduced``),
overlapping the rest of backward; that copy is used only if the device shard is unchanged when the step runs (its
``_version``): loss-scale unscaling or clipping, which run on the device shards, change it, and so does mixed
precision (the step reads an fp32 copy of the shard). The shard is then copied again at the step, on the side stream
too, every flat buffer's copy started at once and each waited for just before the host updates that buffer. On a CPU
device the reduced shard is already in host memory and the host step reads it in place (zero-copy).
With ``offload_optimizer="nvme"`` that host buffer (on a CPU device: the partitioned ``grad_shard`` itself) is a
shared memory map of a gradient file, as the masters and states are: reductions add into page-cache pages that
the kernel writes back and may evict, and ``trim`` after each step unmaps them, so no gradient shard stays in
anonymous memory and resident memory does not grow with the model (see
:mod:`.nvme_swapper`, [Files, page cache and the tensors others see]).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..zero.step_runner import DeviceGradients
from .cpu_adam import TilePool, UpdateRule, prepare_state, rule_for, tiled_update
from .host_gradients import HostGradients
from .nvme_swapper import NvmeSwapper, RunDirectory, SubGroup, SwapFile
from .param_offload import ParamOffload, ParamSink, host_copy

if TYPE_CHECKING:
    from ..config.policies import OffloadPolicy
    from ..zero.flat_param import FlatParam
    from ..zero.step_runner import GradientStore, StepContext
    from .pinned import PinnedHostMemory
    from .transfers import Done, Transfers

log = logging.getLogger(__name__)


def offloaded_flat_params(flat_params: list[FlatParam], ratio: float) -> list[FlatParam]:
    """The flat parameters, in engine order, whose optimizer work adds up to ``ratio`` of the total (by elements,
    whole buffers, rounded to the nearest buffer): DeepSpeed's partial offload at the granularity we shard at."""
    total = sum(fp.master.numel() for fp in flat_params)
    chosen, done = [], 0
    for fp in flat_params:
        if done + fp.master.numel() / 2 <= ratio * total:
            chosen.append(fp)
            done += fp.master.numel()
    return chosen


def _state_keys(rule: UpdateRule, optimizer: torch.optim.Optimizer, fp: FlatParam) -> tuple[str, ...]:
    return rule.keys(optimizer.param_groups[fp.group_index])


def _grad_file_numel(fp: FlatParam, copies: bool) -> int:
    """Elements of ``fp``'s NVMe gradient file (see [Gradients to the host]): its shard, when the gradients
    are partitioned on a CPU device or ``copies`` them off a device; 0 when a CPU run keeps them whole (stage 0/1)."""
    return fp.master.numel() if fp.policy.grads or copies else 0


def _grad_file_dtype(fp: FlatParam, copies: bool) -> torch.dtype:
    return fp.master_dtype if copies else fp.grad_shard_dtype


class _EarlyCopy(NamedTuple):
    """A stage-1 reduced gradient's copy to the host in flight on the side stream (see [Gradients to the host]):
    usable at the step only if ``source`` is still the step's gradient and unchanged since (its ``_version``)."""

    done: Done
    source: torch.Tensor
    version: int


def flat_params_of(context: StepContext, optimizer_index: int) -> list[FlatParam]:
    """The flat parameters optimizer ``optimizer_index`` of ``context`` steps, in engine order."""
    return [fp for fp in context.flat_params if fp.optimizer_index == optimizer_index]


class HostOptimizer:
    """Steps the offloaded share of one of the user's optimizers on the host.

    See Note: [The user's optimizer stays the optimizer].
    """

    def __init__(
        self,
        context: StepContext,
        optimizer_index: int,
        directory: RunDirectory | None,
        params: ParamOffload | None,
        pinned: PinnedHostMemory | None,
        transfers: Transfers | None,
        others: GradientStore | None = None,
    ):
        """``optimizer_index``: which of ``context.optimizers`` this steps. ``pinned``: where host buffers that are
        copied to or from the device come from (None: pageable); ``transfers``: the device's copies (None on a CPU
        device, where the host step reads gradients in place). ``others``: where the gradients of flat buffers this
        does not step are summed (another optimizer's host buffers; by default on the device)."""
        offload = self.offload = context.offload
        self.optimizer, self.pinned, self.device = context.optimizers[optimizer_index], pinned, context.device
        self.rule = rule_for(self.optimizer)
        self.flat_params = offloaded_flat_params(flat_params_of(context, optimizer_index), offload.offload_ratio)
        self.indices = {fp.index for fp in self.flat_params}
        self.transfers = transfers
        self.copies_grads = transfers is not None
        self.pool = TilePool()
        self.files: dict[int, dict[str, SwapFile]] = {}  # fp.index -> master and state files
        self.grad_files: dict[int, SwapFile] = {}
        self.swapper: NvmeSwapper | None = None
        if offload.offload_optimizer == "nvme":
            if self.rule is None:
                raise ValueError(
                    f"offload_optimizer='nvme' streams optimizer state through ds_strategy's host "
                    f"kernels, which exist for Adam, AdamW, Adagrad and SGD, not for "
                    f"{type(self.optimizer).__name__}; use offload_optimizer='cpu' for it"
                )
            self._move_masters_to_files(directory)
        else:
            for fp in self.flat_params:
                fp.relocate_master(host_copy(fp.master, None))  # read and written by the host alone: pageable
        self.sinks = {
            fp.index: ParamSink(fp, fp.master, params.file_of(fp) if params else None) for fp in self.flat_params
        }
        if self.files:
            self.swapper = self._make_swapper(offload)
        self._host_grads: dict[int, torch.Tensor] = {}
        self._early_copies: dict[int, _EarlyCopy] = {}
        self._arriving: dict[int, Done] = {}  # fp.index -> the step's gradient copy to the host (see host_grad)
        self._staging: torch.Tensor | None = None
        self.gradients: GradientStore = others or DeviceGradients()
        if transfers is not None:  # Note: [Reduced gradients leave the device]
            held = {fp.index for fp in self.flat_params if fp.policy.grads}
            self.gradients = HostGradients(held, self._host_grad, transfers, self.gradients)
        if self.rule is None and context.rank == 0:
            log.warning(
                "offload_optimizer: no host kernel for %s; its own step() runs on the host tensors",
                type(self.optimizer).__name__,
            )

    @property
    def kernel_name(self) -> str:
        return f"CpuAdam {self.rule.name} kernels" if self.rule else f"torch {type(self.optimizer).__name__}"

    # -- NVMe ---------------------------------------------------------------------------------------------------
    @staticmethod
    def nvme_bytes(context: StepContext, optimizer_index: int) -> int:
        """Bytes of the master and state files this rank's NVMe offload of that optimizer will create."""
        optimizer, copies = context.optimizers[optimizer_index], context.device.type != "cpu"
        rule = rule_for(optimizer)
        if rule is None:
            return 0
        return sum(
            fp.master.numel() * fp.master.element_size() * (1 + len(_state_keys(rule, optimizer, fp)))
            + _grad_file_numel(fp, copies) * torch.empty((), dtype=_grad_file_dtype(fp, copies)).element_size()
            for fp in offloaded_flat_params(flat_params_of(context, optimizer_index), context.offload.offload_ratio)
        )

    def _move_masters_to_files(self, directory: RunDirectory) -> None:
        for fp in self.flat_params:
            index = fp.index  # file names unique across the optimizers' host optimizers
            dtype, numel = fp.master.dtype, fp.master.numel()
            files = {"master": directory.new_file(f"flat{index}.master", numel, dtype)}
            for key in _state_keys(self.rule, self.optimizer, fp):
                files[key] = directory.new_file(f"flat{index}.{key}", numel, dtype)
            files["master"].write_converted(fp.master)
            fp.relocate_master(files["master"].view)
            self.files[fp.index] = files
            if _grad_file_numel(fp, self.copies_grads):
                grad_file = self.grad_files[fp.index] = directory.new_file(
                    f"flat{index}.grad", numel, _grad_file_dtype(fp, self.copies_grads)
                )
                if not self.copies_grads:
                    if fp.grad_shard is not None:
                        grad_file.write_converted(fp.grad_shard)
                    fp.relocate_grad_shard(grad_file.view)

    def _make_swapper(self, offload: OffloadPolicy) -> NvmeSwapper:
        keys = tuple(dict.fromkeys(k for files in self.files.values() for k in files if k != "master"))
        master_dtypes = {fp.master.dtype for fp in self.flat_params}
        staging_dtypes = {sink.dtype for sink in self.sinks.values() if sink.needs_staging}
        if len(master_dtypes) > 1 or len(staging_dtypes) > 1:
            raise NotImplementedError(
                f"NVMe offload needs one master dtype and one parameter dtype across flat "
                f"buffers, got {master_dtypes} and {staging_dtypes}"
            )
        largest = max(fp.master.numel() for fp in self.flat_params)
        numel = NvmeSwapper.sub_group_numel_for(largest, offload.sub_group_size, offload.buffer_size)
        return NvmeSwapper(
            self.rule,
            keys,
            numel,
            offload.buffer_count,
            master_dtypes.pop(),
            staging_dtypes.pop() if staging_dtypes else None,
            self.pool,
            self.pinned,
        )

    def _adopt_loaded_state(self, fp: FlatParam, state: dict) -> None:
        """``optimizer.load_state_dict`` (a checkpoint restore) replaces state tensors with in-memory ones: write
        them to the files and put the files' maps back in their place."""
        for key, file in self.files[fp.index].items():
            value = state.get(key)
            if key != "master" and torch.is_tensor(value) and value is not file.view:
                file.write_converted(value)
                state[key] = file.view

    def _sub_groups(self, fp: FlatParam, group: dict, state: dict, grad: torch.Tensor) -> list[SubGroup]:
        files = self.files[fp.index]
        self._adopt_loaded_state(fp, state)
        first = prepare_state(self.rule, self.optimizer, group, state, lambda key, fill: files[key].view)
        keys, hyper = self.rule.keys(group), self.rule.hyper(group, self.optimizer)
        initial = {key: self.rule.initial(key, self.optimizer) for key in keys}
        size, numel = self.swapper.sub_group_numel, fp.master.numel()
        return [
            SubGroup(
                files,
                keys,
                lo,
                min(numel, lo + size),
                grad,
                hyper,
                state.get("step"),
                first,
                initial,
                self.sinks[fp.index],
            )
            for lo in range(0, numel, size)
        ]

    # -- gradients ----------------------------------------------------------------------------------------------
    def _host_grad(self, fp: FlatParam) -> torch.Tensor:
        if fp.index in self.grad_files:
            return self.grad_files[fp.index].view
        if fp.index not in self._host_grads:
            self._host_grads[fp.index] = self._host_empty(fp.master.numel(), fp.master_dtype)
        return self._host_grads[fp.index]

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the device copies to or from: pinned when the budget allows (Note: [Pinned host memory
        is bounded] in :mod:`.pinned`)."""
        return self.pinned.empty(numel, dtype) if self.pinned is not None else torch.empty(numel, dtype=dtype)

    def on_reduced(self, fp: FlatParam, source: torch.Tensor) -> None:
        """Start copying ``source``, ``fp``'s reduced stage-1 gradient shard, to the host (see [Gradients to the
        host])."""
        if not self.copies_grads or fp.index not in self.indices or source.dtype != fp.master_dtype:
            return
        host = self._host_grad(fp)
        done = self.transfers.on_side_stream(lambda: host.copy_(source, non_blocking=host.is_pinned()), source)
        self._early_copies[fp.index] = _EarlyCopy(done, source, source._version)

    def host_grad(self, fp: FlatParam, grad: torch.Tensor) -> torch.Tensor:
        """The host buffer the host step reads for ``fp``, its copy of ``grad`` started on the side stream (or the
        early copy, when still valid): :meth:`step` waits for each one just before updating its flat buffer, so the
        copies overlap the host's work. ``grad`` itself when it is not offloaded from a device, or when it is the
        host buffer the reductions were summed into."""
        if not self.copies_grads or fp.index not in self.indices or grad is self._host_grad(fp):
            return grad
        early = self._early_copies.pop(fp.index, None)
        host = self._host_grad(fp)
        if early is not None and early.source is grad and early.version == grad._version:
            self._arriving[fp.index] = early.done
        else:  # ordered after an early copy still writing ``host``: the same side stream
            copy = lambda: host.copy_(grad, non_blocking=host.is_pinned())  # noqa: E731
            self._arriving[fp.index] = self.transfers.on_side_stream(copy, grad)
        return host

    def _arrived(self, fp: FlatParam) -> None:
        done = self._arriving.pop(fp.index, None)
        if done is not None:
            done.synchronize()

    # -- step ---------------------------------------------------------------------------------------------------
    def step(self, pairs: list[tuple[FlatParam, torch.Tensor]]) -> set[int]:
        """Step the offloaded elementwise flat parameters among ``pairs`` (flat parameter, host gradient) with the
        host kernel, writing their updated parameters back; returns their indices (none without a kernel: the
        caller's ``optimizer.step()`` steps the rest, whole-tensor ones included)."""
        kernel = [
            (fp, grad) for fp, grad in pairs if self.rule is not None and fp.index in self.indices and not fp.whole
        ]
        if len(kernel) < len(pairs) or self.swapper is not None:
            for fp, _ in pairs:
                self._arrived(fp)
        sub_groups = []
        for fp, grad in kernel:
            group, state = self.optimizer.param_groups[fp.group_index], self.optimizer.state[fp.master]
            if self.swapper is not None:
                sub_groups += self._sub_groups(fp, group, state, grad)
            else:
                self._arrived(fp)
                self._step_in_memory(fp, group, state, grad)
        if sub_groups:
            self.swapper.run(sub_groups)
        return {fp.index for fp, _ in kernel}

    def _step_in_memory(self, fp: FlatParam, group: dict, state: dict, grad: torch.Tensor) -> None:
        master = fp.master

        def allocate(key: str, fill: float | None) -> torch.Tensor:  # the host's alone: pageable
            return torch.full((master.numel(),), 0.0 if fill is None else fill, dtype=master.dtype)

        first = prepare_state(self.rule, self.optimizer, group, state, allocate)
        keys, hyper, sink = self.rule.keys(group), self.rule.hyper(group, self.optimizer), self.sinks[fp.index]
        size = min(self.offload.sub_group_size, master.numel())
        for lo in range(0, master.numel(), size):
            hi = min(master.numel(), lo + size)
            staging = self._staging_for(hi - lo, sink.dtype) if sink.needs_staging else None
            out = sink.target(lo, hi, staging)
            tiled_update(
                self.pool,
                self.rule,
                hyper,
                master[lo:hi],
                grad[lo:hi],
                [state[key][lo:hi] for key in keys],
                state.get("step"),
                first,
                out,
            )
            sink.after_update(lo, hi, out)
            sink.write_behind(lo, hi, staging)

    def _staging_for(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < numel or self._staging.dtype != dtype:
            if self._staging is not None and self.pinned is not None:
                self.pinned.unpin(self._staging)
            self._staging = self._host_empty(numel, dtype)
        return self._staging[:numel]

    # -- reporting and lifetime ---------------------------------------------------------------------------------
    def places(self) -> dict[int, str]:
        """Storage address -> "host" or "nvme" for every tensor this offload placed."""
        placed = {file.view.untyped_storage().data_ptr(): "nvme" for file in self.grad_files.values()}
        if self.copies_grads:  # copied off the device: host memory, also where the host is the device (tests)
            placed.update({t.untyped_storage().data_ptr(): "host" for t in self._host_grads.values()})
        for fp in self.flat_params:
            files = self.files.get(fp.index, {})
            for file in files.values():
                placed[file.view.untyped_storage().data_ptr()] = "nvme"
            separate = fp.master.untyped_storage().data_ptr() != fp.master_region().untyped_storage().data_ptr()
            tensors = [fp.master] if separate else []  # else it is the parameters, which the report counts there
            tensors += [v for state in self._states(fp) for v in state.values() if torch.is_tensor(v)]
            if (
                not self.copies_grads
                and fp.grad_shard is not None
                and (
                    fp.grad_full is None
                    or fp.grad_full.untyped_storage().data_ptr() != fp.grad_shard.untyped_storage().data_ptr()
                )
            ):
                tensors.append(fp.grad_shard)  # the host step reads it in place
            for tensor in tensors:
                placed.setdefault(tensor.untyped_storage().data_ptr(), "host")
        for _, tensor in self.own_tensors():
            placed.setdefault(tensor.untyped_storage().data_ptr(), "host")
        return placed

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(kind, tensor) for what only this offload holds: host gradient copies, staging and swap buffers, and
        state files not yet in the optimizer's state (it creates state on the first step, as torch does)."""
        owned = [("grads", t) for t in self._host_grads.values()]
        owned += [("buffers", t) for t in ([self._staging] if self._staging is not None else [])]
        owned += [("buffers", t) for t in (self.swapper.buffer_tensors() if self.swapper else [])]
        for fp in self.flat_params:
            present = {id(v) for state in self._states(fp) for v in state.values()}
            owned += [
                ("optimizer", f.view)
                for key, f in self.files.get(fp.index, {}).items()
                if key != "master" and id(f.view) not in present
            ]
        return owned

    def _states(self, fp: FlatParam) -> list[dict]:
        """The optimizer's state of ``fp``: the master's, or each whole parameter's."""
        return [self.optimizer.state.get(param, {}) for param in fp.optimizer_params()]

    def all_files(self) -> list[SwapFile]:
        return [file for files in self.files.values() for file in files.values()] + list(self.grad_files.values())

    def trim(self) -> None:
        for file in self.all_files():
            file.trim()

    def close(self) -> None:
        self.pool.close()
        if self.swapper is not None:
            self.swapper.close()
        for file in self.all_files():
            file.close()
