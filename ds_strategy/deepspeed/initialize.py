"""``deepspeed.initialize``: DeepSpeed's entry point, its arguments meaning what they mean there.

The config comes from ``config``, ``config_params`` or ``args.deepspeed_config`` (one of them), read with DeepSpeed's
meaning by :func:`ds_strategy.config.sources.load_config`. The batch sizes follow DeepSpeed's rule,
``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size``, any two of
the three giving the third. The model is composed by :func:`ds_strategy.compose.compose_model`, as under every other
entry point, and :class:`~.engine.DeepSpeedEngine` drives it.

Note: [The script's optimizer wins under deepspeed.initialize]
DeepSpeed's rule, not Lightning's (Note: [A DeepSpeed config's optimizer wins]): an optimizer passed to
``initialize`` (an instance, or a callable given ``model_parameters``) trains, and the config's ``optimizer`` section
is used only when none is passed; the same for ``lr_scheduler`` (an instance, or a callable given the optimizer)
against the ``scheduler`` section. The sections are built by the same translation the other adapters use
(:class:`~ds_strategy.config.deepspeed.optimizer_section.OptimizerSections`: torch's classes computing DeepSpeed's).
``model_parameters`` (parameters, or param-group dicts) is what the optimizer built here trains; by default every
parameter of the model.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ..compose import Composed, TensorParallelism, Unparallelized, build_mesh, compose_model
from ..config import ZeroConfig
from ..config.sources import LoadedConfig, load_config
from ..parallel.mesh import ParallelMesh
from . import comm
from .arguments import init_distributed, local_rank_of
from .engine import DeepSpeedEngine

log = logging.getLogger("ds_strategy.deepspeed")

# The engines initialize built in this process, for zero.GatheredParameters, whose DeepSpeed signature names
# parameters and no engine (DeepSpeed hangs its state on every parameter instead). Read and written in this package.
ENGINES: weakref.WeakSet[DeepSpeedEngine] = weakref.WeakSet()


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Mapping | str | os.PathLike | ZeroConfig | None = None,
    mesh_param: Any = None,
    config_params: Mapping | str | os.PathLike | None = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer | None, DataLoader | None, Any]:
    """``(engine, optimizer, training_dataloader, lr_scheduler)``, as DeepSpeed's ``initialize`` returns them (see
    the module docstring). ``mpu`` and ``mesh_param`` are refused: model parallelism comes from the config
    (``tensor_parallel.autotp_size``, ``sequence_parallel_size``, ``pipeline_parallel_size``)."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError(
            "deepspeed.initialize(mpu=..., mesh_param=...): a Megatron-style model-parallel unit is not supported; set "
            "tensor_parallel.autotp_size (or sequence_parallel_size) in the config instead"
        )
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    loaded, raw = _read_config(args, config, config_params)
    if loaded.zero.pipeline_parallel_size > 1:
        raise NotImplementedError(
            f"deepspeed.initialize with pipeline_parallel_size={loaded.zero.pipeline_parallel_size}: DeepSpeed "
            f"pipelines through its PipelineModule and engine.train_batch, which are not implemented; train a "
            f"pipelined model under the Lightning or Fabric adapter (ZeroStrategy.from_deepspeed_config)"
        )
    mesh = build_mesh(loaded.zero, _device().type) if loaded.zero.parallelism_policy.model_parallel else None
    dp_rank, dp_size = (mesh.dp_rank, mesh.dp_size) if mesh is not None else (comm.get_rank(), comm.get_world_size())
    zero_config = _batch_sizes(loaded.zero, dp_size)
    parameters = list(model_parameters) if model_parameters is not None else list(model.parameters())
    optimizer = _optimizer(optimizer, parameters, loaded)
    scheduler = _scheduler(lr_scheduler, optimizer, loaded)
    composed = _compose(model, zero_config, mesh, optimizer)
    engine = DeepSpeedEngine(
        composed.engine, composed.module, scheduler, data_parallel_size=dp_size, local_rank=local_rank_of(args)
    )
    ENGINES.add(engine)
    loader = None
    if training_data is not None:
        drop_last = bool(raw.get("dataloader_drop_last", False))
        loader = _data_loader(training_data, zero_config, dp_rank, dp_size, collate_fn, drop_last)
    return engine, engine.optimizer, loader, scheduler


def _compose(module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None, optimizer) -> Composed:
    """The one call of :func:`~ds_strategy.compose.compose_model` for this entry point: the optimizer built before
    composition (as Fabric and Accelerate pass theirs), and for a model without a tensor-parallel plan under
    ``autotp_size``, the automatic one (as Accelerate)."""
    return compose_model(
        module,
        config,
        mesh=mesh,
        device=_device(),
        log=_log_rank0,
        optimizers=[optimizer] if optimizer is not None else (),
        tensor_parallel=TensorParallelism(unparallelized=Unparallelized.AUTO_PLAN),
    )


def _read_config(args: Any, config: Any, config_params: Any) -> tuple[LoadedConfig, Mapping[str, Any]]:
    """The config named by exactly one of ``config`` (or its old name ``config_params``) and
    ``args.deepspeed_config``, read as DeepSpeed's; also the mapping as written (for keys only the data loader
    reads)."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError(
                "deepspeed.initialize got a config and args.deepspeed_config; pass one (DeepSpeed refuses both)"
            )
        config = from_args
    if config is None:
        raise ValueError(
            "DeepSpeed requires --deepspeed_config to specify configuration file (or initialize(config=...))"
        )
    if isinstance(config, (ZeroConfig, LoadedConfig)):
        return load_config(config), {}
    loaded = load_config(config, deepspeed=True)
    return loaded, loaded.written


def _batch_sizes(config: ZeroConfig, dp_size: int) -> ZeroConfig:
    """DeepSpeed's rule: any two of train_batch_size, the micro-batch and the accumulation give the third."""
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        raise ValueError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided (DeepSpeed's rule: "
            "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size)"
        )
    return config.resolve_batch_sizes(dp_size)


def _optimizer(optimizer: Any, parameters: list, loaded: LoadedConfig) -> torch.optim.Optimizer | None:
    """Note: [The script's optimizer wins under deepspeed.initialize]."""
    if optimizer is None:
        sections = loaded.sections
        return sections.build_optimizer(parameters) if sections.optimizer is not None else None
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"Client Optimizer is of unexpected type {type(optimizer).__name__}")
        optimizer = optimizer(parameters)
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]  # as DeepSpeed
    return optimizer


def _scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer | None, loaded: LoadedConfig) -> Any:
    """Note: [The script's optimizer wins under deepspeed.initialize]."""
    if lr_scheduler is not None:
        if callable(lr_scheduler):
            return lr_scheduler(optimizer)
        if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
            raise AssertionError(  # DeepSpeed's own check, raised as DeepSpeed raises it
                "Client Optimizer is not instantiated but Client LR Scheduler is instantiated: the scheduler steps "
                "another optimizer than the one that trains; pass that optimizer too, or a callable that builds the "
                "scheduler from the optimizer"
            )
        return lr_scheduler
    sections = loaded.sections
    if sections.scheduler is None:
        return None
    if optimizer is None:
        raise ValueError("the DeepSpeed config's scheduler section needs an optimizer (passed, or the config's)")
    return sections.build_scheduler(optimizer)


def _data_loader(
    dataset: Dataset, config: ZeroConfig, dp_rank: int, dp_size: int, collate_fn: Callable | None, drop_last: bool
) -> DataLoader:
    """DeepSpeed's training loader: micro-batches of this data-parallel rank's share (``DistributedSampler``, which
    shuffles with seed 0, and is never re-seeded per epoch, as DeepSpeed's); an iterable dataset as it comes."""
    if not isinstance(dataset, Dataset):
        raise ValueError(f"Training data must be a torch Dataset, got {type(dataset).__name__}")
    sampler = None
    if not isinstance(dataset, IterableDataset):
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank)
    return DataLoader(
        dataset,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )


def _device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``) when there is one, else the CPU (DeepSpeed's CPU accelerator)."""
    if torch.cuda.is_available():
        return torch.device("cuda", comm.get_local_rank())
    return torch.device("cpu")


def _log_rank0(message: str) -> None:
    if comm.get_rank() == 0:
        log.info(message)
