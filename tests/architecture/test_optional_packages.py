"""Every optional package can be missing: each public module imports (or, if its whole purpose is that package,
refuses naming what to install) and every entry point that does not need it trains.

One fresh interpreter per case hides the case's packages from the import system and from ``importlib.metadata``, as a
machine without them would (``tests/architecture/optional_absent.py`` says how, and what it runs: the import of every
public module of ``ds_strategy``; ``ZeroEngine`` alone; Lightning's Trainer by the names ``zero2`` and ``zero3``; Fabric
with ``zero2``; ``examples/train_accelerate.py`` configured by ``$DS_STRATEGY_CONFIG`` with a DeepSpeed config whose
optimizer and scheduler come from accelerate's ``DummyOptim``/``DummyScheduler``; ``ZeroTrainer``; ``examples/
train.py`` through Hydra; and the ``ds-strategy`` command). A case takes 5-15 s of CPU, mostly importing torch,
Lightning, transformers and the peers, so the cases run side by side, two at a time.

Two kinds of case: one package missing from a machine that has every other (``deepspeed``, ``triton``, ...), and a
machine with one extra only (``extra_lightning``: ``pip install -e ".[lightning]"``; ``extra_transformers``;
``core``: no framework at all), where each entry point of that extra trains and each adapter of another refuses.
``CI`` proves the extras' cases again for real, from wheels installed in fresh virtual environments (``.ci/run``).

The ``deepspeed`` case is the machine the README promises and issue 24 found broken: accelerate exports
``DummyOptim`` from ``accelerate.utils`` only when DeepSpeed is installed, so importing it from there fails this case.
"""

import importlib
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from optional_absent import ENTRY_POINTS, STEPS, runnable

from ds_strategy.optional_packages import needs

HERE = Path(__file__).resolve().parent
PARALLEL = 2
# ds-strategy estimate --params 1e6 --world-size 2 --stage 3 (bf16-mixed, Adam): 16 bytes per parameter over 2 ranks
ESTIMATE_BYTES = 16 * 1e6 / 2

# Each optional framework as the top-level packages its install brings (what a machine without it lacks).
FRAMEWORKS = {
    "lightning": ("lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning", "torchmetrics"),
    "pytorch_lightning": ("pytorch_lightning",),
    "accelerate": ("accelerate",),
    "transformers": ("transformers",),
    "hydra": ("hydra", "omegaconf"),
    "triton": ("triton",),
    "trl": ("trl",),
    "peft": ("peft",),
    "deepspeed": ("deepspeed",),
}
# The modules whose whole purpose is a package, which refuse to import without it (with every module under them),
# and the install command the refusal must name: the extra's requirements, which install today (Note: [The install
# command a missing package names] in ds_strategy/optional_packages.py); a package's entry precedes its subpackages'.
LIGHTNING_INSTALL = "pip install 'lightning>=2.5'"
REFUSALS = {
    "ds_strategy.lightning": ({"lightning"}, LIGHTNING_INSTALL),
    "ds_strategy.lightning.standalone": ({"pytorch_lightning"}, LIGHTNING_INSTALL),
    "ds_strategy.fabric": ({"lightning"}, LIGHTNING_INSTALL),
    "ds_strategy.autotune": ({"lightning"}, LIGHTNING_INSTALL),
    "ds_strategy.accelerate": ({"accelerate"}, "pip install 'accelerate>=1.0'"),
    "ds_strategy.transformers": ({"transformers", "accelerate"}, "pip install 'accelerate>=1.0' 'transformers>=5.0'"),
    "ds_strategy.transformers.trl_trainers": ({"trl"}, "pip install 'trl'"),
    "ds_strategy.hydra": ({"hydra"}, "pip install 'hydra-core>=1.3' 'omegaconf>=2.3'"),
    "ds_strategy.kernels.grad_stats": ({"triton"}, "pip install 'triton'"),
    "ds_strategy.kernels.quantize": ({"triton"}, "pip install 'triton'"),
}


def _only(*present: str) -> tuple[str, ...]:
    return tuple(name for name in FRAMEWORKS if name not in present)


# each case: the frameworks missing
CASES = {
    **{name: (name,) for name in FRAMEWORKS},
    "extra_lightning": _only("lightning"),
    "extra_transformers": _only("accelerate", "transformers"),
    "core": _only(),
}
# what a user of each extra runs, all of which must train there
EXTRA_ENTRY_POINTS = {
    "extra_lightning": {"engine", "cli", "deepspeed_initialize", "lightning_zero2", "lightning_zero3", "fabric_zero2"},
    "extra_transformers": {"engine", "cli", "deepspeed_initialize", "accelerate", "hf_trainer"},
    "core": {"engine", "cli", "deepspeed_initialize"},
}


def _hidden(case: str) -> tuple[str, ...]:
    return tuple(package for framework in CASES[case] for package in FRAMEWORKS[framework])


def _refused(case: str) -> dict[str, str]:
    """The refused modules of the case, each with the install command its error must name."""
    return {module: install for module, (needed, install) in REFUSALS.items() if needed & set(CASES[case])}


def _run_case(name: str, out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HERE / "optional_absent.py"), str(out), *_hidden(name)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=out_dir
    )
    assert result.returncode == 0 and out.exists(), f"{cmd} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory) -> dict[str, Future]:
    """The reports of the cases this session selected, started side by side when the first is needed."""
    specs = (getattr(item, "callspec", None) for item in request.session.items if item.module is request.module)
    selected = [spec.params["case"] for spec in specs if spec is not None]  # the one parametrized test's cases
    selected.append(REFERENCE_CASE)  # every case's losses are compared with its
    out_dir = tmp_path_factory.mktemp("optional_absent")
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {case: pool.submit(_run_case, case, out_dir) for case in dict.fromkeys(selected)}
        yield futures
        for future in futures.values():
            future.cancel()


# Note: [The reference of the absent-package cases]
# Whether a package is installed must not change what an entry point that does not need it computes: each entry
# point trains the same seeded model on the same batches in every case, so its losses must be the ones it reaches on
# the machine with every entry point (the ``deepspeed`` case: nothing of ours imports DeepSpeed). "The loss fell" alone
# would pass a run that trained wrongly.
REFERENCE_CASE = "deepspeed"
LOSS_RTOL = 1e-6


def _refusal(module: str, refused: dict[str, str]) -> tuple[str, str] | None:
    """``(refused module, install command)`` if ``module`` is or lies under a refused one, else None."""
    for prefix, install in refused.items():
        if module == prefix or module.startswith(prefix + "."):
            return prefix, install
    return None


def _names_what_to_install(error: str | None, hidden: tuple[str, ...], install: str) -> bool:
    return bool(error and error.startswith("ModuleNotFoundError") and install in error) and any(
        repr(package) in error for package in hidden
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_everything_that_does_not_need_the_package_imports_and_trains_without_it(case, reports):
    hidden, refused = _hidden(case), _refused(case)
    report = reports[case].result()
    assert report["leaked"] == [], f"{report['leaked']} were imported although hidden"

    # Every module imports, but a refused one, which fails naming the package and its install command. A module under
    # a refused package may import anyway: its parent's failed import left it in sys.modules, as it would for a user.
    imports = report["imports"]
    broken = {module: error for module, error in imports.items() if error and not _refusal(module, refused)}
    assert broken == {}, f"with {hidden} missing these modules fail to import"
    assert len(imports) > 100 and "ds_strategy.accelerate.dummy_objects" in imports, sorted(imports)
    assert "ds_strategy.kernels.quantize" in imports and set(refused) <= set(imports)
    unclear = {
        module: error
        for module, error in imports.items()
        if (refusal := _refusal(module, refused))
        and (error or module == refusal[0])
        and not _names_what_to_install(error, hidden, refusal[1])
    }
    assert unclear == {}, f"with {hidden} missing these imports must fail naming the package and how to install it"

    # ds_strategy.ZeroStrategy and the other Lightning names: there with Lightning, else an error saying what to install
    names = report["adapter_names"]
    if "lightning" in CASES[case]:
        assert all(_names_what_to_install(error, hidden, LIGHTNING_INSTALL) for error in names.values()), names
    else:
        assert names == dict.fromkeys(names) and len(names) == 3, names

    runs = report["entry_points"]
    expected = set(runnable(set(hidden)))
    assert set(runs) == expected == EXTRA_ENTRY_POINTS.get(case, expected) and "engine" in expected
    assert case != "deepspeed" or expected == set(ENTRY_POINTS), "one case has every entry point"
    failed = {name: run["error"] for name, run in runs.items() if run["error"]}
    assert failed == {}, f"with {hidden} missing these entry points fail"
    reference = reports[REFERENCE_CASE].result()["entry_points"]
    for name in expected - {"cli"}:
        losses = runs[name]["values"]
        assert len(losses) == STEPS and losses[-1] < losses[0], f"{name} did not train: losses {losses}"
        assert losses == pytest.approx(reference[name]["values"], rel=LOSS_RTOL), (
            f"{name} trains otherwise with {hidden} missing (Note: [The reference of the absent-package cases])"
        )
    assert runs["cli"]["values"] == [ESTIMATE_BYTES]


def test_only_a_package_that_is_not_installed_is_reported_as_missing():
    """``needs`` names the install command for an absent package, but a submodule missing from an installed one (a
    version without it) keeps Python's own error."""
    absent = (
        r"^adapter needs the optional package 'absent_pkg_24', which is not installed: pip install 'absent_pkg_24'$"
    )
    with pytest.raises(ModuleNotFoundError, match=absent), needs("absent_pkg_24", needed_by="adapter"):
        importlib.import_module("absent_pkg_24")
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'pytest\.no_such_module'$"):
        with needs("pytest", needed_by="adapter"):
            importlib.import_module("pytest.no_such_module")
