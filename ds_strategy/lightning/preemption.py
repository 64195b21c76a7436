"""Preemption under ZeroStrategy: on SIGTERM every rank finishes its optimizer step, the ranks write one checkpoint
and exit, and ``fit(ckpt_path="last")`` resumes exactly.

Note: [Why ZeroStrategy replaces Lightning's SIGTERM handling]
Lightning 2.6's SIGTERM handler (``_SignalConnector._sigterm_notifier_fn``) runs a ``dist.broadcast`` inside the
signal handler, that is at whatever bytecode the main thread was executing, on the signalled rank only; its SLURM
requeue handler saves a checkpoint there too. Under ZeRO a collective issued mid-step pairs with one of the
engine's on the other ranks, so the job mismatches its collectives or deadlocks instead of saving. During
training :class:`PreemptionCheckpoint` replaces both handlers by one that only notes the signal. At each optimizer
step boundary (``on_train_batch_end`` of a batch that stepped, the moment ``ModelCheckpoint`` saves at, so resume
is as exact as with its checkpoints) the ranks all-reduce (max) the signal each has noted: one rank having
received it is enough, and every rank acts at the same step. They then save through ``trainer.save_checkpoint``,
which writes an atomic checkpoint directory (see [Atomic checkpoint directories]), and raise :class:`Preempted`,
a ``SIGTERMException`` as Lightning raises for SIGTERM, so that ``on_exception`` callbacks and teardown run and
the script does not carry on after ``fit``. The cost is one all-reduce of one integer per optimizer step.

Where and how:
  * SIGTERM (SLURM's preemption, Kubernetes' pod deletion, ``kill``) writes ``last.ckpt`` in the first
    ``ModelCheckpoint``'s directory, where ``fit(ckpt_path="last")`` looks (or ``dirpath/last.ckpt`` when given,
    or ``default_root_dir/checkpoints`` without a ModelCheckpoint: then pass that path to ``ckpt_path``);
  * with ``SLURMEnvironment(auto_requeue=True)``, its ``requeue_signal`` (SIGUSR1, sent by ``#SBATCH
    --signal=SIGUSR1@90``) writes Lightning's ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which Lightning
    resumes from by itself on SLURM (``fit(ckpt_path=None)``), and rank 0 runs ``scontrol requeue`` as Lightning
    does.
Every rank exits with ``128 + signal`` (143 for SIGTERM), the status of a process ended by that signal, so that a
scheduler or ``torchrun`` sees an unfinished run, not a success. Lightning's ``devices=N`` launcher SIGKILLs every
rank when it sees a child exit non-zero; the launching rank therefore waits for its children, which are exiting
from the same checkpoint, and tells its observer thread they succeeded.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..comm.collectives import Collectives

log = logging.getLogger(__name__)
CHILD_EXIT_WAIT_S = 120.0


class Preempted(SIGTERMException):
    """Training stopped at a step boundary after a preemption signal, with its checkpoint written at ``path``."""

    def __init__(self, code: int, path: str):
        super().__init__(code)
        self.path = path


class PreemptionCheckpoint(Callback):
    """Save and stop at the first optimizer step boundary after any rank received SIGTERM (or, under
    ``SLURMEnvironment(auto_requeue=True)``, its requeue signal). ZeroStrategy adds one unless the Trainer has one.

    ``dirpath``: where ``last.ckpt`` goes; by default the first ModelCheckpoint's directory. ``exit_code``: the
    processes' exit status after saving; by default ``128 + signal``.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, exit_code: int | None = None):
        self.dirpath = dirpath
        self.exit_code = exit_code
        self.received = 0  # the signal number noted since training started, 0 for none
        self._replaced: dict[int, object] = {}
        self._step_before = -1
        self._collectives: Collectives | None = None

    # -- signals ----------------------------------------------------------------------------------------------
    def _requeue_signal(self, trainer) -> int | None:
        environment = trainer._accelerator_connector.cluster_environment
        return environment.requeue_signal if getattr(environment, "auto_requeue", False) else None

    def _note(self, signum: int, _frame) -> None:
        """The handler: note the signal and nothing else (it runs between any two bytecodes of the step)."""
        self.received = self.received or signum

    def on_train_start(self, trainer, pl_module) -> None:
        """After Lightning registered its handlers (``Trainer._run``), replace them for the training loop."""
        self.received = 0
        config = getattr(trainer.strategy, "config", None)
        self._collectives = Collectives(timeout=getattr(config, "collective_timeout", 600.0))
        for signum in {signal.SIGTERM, self._requeue_signal(trainer)} - {None}:
            self._replaced[signum] = signal.signal(signum, self._note)

    def _restore_handlers(self) -> None:
        for signum, handler in self._replaced.items():
            signal.signal(signum, handler)
        self._replaced = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()

    # -- the step boundary ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step_before:  # an accumulation micro-batch: no step boundary
            return
        signum = self._agree(trainer)
        if signum:
            self._save_and_stop(trainer, signum)

    def _agree(self, trainer) -> int:
        """The largest signal number any rank noted (0: none), the same on every rank."""
        if trainer.world_size == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=trainer.strategy.root_device)
        self._collectives.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, label="preemption signal").wait()
        return int(flag.item())

    def checkpoint_path(self, trainer, signum: int) -> str:
        """``last.ckpt`` for SIGTERM, Lightning's next HPC checkpoint for SLURM's requeue signal."""
        if signum == self._requeue_signal(trainer):
            return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        if self.dirpath is not None:
            return str(Path(self.dirpath, "last.ckpt"))
        model_checkpoint = trainer.checkpoint_callback
        if model_checkpoint is not None and getattr(model_checkpoint, "dirpath", None):
            name = getattr(model_checkpoint, "CHECKPOINT_NAME_LAST", "last") + ".ckpt"
            return str(Path(model_checkpoint.dirpath, name))
        return str(Path(trainer.default_root_dir, "checkpoints", "last.ckpt"))

    def _save_and_stop(self, trainer, signum: int) -> None:
        path = self.checkpoint_path(trainer, signum)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.warning(f"preempted by signal {signum}: checkpoint written to {path} at step {trainer.global_step}")
            if signum == self._requeue_signal(trainer):
                _requeue_slurm_job()
        self._restore_handlers()
        code = self.exit_code if self.exit_code is not None else 128 + signum
        # no rank exits before the launching rank waits for them: one that did while it still wrote, logged or
        # requeued would be seen by the launcher's observer, which SIGKILLs everything on a non-zero exit
        trainer.strategy.barrier("preemption checkpoint written")
        _let_children_exit(trainer, code)
        raise Preempted(code, path)


def _let_children_exit(trainer, code: int) -> None:
    """On the rank whose Lightning launcher started the others, wait for them to exit with ``code`` and report
    them as done to the launcher's observer, which would otherwise SIGKILL this rank mid-exit on seeing it."""
    for child in getattr(trainer.strategy.launcher, "procs", None) or []:
        try:
            if child.wait(timeout=CHILD_EXIT_WAIT_S) == code:
                child.returncode = 0
        except subprocess.TimeoutExpired:
            log.warning(
                f"launched rank with pid {child.pid} did not exit within {CHILD_EXIT_WAIT_S} s of the "
                f"preemption checkpoint"
            )


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` this job, as Lightning's SLURM requeue handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    result = subprocess.call(["scontrol", "requeue", job])
    (log.info if result == 0 else log.warning)(f"scontrol requeue {job} exited {result}")


def add_preemption_checkpoint(trainer) -> None:
    """Give ``trainer`` a :class:`PreemptionCheckpoint`, last among its callbacks, unless it has one."""
    if not any(isinstance(callback, PreemptionCheckpoint) for callback in trainer.callbacks):
        trainer.callbacks.append(PreemptionCheckpoint())
