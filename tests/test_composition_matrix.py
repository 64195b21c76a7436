"""The composition matrix as the oracle: every runnable cell of a pairwise-covering set over {build: normal, meta,
sync_module_states, load_pretrained} x {layout: dp, tp, dp x tp, pp, pp x dp, pp x tp, Ulysses sp, Megatron SP} x
{ZeRO stage 0-3} x {entry point: engine, Lightning, Fabric, Accelerate} starts equal to a normal build, bitwise,
and trains 3 SGD steps to the parameters one process reaches on a normally built copy (fp32); every combination
refused by design is refused with an error naming it. The cells, how they are chosen and run: ``composition_runs``.
"""

import hf_models  # noqa: F401  (transformers' logging quieted before the ranks fork)
import pytest
import torch
from composition_runs import (
    BUILDS,
    LAYOUTS,
    REFUSED_CONFIGS,
    build_model,
    pairwise_cells,
    reference,
    refused_cells,
    run_cells,
)
from distributed import run_ranks

from ds_strategy import ZeroFabricStrategy
from ds_strategy.config import ZeroConfig, ZeroConfigError

CELLS = pairwise_cells()
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Each world size's cells in one process group; the references per seed in this process."""
    pretrained = tmp_path_factory.mktemp("pretrained")
    build_model(BUILDS["load_pretrained"].pretrained_seed).save_pretrained(pretrained, max_shard_size="20KB")
    results = {}
    for world in sorted({LAYOUTS[c.layout].world for c in CELLS}):
        cells = [c for c in CELLS if LAYOUTS[c.layout].world == world]
        for outcome in run_ranks(run_cells, world, cells, str(pretrained), timeout=600):
            for cell_id, result in outcome.items():
                results.setdefault(cell_id, []).append(result)
    references = {seed: reference(seed) for seed in {BUILDS[c.build].seed for c in CELLS}}
    return results, references


def test_the_cells_cover_every_pair_of_axis_values():
    """Printed with ``-s``: the cells the matrix runs, and those refused."""
    covered = set()
    for cell in CELLS:
        values = (cell.build, cell.layout, cell.stage, cell.entry)
        covered |= {(i, values[i], j, values[j]) for i in range(4) for j in range(i + 1, 4)}
    refused = {(c.entry, c.layout) for c in refused_cells()}
    for build in BUILDS:
        for layout in LAYOUTS:
            assert (0, build, 1, layout) in covered
        for stage in range(4):
            assert (0, build, 2, stage) in covered
    for layout in LAYOUTS:
        for entry in ("engine", "lightning", "fabric", "accelerate"):
            assert (1, layout, 3, entry) in covered or (entry, layout) in refused
    print("\n".join(["cells:", *(c.id for c in CELLS), "refused:", *(c.id for c in refused_cells())]))


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell_starts_as_a_normal_build_and_trains_as_one_process(matrix, cell):
    results, references = matrix
    expected = references[BUILDS[cell.build].seed]
    initial, final = {}, {}
    for rank in results[cell.id]:
        for name, value in rank["initial"].items():
            assert torch.equal(initial.setdefault(name, value), value), f"ranks disagree on {name}"
        for name, value in rank["final"].items():
            final.setdefault(name, value)
    assert set(initial) == set(expected["initial"]), sorted(set(initial) ^ set(expected["initial"]))
    differing = [name for name, value in expected["initial"].items() if not torch.equal(initial[name], value)]
    assert differing == [], f"{cell.id}: initial state differs from a normal build in {differing}"
    for name, value in expected["params"].items():
        torch.testing.assert_close(final[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("cell", refused_cells(), ids=[c.id for c in refused_cells()])
def test_refused_combination_is_refused_naming_it(cell):
    fields = {"stage": cell.stage, **LAYOUTS[cell.layout].fields()}
    with pytest.raises(ValueError, match=cell.refused()):
        if cell.entry == "fabric":
            ZeroFabricStrategy(**fields)
        else:
            from ds_strategy.accelerate import ZeroAccelerator

            ZeroAccelerator(fields, cpu=True)


@pytest.mark.parametrize("fields, words", REFUSED_CONFIGS, ids=lambda v: str(v))
def test_refused_configuration_is_refused_naming_both_sizes(fields, words):
    with pytest.raises(ZeroConfigError, match=words):
        ZeroConfig(**fields)
