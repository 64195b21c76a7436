"""Composition happens in one function: no adapter builds a mesh, applies a parallelism, cuts a pipeline, converts
dtypes or builds an engine itself, and the engine's constructor knows only ZeRO (issue 27's "done when", checked
from the sources with ``ast`` so that a new adapter line doing one of them fails here)."""

import ast
import inspect
from pathlib import Path

import ds_strategy
from ds_strategy.zero.engine import ZeroEngine

ROOT = Path(ds_strategy.__file__).parent
ADAPTERS = ("lightning", "fabric", "accelerate", "transformers", "hydra", "deepspeed", "adapters")
# What only ds_strategy.compose may call: each is one step of Note: [The order of composition].
COMPOSITION_STEPS = {
    "build_parallel_mesh",
    "init_device_mesh",
    "apply_tensor_parallelism",
    "apply_tensor_parallel_plan",
    "parallelize_module",
    "attend_with_ulysses",
    "plan_stages",
    "cut_to_stages",
    "apply_activation_checkpointing",
    "ZeroEngine",
    "PipelineRunner",
}


def _called_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every call by plain or attribute name, and of every ``.to(dtype=...)``."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "to" and any(keyword.arg == "dtype" for keyword in node.keywords):
            calls.append((node.lineno, "to(dtype=...)"))
        elif name in COMPOSITION_STEPS:
            calls.append((node.lineno, name))
    return calls


def test_the_detector_sees_each_kind_of_step():
    source = "mesh = build_parallel_mesh('cpu', 2)\nmodel.to(dtype=torch.bfloat16)\nengine = zero.ZeroEngine(m, o, c)\n"
    assert _called_names(source) == [(1, "build_parallel_mesh"), (2, "to(dtype=...)"), (3, "ZeroEngine")]


def test_no_adapter_composes_by_itself():
    files = [path for name in ADAPTERS for path in sorted((ROOT / name).rglob("*.py"))]
    assert len(files) > 15
    offenders = {
        f"{path.relative_to(ROOT)}:{line}": name for path in files for line, name in _called_names(path.read_text())
    }
    assert offenders == {}, "call ds_strategy.compose.compose_model (or build_mesh) instead"


def test_the_engine_constructor_takes_only_what_zero_needs():
    """Pipelining and Ulysses reach the engine through public methods, the groups object and what it must know of a
    model it holds part of (``ModelPart``: names, tied copies, pieces cut away), given once at construction; the
    units are the ones composition chose (and checkpointed), not chosen a second time."""
    parameters = list(inspect.signature(ZeroEngine.__init__).parameters)
    expected = ["self", "module", "optimizer", "config", "groups", "device", "step_runner", "part", "unit_modules"]
    assert parameters == expected
    for method in ("set_gradient_divide_factor", "driven_by_schedule"):
        assert callable(getattr(ZeroEngine, method))
