"""Run ds_strategy with some installed packages made absent, and report what worked as JSON.

    python tests/architecture/optional_absent.py OUT.json deepspeed [hydra omegaconf ...]

Run in a fresh interpreter (``tests/architecture/test_optional_packages.py`` starts one per case). It hides the named
top-level packages, imports every public module of ``ds_strategy`` and gets the Lightning names it exports, then trains
a few steps through each entry point that does not need a hidden package, and writes ``{"hidden": [...], "imports":
{module: error or null}, "adapter_names": {name: error or null}, "entry_points": {name: {"error": ..., "values":
[...]}}}`` to ``OUT.json``. It never raises: every failure is a result for the test to judge.

Note: [Hiding a package as a user's machine lacks it]
A finder that *raises* ImportError for a name would also make ``importlib.util.find_spec(name)`` raise, where a
machine without the package returns ``None``, and torch, accelerate, transformers and Lightning all probe optional
packages with ``find_spec`` and ``importlib.metadata``: raising there would fail code that works for real users.
So every finder on ``sys.meta_path`` is wrapped to find nothing under a hidden name (``import`` then raises
ModuleNotFoundError, ``find_spec`` returns None) and to list no distribution that provides one (``metadata.version``
raises PackageNotFoundError). A finder added later could still find a hidden package; the report's ``leaked`` lists
any hidden module that got imported anyway, which the test requires to be empty.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import pkgutil
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
STEPS = 4


class _HidingFinder(importlib.abc.MetaPathFinder):
    """One of ``sys.meta_path``'s finders, blind to the hidden packages and to the distributions providing them."""

    def __init__(self, finder, hidden: frozenset[str], hidden_distributions: frozenset[str]):
        self._finder, self._hidden, self._hidden_distributions = finder, hidden, hidden_distributions

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self._hidden or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(fullname, path, target)

    def find_distributions(self, *args, **kwargs):
        if not hasattr(self._finder, "find_distributions"):
            return iter(())
        found = self._finder.find_distributions(*args, **kwargs)
        return (d for d in found if _normalized(d.metadata["Name"] or "") not in self._hidden_distributions)

    def invalidate_caches(self):
        if hasattr(self._finder, "invalidate_caches"):
            self._finder.invalidate_caches()


def _normalized(distribution: str) -> str:
    return distribution.lower().replace("_", "-").replace(".", "-")


def hide(packages: list[str]) -> None:
    """Make the top-level ``packages`` (and the distributions that provide them) absent in this interpreter."""
    imported = [name for name in sys.modules if name.partition(".")[0] in packages]
    if imported:
        raise RuntimeError(f"{imported} were imported before they could be hidden (a .pth file?)")
    provided_by = importlib.metadata.packages_distributions()
    distributions = frozenset(_normalized(d) for name in packages for d in provided_by.get(name, ()))
    hidden = frozenset(packages)
    sys.meta_path[:] = [_HidingFinder(finder, hidden, distributions) for finder in sys.meta_path]
    importlib.invalidate_caches()


def public_modules() -> list[str]:
    """Every module of the installed ``ds_strategy`` whose dotted name has no ``_``-prefixed part, found on disk
    (importing a package to walk it would stop the walk at the first one that fails)."""
    import ds_strategy

    roots = [(Path(p), "ds_strategy") for p in ds_strategy.__path__]
    # the Triton kernels install as ds_strategy.kernels from the top-level kernels/ folder (pyproject's package-dir)
    roots.append((Path(importlib.util.find_spec("ds_strategy.kernels").origin).parent, "ds_strategy.kernels"))
    found = set()
    while roots:
        folder, package = roots.pop()
        found.add(package)
        for info in pkgutil.iter_modules([str(folder)]):
            if info.name.startswith("_"):
                continue
            if info.ispkg:
                roots.append((folder / info.name, f"{package}.{info.name}"))
            else:
                found.add(f"{package}.{info.name}")
    return sorted(found)


def _error(error: BaseException) -> str:
    """The exception as ``Type: message``, with the innermost frame it came from."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" [{Path(frames[-1].filename).name}:{frames[-1].lineno}]" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def import_all() -> dict[str, str | None]:
    """``{module: None, or the error importing it}`` for every public module (just ``ds_strategy`` if that fails)."""
    try:
        names = public_modules()
    except BaseException as error:  # noqa: B036
        return {"ds_strategy": _error(error)}
    results = {}
    for name in names:
        try:
            importlib.import_module(name)
            results[name] = None
        except BaseException as error:  # noqa: B036  a SystemExit on import is a result too
            results[name] = _error(error)
    return results


def adapter_names() -> dict[str, str | None]:
    """``{name: None, or the error getting it}`` for the Lightning and Fabric names ``ds_strategy`` exports."""
    results = {}
    for name in ("ZeroStrategy", "ZeroPrecision", "ZeroFabricStrategy"):
        try:
            getattr(importlib.import_module("ds_strategy"), name)
            results[name] = None
        except Exception as error:  # the error is the result
            results[name] = _error(error)
    return results


def _regression_batch():
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)


def _regression_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def train_engine(scratch: Path) -> list[float]:
    """``ZeroEngine`` alone at stage 3 (no adapter, no framework), STEPS steps on one fixed batch in a process group
    of one; the losses."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ds_strategy import ZeroConfig, ZeroEngine

    dist.init_process_group("gloo", init_method=f"file://{scratch / 'engine_store'}", rank=0, world_size=1)
    try:
        model = _regression_model()
        engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
        x, y = _regression_batch()
        losses = []
        for _ in range(STEPS):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            engine.step()
            losses.append(loss.item())
        return losses
    finally:
        dist.destroy_process_group()


def train_hf_trainer(out: Path) -> list[float]:
    """``ZeroTrainer`` (the Hugging Face Trainer on ZeRO stage 3) on a tiny ``LlamaForCausalLM`` built from a config,
    STEPS steps on fixed token rows; the losses it logged."""
    import torch
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    from ds_strategy.transformers import ZeroTrainer

    AcceleratorState._reset_state(reset_partial_state=True)  # as a new script finds them, whatever ran before
    GradientState._reset_state()
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    rows = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = ZeroTrainer(model=model, args=args, train_dataset=dataset, zero_config={"stage": 3})
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def train_lightning(strategy: str) -> list[float]:
    """``lightning.pytorch``'s Trainer by strategy name, STEPS steps on one fixed batch; the losses."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    x, y = _regression_batch()

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _regression_model()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Regression()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return module.losses


def train_fabric() -> list[float]:
    """Fabric with ``strategy="zero2"``, STEPS steps on one fixed batch; the losses."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero2")
    fabric.launch()
    model = _regression_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _regression_batch()
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def _as_script(path: Path, argv: list[str], env: dict[str, str]):
    """``sys.argv``, ``sys.path`` and environment as when ``python path *argv`` runs, restored afterwards."""
    saved_argv, saved_path, saved_env = sys.argv, list(sys.path), dict(os.environ)
    sys.argv, sys.path[:0] = [str(path), *argv], [str(path.parent)]
    os.environ.update(env)
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def _script_losses(path: Path, argv: list[str], out: Path, env: dict[str, str] | None = None) -> list[float]:
    """Run an example in this interpreter; the losses from the ``summary.json`` it writes to ``out``."""
    with _as_script(path, argv, env or {}):
        runpy.run_path(str(path), run_name="__main__")
    return json.loads((out / "summary.json").read_text())["losses"]


def train_accelerate(out: Path) -> list[float]:
    """``examples/train_accelerate.py`` on one process, its ZeroAccelerator configured by ``$DS_STRATEGY_CONFIG``
    with a DeepSpeed config whose optimizer and scheduler sections ("auto") take accelerate's DummyOptim and
    DummyScheduler."""
    deepspeed = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}},
    }
    argv = ["--max-steps", str(STEPS), "--batch-size", "4", "--corpus-bytes", "20000", "--out", str(out)]
    return _script_losses(EXAMPLES / "train_accelerate.py", argv, out, {"DS_STRATEGY_CONFIG": json.dumps(deepspeed)})


def train_hydra(out: Path) -> list[float]:
    """``examples/train.py`` (Hydra, the ``pkg://ds_strategy.configs`` presets) with tiny overrides on one process."""
    overrides = [
        "strategy=zero3",
        "trainer.devices=1",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "data.corpus_bytes=20000",
        "data.batch_size=4",
        f"hydra.run.dir={out}",
    ]
    return _script_losses(EXAMPLES / "train.py", overrides, out)


def _printed_by_cli(argv: list[str]) -> str:
    """What ``ds-strategy *argv`` prints before it exits (as ``--help`` and ``--version`` do), which must be 0."""
    from ds_strategy.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            main(argv)
        except SystemExit as exit_:
            if exit_.code != 0:
                raise
    return printed.getvalue()


def run_cli() -> list[float]:
    """``ds-strategy --help`` and ``--version``, then ``ds-strategy estimate`` of 1e6 parameters at stage 3 on 2
    ranks; the estimate's device bytes per rank."""
    import ds_strategy
    from ds_strategy.cli import main

    help_text, version = _printed_by_cli(["--help"]), _printed_by_cli(["--version"])
    if "estimate" not in help_text:
        raise RuntimeError(f"ds-strategy --help lists no estimate command:\n{help_text}")
    if version.split() != ["ds-strategy", ds_strategy.__version__]:
        raise RuntimeError(f"ds-strategy --version printed {version!r}, not the version {ds_strategy.__version__}")
    estimate = io.StringIO()
    with contextlib.redirect_stdout(estimate):
        code = main(["estimate", "--params", "1e6", "--world-size", "2", "--stage", "3", "--no-offload", "--json"])
    if code != 0:
        raise RuntimeError(f"ds-strategy estimate exited {code}")
    return [float(json.loads(estimate.getvalue())[0]["device"])]


def train_deepspeed_initialize(scratch: Path) -> list[float]:
    """``ds_strategy.deepspeed.initialize`` as a DeepSpeed script calls it (``import ds_strategy.deepspeed as
    deepspeed``), stage 3 with AdamW from the config, STEPS steps on one fixed batch in a process group of one."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import ds_strategy.deepspeed as deepspeed

    dist.init_process_group("gloo", init_method=f"file://{scratch / 'deepspeed_store'}", rank=0, world_size=1)
    try:
        model = _regression_model()
        config = {
            "train_batch_size": 16,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        x, y = _regression_batch()
        losses = []
        for _ in range(STEPS):
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses
    finally:
        dist.destroy_process_group()


# Every entry point, what runs it, and the top-level packages it needs: each runs where none of them is hidden.
ENTRY_POINTS = {
    "engine": (train_engine, ()),
    "cli": (lambda scratch: run_cli(), ()),
    "deepspeed_initialize": (train_deepspeed_initialize, ()),
    "lightning_zero2": (lambda scratch: train_lightning("zero2"), ("lightning",)),
    "lightning_zero3": (lambda scratch: train_lightning("zero3"), ("lightning",)),
    "fabric_zero2": (lambda scratch: train_fabric(), ("lightning",)),
    "accelerate": (lambda scratch: train_accelerate(scratch / "accelerate"), ("accelerate",)),
    "hf_trainer": (lambda scratch: train_hf_trainer(scratch / "hf_trainer"), ("transformers", "accelerate")),
    "hydra": (lambda scratch: train_hydra(scratch / "hydra"), ("hydra", "omegaconf", "lightning")),
}


def runnable(hidden: set[str]) -> list[str]:
    """The entry points that need no hidden package."""
    return [name for name, (_, needed) in ENTRY_POINTS.items() if not hidden.intersection(needed)]


def entry_points(hidden: set[str], scratch: Path) -> dict:
    """Every entry point that does not need a hidden package, each STEPS steps; ``{name: {error, values}}``, the
    values being its losses (the CLI's: its estimate)."""
    runs = {name: functools.partial(ENTRY_POINTS[name][0], scratch) for name in runnable(hidden)}
    results = {}
    for name, run in runs.items():
        try:
            values = run()
            ok = len(values) > 0 and all(math.isfinite(v) for v in values)
            results[name] = {"error": None if ok else f"not all finite: {values}", "values": values}
        except BaseException as error:  # noqa: B036  hydra ends a failed run with SystemExit
            results[name] = {"error": _error(error), "values": []}
    return results


def main(out: str, *hidden: str) -> None:
    start = time.perf_counter()
    hide(list(hidden))
    report = {"hidden": list(hidden), "imports": import_all(), "import_seconds": time.perf_counter() - start}
    report["adapter_names"] = adapter_names()
    with tempfile.TemporaryDirectory(prefix="ds_strategy_absent_") as scratch:
        report["entry_points"] = entry_points(set(hidden), Path(scratch))
    report["seconds"] = time.perf_counter() - start
    report["leaked"] = sorted(name for name in sys.modules if name.partition(".")[0] in hidden)
    Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
