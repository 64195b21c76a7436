"""Every collective outside ``ds_strategy/comm/`` goes through it (``Collectives``, ``collectives_for``, the
differentiable and object collectives there), so that each is timed out, counted by kind, checked in sequence and
names a failed rank. Read from the source with ``ast``: a collective named in a docstring or a comment is not a
call, and one passed around without being called (``fn = dist.broadcast``) is a use all the same."""

import ast
import textwrap
from pathlib import Path

import ds_strategy

ROOT = Path(ds_strategy.__file__).parent
ALLOWED = ROOT / "comm"
# torch.distributed functions that talk to other ranks: these names, and any name beginning with one of the prefixes
COLLECTIVES = {
    "barrier",
    "monitored_barrier",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
}
COLLECTIVE_PREFIXES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "gather", "scatter")
# modules all of whose functions are collectives
COLLECTIVE_MODULES = ("torch.distributed._functional_collectives", "torch.distributed.nn.functional")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it was imported as (``dist`` -> ``torch.distributed``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                # ``import torch.distributed`` binds ``torch``; ``import a.b as c`` binds ``c`` to ``a.b``
                local = alias.asname or alias.name.partition(".")[0]
                names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The imported dotted name ``node`` (a name or a chain of attributes on one) stands for, if any."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_collective(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    if module in COLLECTIVE_MODULES:
        return True
    return module == "torch.distributed" and (name in COLLECTIVES or name.startswith(COLLECTIVE_PREFIXES))


def raw_collectives(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every use of a torch.distributed collective in ``source``."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node, aliases)
            if dotted and _is_collective(dotted):
                found.add((node.lineno, dotted))
    return sorted(found)


def test_the_detector_finds_each_way_of_naming_a_collective():
    source = textwrap.dedent(
        """
        import torch
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed import barrier
        from torch.distributed.nn.functional import all_reduce as differentiable_sum

        dist.all_reduce(x, group=g)
        torch.distributed.broadcast(x, 0)
        barrier()
        funcol.all_to_all_single_autograd(x, None, None, g)
        launch = dist.all_gather_into_tensor
        differentiable_sum(x)
        dist.get_rank(g), dist.ReduceOp.SUM, dist.group.WORLD, dist.new_group([0, 1])
        \"\"\"dist.all_reduce in a docstring\"\"\"
        """
    )
    assert raw_collectives(source) == [
        (8, "torch.distributed.all_reduce"),
        (9, "torch.distributed.broadcast"),
        (10, "torch.distributed.barrier"),
        (11, "torch.distributed._functional_collectives.all_to_all_single_autograd"),
        (12, "torch.distributed.all_gather_into_tensor"),
        (13, "torch.distributed.nn.functional.all_reduce"),
    ]


def test_no_collective_outside_comm_bypasses_it():
    files = [path for path in sorted(ROOT.rglob("*.py")) if ALLOWED not in path.parents]
    assert len(files) > 50
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{line}: {name}"
        for path in files
        for line, name in raw_collectives(path.read_text())
    ]
    assert offenders == [], "collectives that bypass ds_strategy/comm/:\n" + "\n".join(offenders)
