"""The collectives model code and checkpoints issue outside an engine (``ds_strategy.comm.differentiable``,
``objects``, ``group_collectives``) compute what torch's would, differentiate as they should, and are counted per
kind on the ``Collectives`` they are given (the mesh's, under composition), on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from ds_strategy.comm.collectives import Collectives
from ds_strategy.comm.differentiable import AllToAll, SumGradOverRanks, SumOverRanks
from ds_strategy.comm.group_collectives import collectives_for
from ds_strategy.comm.objects import all_gather_object, broadcast_object
from ds_strategy.parallel.ulysses import heads_to_seq, seq_to_heads

WORLD = 2


def _differentiable(rank: int) -> dict:
    """Each rank's tensor is (rank + 1) * arange: sums and exchanges are checked against that, gradients against
    an upstream gradient of (rank + 1) everywhere."""
    mine = (rank + 1) * torch.arange(4.0)
    results = {}
    x = mine.clone().requires_grad_()
    total = SumOverRanks.apply(x, None)
    total.backward(torch.full_like(total, rank + 1.0))
    results["sum"] = (total.detach(), x.grad)
    x = mine.clone().requires_grad_()
    same = SumGradOverRanks.apply(x, None)
    same.backward(torch.full_like(same, rank + 1.0))
    results["sum_grad"] = (same.detach(), x.grad)
    x = mine.clone().requires_grad_()
    exchanged = AllToAll.apply(x, None)
    exchanged.backward(torch.full_like(exchanged, rank + 1.0))
    results["all_to_all"] = (exchanged.detach(), x.grad)
    return results


def _counted_by_ulysses() -> dict:
    """Calls per kind that one Ulysses exchange and its backward add to the counters of the collectives given."""
    world = Collectives(dist.group.WORLD)
    x = torch.randn(1, 2, 4, 3, requires_grad=True)
    heads_to_seq(seq_to_heads(x, world), world).sum().backward()
    return {kind: world.stats.kinds[kind].calls for kind in ("all_to_all", "all_reduce")}


def _objects(rank: int) -> dict:
    mine = {"rank": rank, "payload": "x" * (10 + 1000 * rank)}  # pickles of different lengths
    return {
        "all_gathered": all_gather_object(mine, collectives_for()),
        "broadcast": broadcast_object(mine if rank == 1 else None, collectives_for(), src=1),
    }


def _run(rank: int, world_size: int) -> dict:
    return {
        "differentiable": _differentiable(rank),
        "ulysses_calls": _counted_by_ulysses(),
        "objects": _objects(rank),
        "bare_group": collectives_for(dist.group.WORLD).world_size,
        "given_back": _given_back(),
    }


def _given_back() -> bool:
    """A ``Collectives`` handed in (the mesh's) is used as it is, with its own timeout and counters."""
    mine = Collectives(dist.group.WORLD, timeout=7.0)
    x = torch.randn(1, 2, 4, 3)
    heads_to_seq(seq_to_heads(x, mine), mine)
    return collectives_for(mine) is mine and mine.stats.kinds["all_to_all"].calls == 2


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_run, WORLD)


def test_sum_over_ranks_sums_in_forward_and_passes_the_gradient_through(runs):
    for rank, run in enumerate(runs):
        total, grad = run["differentiable"]["sum"]
        assert torch.equal(total, 3 * torch.arange(4.0))
        assert torch.equal(grad, torch.full((4,), rank + 1.0))


def test_sum_grad_over_ranks_passes_forward_and_sums_the_gradient(runs):
    for rank, run in enumerate(runs):
        same, grad = run["differentiable"]["sum_grad"]
        assert torch.equal(same, (rank + 1) * torch.arange(4.0))
        assert torch.equal(grad, torch.full((4,), 3.0))


def test_all_to_all_exchanges_chunks_and_sends_gradients_back_where_values_came_from(runs):
    for rank, run in enumerate(runs):
        exchanged, grad = run["differentiable"]["all_to_all"]
        expected = torch.cat([(r + 1) * torch.arange(4.0).chunk(WORLD)[rank] for r in range(WORLD)])
        assert torch.equal(exchanged, expected)
        # my chunk r went to rank r, whose upstream gradient is r + 1
        assert torch.equal(grad, torch.cat([torch.full((2,), r + 1.0) for r in range(WORLD)]))


def test_ulysses_exchanges_are_counted_as_all_to_alls_forward_and_backward(runs):
    for run in runs:
        assert run["ulysses_calls"] == {"all_to_all": 4, "all_reduce": 0}


def test_objects_of_different_sizes_are_gathered_and_broadcast(runs):
    for run in runs:
        gathered = run["objects"]["all_gathered"]
        assert [o["rank"] for o in gathered] == [0, 1]
        assert [len(o["payload"]) for o in gathered] == [10, 1010]
        assert run["objects"]["broadcast"]["rank"] == 1


def test_a_given_collectives_is_used_as_it_is_and_a_bare_group_gets_one(runs):
    for run in runs:
        assert run["given_back"]
        assert run["bare_group"] == WORLD


def test_without_a_process_group_the_collectives_act_on_one_rank():
    assert not dist.is_initialized()
    assert all_gather_object({"a": 1}, collectives_for()) == [{"a": 1}]
    assert broadcast_object("b", collectives_for()) == "b"
    x = torch.arange(4.0, requires_grad=True)
    AllToAll.apply(x, None).sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
