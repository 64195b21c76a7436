"""No module-level mutable registry is shared across packages: state travels as arguments (STYLE.md, 14).

A *registry* is a dict, list, set, ``WeakKeyDictionary``, ... assigned at module level and mutated somewhere (a table
that is never mutated is a constant, free to read). It is *shared* when code of another package reaches it: by
importing it, or by calling a function or class of its module that reads or writes it, directly or through other
functions of that module. Then the state is an argument nobody sees: the callee's signature does not show it and
the order of calls becomes part of the API (a pipeline cut remembered for the engine, a timeout set on a cache that
later readers rely on). Read from the source with ``ast``, as ``tests/architecture/test_import_graph.py`` reads imports;
a "package" is a top-level subpackage or root module of ds_strategy, as there.
"""

import ast
from collections import defaultdict
from pathlib import Path

from test_import_graph import ROOT, _imports, _module_name, _package_of

MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
MUTATORS = {
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "popitem",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "appendleft",
    "popleft",
    "__setitem__",
    "__delitem__",
}
# Registries shared on purpose, each with the reason it is process-wide state rather than an argument.
ALLOWED = {
    # The exit hook's list of releases: process-wide by nature, it runs at interpreter exit (Note: [Why every process
    # group is destroyed at exit]); every holder of a process group registers there.
    "ds_strategy.comm.process_exit._releases",
    # The job's failure record, one per default process group: every rank's failure is reported to it and every
    # wait reads it (Note: [How a failed rank ends the job]), whoever issued the collective.
    "ds_strategy.comm.rank_failure._BOARD",
    # The sequence check's own process groups, one per partition of the ranks: a new group must be made on every
    # rank alike and once (Note: [Creating groups inside a sub-group]), whichever engine asks first.
    "ds_strategy.comm.sequence_check._MONITOR_GROUPS",
}


def _is_mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in MUTABLE_CALLS
    return False


def _module_level_containers(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_mutable(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_mutable(node.value):
            names.add(node.target.id)
    return names


def _mutated(tree: ast.Module, name: str) -> bool:
    """Whether ``name`` is changed anywhere in its module: a mutating method (called or handed on), an item stored
    or deleted, an augmented assignment, or a rebinding under ``global``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name:
            if node.attr in MUTATORS:
                return True
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name:
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                return True
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, ast.Global) and name in node.names:
            return True
    return False


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _touching(tree: ast.Module, registry: str) -> set[str]:
    """The module's top-level functions and classes that reach ``registry``, directly or through one another."""
    defs = {
        node.name: _names_in(node)
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    touching = {name for name, used in defs.items() if registry in used}
    while True:
        more = {name for name, used in defs.items() if name not in touching and used & touching}
        if not more:
            return touching | {registry}
        touching |= more


def _users(files: list[Path], root: Path) -> dict[str, set[str]]:
    """For each imported ``module.name`` (and ``module`` itself), the packages of the files that import it."""
    users = defaultdict(set)
    for path in files:
        package = _package_of(_module_name(path, root), root)
        for name in _imports(path, root):
            users[name].add(package)
    return users


def shared_registries(root: Path = ROOT) -> dict[str, set[str]]:
    """``module.registry`` -> the other packages that reach it, for every mutated module-level container."""
    files = sorted(root.rglob("*.py"))
    users = _users(files, root)
    shared = {}
    for path in files:
        module = _module_name(path, root)
        tree = ast.parse(path.read_text())
        for registry in _module_level_containers(tree):
            if not _mutated(tree, registry):
                continue
            reached_by = {package for name in _touching(tree, registry) for package in users[f"{module}.{name}"]}
            others = reached_by - {_package_of(module, root)}
            if others:
                shared[f"{module}.{registry}"] = others
    return shared


def test_finds_a_registry_reached_through_a_function_of_its_module(tmp_path, monkeypatch):
    """The shape of the pipeline cut's pieces: written by one function, read back by another package."""
    (tmp_path / "cut.py").write_text(
        "import weakref\n_PIECES = weakref.WeakKeyDictionary()\nCONSTANT = {'a': 1}\n"
        "def _remember(m, p):\n    _PIECES.setdefault(m, []).append(p)\n"
        "def cut(m, p):\n    _remember(m, p)\n"
        "def restored(m):\n    return _PIECES.pop(m, [])\n"
    )
    (tmp_path / "engine.py").write_text("from .cut import restored, CONSTANT\n")
    assert shared_registries(tmp_path) == {"ds_strategy.cut._PIECES": {"engine"}}


def test_no_module_level_mutable_state_is_shared_across_packages():
    shared = shared_registries()
    unexpected = {name: sorted(packages) for name, packages in shared.items() if name not in ALLOWED}
    assert unexpected == {}, "pass the state as an argument (STYLE.md, 14) instead of a module-level table"


def test_every_allowance_is_still_needed():
    assert set(shared_registries()) >= ALLOWED
