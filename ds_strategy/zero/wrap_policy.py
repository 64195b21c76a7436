"""Where a model is cut into units: the modules whose parameters are gathered, reduced and freed together."""

from __future__ import annotations

from collections import Counter

from torch import nn


def _class_matches(module: nn.Module, targets: tuple) -> bool:
    return any(
        (isinstance(t, str) and type(module).__name__ == t) or (isinstance(t, type) and isinstance(module, t))
        for t in targets
    )


def _own_param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def detect_block_class(root: nn.Module) -> type | None:
    """The repeated composite child type (e.g. a transformer block): the class with submodules that occurs most
    often among modules holding trainable parameters, if it occurs at least twice; ties go to the bigger class."""
    counts: Counter = Counter()
    sizes: dict[type, int] = {}
    for module in root.modules():
        if module is root or not any(True for _ in module.children()):
            continue
        size = _own_param_count(module)
        if size:
            counts[type(module)] += 1
            sizes[type(module)] = size
    repeated = [(n, sizes[cls], cls) for cls, n in counts.items() if n >= 2]
    return max(repeated, key=lambda item: (item[0], item[1]))[2] if repeated else None


def select_unit_modules(
    root: nn.Module, unit_modules: tuple = (), unit_min_params: int = 0
) -> list[tuple[str, nn.Module]]:
    """Named submodules that become units, outermost first in module order; the root unit is implicit.

    ``unit_modules`` (classes or class names) wins; else ``unit_min_params`` > 0 wraps, bottom up, every module
    whose not-yet-wrapped trainable parameters reach that count; else the auto-detected repeated block class.
    """
    if not unit_modules and unit_min_params <= 0:
        block = detect_block_class(root)
        if block is None:
            return []
        unit_modules = (block,)
    if unit_modules:
        chosen: list[tuple[str, nn.Module]] = []
        taken: set[int] = set()
        for name, module in root.named_modules():
            if module is root or not _class_matches(module, unit_modules):
                continue
            if any(id(m) in taken for m in _ancestors(root, name)):
                continue
            chosen.append((name, module))
            taken.add(id(module))
        return chosen
    return _wrap_by_size(root, unit_min_params)


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    found, module = [], root
    for part in parts[:-1]:
        module = getattr(module, part)
        found.append(module)
    return found


def _wrap_by_size(root: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        """Returns the count of trainable parameters under ``module`` not yet claimed by a unit."""
        leftover = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        for child_name, child in module.named_children():
            leftover += visit(f"{name}.{child_name}" if name else child_name, child)
        if module is not root and leftover >= min_params:
            chosen.append((name, module))
            return 0
        return leftover

    visit("", root)
    order = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(chosen, key=lambda item: order[id(item[1])])
