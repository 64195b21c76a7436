"""The layout of units and flat buffers (``zero.layout.lay_out``) is a pure function: worked out here in one process,
with no process group, for ranks given as numbers."""

import torch
from torch import nn

from ds_strategy.config import ZeroConfig
from ds_strategy.zero.layout import Ranks, lay_out
from ds_strategy.zero.model_part import ModelPart
from ds_strategy.zero.sharded_optimizers import ShardedOptimizers


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)


WHOLE = ModelPart()
RANK_1_OF_2 = Ranks(1, 2)


def _lay_out(model: nn.Module, part: ModelPart = WHOLE, ranks: Ranks = RANK_1_OF_2, tp_size: int = 1):
    optimizers = ShardedOptimizers([torch.optim.SGD(model.parameters(), lr=0.1)])
    plan = ZeroConfig(stage=3).plan
    cpu = torch.device("cpu")
    return lay_out(model, [("block", model.block)], 0, optimizers, plan, part, ranks, None, tp_size, cpu)


def _buffers(layout) -> dict[str, tuple[float, list[str]]]:
    return {fp.name: (fp.norm_share, [s.name for s in fp.slots]) for u in layout.units for fp in u.flat_params}


def test_parameters_outside_every_unit_go_to_the_root_and_a_unit_holds_its_own():
    layout = _lay_out(_Tiny())
    assert [u.name for u in layout.units] == ["<root>", "block"]
    assert _buffers(layout) == {
        "<root>/group0/persistent": (1.0, ["embed.weight", "head.weight"]),
        "block/group0/persistent": (1.0, ["block.weight", "block.bias"]),
    }
    assert layout.saved_as == {}


def test_a_copy_another_part_saves_is_held_apart_under_its_saved_name_with_its_norm_share():
    part = ModelPart(saved_as={"head.weight": "embed.weight"}, norm_shares={"head.weight": 0.0})
    model = _Tiny()
    del model.embed  # the owner lives on another part
    layout = _lay_out(model, part)
    assert _buffers(layout) == {
        "<root>/group0/persistent/norm_share=0": (0.0, ["embed.weight"]),
        "block/group0/persistent": (1.0, ["block.weight", "block.bias"]),
    }
    assert layout.saved_as == {"head.weight": "embed.weight"}


def test_each_tensor_parallel_rank_counts_its_share_of_a_replicated_parameter():
    layout = _lay_out(_Tiny(), tp_size=4)
    assert {name: share for name, (share, _) in _buffers(layout).items()} == {
        "<root>/group0/persistent/tp_replicated": 0.25,
        "block/group0/persistent/tp_replicated": 0.25,
    }


def test_the_buffers_are_sharded_for_the_ranks_given():
    layout = _lay_out(_Tiny(), ranks=RANK_1_OF_2)
    block = layout.units[1].flat_params[0]
    assert (block.rank, block.world_size, block.numel, block.shard_numel) == (1, 2, 20, 10)
