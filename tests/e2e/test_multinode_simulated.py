"""Two torchrun agents on this machine as two nodes of two ranks each (c10d rendezvous on 127.0.0.1), against one
agent of four ranks: the node-aware parts of a ZeRO-3 + hpZ + NVMe-offload run must behave as across machines, and
the training must not notice the difference.

The two jobs are the same four ranks doing the same arithmetic, so the final parameters must be equal bit for bit:
any difference means a rank's identity (RANK vs LOCAL_RANK, its hpZ group) depends on the launch layout. Lightning
(``num_nodes=2``, its own launcher and under torchrun) and ``ds-strategy launch`` with accelerate's
``num_machines: 2`` run the same comparison in benchmarks/multinode.py, which is slower. See tests/e2e/multinode_runs.py
for what the simulation does not cover.
"""

from pathlib import Path

import pytest
import torch
from multinode_runs import WORLD_SIZE, differing, rank_records, run_nodes

from ds_strategy.checkpoint import consolidate
from ds_strategy.models import GPT, gpt_config

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """The two-node job and the one-node job, run once for the module: ``{"two": ..., "one": ...}``."""
    result = {}
    for name, nodes in (("two", 2), ("one", 1)):
        out = tmp_path_factory.mktemp(f"{name}_nodes")
        run_nodes("torchrun", nodes, out)
        result[name] = out, rank_records(out)
    return result


def test_each_node_numbers_its_ranks_from_local_rank_zero(runs):
    _, records = runs["two"]
    identities = [r["identity"] for r in records]
    assert [i["rank"] for i in identities] == list(range(WORLD_SIZE))
    assert all(i["world_size"] == WORLD_SIZE for i in identities)
    by_node = {}
    for i in identities:
        by_node.setdefault(i["node"], []).append(i)
    assert sorted(by_node) == ["node0", "node1"]
    for members in by_node.values():
        assert sorted(i["local_rank"] for i in members) == [0, 1]
        assert len({i["rank"] - i["local_rank"] for i in members}) == 1, "a node's global ranks are consecutive"


def test_hpz_groups_are_the_ranks_of_one_node(runs):
    _, records = runs["two"]
    identities = [r["identity"] for r in records]
    node_ranks = {}
    for i in identities:
        node_ranks.setdefault(i["node"], set()).add(i["rank"])
    for i in identities:
        assert set(i["hpz_group"]) == node_ranks[i["node"]], i
    assert sorted(map(sorted, node_ranks.values())) == [[0, 1], [2, 3]]


def test_one_node_forms_the_same_hpz_groups(runs):
    _, records = runs["one"]
    assert [r["identity"]["hpz_group"] for r in records] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_nvme_files_live_on_their_own_node(runs):
    out, records = runs["two"]
    for r in records:
        node_dir = out / f"nvme-{r['identity']['node']}"
        assert Path(r["identity"]["nvme_directory"]).parent == node_dir
        assert f"-rank{r['identity']['rank']}-" in Path(r["identity"]["nvme_directory"]).name


def test_two_nodes_train_bitwise_like_one_node(runs):
    _, two = runs["two"]
    _, one = runs["one"]
    for rank in range(WORLD_SIZE):
        assert differing(two[rank]["params"], two[0]["params"]) == [], f"rank {rank} disagrees with rank 0"
        assert differing(two[rank]["params"], one[rank]["params"]) == [], f"rank {rank}: 2 nodes != 1 node"
    torch.manual_seed(0)
    initial = dict(GPT(gpt_config("tiny")).named_parameters())
    assert differing(two[0]["params"], {name: p.detach() for name, p in initial.items()}), "no step was taken"


def test_checkpoint_of_two_nodes_has_every_rank_and_consolidates_to_the_final_weights(runs):
    out, records = runs["two"]
    path = out / "checkpoint"
    files = {p.name for p in path.iterdir()}
    assert {f"__{rank}_0.distcp" for rank in range(WORLD_SIZE)} <= files and "manifest.json" in files
    full = torch.load(consolidate(path, out / "consolidated.pt"), weights_only=True)
    assert differing({name: full[name] for name in records[0]["params"]}, records[0]["params"]) == []
