"""DeepSpeed's launcher command line mapped onto torchrun: ``ds-strategy launch --num_gpus 2 train.py --deepspeed
--deepspeed_config ds.json`` runs what ``deepspeed --num_gpus 2 train.py ...`` runs.

Honoured: ``--num_gpus``/``--num_accelerators`` (processes per node), ``--num_nodes``, ``--node_rank``,
``--master_addr``, ``--master_port``, ``--hostfile`` with ``--include``/``--exclude`` on host names (nodes = hosts,
processes per node = their common ``slots``, master = the first host; torchrun starts no remote processes, so the
command runs on every node with its ``--node_rank``, as with torchrun itself), ``--module``, ``--no_python`` and
``--no_local_rank``. As DeepSpeed's launcher, each process gets ``--local_rank=<n>`` after the script's arguments
unless ``--no_local_rank`` (and ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE`` from torchrun). Refused, by name:
``--launcher``
other than pdsh's default, ``--ssh_port``, ``--force_multi``, ``--autotuning``, ``--elastic_training``,
``--bind_cores_to_rank``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

import torch

REFUSED = ("launcher", "ssh_port", "force_multi", "autotuning", "elastic_training", "bind_cores_to_rank")


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher options (the ones :data:`REFUSED` names are accepted only to be refused by name)."""
    group = parser.add_argument_group("DeepSpeed launcher options (used without --config_file; mapped onto torchrun)")
    group.add_argument("--num_gpus", "--num_accelerators", type=int, default=None, dest="num_gpus")
    group.add_argument("--num_nodes", type=int, default=None)
    group.add_argument("--node_rank", type=int, default=0)
    group.add_argument("--master_addr", default="127.0.0.1")
    group.add_argument("--master_port", type=int, default=29500)
    group.add_argument("-H", "--hostfile", default=None)
    group.add_argument("-i", "--include", default="")
    group.add_argument("-e", "--exclude", default="")
    group.add_argument("--module", action="store_true")
    group.add_argument("--no_python", action="store_true")
    group.add_argument("--no_local_rank", action="store_true")
    group.add_argument("--launcher", default="pdsh")
    group.add_argument("--ssh_port", type=int, default=None)
    group.add_argument("--force_multi", action="store_true")
    group.add_argument("--autotuning", default="")
    group.add_argument("--elastic_training", action="store_true")
    group.add_argument("--bind_cores_to_rank", action="store_true")


def torchrun_arguments(args: argparse.Namespace) -> list[str]:
    """torchrun's command line for DeepSpeed's launcher options in ``args`` (see the module docstring)."""
    for name in REFUSED:
        value = getattr(args, name)
        if value and not (name == "launcher" and value == "pdsh"):
            raise ValueError(
                f"--{name}={value!r} is DeepSpeed's launcher's and not honoured by ds-strategy launch, which runs "
                f"torchrun on this node; start the other nodes yourself with --node_rank (or use torchrun directly)"
            )
    nodes, per_node, master = args.num_nodes or 1, args.num_gpus, args.master_addr
    if args.hostfile:
        hosts = _hosts(Path(args.hostfile), args.include, args.exclude)
        slots = set(hosts.values())
        if len(slots) != 1:
            raise ValueError(f"--hostfile {args.hostfile}: hosts with different slots {hosts}; torchrun needs one")
        nodes, master = len(hosts), next(iter(hosts))
        per_node = per_node or slots.pop()
    per_node = per_node or max(torch.cuda.device_count(), 1)
    command = [
        f"--nnodes={nodes}",
        f"--nproc_per_node={per_node}",
        f"--node_rank={args.node_rank}",
        f"--master_addr={master}",
        f"--master_port={args.master_port}",
    ]
    if args.no_python:
        return [*command, "--no-python", args.training_script, *args.training_script_args]
    runner = [__name__, "--no_local_rank"] if args.no_local_rank else [__name__]
    module = ["--module"] if args.module else []
    return [*command, "-m", *runner, *module, args.training_script, *args.training_script_args]


def _hosts(hostfile: Path, include: str, exclude: str) -> dict[str, int]:
    """``{host: slots}`` from DeepSpeed's hostfile format (``worker-1 slots=4``), filtered by host name."""
    hosts = {}
    for line in hostfile.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(" slots=")
        hosts[host.strip()] = int(slots) if slots else 1
    keep = {part.split(":")[0] for part in include.split("@") if part}
    drop = {part.split(":")[0] for part in exclude.split("@") if part}
    return {host: n for host, n in hosts.items() if (not keep or host in keep) and host not in drop}


def run_with_local_rank(argv: list[str]) -> None:
    """What each torchrun process runs: the script (or ``--module``) with ``--local_rank=$LOCAL_RANK`` appended,
    as DeepSpeed's launcher passes it, unless ``--no_local_rank``."""
    pass_local_rank = argv[:1] != ["--no_local_rank"]
    argv = argv if pass_local_rank else argv[1:]
    as_module = argv[:1] == ["--module"]
    target, *rest = argv[1:] if as_module else argv
    if pass_local_rank:
        rest.append(f"--local_rank={os.environ.get('LOCAL_RANK', 0)}")
    sys.argv = [target, *rest]
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    run_with_local_rank(sys.argv[1:])
