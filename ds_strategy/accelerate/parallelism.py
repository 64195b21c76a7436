"""Accelerate's ``ParallelismConfig`` in ZeroConfig's terms: its ``tp_size`` is ``tensor_parallel_size``, its
``sp_size`` (DeepSpeed-Ulysses, Accelerate's ``sp_backend="deepspeed"``) is ``sequence_parallel_size``, and ZeRO
itself is its ``dp_shard`` dimension; the dimensions ds_strategy lacks are refused by name. Pipelining, which
``ParallelismConfig`` has no dimension for, is ``ZeroConfig.pipeline_parallel_size``.

Accelerate is not handed the ``ParallelismConfig``: its own tensor-parallel path expects a model that
``transformers`` already split (``from_pretrained(tp_plan=...)``) and builds a mesh only for CUDA-like devices, and
its Ulysses path is DeepSpeed's engine. The mesh ds_strategy builds carries Accelerate's dimension names instead
(``accelerator.torch_device_mesh``), and the data loaders are split over its data-parallel dimension
(:func:`prepare_over_data_parallel`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from accelerate.data_loader import prepare_data_loader

from ..config import ZeroConfig

if TYPE_CHECKING:
    from .accelerator import ZeroAccelerator

USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"
# ParallelismConfig sizes ds_strategy has no dimension for, with what each would mean.
_REFUSED_SIZES = {
    "dp_replicate_size": "replicated data parallelism (HSDP) around the sharded group",
    "cp_size": "context parallelism (DeepSpeed-Ulysses is sp_size)",
}


def check_no_launcher_parallelism(parallelism_config: Any) -> None:
    """``accelerate launch --use_parallelism_config`` has Accelerate build a ParallelismConfig from the environment,
    with its own mesh; ds_strategy takes the sizes only from the argument or the ZeroConfig."""
    if parallelism_config is None and os.environ.get(USE_PARALLELISM_CONFIG, "").lower() == "true":
        raise ValueError(
            f"{USE_PARALLELISM_CONFIG} is set (accelerate launch --use_parallelism_config), which has Accelerate "
            f"build its own device mesh; pass ZeroAccelerator(parallelism_config=ParallelismConfig(tp_size=..., "
            f"sp_size=...)) or set ZeroConfig.tensor_parallel_size and sequence_parallel_size instead, and launch "
            f"without --use_parallelism_config"
        )


def with_parallelism(config: ZeroConfig, parallelism_config: Any, num_processes: int) -> ZeroConfig:
    """``config`` with ``parallelism_config``'s ``tp_size`` and ``sp_size`` as its ``tensor_parallel_size`` and
    ``sequence_parallel_size`` (None: ``config`` as is)."""
    if parallelism_config is None:
        return config
    refused = {name: getattr(parallelism_config, name) for name in _REFUSED_SIZES}
    refused = {name: size for name, size in refused.items() if size not in (None, 1)}
    if refused:
        named = ", ".join(f"{name}={size} ({_REFUSED_SIZES[name]})" for name, size in refused.items())
        raise ValueError(
            f"ZeroAccelerator supports ParallelismConfig's tp_size, sp_size and dp_shard_size only, not {named}; "
            f"set those to 1 (ZeRO shards over the data-parallel ranks, the dp_shard dimension)"
        )
    sizes = {name: getattr(parallelism_config, name) or 1 for name in ("dp_shard_size", "tp_size", "sp_size")}
    pp = config.pipeline_parallel_size  # the pipeline stages hold the other dimensions each
    covered = sizes["dp_shard_size"] * sizes["tp_size"] * sizes["sp_size"] * pp
    if covered != num_processes:
        given = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise ValueError(
            f"ParallelismConfig({given}) with pipeline_parallel_size={pp} covers {covered} processes but there are "
            f"{num_processes}; make dp_shard_size * tp_size * sp_size * pipeline_parallel_size equal the number of "
            f"processes"
        )
    fields = {"tp_size": "tensor_parallel_size", "sp_size": "sequence_parallel_size"}
    for name, field in fields.items():
        if getattr(config, field) not in (1, sizes[name]):
            raise ValueError(
                f"ParallelismConfig({name}={sizes[name]}) conflicts with ZeroConfig.{field}={getattr(config, field)}; "
                f"set it in one place only"
            )
    return config.replace(**{field: sizes[name] for name, field in fields.items()})


def prepare_over_data_parallel(
    accelerator: ZeroAccelerator, data_loader: torch.utils.data.DataLoader, device_placement: bool | None
) -> torch.utils.data.DataLoader:
    """Accelerate's prepared ``data_loader``, split over the mesh's data-parallel ranks only: the ranks of one
    tensor- or sequence-parallel group, and the stages of one pipeline, read the same batches.

    Accelerate's own split from ``torch_device_mesh`` knows tensor and context parallelism only (it divides the
    process index by the "tp" and "cp" sizes, which puts ranks of one sequence-parallel group or of different stages
    on different batches), so the data-parallel rank and size are given to it directly. Its dispatching of batches
    from process 0 knows no data-parallel dimension (a slice to every process, or under "tp" the same batch to
    all): it is refused, and an iterable dataset is read by each data-parallel rank, its own part."""
    mesh = accelerator.parallel_mesh
    if accelerator.dispatch_batches:
        raise ValueError(
            f"dispatch_batches=True with model parallelism (mesh {tuple(mesh.mesh.mesh_dim_names)}): Accelerate "
            f"dispatches to every process, so ranks that must read the same batch would read different ones; set "
            f"DataLoaderConfiguration(dispatch_batches=False) (each data-parallel rank then reads its own part)"
        )
    if device_placement is None:
        device_placement = accelerator.device_placement
    return prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=mesh.dp_size,
        process_index=mesh.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
