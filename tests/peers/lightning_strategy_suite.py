"""Lightning's own strategy tests, adapted minimally to ours, run against the installed ``ds_strategy`` (issue 45).

Lightning's test files are read from a git clone of Lightning (``--repo``, or ``$LIGHTNING_REPO``) at the tag of the
installed ``lightning`` (``--ref`` to choose another), copied into a temporary folder, and changed only where they name
a strategy class: Lightning's ``DDPStrategy`` becomes ``ZeroStrategy``/``ZeroFabricStrategy`` (both are DDPStrategy
subclasses), Lightning's ``DeepSpeedStrategy`` becomes ours built from the same arguments (a DeepSpeed config through
``from_deepspeed_config``), ``RunIf(deepspeed=True)`` no longer asks for the ``deepspeed`` package, and the DeepSpeed
files' one-device cases run on the CPU (ours need no GPU). Cases on several GPUs skip themselves as in Lightning's CPU
CI. Nothing of Lightning's is kept in this repository; without a
clone this says so and exits 0.

    python tests/peers/lightning_strategy_suite.py --repo ~/src/pytorch-lightning [--ref 2.6.5] [--lightning-strategies]

``--lightning-strategies`` runs the same files unadapted (Lightning's own strategies), the baseline each outcome is
read against. Every failure is printed with the first line of its reason; the figures and what each failure means are
in docs/guides/lightning.md ("Lightning's own strategy tests").
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# Lightning's files whose cases apply to a data-parallel strategy that also reads DeepSpeed configs.
FILES = [
    "tests_fabric/strategies/test_ddp.py",
    "tests_fabric/strategies/test_ddp_integration.py",
    "tests_fabric/strategies/test_deepspeed.py",
    "tests_fabric/strategies/test_deepspeed_integration.py",
    "tests_pytorch/strategies/test_ddp.py",
    "tests_pytorch/strategies/test_ddp_integration.py",
    "tests_pytorch/strategies/test_deepspeed.py",
]

SHIMS = '''"""Lightning's DeepSpeedStrategy signature over ours: a DeepSpeed config means what DeepSpeed means."""

import ds_strategy


def _deepspeed_like(base):
    class DeepSpeedStrategy(base):
        def __init__(self, config=None, **kwargs):
            if config is not None:
                config = ds_strategy.config.load_config(config, deepspeed=True)
            super().__init__(config, **kwargs)

    return DeepSpeedStrategy


FabricDeepSpeedStrategy = _deepspeed_like(ds_strategy.ZeroFabricStrategy)
TrainerDeepSpeedStrategy = _deepspeed_like(ds_strategy.ZeroStrategy)
'''

# (old, new) replacements, each made wherever it occurs in the files above.
ADAPTATIONS = [
    (
        "from lightning.fabric.strategies import DDPStrategy",
        "from ds_strategy import ZeroFabricStrategy as DDPStrategy",
    ),
    ("from lightning.pytorch.strategies import DDPStrategy", "from ds_strategy import ZeroStrategy as DDPStrategy"),
    (
        "from lightning.fabric.strategies import DeepSpeedStrategy",
        "from _zero_shims import FabricDeepSpeedStrategy as DeepSpeedStrategy",
    ),
    (
        "from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy",
        "from _zero_shims import TrainerDeepSpeedStrategy as DeepSpeedStrategy",
    ),
    ('strategy="deepspeed_stage_3"', "strategy=DeepSpeedStrategy(stage=3)"),
    ('strategy="deepspeed"', "strategy=DeepSpeedStrategy()"),
    ("RunIf(deepspeed=True, ", "RunIf("),
    ("RunIf(deepspeed=True)", "RunIf()"),
    (", deepspeed=True", ""),
]
# Lightning's DeepSpeed cases on one device need CUDA because DeepSpeed does; ours run them on the CPU. Those on two
# devices stay skipped: they need Lightning's standalone runner (one pytest process per case, re-run by each rank).
ONE_DEVICE_ON_CPU = [
    ("RunIf(min_cuda_gpus=1, standalone=True, ", "RunIf("),
    ("RunIf(min_cuda_gpus=1, standalone=True)", "RunIf()"),
    ("RunIf(min_cuda_gpus=1, ", "RunIf("),
    ("RunIf(min_cuda_gpus=1)", "RunIf()"),
    ('accelerator="gpu"', 'accelerator="cpu"'),
    ('accelerator="cuda"', 'accelerator="cpu"'),
]


def _copy_tests(repo: Path, ref: str, into: Path) -> None:
    """Lightning's ``tests/tests_fabric`` and ``tests/tests_pytorch`` at ``ref``, as files under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", ref, "tests/tests_fabric", "tests/tests_pytorch"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _adapt(tests: Path) -> None:
    (tests / "_zero_shims.py").write_text(SHIMS)
    for name in FILES:
        path = tests / name
        text = path.read_text()
        for old, new in ADAPTATIONS + (ONE_DEVICE_ON_CPU if "deepspeed" in name else []):
            text = text.replace(old, new)
        path.write_text(text)


def _outcomes(report: Path) -> list[tuple[str, str, str]]:
    """(test id, outcome, first line of the reason) for every case in pytest's JUnit XML."""
    rows = []
    for case in ET.parse(report).iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (child.get("message") or "").strip().splitlines()[0:1]
                reason = reason[0][:200] if reason else ""
        rows.append((f"{case.get('classname')}::{case.get('name')}", outcome, reason))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=os.environ.get("LIGHTNING_REPO"), help="a git clone of pytorch-lightning")
    parser.add_argument("--ref", help="the tag or commit to read (default: the installed lightning's version)")
    parser.add_argument("--lightning-strategies", action="store_true", help="run the files unadapted")
    parser.add_argument("-k", default=None, help="pytest's -k, to run some cases")
    args = parser.parse_args()
    if not args.repo or not Path(args.repo).exists():
        print("skipped: no clone of pytorch-lightning (pass --repo or set LIGHTNING_REPO)")
        return 0
    import lightning

    ref = args.ref or lightning.__version__
    with tempfile.TemporaryDirectory(prefix="lightning_tests_") as tmp:
        _copy_tests(Path(args.repo), ref, Path(tmp))
        tests = Path(tmp) / "tests"
        if not args.lightning_strategies:
            _adapt(tests)
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *FILES]
        command += ["-k", args.k] if args.k else []
        subprocess.run(
            command,
            cwd=tests,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))},
            stdout=subprocess.DEVNULL,
        )
        rows = _outcomes(report)
        shutil.rmtree(tests)
    print(f"Lightning {ref}'s strategy tests, {'unadapted' if args.lightning_strategies else 'adapted to ds_strategy'}")
    for name in FILES:
        module = name.removesuffix(".py").replace("/", ".")
        mine = [
            outcome for test, outcome, _ in rows if test == module or test.startswith((module + "::", module + "."))
        ]
        counts = {o: mine.count(o) for o in ("passed", "failed", "error", "skipped")}
        print(f"  {name}: " + ", ".join(f"{n} {o}" for o, n in counts.items()))
    for test, outcome, reason in rows:
        if outcome in ("failed", "error"):
            print(f"{outcome.upper()} {test}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
