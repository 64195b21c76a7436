"""Dependencies point one way: offload -> zero (never back), and adapters -> core (never back).

Read from the source with ``ast``, so imports inside functions and under ``TYPE_CHECKING`` count too: a lazy import
is still a dependency. See Note: [One-way dependency between the engine and offload] in
``ds_strategy.zero.step_runner``.
"""

import ast
from pathlib import Path

import ds_strategy

ROOT = Path(ds_strategy.__file__).parent
ADAPTERS = ("lightning", "fabric", "accelerate", "hydra", "transformers")
# Tools built on the adapters: ``ds-strategy launch`` starts Accelerate's launcher with its config source, and the
# autotuner's trials train through Lightning's Trainer. They sit beside the adapters, outside the core.
TOOLS = ("cli", "autotune")


def _module_name(path: Path) -> str:
    parts = ("ds_strategy",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (``from x import y`` also yields ``x.y``)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
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
    assert "ds_strategy.zero.step_runner" in _imports(ROOT / "offload" / "__init__.py")


def test_zero_imports_nothing_from_offload():
    files = sorted((ROOT / "zero").rglob("*.py"))
    assert len(files) > 10
    assert _offenders(files, ("ds_strategy.offload",)) == {}


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
