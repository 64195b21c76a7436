"""What a DeepSpeed script does before ``initialize``: ``add_config_arguments(parser)`` (``--deepspeed``,
``--deepspeed_config``), ``init_distributed()``, and the launcher's ``--local_rank`` / ``$LOCAL_RANK``."""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_PORT = 29500


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's argument group: ``--deepspeed`` (a flag scripts test), ``--deepspeed_config`` (the JSON
    ``initialize`` reads from ``args``), and its old alias ``--deepscale_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (ds_strategy)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def local_rank_of(args: Any = None) -> int:
    """``args.local_rank`` when the launcher passed ``--local_rank``, else ``$LOCAL_RANK`` (torchrun's), else 0."""
    given = getattr(args, "local_rank", None)
    if given is not None and int(given) >= 0:
        return int(given)
    return int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the process group torchrun's (or DeepSpeed's launcher's) environment describes, once: NCCL on GPUs,
    gloo on the CPU unless ``dist_backend`` says otherwise. Without a launcher's environment, a group of one
    process (as DeepSpeed falls back to). Nothing when a group exists, unless ``dist_init_required`` insists."""
    if dist.is_initialized():
        if dist_init_required:
            raise RuntimeError("init_distributed(dist_init_required=True): the process group exists already")
        return
    if dist_init_required is False:
        return
    if rank < 0 and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    options = {"timeout": timeout} if timeout is not None else {}
    if rank >= 0:
        options.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, init_method=init_method, **options)
