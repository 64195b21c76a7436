"""Two launcher agents on this machine as two "nodes": the plumbing of tests/e2e/test_multinode_simulated.py and
benchmarks/multinode.py.

Each node is started as it would be on its own machine (one torchrun agent, one Lightning script, one ``ds-strategy
launch``), all nodes at once, against a rendezvous on 127.0.0.1. Every process of a node inherits ``$SIM_NODE``
(its name, so a rank can say which node it ran on) and ``$NVME_PATH``, a directory of that node's own, as a real
node's local disk would be. Each node's processes share this machine's cores, so every process gets one thread.

What this does not simulate: the network (loopback only) and separate filesystems (the checkpoint directory is
shared, as a multi-node checkpoint needs; the NVMe directories are separate only because each node is given its
own).
"""

import os
import subprocess
from pathlib import Path

import torch
import yaml
from e2e_runs import DS_STRATEGY, PYTHON, REPO, SCRIPTS, assert_clean_exit, free_port

TRAIN = SCRIPTS / "multinode_train.py"
WORLD_SIZE = 4
LAUNCHERS = ("torchrun", "lightning", "lightning_torchrun", "accelerate")


def node_command(launcher: str, nodes: int, node: int, port: int, out: Path) -> tuple[list, dict]:
    """The command and extra environment that start node ``node`` of ``nodes`` (``WORLD_SIZE // nodes`` ranks
    each) under ``launcher``, the script writing to ``out``."""
    per_node = WORLD_SIZE // nodes
    env = {"SIM_NODE": f"node{node}", "NVME_PATH": str(out / f"nvme-node{node}")}
    torchrun = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nodes,
        "--node_rank",
        node,
        "--nproc_per_node",
        per_node,
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "multinode",
        "--monitor_interval",
        "0.5",
    ]
    if launcher == "torchrun":
        return [*torchrun, TRAIN, "engine", out], env
    if launcher == "lightning_torchrun":
        return [*torchrun, TRAIN, "lightning", out, nodes], env
    if launcher == "lightning":  # Lightning's own launcher starts the node's other ranks
        return [PYTHON, TRAIN, "lightning", out, nodes], {
            **env,
            "NODE_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    if launcher == "accelerate":
        return [
            DS_STRATEGY,
            "launch",
            "--config_file",
            _accelerate_yaml(out, nodes, node, port, env["NVME_PATH"]),
            TRAIN,
            "accelerate",
            out,
        ], env
    raise ValueError(f"launcher={launcher!r} is not one of {LAUNCHERS}")


def _accelerate_yaml(out: Path, nodes: int, node: int, port: int, nvme_path: str) -> str:
    """The YAML each machine of an accelerate job has: the same but for ``machine_rank`` (and here the NVMe path,
    which on real machines would be the same local path on each)."""
    settings = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU",
        "num_machines": nodes,
        "num_processes": WORLD_SIZE,
        "machine_rank": node,
        "main_process_ip": "127.0.0.1",
        "main_process_port": port,
        "same_network": True,
        "rdzv_backend": "static",
        "mixed_precision": "no",
        "dynamo_config": {},
        "main_training_function": "main",
        "ds_strategy": {"stage": 3, "zero_hpz_partition_size": 2, "offload_optimizer": "nvme", "nvme_path": nvme_path},
    }
    path = out / f"accelerate-node{node}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def run_nodes(launcher: str, nodes: int, out: Path, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start every node of a ``nodes``-node job at once and wait for all; each must exit cleanly."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    commands = [node_command(launcher, nodes, node, port, out) for node in range(nodes)]
    procs = [
        subprocess.Popen(
            [str(c) for c in cmd],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd, env in commands
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for (cmd, _), result in zip(commands, results):
        assert_clean_exit(cmd, result)
    return results


def rank_records(out: Path) -> list[dict]:
    """What each rank wrote (``multinode_train.record``), by rank."""
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def differing(a: dict, b: dict) -> list[str]:
    """Names of the parameters that are not bit for bit equal in ``a`` and ``b``."""
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]
