"""The composition matrix as the oracle: every runnable cell of a pairwise-covering set over {build: normal, meta,
sync_module_states, load_pretrained, init_module (Lightning and Fabric), the user's own parallelize_module on a model
built normally or under init_module (Lightning and Fabric, tensor-parallel layouts)} x {layout: dp, tp, dp x tp, pp,
pp x dp, pp x tp, pp x Ulysses sp, Ulysses sp, Ulysses sp tiled (tiled MLPs, every unit checkpointed with its input
on the host), Ulysses sp x tp, Megatron SP} x {ZeRO stage 0-3} x {entry point: engine, Lightning, Fabric,
Accelerate} starts equal to a normal build, bitwise, and trains 3 SGD steps to the parameters one process reaches
on a normally built copy (fp32); the buffer and metric every Lightning ``configure_model`` creates are real and
right; every configuration refused by design is refused with an error naming it. ``init_module()`` under
"bf16-true" is checked in its own cells against a bf16 reference, and each entry point's export under "bf16-mixed"
in cells of its own against the file ``consolidate`` writes. The cells, how they are chosen and run:
``composition_runs``.
"""

import hf_models  # noqa: F401  (transformers' logging quieted before the ranks fork)
import pytest
import torch
from composition_runs import (
    ALL_LAYOUTS,
    BF16_CELLS,
    BUFFER_VALUE,
    BUILDS,
    DEEPSPEED_CELLS,
    EXPERT_CELLS,
    EXPERT_LAYOUTS,
    EXPORT_CELLS,
    FROZEN_CELLS,
    LAYOUTS,
    OPTIMIZER_CELLS,
    REFUSED_CONFIGS,
    REFUSED_DEEPSPEED_CELLS,
    REFUSED_OPTIMIZER_CELLS,
    build_model,
    export_dir,
    pairwise_cells,
    reference,
    run_cells,
)
from distributed import run_ranks

from ds_strategy.accelerate.checkpointing import SHARDED_DIR
from ds_strategy.checkpoint import consolidate
from ds_strategy.config import ZeroConfig, ZeroConfigError

CELLS = pairwise_cells()
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """The weights the ``load_pretrained`` build loads; export cells save their checkpoints beside them."""
    path = tmp_path_factory.mktemp("pretrained")
    build_model(BUILDS["load_pretrained"].pretrained_seed).save_pretrained(path, max_shard_size="20KB")
    return str(path)


@pytest.fixture(scope="module")
def matrix(pretrained):
    """Each world size's cells in one process group; the references per seed in this process."""
    results = {}
    refused = (cell for cell, _ in (*REFUSED_OPTIMIZER_CELLS, *REFUSED_DEEPSPEED_CELLS))
    every = [
        *CELLS,
        *BF16_CELLS,
        *EXPORT_CELLS,
        *OPTIMIZER_CELLS,
        *FROZEN_CELLS,
        *DEEPSPEED_CELLS,
        *EXPERT_CELLS,
        *refused,
    ]
    for world in sorted({ALL_LAYOUTS[c.layout].world for c in every}):
        cells = [c for c in every if ALL_LAYOUTS[c.layout].world == world]
        for outcome in run_ranks(run_cells, world, cells, pretrained, timeout=600):
            for cell_id, result in outcome.items():
                results.setdefault(cell_id, []).append(result)
    references = {seed: reference(seed) for seed in {BUILDS[c.build].seed for c in CELLS}}
    references["bf16"] = reference(0, torch.bfloat16)
    for seed in {BUILDS[c.build].seed for c in EXPORT_CELLS}:
        references["bf16-mixed", seed] = reference(seed, autocast=torch.bfloat16)
    references["whole+sgd"] = reference(0, optimizers="whole+sgd")
    references["frozen"] = reference(0, optimizers="frozen")
    for model_name in {layout.model for layout in EXPERT_LAYOUTS.values()}:
        references[model_name] = reference(0, model_name=model_name)
    return results, references


def test_the_cells_cover_every_pair_of_axis_values():
    """Printed with ``-s``: the cells the matrix runs."""
    covered = set()
    for cell in CELLS:
        values = (cell.build, cell.layout, cell.stage, cell.entry)
        covered |= {(i, values[i], j, values[j]) for i in range(4) for j in range(i + 1, 4)}
    for build in BUILDS:
        for layout in BUILDS[build].layouts or LAYOUTS:
            assert (0, build, 1, layout) in covered
        for stage in range(4):
            assert (0, build, 2, stage) in covered
    for layout in LAYOUTS:
        for entry in ("engine", "lightning", "fabric", "accelerate"):
            assert (1, layout, 3, entry) in covered
    print("\n".join(["cells:", *(c.id for c in CELLS)]))


def _gathered(cell_results: list[dict]) -> tuple[dict, dict]:
    """The whole initial and final state over the ranks (each holds its pipeline stages'), every rank that holds an
    entry agreeing on it bitwise, before and after training: a replica that diverged (a stage-0 rank stepping with
    another gradient, a tensor-parallel rank whose replicated norm drifted) would otherwise go unseen whenever the
    first rank holding the entry is right."""
    initial, final = {}, {}
    for index, rank in enumerate(cell_results):
        for state, gathered in ((rank["initial"], initial), (rank["final"], final)):
            for name, value in state.items():
                first = gathered.setdefault(name, value)
                assert torch.equal(first, value), (
                    f"rank {index} disagrees with the first rank holding {name} "
                    f"({'initial' if gathered is initial else 'final'} state), by up to "
                    f"{(first.float() - value.float()).abs().max():.3e}"
                )
    return initial, final


def _assert_initial_equal(cell_id: str, initial: dict, expected: dict) -> None:
    assert set(initial) == set(expected), sorted(set(initial) ^ set(expected))
    differing = [name for name, value in expected.items() if not torch.equal(initial[name], value)]
    assert differing == [], f"{cell_id}: initial state differs from a normal build in {differing}"


def _assert_extras(cell_results: list[dict], losses: list[float]) -> None:
    """Lightning's configure_model buffer and metric: real, the buffer's value kept, the metric the mean loss."""
    for rank in cell_results:
        extras = rank["extras"]
        assert torch.equal(extras["scale"], torch.full((4,), BUFFER_VALUE)), extras["scale"]
        assert not extras["metric_on_meta"]
        assert extras["mean_loss"] == pytest.approx(sum(losses) / len(losses), rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS + list(DEEPSPEED_CELLS), ids=[c.id for c in CELLS + list(DEEPSPEED_CELLS)])
def test_cell_starts_as_a_normal_build_and_trains_as_one_process(matrix, cell):
    results, references = matrix
    expected = references[BUILDS[cell.build].seed]
    _assert_trains_as_reference(results[cell.id], cell, expected)


def _assert_trains_as_reference(ranks: list, cell, expected: dict) -> None:
    """Every rank started as the normal build and ends with the one-process reference's parameters (and, under
    Lightning, its losses and extras)."""
    initial, final = _gathered(ranks)
    _assert_initial_equal(cell.id, initial, expected["initial"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(final[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    if cell.entry == "lightning":
        _assert_extras(ranks, expected["losses"])


# Note: [The bf16-true bound]
# "-true" keeps only the bf16 weights (no fp32 master), so the reference trains the normal build converted to bf16,
# in one process on whole batches. A cell computes each data-parallel half's gradient in bf16 and averages them:
# the gradients differ from the reference's by a few roundings, and each SGD step at lr 1 rounds the new weight
# to bf16 again (8 significant bits: one ulp is 2**-8 to 2**-7 of the value), so after 3 steps a weight may sit
# an ulp or two from the reference's (measured: at most 2**-10 absolute, one ulp). Bitwise equality is asked of
# the initial state only; training within 2-4 ulps: rtol 2**-6, and atol 2**-8 (an ulp of a weight near 0.5) for
# weights the steps moved near zero.
BF16_RTOL, BF16_ATOL = 2**-6, 2**-8


@pytest.mark.slow
@pytest.mark.parametrize("cell", BF16_CELLS, ids=[c.id for c in BF16_CELLS])
def test_init_module_under_bf16_true_builds_16bit_weights_of_the_normal_build(matrix, cell):
    """Issue 26, item 10: ``init_module()`` under "bf16-true" creates bf16 weights (fp32 before), equal bitwise to
    a normal build converted to bf16, which then train as that converted model does in one process."""
    results, references = matrix
    expected = references["bf16"]
    for rank in results[cell.id]:
        assert rank["dtypes"] == ["torch.bfloat16"], rank["dtypes"]
    initial, final = _gathered(results[cell.id])
    assert {value.dtype for value in final.values()} == {torch.bfloat16}  # exported in the model's dtype, as DDP's
    _assert_initial_equal(cell.id, initial, expected["initial"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(
            final[name], value, rtol=BF16_RTOL, atol=BF16_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("cell", OPTIMIZER_CELLS, ids=[c.id for c in OPTIMIZER_CELLS])
def test_several_optimizers_one_of_them_whole_tensor_train_as_one_process(matrix, cell):
    """Issue 39: a whole-tensor optimizer (each hidden matrix stepped by its gradient over the gradient's norm) beside
    SGD on the rest, as separate optimizers or chained, under every entry point, stage and dp/pp/sp layout."""
    results, references = matrix
    expected = references[cell.optimizers]
    initial, final = _gathered(results[cell.id])
    _assert_initial_equal(cell.id, initial, expected["initial"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(final[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("cell", FROZEN_CELLS, ids=[c.id for c in FROZEN_CELLS])
def test_frozen_parameters_in_the_optimizer_train_as_one_process(matrix, cell):
    """Issue 45, items 1-2: an optimizer over ``model.parameters()`` of a partly frozen model, given with the model or
    after it, at every stage and entry point, and the all-frozen decoder layer built on meta at stage 3, start as a
    normal build and train as one process (whose SGD skips the frozen parameters); the frozen ones never change."""
    results, references = matrix
    expected = references["frozen"]
    initial, final = _gathered(results[cell.id])
    _assert_initial_equal(cell.id, initial, expected["initial"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(final[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    frozen = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(final[frozen], expected["initial"][frozen])


@pytest.mark.slow
@pytest.mark.parametrize("cell", EXPERT_CELLS, ids=[c.id for c in EXPERT_CELLS])
def test_expert_parallel_cell_trains_as_one_process_on_the_unsharded_model(matrix, cell):
    """Issue 47: a Qwen3-MoE whose experts are split over an expert-parallel group of 2 (and ZeRO-sharded over the
    ranks holding the same ones), at stages 1-3 under every entry point, alone, under activation checkpointing, with
    the optimizer on the host and built on meta, starts as the normal build and trains as the whole model in one
    process; every rank's export holds every expert."""
    results, references = matrix
    expected = references[EXPERT_LAYOUTS[cell.layout].model]
    assert all(rank["on_meta"] == (cell.build != "normal") for rank in results[cell.id])
    _assert_trains_as_reference(results[cell.id], cell, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cell, words",
    (*REFUSED_OPTIMIZER_CELLS, *REFUSED_DEEPSPEED_CELLS),
    ids=[c.id for c, _ in (*REFUSED_OPTIMIZER_CELLS, *REFUSED_DEEPSPEED_CELLS)],
)
def test_whole_tensor_optimizer_over_split_matrices_is_refused_by_name(matrix, cell, words):
    results, _ = matrix
    for rank in results[cell.id]:
        assert rank["refused"] is not None and words in rank["refused"], rank["refused"]


@pytest.mark.parametrize("fields, words", REFUSED_CONFIGS, ids=lambda v: str(v))
def test_refused_configuration_is_refused_naming_both_sizes(fields, words):
    with pytest.raises(ZeroConfigError, match=words):
        ZeroConfig(**fields)


# Note: [The bf16-mixed bound]
# The reference trains fp32 weights with its forward under bf16 autocast (torch AMP's meaning); a cell computes with
# bf16 copies of its fp32 masters, the residual stream in bf16 too (Note: [What each precision keeps] in
# ``ds_strategy.config.plan``), so the two forwards round differently and 3 SGD steps at lr 1 carry that into the
# weights: measured at most 1.8e-3 apart (about 2**-9), within the bf16-true cells' bound of a few bf16 ulps.
# What the export must not be, the bf16 compute copy, is checked apart: every weight holds values bf16 cannot.


@pytest.mark.slow
@pytest.mark.parametrize("cell", EXPORT_CELLS, ids=[c.id for c in EXPORT_CELLS])
def test_bf16_mixed_export_is_the_fp32_masters_that_consolidate_writes(matrix, pretrained, cell):
    """Issue 41: the entry point's own export (``full_state_dict``, ``lightning_module_state_dict``,
    ``get_module_state_dict``, ``get_state_dict``) under "bf16-mixed" starts as the model's own fp32 weights, ends
    as the fp32 masters (not the bf16 compute copy), equal bitwise to what ``consolidate`` writes of the checkpoint
    the entry point saved, under tensor and pipeline parallelism, and trains as fp32 weights under bf16 autocast."""
    results, references = matrix
    expected = references["bf16-mixed", BUILDS[cell.build].seed]
    initial, final = _gathered(results[cell.id])
    _assert_initial_equal(cell.id, initial, expected["initial"])
    export = {}
    for rank in results[cell.id]:  # each rank holds its pipeline stage's entries
        export.update(rank["export"])
    checkpoint = export_dir(pretrained, cell) / (SHARDED_DIR if cell.entry == "accelerate" else "")
    written = torch.load(consolidate(checkpoint, export_dir(pretrained, cell).with_suffix(".pt")), weights_only=False)
    if cell.entry == "lightning":
        written = {k.removeprefix("model."): v for k, v in written["state_dict"].items()}
    assert export.keys() == written.keys() == expected["initial"].keys()
    for name, value in written.items():
        assert value.dtype == export[name].dtype == torch.float32, name
        assert torch.equal(export[name], value), name
        assert torch.equal(final[name], value), name
    for name, value in expected["params"].items():
        assert (final[name] != final[name].bfloat16().float()).any(), f"{name} holds only bf16 values"
        torch.testing.assert_close(
            final[name], value, rtol=BF16_RTOL, atol=BF16_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
