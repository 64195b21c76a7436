"""Where a model is cut into units: the modules whose parameters are gathered, reduced and freed together.

Note: [A unit is a module that runs forward]
Stage 3 gathers a unit in its module's forward pre-hook and frees it in its forward hook. A container without a
``forward`` of its own (``nn.ModuleList``, ``nn.ModuleDict``) is never called: its children are called one by one
by the parent's forward, so a container made a unit would never be gathered and the first forward would read its
partitioned parameters as empty shards (T5's ``encoder.block`` list, which ties in count with ``T5Attention`` and
wins on size, did exactly that; below the persistence threshold the parameters stay whole, which hid it). So
containers are never chosen: not as the auto-detected block class, not by size (their parameters roll up to the
parent), and naming one in ``unit_modules`` is refused.
"""

from __future__ import annotations

from collections import Counter

from torch import nn


def _class_matches(module: nn.Module, targets: tuple) -> bool:
    return any(
        (isinstance(t, str) and type(module).__name__ == t) or (isinstance(t, type) and isinstance(module, t))
        for t in targets
    )


def runs_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a ``forward`` of its own (a container's is ``nn.Module``'s, which raises)."""
    return type(module).forward is not nn.Module.forward


def _own_param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def detect_block_class(root: nn.Module) -> type | None:
    """The repeated composite child type (e.g. a transformer block): the class with submodules and a forward of its
    own that occurs most often among modules holding trainable parameters, if it occurs at least twice; ties go to
    the bigger class. See Note: [A unit is a module that runs forward]."""
    counts: Counter = Counter()
    sizes: dict[type, int] = {}
    for module in root.modules():
        if module is root or not any(True for _ in module.children()) or not runs_forward(module):
            continue
        size = _own_param_count(module)
        if size:
            counts[type(module)] += 1
            sizes[type(module)] = size
    repeated = [(n, sizes[cls], cls) for cls, n in counts.items() if n >= 2]
    return max(repeated, key=lambda item: (item[0], item[1]))[2] if repeated else None


def declared_block_classes(root: nn.Module) -> tuple[str, ...]:
    """The block classes a Hugging Face model declares in ``_no_split_modules`` (those accelerate's FSDP wraps), the
    outermost model's, present in ``root`` and running a forward of their own; () when none is declared.

    T5 declares ``T5Block``, where counting alone finds ``T5Attention`` (more numerous), which would leave every
    feed-forward weight in the root unit, gathered for the whole step."""
    declared = next((m._no_split_modules for m in root.modules() if getattr(m, "_no_split_modules", None)), ())
    present = {type(m).__name__ for m in root.modules() if m is not root and runs_forward(m)}
    return tuple(sorted(name for name in declared if name in present))


def select_unit_modules(
    root: nn.Module, unit_modules: tuple = (), unit_min_params: int = 0
) -> list[tuple[str, nn.Module]]:
    """Named submodules that become units, outermost first in module order; the root unit is implicit.

    ``unit_modules`` (classes or class names) wins; else ``unit_min_params`` > 0 wraps, bottom up, every module
    whose not-yet-wrapped trainable parameters reach that count; else the block classes a Hugging Face model
    declares, else the auto-detected repeated block class.
    """
    if not unit_modules and unit_min_params <= 0:
        block = declared_block_classes(root) or detect_block_class(root)
        if not block:
            return []
        unit_modules = block if isinstance(block, tuple) else (block,)
    if unit_modules:
        chosen: list[tuple[str, nn.Module]] = []
        taken: set[int] = set()
        for name, module in root.named_modules():
            if module is root or not _class_matches(module, unit_modules):
                continue
            if any(id(m) in taken for m in _ancestors(root, name)):
                continue
            if not runs_forward(module):
                raise ValueError(
                    f"unit_modules names {type(module).__name__} ({name!r}), a container without a forward of its "
                    f"own: stage 3 gathers a unit when its module is called, and this one never is. Name the class "
                    f"of the modules it holds instead"
                )
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
        if module is not root and leftover >= min_params and runs_forward(module):
            chosen.append((name, module))
            return 0
        return leftover

    visit("", root)
    order = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(chosen, key=lambda item: order[id(item[1])])
