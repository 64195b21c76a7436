"""Dependencies point one way: offload -> zero (never back), compose -> pipeline -> zero (never back), adapters ->
core (never back), and no package reaches itself through a chain of imports.

Read from the source with ``ast``, so imports inside functions and under ``TYPE_CHECKING`` count too: a lazy import
is still a dependency. See Note: [One-way dependency between the engine and offload] in
``ds_strategy.zero.step_runner``.
"""

import ast
from collections import defaultdict
from pathlib import Path

import ds_strategy

ROOT = Path(ds_strategy.__file__).parent
ADAPTERS = (
    "lightning",
    "fabric",
    "accelerate",
    "hydra",
    "transformers",
    "deepspeed",
    "adapters",
)  # adapters/: what they share
# Tools built on the adapters: ``ds-strategy launch`` starts Accelerate's launcher with its config source, and the
# autotuner's trials train through Lightning's Trainer. They sit beside the adapters, outside the core.
TOOLS = ("cli", "autotune")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = ("ds_strategy",) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (``from x import y`` also yields ``x.y``)."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _offenders(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    hits = {}
    for path in files:
        bad = sorted(name for name in _imports(path) if any(name == f or name.startswith(f + ".") for f in forbidden))
        if bad:
            hits[str(path.relative_to(ROOT))] = bad
    return hits


def test_resolves_relative_imports():
    assert "ds_strategy.zero.flat_param" in _imports(ROOT / "zero" / "engine.py")
    assert "ds_strategy.zero.step_runner" in _imports(ROOT / "offload" / "offloaded_step.py")


def test_zero_imports_nothing_from_offload():
    files = sorted((ROOT / "zero").rglob("*.py"))
    assert len(files) > 10
    assert _offenders(files, ("ds_strategy.offload",)) == {}


def test_pipelining_sits_above_the_engine_and_below_composition():
    """The engine knows only ZeRO: pipelining drives it from above (ARCHITECTURE.md), and is itself one of the steps
    composition calls, never the other way round."""
    zero = sorted((ROOT / "zero").rglob("*.py"))
    assert _offenders(zero, ("ds_strategy.pipeline", "ds_strategy.compose")) == {}
    pipeline = sorted((ROOT / "pipeline").rglob("*.py"))
    assert len(pipeline) >= 4
    assert "ds_strategy.zero.schedule_interface" in set().union(*(_imports(path) for path in pipeline))
    assert _offenders(pipeline, ("ds_strategy.compose",)) == {}


def test_core_imports_nothing_from_the_adapters():
    """The core is the package minus the adapters and the tools on them; its ``__init__`` alone wires the adapters
    in."""
    files = [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if p.relative_to(ROOT).parts[0] not in ADAPTERS + TOOLS and p != ROOT / "__init__.py"
    ]
    assert len(files) > 30
    assert _offenders(files, tuple(f"ds_strategy.{name}" for name in ADAPTERS)) == {}


def _package_of(module: str, root: Path = ROOT) -> str | None:
    """The top-level subpackage or module of ds_strategy that ``module`` lies in; None outside them (the root)."""
    parts = module.split(".")
    if parts[0] != "ds_strategy" or len(parts) < 2:
        return None
    return parts[1] if (root / parts[1]).is_dir() or (root / f"{parts[1]}.py").is_file() else None


def _package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the files that make the edge. The root ``__init__``, which wires
    everything in, is no package of its own."""
    edges = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "__init__.py":
            continue
        source = _package_of(_module_name(path))
        for target in sorted({_package_of(name) for name in _imports(path)} - {None, source}):
            edges[source, target].append(str(path.relative_to(ROOT)))
    return edges


def _reachable(edges: dict[tuple[str, str], list[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for target in (b for a, b in edges if a == node and b not in seen):
            seen.add(target)
            todo.append(target)
    return seen


def test_no_package_imports_itself_through_others():
    """Packages in a circle (config -> zero -> config) can be neither read, tested nor imported one without the other.
    Every top-level subpackage and module of ds_strategy, the adapters and tools included, counts; a failure names
    each import in the circle with the files that make it."""
    edges = _package_edges()
    assert ("zero", "config") in edges and ("lightning", "zero") in edges
    circular = [
        f"{a} -> {b} ({', '.join(files)})" for (a, b), files in sorted(edges.items()) if a in _reachable(edges, b)
    ]
    assert circular == []


def _file_edges(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (under ``TYPE_CHECKING`` too, as everywhere here)."""
    files = sorted((ROOT / package).rglob("*.py"))
    modules = {_module_name(path) for path in files}
    return {_module_name(path): (_imports(path) & modules) - {_module_name(path)} for path in files}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that reaches itself, as the list of modules around it."""
    found = []
    for start in sorted(edges):
        path, todo = {start: [start]}, [start]
        while todo:
            node = todo.pop()
            for target in sorted(edges[node]):
                if target == start:
                    found.append(path[node] + [start])
                    todo.clear()
                    break
                if target not in path:
                    path[target] = path[node] + [target]
                    todo.append(target)
    return found


def test_the_cycle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_file_of_zero_imports_itself_through_others():
    """The engine is a façade over collaborators that each import only what lies below them: a collaborator that
    needs the engine types what it reads as a ``Protocol`` of its own (``memory_report.HeldState``,
    ``full_state_dict.ShardedModule``, ``schedule_interface.DrivenEngine``) or takes the collaborator it works with
    (``full_gradients`` takes the ``OptimizerStep``). Imports under ``TYPE_CHECKING`` count: a circle of types is
    still a circle a reader must hold in mind at once."""
    edges = _file_edges("zero")
    assert "ds_strategy.zero.layout" in edges["ds_strategy.zero.engine"]
    assert _cycles(edges) == []


def _engine_private_reads(source: str) -> list[str]:
    """``engine._name`` (or ``x.engine._name``, ``zero_engine._name``) read in ``source``, as ``line: name``."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            holder = node.value
            name = getattr(holder, "id", None) or getattr(holder, "attr", "")
            if name == "engine" or name.endswith("_engine"):
                hits.append(f"{node.lineno}: {node.attr}")
    return sorted(hits, key=lambda hit: int(hit.split(":")[0]))


def test_the_private_read_finder_finds_one():
    source = "engine.step()\nself.engine._grad_stats.clear()\nzero_engine._hooks\nengine.__class__\n"
    assert _engine_private_reads(source) == ["2: _grad_stats", "3: _hooks"]


def test_no_module_outside_zero_reads_engine_internals():
    """What other packages need of the engine is its public surface (methods, and attributes without a leading
    underscore); its private state may change with any refactoring of ``zero/``."""
    outside = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] != "zero"]
    assert len(outside) > 100
    hits = {str(p.relative_to(ROOT)): _engine_private_reads(p.read_text()) for p in outside}
    assert {path: found for path, found in hits.items() if found} == {}
