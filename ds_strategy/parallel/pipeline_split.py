"""Which pipeline stage owns which blocks, which stages this rank runs, and cutting the model down to them.

Everything here is decided from the whole model and the configuration alone, identically on every rank and
before any process group work, so that bad input (a stage count not dividing the blocks, a split point naming no
module) fails at once with the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib

from torch import nn

from .dtensor_params import local_tensor
from .pipeline_layout import PipelineLayout, find_layout
from .pipeline_schedules import stage_count, stages_per_rank


@dataclasses.dataclass(frozen=True)
class TiedParameter:
    """A parameter two stages on different ranks both use (an LM head tied to the embedding): each holds a copy,
    their gradients are summed over the pipeline group, and ``name`` (its first name in the whole model) is what
    checkpoints and norms know it by. ``shape``: this rank's local shape (a tensor-parallel shard's)."""

    name: str
    names: tuple[str, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The cut of one model into ``len(blocks_of)`` stages and this rank's share of it."""

    layout: PipelineLayout
    block_names: tuple[str, ...]
    blocks_of: tuple[range, ...]  # per stage, indices into the layout's blocks
    stage_ids: tuple[int, ...]  # this rank's stages, in the order its schedule runs them
    rank_of_stage: tuple[int, ...]  # pipeline rank of every stage
    tied: tuple[TiedParameter, ...]  # shared by stages on different ranks
    block_class: type
    whole_names: tuple[str, ...]  # the uncut model's state_dict names in order, which no single rank sees after
    cut_pieces: tuple[tuple[nn.Module, str, nn.Module], ...] = ()  # (parent, attribute, piece) cut on meta

    @property
    def num_stages(self) -> int:
        return len(self.blocks_of)

    def owns(self, stage: int, name: str) -> bool:
        """Whether ``stage`` runs the module or parameter called ``name``."""
        layout = self.layout
        if _under(name, layout.before):
            return stage == 0
        if _under(name, layout.after):
            return stage == self.num_stages - 1
        if _under(name, layout.helpers):
            return True
        return any(_under(name, (self.block_names[i],)) for i in self.blocks_of[stage])

    def tied_copies(self, root: nn.Module) -> dict[str, str]:
        """This rank's names of tied parameters whose canonical name it does not hold, mapped to that name."""
        first_name = {id(p): n for n, p in root.named_parameters()}
        present = dict(root.named_parameters(remove_duplicate=False))
        copies = {}
        for tied in self.tied:
            held = [present[n] for n in tied.names if n in present]
            if held and first_name[id(held[0])] != tied.name:
                copies[first_name[id(held[0])]] = tied.name
        return copies


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def stage_ranks(num_ranks: int, schedule: str) -> tuple[int, ...]:
    """Pipeline rank of every stage: round robin ("loop" placement), or a V for "zbv" (rank r holds stages r and
    2p-1-r, so the first and last stage share rank 0)."""
    per_rank = stages_per_rank(schedule)
    stages = range(num_ranks * per_rank)
    if schedule == "zbv":
        return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in stages)
    return tuple(s % num_ranks for s in stages)


def split_blocks(
    block_names: list[str], sizes: list[int], num_stages: int, split, extra: tuple[int, int] = (0, 0)
) -> list[range]:
    """Contiguous runs of blocks, one per stage. ``split``: "auto" (equal counts), "parameters" (balanced
    parameter counts, ``extra`` adding the first stage's embedding and the last's head) or the names where stages
    1.. begin."""
    n = len(block_names)
    if n < num_stages:
        raise ValueError(f"{num_stages} pipeline stages need at least as many blocks; the model has {n}")
    if split == "auto":
        if n % num_stages:
            allowed = [s for s in range(1, n + 1) if n % s == 0]
            raise ValueError(
                f'pipeline_split="auto" gives every stage the same number of blocks, but {n} blocks do not divide '
                f'into {num_stages} stages (stage counts allowed: {allowed}); use pipeline_split="parameters" or '
                f"name the first block of each stage"
            )
        per = n // num_stages
        return [range(s * per, (s + 1) * per) for s in range(num_stages)]
    if split == "parameters":
        weights = list(sizes)
        weights[0] += extra[0]
        weights[-1] += extra[1]
        return _balanced(weights, num_stages)
    names = list(split)
    if len(names) != num_stages - 1:
        raise ValueError(
            f"pipeline_split names {len(names)} split points {names}; {num_stages} stages need {num_stages - 1}"
        )
    starts = [0]
    for name in names:
        if name not in block_names:
            close = difflib.get_close_matches(name, block_names, n=3)
            raise ValueError(
                f"pipeline_split point {name!r} names no block of the model"
                + (f"; did you mean {close}?" if close else "")
                + f" Blocks: {block_names[0]} ... {block_names[-1]}"
            )
        starts.append(block_names.index(name))
    if starts != sorted(set(starts)) or 0 in starts[1:]:
        raise ValueError(f"pipeline_split points {names} must name distinct blocks after the first, in order")
    return [range(a, b) for a, b in zip(starts, starts[1:] + [n])]


def _balanced(weights: list[int], parts: int) -> list[range]:
    """Contiguous non-empty runs minimising the largest sum (the classic linear-partition dynamic programme)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def plan_stages(root: nn.Module, pipeline_size: int, pp_rank: int, schedule: str, split) -> StagePlan:
    """Cut ``root``'s model into ``stage_count(pipeline_size, schedule)`` stages (no process group work)."""
    layout = find_layout(root)
    blocks = root.get_submodule(layout.blocks) if layout.blocks else root
    block_names = [f"{layout.blocks}.{name}" if layout.blocks else name for name, _ in blocks.named_children()]
    block_list = list(blocks.children())
    sizes = [sum(p.numel() for p in b.parameters()) for b in block_list]
    num_stages = stage_count(pipeline_size, schedule)
    extra = (_param_count(root, layout.before), _param_count(root, layout.after))
    ranges = split_blocks(block_names, sizes, num_stages, split, extra)
    ranks = stage_ranks(pipeline_size, schedule)
    plan = StagePlan(
        layout=layout,
        block_names=tuple(block_names),
        blocks_of=tuple(ranges),
        stage_ids=tuple(s for s in range(num_stages) if ranks[s] == pp_rank),
        rank_of_stage=ranks,
        tied=(),
        block_class=type(block_list[0]),
        whole_names=tuple(root.state_dict(keep_vars=True)),
    )
    return dataclasses.replace(plan, tied=_tied_across_ranks(root, plan))


def _param_count(root: nn.Module, names: tuple[str, ...]) -> int:
    return sum(p.numel() for name in names for p in root.get_submodule(name).parameters())


def _tied_across_ranks(root: nn.Module, plan: StagePlan) -> tuple[TiedParameter, ...]:
    """Parameters reached under several names whose owning stages sit on different ranks; a parameter no stage
    owns is refused (no stage would train it)."""
    names_of: dict[int, list[str]] = {}
    shape_of = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        shape_of[id(p)] = tuple(local_tensor(p).shape)
    tied = []
    for key, names in names_of.items():
        stages = {s for n in names for s in range(plan.num_stages) if plan.owns(s, n)}
        if not stages:
            raise ValueError(
                f"parameter {names[0]!r} belongs to no pipeline stage ({plan.layout.kind} pieces: embedding, "
                f"blocks under {plan.layout.blocks!r}, head); move it into the model or freeze and drop it"
            )
        if len({plan.rank_of_stage[s] for s in stages}) > 1:
            tied.append(TiedParameter(names[0], tuple(names), shape_of[key]))
    return tuple(tied)


def cut_to_stages(root: nn.Module, plan: StagePlan) -> StagePlan:
    """Set every piece none of this rank's stages owns to None in its parent, keeping the others' global names.
    Returns ``plan`` carrying the pieces that were built on the meta device (they hold no memory), which the
    engine's initialisation of a meta build puts back for the duration (``ModelPart.cut_pieces``)."""
    layout = plan.layout
    blocks = root.get_submodule(layout.blocks) if layout.blocks else root
    owned_blocks = {i for s in plan.stage_ids for i in plan.blocks_of[s]}
    cut = [(blocks, name) for i, (name, _) in enumerate(list(blocks.named_children())) if i not in owned_blocks]
    for names, stage in ((layout.before, 0), (layout.after, plan.num_stages - 1)):
        if stage not in plan.stage_ids:
            for name in names:
                parent, _, attr = name.rpartition(".")
                cut.append((root.get_submodule(parent) if parent else root, attr))
    on_meta = []
    for parent, attr in cut:
        piece = getattr(parent, attr)
        if all(t.is_meta for t in [*piece.parameters(), *piece.buffers()]):
            on_meta.append((parent, attr, piece))
        setattr(parent, attr, None)
    return dataclasses.replace(plan, cut_pieces=tuple(on_meta))
