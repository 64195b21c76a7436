"""Exit codes of every entry point, repeated: each run must exit 0 with no "terminate called without an active
exception" anywhere in its stderr (see ``ds_strategy/comm/process_exit.py``).

    python benchmarks/clean_exit.py                      # 50 runs of each entry point, and of the reproducer
    python benchmarks/clean_exit.py --runs 5 --only fabric gloo_race_bare

``gloo_race_bare`` is torch's own behaviour (the reproducer without our teardown): it is expected to abort now
and then, and its count is the baseline; every other entry must be clean in every run. Runs a short training of
each example (3 optimizer steps) so that start-up, a collective-heavy step and the final checkpoint are covered.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import import_root  # noqa: F401 - the suite's folders on sys.path: Note: [Every folder of the suite is an import root]
from e2e_runs import ENTRY_POINTS, EXIT_ABORT, entry_point_env, gloo_threads_at_exit, run, run_gloo_exit_race


def failures_of(name: str, runs: int) -> list[str]:
    """One line per failed run of entry point ``name`` (exit code and the end of its stderr)."""
    failed = []
    for i in range(runs):
        if name.startswith("gloo_race_"):
            results = run_gloo_exit_race(name.removeprefix("gloo_race_"), pairs=1)
        else:
            with tempfile.TemporaryDirectory(prefix="clean_exit_") as out:
                results = [
                    run(
                        ENTRY_POINTS[name](Path(out)),
                        env=entry_point_env(name, probe_threads=True),
                        timeout=600,
                        check=False,
                    )
                ]
        for result in results:
            if result.returncode != 0 or EXIT_ABORT in result.stderr:
                failed.append(f"run {i}: exit {result.returncode}: {result.stderr.strip()[-300:]!r}")
            elif not name.startswith("gloo_race_") and gloo_threads_at_exit(result):
                failed.append(f"run {i}: gloo threads left at exit: {gloo_threads_at_exit(result)}")
    return failed


def main() -> None:
    names = [*ENTRY_POINTS, "gloo_race_ours", "gloo_race_bare"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--only", nargs="+", choices=names, default=names)
    args = parser.parse_args()
    dirty = False
    for name in args.only:
        failed = failures_of(name, args.runs)
        print(f"{name}: {args.runs - len(failed)} of {args.runs} runs clean", flush=True)
        for line in failed:
            print(f"  {line}")
        dirty |= bool(failed) and name != "gloo_race_bare"
    sys.exit(1 if dirty else 0)


if __name__ == "__main__":
    main()
