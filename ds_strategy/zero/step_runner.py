"""Where the optimizer step runs: the narrow protocol the engine owns, and its device implementation.

Note: [One-way dependency between the engine and offload]
  ``ZeroEngine`` decides *when* the optimizer steps (after the overflow check, before the parameter refresh);
  a :class:`StepRunner` decides *where*: on the device, beside the shards (:class:`DeviceStep`, here), or on the
  host / NVMe (``ds_strategy.offload``, which implements this protocol from a :class:`StepContext`: the flat
  parameters, the optimizers, the offload policy, the device and the rank, nothing else of the engine). The engine
  calls the runner at five points and never asks which one it has: ``on_reduced`` inside backward (a reduced
  gradient is final), ``step`` (once per optimizer stepped, with the flat parameters it owns), ``places`` /
  ``own_tensors`` / ``describe`` for reports, and ``close`` at teardown; and the runner's ``gradients`` (a
  :class:`GradientStore`) is where the reducer sums partitioned gradients (stage 2/3) and the step reads them: on
  the device (:class:`DeviceGradients`), or in host buffers when the optimizer step runs there
  (``ds_strategy.offload.host_gradients``). So ``ds_strategy.zero`` imports nothing
  from ``ds_strategy.offload``: the engine's builder passes the factory as an argument
  (``ds_strategy.offload.step_runner_for`` chooses it); given none, the engine runs :class:`DeviceStep`, and
  refuses a config that offloads.
  Stage-3 NVMe parameter shards are written as units are built, before any runner exists; a factory may provide
  a :class:`ShardStore` for that (``shard_store``), which its runner then adopts through the context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from ..config.policies import OffloadPolicy
    from .flat_param import FlatParam


class ShardStore(Protocol):
    """Where partitioned parameter shards go as each unit is cut (``FlatParam.shard_store``)."""

    def store(self, fp: FlatParam, values: torch.Tensor) -> torch.Tensor: ...


class StepContext(NamedTuple):
    """Everything a step runner may know of the engine that owns it."""

    flat_params: list[FlatParam]
    optimizers: tuple[torch.optim.Optimizer, ...]  # optimizer i steps the flat parameters of optimizer_index i
    offload: OffloadPolicy
    device: torch.device
    rank: int
    shard_store: ShardStore | None  # what the factory's ``shard_store`` returned, if anything


class GradientStore(Protocol):
    """Where a flat buffer's partitioned gradient (stage 2/3) is summed over backward passes until the step.

    The reducer calls :meth:`add` with this rank's reduced slice of each backward; the engine reads the sum with
    :meth:`read` (unscaling, clipping and the optimizer may change it in place) and clears it with :meth:`zero`."""

    def add(self, fp: FlatParam, reduced: torch.Tensor, scale: float) -> None:
        """Add ``scale * reduced`` (a device tensor the caller drops afterwards) to ``fp``'s gradient."""

    def read(self, fp: FlatParam) -> torch.Tensor:
        """``fp``'s summed gradient (zeros if nothing was added since :meth:`zero`), ready to read."""

    def zero(self, fp: FlatParam) -> None:
        """Start ``fp``'s sum afresh."""


class DeviceGradients:
    """The sum kept beside the shards, in ``fp.grad_shard`` (``grad_shard_dtype``), allocated at the first add."""

    def add(self, fp: FlatParam, reduced: torch.Tensor, scale: float) -> None:
        fp.reduced_grad_shard().add_(reduced, alpha=scale)

    def read(self, fp: FlatParam) -> torch.Tensor:
        return fp.reduced_grad_shard()

    def zero(self, fp: FlatParam) -> None:
        if fp.grad_shard is not None:
            fp.grad_shard.zero_()


class StepRunner(Protocol):
    """Runs the optimizer step over the flat parameters' masters, wherever those live."""

    gradients: GradientStore  # where partitioned gradients are summed (see [One-way dependency ...])

    def on_reduced(self, fp: FlatParam, grad: torch.Tensor) -> None:
        """``grad``, ``fp``'s reduced gradient, is final for this step (called inside backward, synced only)."""

    def step(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[FlatParam, torch.Tensor]]) -> None:
        """Step ``optimizer`` over the flat parameters it owns, each with its gradient in ``pairs``, and write the
        updated values back to where the forward pass reads them."""

    def places(self) -> dict[int, str]:
        """Storage address -> "host" / "nvme" for the tensors this runner moved off the device."""

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(memory-report kind, tensor) for what only this runner holds."""

    def describe(self, report: dict[str, dict[str, int]]) -> str:
        """Where things live, for the setup summary; empty when nothing is off the device."""

    def close(self) -> None:
        """Release threads and files (teardown; later calls do nothing)."""


class StepRunnerFactory(Protocol):
    def shard_store(self, offload: OffloadPolicy, rank: int) -> ShardStore | None: ...

    def __call__(self, context: StepContext) -> StepRunner: ...


def step_on_device(
    optimizer: torch.optim.Optimizer,
    pairs: list[tuple[FlatParam, torch.Tensor]],
    write_back: Callable[[FlatParam], None],
) -> None:
    """The user's ``optimizer.step()`` over the masters of ``pairs`` (flat parameter, gradient), then each
    master written back by ``write_back``. Called even when ``pairs`` is empty, for the optimizer's hooks and
    its LR scheduler's bookkeeping. A whole-tensor optimizer sees each whole parameter's view of the master and
    of the gradient (``FlatParam.optimizer_params``)."""
    for fp, grad in pairs:
        for param, view in zip(fp.optimizer_params(), fp.optimizer_views(grad)):
            param.grad = view
    optimizer.step()
    for fp, _ in pairs:
        for param in fp.optimizer_params():
            param.grad = None
        write_back(fp)


class DeviceStep:
    """The optimizer steps beside the shards; updated fp32 masters are rounded into the 16-bit shards."""

    def __init__(self, context: StepContext):
        self.gradients = DeviceGradients()

    @staticmethod
    def shard_store(offload: OffloadPolicy, rank: int) -> None:
        return None

    def on_reduced(self, fp: FlatParam, grad: torch.Tensor) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[FlatParam, torch.Tensor]]) -> None:
        step_on_device(optimizer, pairs, lambda fp: fp.copy_master_to_params())

    def places(self) -> dict[int, str]:
        return {}

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def describe(self, report: dict[str, dict[str, int]]) -> str:
        return ""

    def close(self) -> None:
        pass


def runner_factory(step_runner: StepRunnerFactory | None, config: ZeroConfig) -> StepRunnerFactory:
    """The runner given, else the device's; an offloading config without a runner is an error, not a silent
    on-device step (zero never imports offload: Note: [One-way dependency between the engine and offload])."""
    if step_runner is not None:
        return step_runner
    if config.plan.offloads:
        raise ValueError(
            f"ZeroConfig offloads (offload_optimizer={config.offload_optimizer!r}, offload_params="
            f"{config.offload_params!r}) but no step_runner was given: pass "
            f"step_runner=ds_strategy.offload.step_runner_for(config), or build through ds_strategy.compose"
        )
    return DeviceStep
