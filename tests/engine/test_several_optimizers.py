"""Several optimizers over one model and whole-tensor optimizers at every ZeRO stage and entry point (issue 39): the
Muon recipe (Muon on a tiny Hugging Face Llama's hidden matrices, AdamW on the rest) on 2 gloo ranks at stages 0-3
and with CPU offload, driven through the engine, Accelerate, Lightning (manual optimization), Fabric and the
Hugging Face Trainer, equals torch DDP bitwise where the reductions are DDP's and ends within Note: [The Muon bound]
(``optimizer_runs``) of one process; each rank's memory stays within the ZeRO formula plus the largest whole
parameter; and a checkpoint resumes at another world size and stage."""

import optimizer_runs as runs
import pytest
import torch
from distributed import run_ranks

from ds_strategy import checkpoint

pytestmark = pytest.mark.slow

STAGE3 = {"stage": 3, "param_persistence_threshold": 0}  # every parameter partitioned, however small
ENTRIES = ("accelerate", "lightning")
RUNS = {
    **{f"engine stage{stage}": ("engine", {"stage": stage}) for stage in (0, 1, 2)},
    "engine stage3": ("engine", STAGE3),
    # the regions reduced to each owner and broadcast from it, NCCL's default path (gloo's is the all-reduce)
    "engine stage1 reduce-scatter": ("engine", {"stage": 1, "gradient_reduction": "reduce_scatter"}),
    "engine stage3 reduce-scatter": ("engine", {**STAGE3, "gradient_reduction": "reduce_scatter"}),
    "engine stage2 offload": ("engine", {"stage": 2, **runs.OFFLOAD_CPU}),
    "engine stage3 offload all": ("engine", {**STAGE3, **runs.OFFLOAD_ALL}),
    **{f"{entry} stage{stage}": (entry, {"stage": stage}) for entry in ENTRIES for stage in (1, 2)},
    "accelerate stage3": ("accelerate", STAGE3),
    "lightning stage3": ("lightning", STAGE3, "lightning_checkpoint"),  # saved after fit, then consolidated
    **{f"{entry} stage3 offload all": (entry, {**STAGE3, **runs.OFFLOAD_ALL}) for entry in ENTRIES},
    "fabric stage3": ("fabric", STAGE3),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every run on 2 ranks in one process group (DDP once), and the one-process reference."""
    where = tmp_path_factory.mktemp("lightning")
    jobs = {
        name: tuple(str(where / arg) if arg == "lightning_checkpoint" else arg for arg in run)
        for name, run in RUNS.items()
    }
    ranks = run_ranks(runs.jobs, 2, jobs, timeout=900)
    for name in ranks[0]:
        for other in ranks[1:]:
            for key, value in ranks[0][name]["params"].items():
                assert torch.equal(value, other[name]["params"][key]), f"{name}: ranks disagree on {key}"
    return ranks, runs.reference(), where / "lightning_checkpoint"


def test_every_stage_and_entry_point_ends_within_the_muon_bound_of_one_process(trained):
    ranks, reference, _ = trained
    errors = {name: runs.relative_error(ranks[0][name]["params"], reference) for name in ranks[0]}
    print("\n".join(f"{name:>28}: {error:.2e} relative to one process" for name, error in errors.items()))
    assert errors["ddp"] < runs.BOUND / 2  # the noise the bound is for (Note: [The Muon bound])
    assert max(errors.values()) <= runs.BOUND, errors


def test_every_stage_and_entry_point_equals_ddp_bitwise_where_the_reductions_are_ddps(trained):
    """Offloaded AdamW steps with ds_strategy's host kernels (not torch's): those runs are held to the bound."""
    ranks, _, _ = trained
    ddp = ranks[0]["ddp"]["params"]
    exact = [name for name in RUNS if "offload" not in name]
    differing = {
        name: [key for key, value in ddp.items() if not torch.equal(ranks[0][name]["params"][key], value)]
        for name in exact
    }
    assert all(not keys for keys in differing.values()), differing


def test_the_global_norm_is_one_norm_over_both_optimizers_or_each_ones_own(trained):
    """With no optimizer named, the engine's ``clip_grad_norm_`` is the norm DDP's ``clip_grad_norm_`` takes over
    ``model.parameters()``, both optimizers' parameters; with one named (Lightning's and Fabric's clipping), that
    optimizer's parameters' norm; Accelerate's ``clip_grad_norm_`` picks by the parameters it is given."""
    ranks, _, _ = trained
    ddp = torch.tensor(ranks[0]["ddp"]["norms"])
    for name in (n for n in RUNS if n.startswith("engine") and "offload" not in n):
        torch.testing.assert_close(torch.tensor(ranks[0][name]["norms"]), ddp, rtol=1e-6, atol=0.0)
    for name in (n for n in RUNS if n.startswith("accelerate") and "offload" not in n):
        torch.testing.assert_close(torch.tensor(ranks[0][name]["norms"]), ddp[:, :2], rtol=1e-6, atol=0.0)


def test_memory_per_rank_is_the_zero_formula_plus_at_most_the_largest_whole_parameter(trained):
    """fp32: the master is the shard itself, Muon keeps one fp32 state per element and AdamW two, so a rank's
    optimizer bytes are 4 x its whole-tensor elements + 8 x its AdamW shard, and it owns at most 1/N of the Muon
    parameters plus the largest (Note: [Whole parameters on owner ranks])."""
    ranks, _, _ = trained
    for name in (n for n in RUNS if "stage0" not in n):
        for rank, outcome in enumerate(r[name] for r in ranks):
            owned = outcome["ownership"]
            optimizer_bytes = sum(outcome["memory"]["optimizer"].values())
            print(
                f"{name:>28} rank {rank}: owns {owned.owned} of {owned.total} Muon elements (bound {owned.bound:.0f});"
                f" per place "
                + ", ".join(
                    f"{kind} {sum(places.values()) / 1024:.1f} KiB" for kind, places in outcome["memory"].items()
                )
            )
            assert owned.owned <= owned.bound
            assert optimizer_bytes == 4 * owned.owned + 8 * outcome["elementwise_shard"], name
    halves = [r["engine stage1"]["ownership"].owned for r in ranks]
    assert sum(halves) == ranks[0]["engine stage1"]["ownership"].total and min(halves) > 0


def test_a_checkpoint_resumes_at_another_world_size_and_stage(tmp_path):
    """Saved by 2 ranks at stage 1 after 3 steps, loaded by 1 rank at stage 3 (a fresh, differently seeded model)
    and continued 3 steps: the weights load exactly, and the continuation equals one process continuing from the
    consolidated checkpoint (weights and both optimizers' state, by name) bitwise."""
    path = str(tmp_path / "muon")
    saved = run_ranks(runs.train_and_save, 2, path, {"stage": 1}, 3, timeout=300)[0]
    resumed = run_ranks(runs.resume, 1, path, STAGE3, 3, 2, timeout=300)[0]
    for key, value in saved["params"].items():
        assert torch.equal(resumed["loaded"][key], value), key
    expected = runs.continue_in_one_process(path, 3, 2)
    for key, value in expected.items():
        assert torch.equal(resumed["params"][key], value), key


def test_a_lightning_checkpoint_consolidates_into_one_optimizer_state_per_optimizer(trained, tmp_path):
    """``trainer.save_checkpoint`` after the stage-3 fit, consolidated into Lightning's single-file layout: Muon's
    momentum for each of its matrices, AdamW's moments for the rest, each keyed by position in its own optimizer."""
    ranks, _, path = trained
    payload = torch.load(checkpoint.consolidate(path, tmp_path / "one.ckpt", weights_only=False), weights_only=False)
    muon, adamw = payload["optimizer_states"]
    params = ranks[0]["lightning stage3"]["params"]
    hidden = [name for name, value in params.items() if runs.is_hidden_matrix(name, value)]
    assert [len(g["params"]) for g in muon["param_groups"]] == [len(hidden)]
    assert [len(g["params"]) for g in adamw["param_groups"]] == [len(params) - len(hidden)]
    assert sorted(muon["state"]) == list(range(len(hidden))) and all(
        set(state) == {"momentum_buffer"} for state in muon["state"].values()
    )
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq"} for state in adamw["state"].values())
    assert muon["state"][0]["momentum_buffer"].shape == params[hidden[0]].shape


def test_adafactor_states_of_other_shapes_reload_at_another_world_size_and_stage(tmp_path):
    """Adafactor keeps each matrix's second moment as a row and a column statistic (not shaped like the matrix):
    saved whole by each owner on 2 ranks at stage 2, read back whole by 1 rank at stage 3."""
    path = str(tmp_path / "adafactor")
    saved = run_ranks(runs.adafactor, 2, path, {"stage": 2}, False, timeout=300)
    loaded = run_ranks(runs.adafactor, 1, path, STAGE3, True, timeout=300)[0]
    expected = {name: state for rank in saved for name, state in rank["states"].items()}
    assert set(expected) == set(loaded["states"]) and {"row_var", "col_var"} <= set(expected["lm_head.weight"])
    for name, state in expected.items():
        for key, value in state.items():
            assert torch.equal(loaded["states"][name][key], value), (name, key)


def test_hugging_face_trainer_with_chained_muon_and_adamw_equals_ddp(tmp_path):
    """``Trainer(optimizers=(ChainedOptimizer(muon, adamw), None))``: ZeroTrainer at stage 3 and DDP's Trainer log
    the same losses and end with the same weights, bitwise."""
    trained = run_ranks(runs.hf_trainers, 2, str(tmp_path), STAGE3, timeout=600)[0]
    assert trained["zero"]["losses"] == trained["ddp"]["losses"]
    for key, value in trained["ddp"]["params"].items():
        assert torch.equal(trained["zero"]["params"][key], value), key
