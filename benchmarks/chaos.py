"""Chaos test of checkpointing, long form: N trials of a two-rank training run that checkpoints after every step,
has a rank SIGKILLed inside a step, a save or the rename (or at a random moment) and is restarted from the latest
complete checkpoint (see Note: [Chaos trial invariants] in ``tests/checkpoint/checkpoint_chaos.py``).

    python benchmarks/chaos.py                    # 200 trials, seeds 0..199
    python benchmarks/chaos.py --seed 17 --trials 1   # replay the trial a failure message names

Prints a table of kill points by outcome and every broken invariant; exits 1 if any invariant broke.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import import_root  # noqa: F401 - the suite's folders on sys.path: Note: [Every folder of the suite is an import root]
from checkpoint_chaos import KillPoint, TrialResult, draw, reference_run, run_trial

_COLUMNS = ("trials", "killed", "fresh start", "resumed", "via .previous", "refused dirs", "broken")


def table(results: list[TrialResult]) -> str:
    """One row per kill point: how many trials, what the restart did, how many directories load refused."""
    rows = [("kill point", *_COLUMNS)]
    for point in [*KillPoint, None]:
        mine = [r for r in results if point is None or r.trial.point is point]
        counts = Counter()
        for r in mine:
            counts.update(
                {
                    "trials": 1,
                    "killed": int(r.killed),
                    "fresh start": int(r.killed and not r.resumed_from),
                    "resumed": int(r.killed and r.resumed_from > 0),
                    "via .previous": int(r.via_previous),
                    "refused dirs": r.refused,
                    "broken": int(bool(r.broken)),
                }
            )
        rows.append((point.name.lower() if point else "all", *(str(counts[c]) for c in _COLUMNS)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="seed of the first trial (trial i uses seed + i)")
    args = parser.parse_args()
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="chaos_") as tmp:
        reference = reference_run(Path(tmp, "reference"))
        for i in range(args.trials):
            trial = draw(args.seed + i)
            workdir = Path(tmp, f"trial{trial.seed}")
            workdir.mkdir()
            try:
                result = run_trial(trial, workdir, reference)
            except Exception:  # noqa: BLE001 - the harness failing is reported as that trial's broken invariant
                result = TrialResult(trial, broken=[f"the trial itself failed:\n{traceback.format_exc()}"])
            results.append(result)
            if result.broken:
                print(f"BROKEN {trial}:\n  " + "\n  ".join(result.broken), flush=True)
            if (i + 1) % 10 == 0:
                print(f"{i + 1} of {args.trials} trials, {time.monotonic() - started:.0f} s", flush=True)
    broken = sum(bool(r.broken) for r in results)
    print(table(results))
    print(
        f"{len(results)} trials in {time.monotonic() - started:.0f} s "
        f"(median {sorted(r.wall_s for r in results)[len(results) // 2]:.1f} s a trial): "
        f"{len(results) - broken} held every invariant, {broken} broke one"
    )
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
