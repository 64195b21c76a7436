"""Run an entry point as a user would, in its own process tree, and check from its ``summary.json`` that it trained
sharded and as its unsharded reference run did.

Lightning and Fabric start their extra processes by re-running ``sys.argv`` and accelerate starts them through
torchrun, so end-to-end tests run scripts with ``subprocess``, never in the pytest process. Each process gets one
intra-op thread (two ranks share this machine's cores) and, for accelerate, its own free rendezvous port, because
other test runs may share the machine.
"""

import functools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
PYTHON = sys.executable
DS_STRATEGY = str(Path(PYTHON).with_name("ds-strategy"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(
    cmd: list, *, cwd: Path = REPO, env: dict | None = None, timeout: float = 150, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``cmd``; with ``check``, a non-zero exit fails the test showing the end of the output."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert_clean_exit(cmd, result)
    return result


# How a surviving rank 0 says at once that a peer's failure failed its collective (peer_failures.announced).
ANNOUNCED = "[ds_strategy] PeerFailedError: rank 0: "


def run_lightning_fault(mode: str, out: Path) -> tuple[subprocess.CompletedProcess, float, float | None, float]:
    """``scripts/lightning_faults.py MODE OUT``: its result, when rank 1 failed, when rank 0 first named the
    failure (``None`` if it never did) and when the job had ended, as ``time.time()`` values."""
    cmd = [PYTHON, str(SCRIPTS / "lightning_faults.py"), mode, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stderr))
    reader.start()
    stdout = proc.stdout.read()
    proc.wait(timeout=240)
    ended = time.time()
    reader.join(timeout=10)
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, "".join(line for _, line in lines))
    said = [at for at, line in lines if line.startswith(ANNOUNCED)]
    return result, float(Path(out, "failed_at").read_text()), said[0] if said else None, ended


EXIT_ABORT = "terminate called without an active exception"


def assert_clean_exit(cmd: list, result: subprocess.CompletedProcess) -> None:
    """The run exited 0 and no process of it aborted (the abort message anywhere in stderr fails it, also when
    a launcher still exited 0): see ``ds_strategy/comm/process_exit.py``."""
    assert result.returncode == 0 and EXIT_ABORT not in result.stderr, (
        f"{cmd} exited {result.returncode}:\n{output(result)[-4000:]}"
    )


def run_gloo_exit_race(mode: str, pairs: int, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Run ``pairs`` two-rank jobs of ``scripts/gloo_exit_race.py`` in ``mode`` ("bare" or "ours") side by
    side; returns every rank's result."""
    ranks = []
    for _ in range(pairs):
        port = free_port()
        ranks += [
            subprocess.Popen(
                [PYTHON, SCRIPTS / "gloo_exit_race.py", str(rank), str(port), mode],
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
    results = []
    for proc in ranks:
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


# Note: [Every sharded run against its stage-0 reference]
# A falling loss says little: a run that updates its shards at the wrong offsets, or applies one rank's gradient, still
# learns. So every sharded run of a script is compared with the same script at stage 0 (no partitioning: the whole
# gradient all-reduced, the whole optimizer state on each rank) on the same 2 ranks, seed and data, run once per test
# session and cached: its first REFERENCE_STEPS losses and gradient norms (global, before clipping) must agree within
# RTOL. The scripts train with AdamW and clip at 1.0, which both undo a constant gradient scale, so the losses alone
# would pass a sum taken for a mean; the norm shows it. With 2 ranks a sum of two values is the same in either order,
# so stages 0-2 give bitwise-equal values here; the tolerance only allows another bucket layout's order of summing.
REFERENCE_STEPS = 8
RTOL = 1e-5
_STAGE0 = {"DS_STRATEGY_CONFIG": '{"stage": 0}'}


def _stage0_ds_config(out: Path) -> Path:
    """``examples/ds_config.json`` at stage 0."""
    config = json.loads((EXAMPLES / "ds_config.json").read_text())
    config["zero_optimization"]["stage"] = 0
    path = out / "ds_config_stage0.json"
    path.write_text(json.dumps(config))
    return path


REFERENCES = {
    "train": lambda out: [
        PYTHON,
        EXAMPLES / "train.py",
        "strategy=zero0",
        "trainer.devices=2",
        f"trainer.max_steps={REFERENCE_STEPS}",
        f"hydra.run.dir={out}",
    ],
    "deepspeed_json": lambda out: [
        PYTHON,
        EXAMPLES / "train_deepspeed_json.py",
        "--ds-config",
        _stage0_ds_config(out),
        "--max-steps",
        REFERENCE_STEPS,
        "--out",
        out,
    ],
    "lightning_by_name": lambda out: [
        PYTHON,
        SCRIPTS / "lightning_by_name.py",
        "pytorch_lightning",
        "zero0",
        out,
        REFERENCE_STEPS,
    ],
    "fabric_accumulate_2": lambda out: [
        PYTHON,
        EXAMPLES / "train_fabric.py",
        "--strategy",
        "zero0",
        "--accumulate",
        "2",
        "--max-steps",
        REFERENCE_STEPS,
        "--out",
        out,
    ],
    "accelerate": lambda out: accelerate_launch("--max-steps", REFERENCE_STEPS, "--out", out),
    "accelerate_accumulate_2": lambda out: accelerate_launch(
        "--accumulate", "2", "--max-steps", REFERENCE_STEPS, "--out", out
    ),
}


@functools.cache
def reference_run(name: str) -> dict[str, list[float]]:
    """The losses and gradient norms of reference run ``name`` (see REFERENCES), run once per test session."""
    with tempfile.TemporaryDirectory() as out:
        run(REFERENCES[name](Path(out)), env=_STAGE0)
        summary = json.loads(Path(out, "summary.json").read_text())
    return {key: summary[key] for key in ("losses", "grad_norms")}


def assert_trained_sharded(out_dir: Path, stage: int, reference: str, world_size: int = 2) -> dict:
    """The run's first losses and gradient norms are those of its stage-0 ``reference`` run, its loss fell, and
    each of its ``world_size`` ranks held 1/N of the optimizer state.

    fp32 AdamW keeps two moments per parameter: 8Ψ bytes on one rank (the ZeRO paper's formula), 8Ψ/N per rank
    once stage >= 1 shards it; padding to equal shards adds a few elements, well inside 5%.
    """
    summary = json.loads(Path(out_dir, "summary.json").read_text())
    assert (summary["stage"], summary["world_size"]) == (stage, world_size)
    one_rank_bytes = 8 * summary["trainable_params"]
    for rank_bytes in summary["bytes_per_rank"]:
        assert abs(rank_bytes["optimizer"] - one_rank_bytes / world_size) <= 0.05 * one_rank_bytes / world_size
    for key, expected in reference_run(reference).items():
        got = summary[key][: len(expected)]
        assert got == pytest.approx(expected, rel=RTOL), f"{key} differ from reference run {reference!r}"
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


# Note: [Entry points, as a user runs them]
# One short training (3 optimizer steps) per entry point, covering start-up, a collective-heavy step and the final
# checkpoint: benchmarks/clean_exit.py repeats each, tests/e2e/test_clean_exit.py runs some once with the thread probe.
ENTRY_STEPS = "3"


def accelerate_launch(*script_args) -> list:
    """``accelerate launch`` of ``examples/train_accelerate.py`` on 2 CPU processes of one machine, its own port."""
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    options = ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", free_port()]
    return [PYTHON, *launch, *options, EXAMPLES / "train_accelerate.py", *script_args]


def _accelerate_yaml(out: Path) -> str:
    path = out / "accelerate.yaml"
    path.write_text((REPO / "configs/accelerate/zero2.yaml").read_text() + f"main_process_port: {free_port()}\n")
    return str(path)


ENTRY_POINTS = {
    "lightning_hydra": lambda out: [
        PYTHON,
        EXAMPLES / "train.py",
        f"trainer.max_steps={ENTRY_STEPS}",
        f"hydra.run.dir={out}",
    ],
    "lightning_deepspeed_json": lambda out: [
        PYTHON,
        EXAMPLES / "train_deepspeed_json.py",
        "--max-steps",
        ENTRY_STEPS,
        "--out",
        out,
    ],
    "pytorch_lightning": lambda out: [PYTHON, SCRIPTS / "lightning_by_name.py", "pytorch_lightning", "zero1", out],
    "fabric": lambda out: [PYTHON, EXAMPLES / "train_fabric.py", "--max-steps", ENTRY_STEPS, "--out", out],
    "accelerate_launch": lambda out: accelerate_launch("--max-steps", ENTRY_STEPS, "--out", out),
    "ds_strategy_launch": lambda out: [
        DS_STRATEGY,
        "launch",
        "--config_file",
        _accelerate_yaml(out),
        EXAMPLES / "train_accelerate.py",
        "--max-steps",
        ENTRY_STEPS,
        "--out",
        out,
    ],
}
_ENTRY_ENV = {"accelerate_launch": {"DS_STRATEGY_CONFIG": '{"stage": 1}'}}
THREAD_PROBE = SCRIPTS / "threads_at_exit"  # its sitecustomize lists each process's threads at its last atexit
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def entry_point_env(name: str, probe_threads: bool = False) -> dict:
    """The environment entry point ``name`` runs with; ``probe_threads`` puts the thread probe on PYTHONPATH, for
    every process of the run (the launched ranks inherit it)."""
    env = dict(_ENTRY_ENV.get(name, {}))
    if probe_threads:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(THREAD_PROBE), os.environ.get("PYTHONPATH")]))
    return env


def thread_listings(result: subprocess.CompletedProcess) -> list[str]:
    """What the thread probe printed, one listing per process of the run (two processes may print on one line)."""
    return re.findall(r"threads at exit of pid \d+: (\[[^\]]*\])", result.stderr)


def gloo_threads_at_exit(result: subprocess.CompletedProcess) -> list[str]:
    """The listings that still show a gloo thread: some object kept a process group alive past our teardown."""
    return [listing for listing in thread_listings(result) if any(name in listing for name in GLOO_THREADS)]
