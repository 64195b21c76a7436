"""A rank's collective that failed because another rank failed, named: :class:`PeerFailedError`, and the seams that
turn a library's raw transport error into it.

Note: [Collectives a library issues]
The engine's own collectives name a failed peer as they wait (:mod:`.collectives`). The libraries we call issue
collectives of their own, on the same process groups: DCP's ``gather_object``/``all_reduce`` inside a sharded save
or load, Lightning's and Fabric's ``barrier``/``broadcast``/``reduce``/``all_gather``, accelerate's ``gather`` and
``wait_for_everyone``, the HF Trainer's metric and checkpoint exchanges, ``torch.distributed.pipelining``'s
send/recv, DTensor redistributions under tensor parallelism, torchmetrics' syncs. On gloo such a collective blocks in
C++ until its peer answers, closes its connection, or the process group's own timeout passes
(``init_process_group(timeout=...)``, ``ZeroConfig.timeout`` for every adapter), and then raises gloo's raw
``RuntimeError`` ("Connection closed by peer", "Connection reset by peer", "Timed out waiting ... for recv").
Nothing of ours runs while it blocks, so it cannot be cut into slices that read the failure record: a dead peer ends
it at once (its sockets close), a peer that raised ends it when that rank's process exits (which an uncaught
exception makes it do promptly: Note: [Why every process group is destroyed at exit] in :mod:`.process_exit`), and
anything else at the process group's timeout. What we own is what happens *after*: the raw error is read against the
job's failure board (:func:`peer_failed_error`) and becomes the same :class:`PeerFailedError` an engine collective
raises, the raw error chained as its cause, printed to stderr at once (a launcher may SIGKILL this rank a moment
later).

That reading happens at three depths, so that no library collective escapes it:
  * at the seams where ds_strategy hands control to a library (:func:`naming_failed_peers`, a context manager and
    decorator, and :func:`name_failed_peers_in`, which applies it to the named methods of an adapter class): the
    sharded checkpoint's ``write`` and ``load``, every adapter's collectives, checkpoint save and load (whatever
    format: a new save path added to ``save_checkpoint`` is covered by the seam around it), training, evaluation and
    prediction steps, the pipeline runner's steps. There the caller gets the typed error;
  * in Lightning's ``on_exception``, which sees every error of a fit, and
  * in ``sys.excepthook``, which sees every uncaught error of any entry point (a Fabric or accelerate loop calling a
    library directly): both print the diagnosis, with the raw error chained, and never record a consequence as the
    job's first failure (:func:`~.rank_failure.report_failure`).
Only errors that come from the transport are read this way (a ``torch.distributed.DistError``, or a message naming
gloo, NCCL, a closed or reset connection or a timeout): a rank's own error that happens while a peer is dying is its
own, and is raised unchanged.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch.distributed as dist

from . import rank_failure


class PeerFailedError(RuntimeError):
    """A collective failed because another rank failed: it raised, died (SIGKILL, the OOM killer, a crash) or
    closed its connections. The message names that rank and its error where the job's failure record or its
    process shows it (:mod:`.rank_failure`); that error is the cause to look at."""


SETTLE_S = 1.0  # how long a closed connection's sender may take to show as dead (see diagnosis)
# How gloo reports a peer whose sockets closed (a dead or departed process), as opposed to a timeout.
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")
# What else marks an error as the transport's rather than the rank's own (Note: [Collectives a library issues]).
_TRANSPORT = (*PEER_GONE, "gloo", "nccl", "timed out", "timeout")
LIBRARY_COLLECTIVE = "a collective a library issued"  # what a rank was doing, where no seam said more
_SEEN = "_ds_strategy_peer_failure"  # the PeerFailedError an error was read as, kept on it: said once, read once


def diagnosis(error: BaseException) -> str | None:
    """Why a collective that raised ``error`` failed, naming the peer, or None when nothing shows a peer failed.

    A peer's closed connection can arrive before its process is a zombie (the kernel closes a killed process's
    sockets as it tears it down), so a closed connection with nothing to show for it is looked at again for up to
    ``SETTLE_S``."""
    failures = rank_failure.board()
    if failures is None:
        return None
    why = failures.diagnose()
    gone = any(sign in str(error).lower() for sign in PEER_GONE)
    settled = time.monotonic() + SETTLE_S
    while why is None and gone and time.monotonic() < settled:
        time.sleep(0.05)
        why = failures.diagnose()
    if why is None and gone:
        why = f"another rank died or left the job ({error})"
    return why


def announced(what: str, why: str) -> PeerFailedError:
    """The error for ``what`` (``rank R: ...``) failing because ``why``, said on stderr at once, named as its
    traceback would name it: a launcher that saw the other rank exit (Lightning's) may SIGKILL this one before its
    traceback prints, and then this line is all the log holds."""
    failed = PeerFailedError(
        f"{what} failed because {why}. That rank's own error is the cause; this one is its consequence."
    )
    print(f"[ds_strategy] {type(failed).__name__}: {failed}", file=sys.stderr, flush=True)
    return failed


def peer_failed_error(error: BaseException, what: str) -> PeerFailedError | None:
    """``error``, raised by a collective a library issued while doing ``what``, read as the consequence of a peer's
    failure (a :class:`PeerFailedError` naming it, announced once), or None when it is this rank's own error or
    nothing shows a peer failed. Reading the same error again returns the same answer without new store reads."""
    if isinstance(error, PeerFailedError) or _consequence(error):
        return None
    if hasattr(error, _SEEN):
        return getattr(error, _SEEN)
    failed = None
    if _from_the_transport(error) and dist.is_initialized():
        why = diagnosis(error)
        if why is not None:
            failed = announced(f"rank {dist.get_rank()}: {what}", why)
    with contextlib.suppress(AttributeError):  # an exception type with __slots__ keeps nothing
        setattr(error, _SEEN, failed)
    return failed


def is_consequence(error: BaseException) -> bool:
    """Whether ``error`` follows from another rank's failure (and must not be recorded as the job's first)."""
    return (
        isinstance(error, PeerFailedError)
        or _consequence(error)
        or peer_failed_error(error, LIBRARY_COLLECTIVE) is not None
    )


def _consequence(error: BaseException) -> bool:
    """A PeerFailedError among ``error``'s causes: raised already, further down."""
    seen = error.__cause__ or error.__context__
    while seen is not None:
        if isinstance(seen, PeerFailedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _from_the_transport(error: BaseException) -> bool:
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(sign in str(error).lower() for sign in _TRANSPORT)
    )


class naming_failed_peers(contextlib.ContextDecorator):  # noqa: N801 - used as a function, like contextlib's own
    """Inside it, an error a library's collective raises because a peer failed becomes a :class:`PeerFailedError`
    naming the peer (the original chained); every other error passes unchanged. ``what`` says what this rank was
    doing ("saving the checkpoint /ckpt/step_4"). A context manager, or a decorator (Note: [Collectives a library
    issues])."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> naming_failed_peers:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None:
            return False
        failed = peer_failed_error(error, self.what)
        if failed is not None:
            raise failed from error
        return False


def name_failed_peers_in(cls: type, methods: tuple[str, ...]) -> type:
    """``cls`` with each of ``methods`` (its own or inherited) run inside :class:`naming_failed_peers`: the seams
    where an adapter hands control to a library that talks to other ranks. Returns ``cls``."""
    for name in methods:
        setattr(cls, name, naming_failed_peers(f"{cls.__name__}.{name}")(getattr(cls, name)))
    return cls
