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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from e2e_runs import (
    DS_STRATEGY,
    EXAMPLES,
    EXIT_ABORT,
    PYTHON,
    REPO,
    SCRIPTS,
    free_port,
    run,
    run_gloo_exit_race,
)

STEPS = "3"


def _accelerate_yaml(out: Path) -> str:
    path = out / "accelerate.yaml"
    path.write_text((REPO / "configs/accelerate/zero2.yaml").read_text() + f"main_process_port: {free_port()}\n")
    return str(path)


ENTRY_POINTS = {
    "lightning_hydra": lambda out: [PYTHON, EXAMPLES / "train.py", f"trainer.max_steps={STEPS}",
                                    f"hydra.run.dir={out}"],
    "lightning_deepspeed_json": lambda out: [PYTHON, EXAMPLES / "train_deepspeed_json.py", "--max-steps", STEPS,
                                             "--out", out],
    "pytorch_lightning": lambda out: [PYTHON, SCRIPTS / "lightning_by_name.py", "pytorch_lightning", "zero1", out],
    "fabric": lambda out: [PYTHON, EXAMPLES / "train_fabric.py", "--max-steps", STEPS, "--out", out],
    "accelerate_launch": lambda out: [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                                      "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                                      "no", "--main_process_port", free_port(), EXAMPLES / "train_accelerate.py",
                                      "--max-steps", STEPS, "--out", out],
    "ds_strategy_launch": lambda out: [DS_STRATEGY, "launch", "--config_file", _accelerate_yaml(out),
                                       EXAMPLES / "train_accelerate.py", "--max-steps", STEPS, "--out", out],
}
ACCELERATE_ENV = {"accelerate_launch": {"DS_STRATEGY_CONFIG": '{"stage": 1}'}}


def failures_of(name: str, runs: int) -> list[str]:
    """One line per failed run of entry point ``name`` (exit code and the end of its stderr)."""
    failed = []
    for i in range(runs):
        if name.startswith("gloo_race_"):
            results = run_gloo_exit_race(name.removeprefix("gloo_race_"), pairs=1)
        else:
            with tempfile.TemporaryDirectory(prefix="clean_exit_") as out:
                results = [run(ENTRY_POINTS[name](Path(out)), env=ACCELERATE_ENV.get(name), timeout=600,
                               check=False)]
        for result in results:
            if result.returncode != 0 or EXIT_ABORT in result.stderr:
                failed.append(f"run {i}: exit {result.returncode}: {result.stderr.strip()[-300:]!r}")
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
