"""Run an entry point as a user would, in its own process tree, and check from its ``summary.json`` that it trained
sharded.

Lightning and Fabric start their extra processes by re-running ``sys.argv`` and accelerate starts them through
torchrun, so end-to-end tests run scripts with ``subprocess``, never in the pytest process. Each process gets one
intra-op thread (two ranks share this machine's cores) and, for accelerate, its own free rendezvous port, because
other test runs may share the machine.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
PYTHON = sys.executable
DS_STRATEGY = str(Path(PYTHON).with_name("ds-strategy"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd: list, *, cwd: Path = REPO, env: dict | None = None, timeout: float = 150,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd``; with ``check``, a non-zero exit fails the test showing the end of the output."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=environment, capture_output=True, text=True,
                            timeout=timeout)
    if check:
        assert_clean_exit(cmd, result)
    return result


EXIT_ABORT = "terminate called without an active exception"


def assert_clean_exit(cmd: list, result: subprocess.CompletedProcess) -> None:
    """The run exited 0 and no process of it aborted (the abort message anywhere in stderr fails it, also when
    a launcher still exited 0): see ``ds_strategy/comm/process_exit.py``."""
    assert result.returncode == 0 and EXIT_ABORT not in result.stderr, \
        f"{cmd} exited {result.returncode}:\n{output(result)[-4000:]}"


def run_gloo_exit_race(mode: str, pairs: int, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Run ``pairs`` two-rank jobs of ``e2e_scripts/gloo_exit_race.py`` in ``mode`` ("bare" or "ours") side by
    side; returns every rank's result."""
    ranks = []
    for _ in range(pairs):
        port = free_port()
        ranks += [subprocess.Popen([PYTHON, SCRIPTS / "gloo_exit_race.py", str(rank), str(port), mode], cwd=REPO,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = []
    for proc in ranks:
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def assert_trained_sharded(out_dir: Path, stage: int, world_size: int = 2) -> dict:
    """The run's loss fell, and each of its ``world_size`` ranks held 1/N of the optimizer state.

    fp32 AdamW keeps two moments per parameter: 8Ψ bytes on one rank (the ZeRO paper's formula), 8Ψ/N per rank
    once stage >= 1 shards it; padding to equal shards adds a few elements, well inside 5%.
    """
    summary = json.loads(Path(out_dir, "summary.json").read_text())
    assert (summary["stage"], summary["world_size"]) == (stage, world_size)
    one_rank_bytes = 8 * summary["trainable_params"]
    for rank_bytes in summary["bytes_per_rank"]:
        assert abs(rank_bytes["optimizer"] - one_rank_bytes / world_size) <= 0.05 * one_rank_bytes / world_size
    assert summary["final_loss"] < 0.8 * summary["first_loss"], summary["losses"]
    return summary


def assert_sharded_checkpoint(path: Path, summary: dict, world_size: int = 2) -> None:
    """``path`` is a sharded checkpoint with one shard file per rank that consolidates into the whole model (its
    trainable parameters, tied ones once) with the optimizer state of every trainable parameter."""
    import torch

    from ds_strategy.checkpoint import consolidate

    assert {f"__{rank}_0.distcp" for rank in range(world_size)} <= set(os.listdir(path))
    full = torch.load(consolidate(path, Path(path).parent / "consolidated.pt", weights_only=False), weights_only=True)
    trainable = full["optimizer"]["state"].keys()
    assert sum(full["state_dict"][name].numel() for name in trainable) == summary["trainable_params"]
