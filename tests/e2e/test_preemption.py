"""SIGTERM during a 2-rank Lightning fit (``scripts/lightning_faults.py``): rank 1 alone is signalled in its
training_step of step 2; every rank finishes that step, the job writes ``last.ckpt`` atomically and exits 143,
and ``fit(ckpt_path="last")`` then ends bitwise where an uninterrupted fit ends. See
``ds_strategy/lightning/preemption.py``, [Why ZeroStrategy replaces Lightning's SIGTERM handling]."""

import os
import sys

import pytest
import torch
from e2e_runs import EXIT_ABORT, SCRIPTS, output, run

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

FAULT_STEP, STEPS = 2, 4


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempted")
    stopped = run([sys.executable, SCRIPTS / "lightning_faults.py", "sigterm", out], cwd=out, timeout=240, check=False)
    resumed = run([sys.executable, SCRIPTS / "lightning_faults.py", "resume", out], cwd=out, timeout=240)
    return out, stopped, resumed, torch.load(out / "result.pt", weights_only=False)


def test_sigterm_on_one_rank_writes_a_complete_checkpoint_and_exits_every_rank_with_143(preempted):
    out, stopped, _, _ = preempted
    assert stopped.returncode == 128 + 15 and EXIT_ABORT not in stopped.stderr, output(stopped)[-4000:]
    assert f"checkpoint written to {out / 'ckpts' / 'last.ckpt'} at step {FAULT_STEP}" in stopped.stderr
    assert {"manifest.json", "meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} == set(
        os.listdir(out / "ckpts" / "last.ckpt")
    )
    assert not [name for name in os.listdir(out / "ckpts") if name.startswith(".")]  # no partial left behind


def test_fit_resumed_from_last_equals_the_uninterrupted_fit_bitwise(preempted):
    _, _, resumed, result = preempted
    assert "Restoring states from the checkpoint path at" in resumed.stdout + resumed.stderr
    uninterrupted, after = result["uninterrupted"], result["resumed"]
    assert after["losses"] == uninterrupted["losses"][FAULT_STEP:]
    assert len(after["losses"]) == STEPS - FAULT_STEP
    assert uninterrupted["final"].keys() == after["final"].keys()
    for name, value in uninterrupted["final"].items():
        assert torch.equal(after["final"][name], value), name


def _slurm_trainer(tmp_path, monkeypatch):
    """Just what PreemptionCheckpoint reads of a Trainer under ``SLURMEnvironment(auto_requeue=True)``."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    return SimpleNamespace(
        _accelerator_connector=SimpleNamespace(cluster_environment=SLURMEnvironment()),
        _checkpoint_connector=_CheckpointConnector,
        default_root_dir=str(tmp_path),
        checkpoint_callback=None,
    )


def test_slurm_requeue_signal_saves_lightnings_next_hpc_checkpoint_and_sigterm_saves_last(tmp_path, monkeypatch):
    """Under Lightning's SLURM convention the requeue signal (SIGUSR1) writes ``hpc_ckpt_<n+1>.ckpt``, which
    ``fit(ckpt_path=None)`` resumes from on SLURM; SIGTERM still writes ``last.ckpt``."""
    import signal

    from ds_strategy.lightning.preemption import PreemptionCheckpoint

    trainer = _slurm_trainer(tmp_path, monkeypatch)
    callback = PreemptionCheckpoint()
    assert callback._requeue_signal(trainer) == signal.SIGUSR1
    assert callback.checkpoint_path(trainer, signal.SIGUSR1) == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert callback.checkpoint_path(trainer, signal.SIGTERM) == str(tmp_path / "checkpoints" / "last.ckpt")


def test_slurm_requeue_runs_scontrol_requeue_for_the_job(tmp_path, monkeypatch):
    from ds_strategy.lightning.preemption import _requeue_slurm_job

    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "called"}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    _requeue_slurm_job()
    assert (tmp_path / "called").read_text().split() == ["requeue", "4242"]
