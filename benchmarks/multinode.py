"""Every multi-node entry point, simulated: two launcher agents on this machine as two nodes of two ranks, against
one node of four ranks, on ZeRO-3 + hpZ (groups of 2) + NVMe optimizer offload.

    python benchmarks/multinode.py                          # torchrun, Lightning (own launcher and torchrun),
                                                            # ds-strategy launch with accelerate num_machines: 2
    python benchmarks/multinode.py --only lightning accelerate

For each launcher: the wall time of each job, whether each rank knew its node (LOCAL_RANK 0 and 1 on each node,
consecutive global ranks, hpZ group = the node's ranks, NVMe directory under the node's own path), and whether the
final parameters equal bit for bit those of the same launcher on one node and those of the bare-engine torchrun
job on one node (all entry points train the same model on the same batches). tests/e2e/test_multinode_simulated.py
runs the torchrun case in the suite; the others take a minute or two each here and so live in this script.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
import import_root  # noqa: F401 - the suite's folders on sys.path: Note: [Every folder of the suite is an import root]
from multinode_runs import LAUNCHERS, WORLD_SIZE, differing, rank_records, run_nodes  # noqa: E402


def layout_problems(out: Path, records: list[dict]) -> list[str]:
    """What a two-node job's ranks got wrong about their node; empty when nothing."""
    problems, node_ranks = [], {}
    for r in records:
        node_ranks.setdefault(r["identity"]["node"], []).append(r["identity"])
    for node, members in sorted(node_ranks.items()):
        ranks = sorted(i["rank"] for i in members)
        if sorted(i["local_rank"] for i in members) != list(range(len(members))):
            problems.append(f"{node}: local ranks {[i['local_rank'] for i in members]}")
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            problems.append(f"{node}: global ranks {ranks} are not consecutive")
        for i in members:
            if sorted(i["hpz_group"]) != ranks:
                problems.append(f"rank {i['rank']} on {node}: hpZ group {i['hpz_group']} != the node's {ranks}")
            if Path(i["nvme_directory"]).parent != out / f"nvme-{node}":
                problems.append(f"rank {i['rank']} on {node}: NVMe directory {i['nvme_directory']}")
    return problems


def timed_job(launcher: str, nodes: int, out: Path) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    run_nodes(launcher, nodes, out, timeout=600)
    return time.perf_counter() - start, rank_records(out)


def all_equal(a: list[dict], b: list[dict]) -> bool:
    return all(not differing(x["params"], y["params"]) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="multinode_") as tmp:
        _, reference = timed_job("torchrun", 1, Path(tmp, "reference"))
        print(
            f"| launcher | 2 nodes x 2 (s) | 1 node x {WORLD_SIZE} (s) | node layout | = own 1-node | "
            f"= torchrun engine 1-node |\n|---|---|---|---|---|---|"
        )
        for launcher in args.only:
            two_s, two = timed_job(launcher, 2, Path(tmp, launcher, "two"))
            one_s, one = timed_job(launcher, 1, Path(tmp, launcher, "one"))
            problems = layout_problems(Path(tmp, launcher, "two"), two)
            print(
                f"| {launcher} | {two_s:.0f} | {one_s:.0f} | {'; '.join(problems) or 'ok'} | "
                f"{all_equal(two, one)} | {all_equal(two, reference)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
