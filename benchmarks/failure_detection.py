"""How soon a job learns that one of its ranks failed: rank 1 of a 2-rank Lightning fit raises, runs out of memory or
is SIGKILLed in its training_step while rank 0 goes on into the step's collectives (``tests/e2e/scripts/
lightning_faults.py``, collective timeout 300 s). Per run, the seconds from rank 1's failure until rank 0 names it
(``[ds_strategy] PeerFailedError: rank 0: ...``; the design aims at about ``rank_failure.POLL_S``, 1 s) and until the
whole job has exited. ``tests/e2e/test_rank_failure.py`` checks only that both happen before the collective
timeout; how soon is measured here, on a machine whose load is printed beside the figures.

    python benchmarks/failure_detection.py              # 5 runs of each mode
    python benchmarks/failure_detection.py --runs 1 --modes sigkill
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import import_root  # noqa: F401 - the suite's folders on sys.path: Note: [Every folder of the suite is an import root]
from e2e_runs import run_lightning_fault

MODES = ("raise", "oom", "sigkill")


def measure(mode: str, runs: int) -> tuple[list[float], list[float], int]:
    """Seconds to the failure being named and to the job's end, per run; and how many runs never named it."""
    named, ended, silent = [], [], 0
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="failure_detection_") as out:
            _, failed_at, said_at, ended_at = run_lightning_fault(mode, Path(out))
        ended.append(ended_at - failed_at)
        if said_at is None:
            silent += 1
        else:
            named.append(said_at - failed_at)
    return named, ended, silent


def _spread(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.2f} / {max(seconds):.2f}" if seconds else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start\n")
    print("| mode | runs | named, s (median / max) | job ended, s (median / max) | never named |")
    print("|---|---|---|---|---|")
    silent_runs = 0
    for mode in args.modes:
        named, ended, silent = measure(mode, args.runs)
        silent_runs += silent
        print(f"| {mode} | {args.runs} | {_spread(named)} | {_spread(ended)} | {silent} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    return 1 if silent_runs else 0


if __name__ == "__main__":
    sys.exit(main())
