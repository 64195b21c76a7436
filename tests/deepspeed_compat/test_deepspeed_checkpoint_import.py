"""A DeepSpeed ZeRO checkpoint imported with ``ds-strategy import-deepspeed`` resumes under ds_strategy at 1, 2 and
4 ranks and takes the steps DeepSpeed itself takes when it continues from that checkpoint. DeepSpeed is not
needed: the checkpoints and DeepSpeed's continuation were recorded by ``tests/data/deepspeed_checkpoints/
make_fixtures.py`` (see the README there).

Every case is the one-block GPT of ``recipe.py``, trained by DeepSpeed on 2 ranks for SAVE_AT steps and saved;
DeepSpeed then loaded the checkpoint and trained CONTINUE more steps. Here the converted checkpoint is loaded into
a ZeroEngine of the same stage and precision, trained on the same batches, saved and consolidated, and its fp32
master weights compared with DeepSpeed's (``zero_to_fp32`` of the state after the continued steps).

Note: [Tolerances against DeepSpeed]
fp32: elementwise 1e-6. Both run torch's single-tensor AdamW on the same fp32 values; only the order in which
gradients are summed differs when the world size is not DeepSpeed's 2 (measured: bitwise equal at 2 ranks,
max |diff| 1.5e-7 at 1 rank, 1.2e-7 at 4). A checkpoint read wrongly (a slice off by one, moments not loaded,
the step count lost) moves parameters by ~lr = 1e-2.
16-bit: DeepSpeed casts the model to bf16/fp16 and so does ds_strategy's "-mixed" ZeroEngine (no autocast here,
as in DeepSpeed), but where gradients are rounded to 16 bits is not the same (fp16 at 2 ranks is still bitwise
equal; bf16 is not), and Adam normalises that noise to a sizeable fraction of a step for a coordinate whose
gradient is ~0 (the attention key bias). The check is therefore on the whole update since the checkpoint, per
tensor, in relative norm, ``||ours - theirs|| / ||theirs - saved||``, worst tensor: measured <= 0.17 for bf16
(median tensor 0.006) and <= 0.011 for fp16; bounds 0.25 and 0.05. Throwing the Adam moments away gives 2.3,
which the negative-control test checks stays far above the bound.
fp16 continues without a loss-scale increase on purpose: on a step where the dynamic scale grows, DeepSpeed
0.19.8 ZeRO-1/2 updates the scale *before* unscaling, so it divides that step's gradients by the doubled scale
(half the true gradient); ds_strategy unscales by the scale the backward used. Measured with a first fixture
recipe (window 2), that one step put the runs 26% apart in update; with our gradient halved by hand they agreed
to 0.04%.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from ds_strategy.checkpoint import consolidate, load, save
from ds_strategy.cli import main as cli_main
from ds_strategy.config import ZeroConfig
from ds_strategy.deepspeed.checkpoint_import import DeepSpeedCheckpointError, import_deepspeed
from ds_strategy.deepspeed.checkpoint_reader import load_file, read_checkpoint
from ds_strategy.zero.engine import ZeroEngine

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(FIXTURES))
import recipe  # noqa: E402

FP32_ATOL = 1e-6
UPDATE_RTOL = {"bf16-mixed": 0.25, "16-mixed": 0.05}  # see [Tolerances against DeepSpeed]
# Beyond same-stage resumes: a DeepSpeed ZeRO-3 checkpoint continued under ds_strategy ZeRO-1 (label -> case, stage).
CROSS_STAGE = {"zero3_fp32@stage1": ("zero3_fp32", 1)}
FOUR_RANKS = ["zero3_fp32", "zero2_fp16"]


@pytest.fixture(scope="module")
def references() -> dict:
    return torch.load(FIXTURES / "references.pt")


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """Every fixture converted, in this (DeepSpeed-free) process."""
    root = tmp_path_factory.mktemp("imported")
    for case in recipe.CASES:
        import_deepspeed(FIXTURES / case, root / case)
    return root


def zero_config(case: str, stage: int | None = None) -> ZeroConfig:
    ds_stage, _, precision = recipe.CASES[case]
    scaler = recipe.FP16_SCALER if precision == "16-mixed" else {}
    return ZeroConfig(stage=ds_stage if stage is None else stage, precision=precision, **scaler)


def resume(
    rank: int, world_size: int, root: Path, runs: dict[str, tuple[str, int | None]], load_optimizer: bool = True
) -> dict:
    """For each ``label: (case, stage)`` load the imported case into a fresh ZeroEngine (at DeepSpeed's stage when
    ``stage`` is None), train the CONTINUE steps DeepSpeed took, save it as ``<label>.w<world_size>``; returns each
    label's losses and the loss scaler's state."""
    torch.set_num_threads(1)
    results = {}
    for label, (case, stage) in runs.items():
        model = recipe.build_model()
        engine = ZeroEngine(model, recipe.build_optimizer(model), zero_config(case, stage))
        load(root / case, model, engine, load_optimizer=load_optimizer)
        losses = []
        for batch in recipe.global_batches()[recipe.SAVE_AT :]:
            _, loss = model(*recipe.rank_slice(batch, rank, world_size))
            engine.backward(loss)
            engine.step()
            total = loss.detach().float()
            if dist.is_initialized():
                dist.all_reduce(total)
            losses.append(total.item() / world_size)
        save(root / f"{label}.w{world_size}", model, engine)
        results[label] = {
            "losses": losses,
            "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        }
        engine.remove_hooks()
    return results


@pytest.fixture(scope="module")
def resumed(imported) -> dict:
    """world size -> label -> result: every case at 1 and 2 ranks (and the cross-stage resume at 2), two at 4."""
    every = {case: (case, None) for case in recipe.CASES}
    return {
        1: resume(0, 1, imported, every),
        2: run_ranks(resume, 2, imported, {**every, **CROSS_STAGE})[0],
        4: run_ranks(resume, 4, imported, {case: (case, None) for case in FOUR_RANKS})[0],
    }


def master_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(consolidate(root / name, root / f"{name}.pt"))


def update_error(ours: dict, theirs: dict, saved: dict) -> float:
    """The largest, over tensors, of ``||ours - theirs|| / ||theirs - saved||``."""
    return max(((ours[n] - theirs[n]).norm() / (theirs[n] - saved[n]).norm().clamp_min(1e-12)).item() for n in theirs)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(recipe.CASES))
def test_imported_weights_equal_deepspeeds_own_consolidation(imported, references, case):
    """The fp32 master weights, tied names included, are bit for bit what DeepSpeed's zero_to_fp32 extracts."""
    weights = master_weights(imported, case)
    saved = references[case]["saved"]
    assert list(weights) == list(recipe.build_model().state_dict())
    assert saved.keys() <= weights.keys()
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    assert weights["lm_head.weight"].data_ptr() == weights["embed.wte.weight"].data_ptr()


@pytest.mark.parametrize(
    "world_size, label",
    [(w, c) for w in (1, 2) for c in recipe.CASES]
    + [(2, label) for label in CROSS_STAGE]
    + [(4, c) for c in FOUR_RANKS],
)
@pytest.mark.slow
def test_resumed_training_matches_deepspeed_continuing(imported, resumed, references, world_size, label):
    case = CROSS_STAGE[label][0] if label in CROSS_STAGE else label
    reference = references[case]
    ours = master_weights(imported, f"{label}.w{world_size}")
    precision = recipe.CASES[case][2]
    if precision == "32-true":
        error = max((ours[n] - reference["continued"][n]).abs().max().item() for n in reference["continued"])
        assert error <= FP32_ATOL, f"max |param - DeepSpeed's| = {error:.2e}"
        torch.testing.assert_close(
            torch.tensor(resumed[world_size][label]["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0.0
        )
    else:
        error = update_error(ours, reference["continued"], reference["saved"])
        assert error <= UPDATE_RTOL[precision], f"update error {error:.2f} relative to DeepSpeed's update"
        torch.testing.assert_close(
            torch.tensor(resumed[world_size][label]["losses"]), torch.tensor(reference["losses"]), rtol=1e-2, atol=0.0
        )


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp16_loss_scaler_resumes_where_deepspeed_left_it(resumed, references, world_size):
    """DeepSpeed's scale schedule continues: the same steps overflow and are skipped, counted since step 0."""
    reference = references["zero2_fp16"]
    scaler = resumed[world_size]["zero2_fp16"]["scaler"]
    assert scaler["skipped_steps"] == reference["skipped_steps"]
    assert scaler["cur_iter"] == reference["global_steps"]
    assert scaler["cur_scale"] == reference["loss_scales"][-1]


@pytest.mark.slow
def test_update_error_bound_rejects_a_resume_without_adam_moments(imported, references):
    """Negative control for the 16-bit bound: the same resume with fresh Adam moments is far outside it."""
    resume(0, 1, imported, {"zero2_bf16": ("zero2_bf16", None)}, load_optimizer=False)
    ours = master_weights(imported, "zero2_bf16.w1")
    reference = references["zero2_bf16"]
    assert update_error(ours, reference["continued"], reference["saved"]) > 4 * UPDATE_RTOL["bf16-mixed"]


def test_conversion_does_not_need_deepspeed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # any `import deepspeed` now raises ImportError
    checkpoint = import_deepspeed(FIXTURES / "zero3_fp32" / "global_step2", tmp_path / "out")
    assert checkpoint.stage == 3 and checkpoint.world_size == recipe.DEEPSPEED_WORLD_SIZE
    assert checkpoint.optimizer_name == "AdamW"


def test_cli_converts_and_reports_how_to_resume(tmp_path, capsys):
    assert cli_main(["import-deepspeed", str(FIXTURES / "zero2_fp16"), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "ZeRO-2 checkpoint of 2 rank(s)" in printed and "precision='16-mixed'" in printed
    assert "loss_scale_window=1000" in printed and (tmp_path / "out" / "manifest.json").is_file()


def test_cli_reports_bad_input_and_fails(tmp_path, capsys):
    assert cli_main(["import-deepspeed", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "is not a DeepSpeed checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- bad input ----------------------------------------------------------------------------------------------------
def copy_fixture(case: str, tmp_path: Path) -> Path:
    """A writable copy of ``case``'s tag folder."""
    source = FIXTURES / case / f"global_step{recipe.SAVE_AT}"
    target = tmp_path / source.name
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def resave_plain(path: Path, edit) -> None:
    """Rewrite a DeepSpeed optim state file after ``edit(state)``, with its DeepSpeed objects replaced by plain
    values (their stand-ins cannot be pickled without DeepSpeed)."""
    loaded = load_file(path)
    state = loaded["optimizer_state_dict"]
    state.update(zero_stage=int(state["zero_stage"].value), loss_scaler=None, param_slice_mappings=None)
    edit(state)
    torch.save(loaded, path)


def test_directory_without_deepspeed_files_is_refused(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(DeepSpeedCheckpointError, match="is not a DeepSpeed checkpoint: it has no mp_rank_00_model"):
        read_checkpoint(tmp_path)


def test_missing_path_and_dangling_latest_are_refused(tmp_path):
    with pytest.raises(DeepSpeedCheckpointError, match="no such directory"):
        read_checkpoint(tmp_path / "absent")
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(DeepSpeedCheckpointError, match="global_step9: no such checkpoint tag folder"):
        read_checkpoint(tmp_path)


def test_tensor_parallel_checkpoint_is_refused(tmp_path):
    where = copy_fixture("zero2_fp32", tmp_path)
    (where / "zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(b"")
    with pytest.raises(DeepSpeedCheckpointError, match="mp_rank_01_optim_states.pt is a tensor-parallel"):
        read_checkpoint(where)


def test_pipeline_checkpoint_is_refused(tmp_path):
    where = copy_fixture("zero1_fp32", tmp_path)
    (where / "layer_01-model_00-model_states.pt").write_bytes(b"")
    with pytest.raises(DeepSpeedCheckpointError, match="layer_01-model_00-model_states.pt is a pipeline-parallel"):
        read_checkpoint(where)


def test_missing_rank_file_is_refused(tmp_path):
    where = copy_fixture("zero3_fp32", tmp_path)
    (where / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(DeepSpeedCheckpointError, match="saved by 2 data-parallel ranks but has 1"):
        read_checkpoint(where)


def test_checkpoint_without_zero_optimizer_files_is_refused(tmp_path):
    where = copy_fixture("zero2_fp32", tmp_path)
    for file in where.glob("*_optim_states.pt"):
        file.unlink()
    with pytest.raises(DeepSpeedCheckpointError, match="no zero_pp_rank_<r>_mp_rank_00_optim_states.pt"):
        read_checkpoint(where)


def test_non_adam_optimizer_is_refused(tmp_path):
    where = copy_fixture("zero2_fp32", tmp_path)

    def to_sgd(state):
        for per_param in state["base_optimizer_state"]["state"].values():
            per_param["momentum_buffer"] = per_param.pop("exp_avg")
            del per_param["exp_avg_sq"]

    for rank in range(recipe.DEEPSPEED_WORLD_SIZE):
        resave_plain(where / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", to_sgd)
    with pytest.raises(
        DeepSpeedCheckpointError,
        match=r"optim_states.pt: the optimizer state has keys "
        r"\['momentum_buffer', 'step'\], not Adam's",
    ):
        read_checkpoint(where)


def test_truncated_file_is_refused_naming_it(tmp_path):
    where = copy_fixture("zero1_fp32", tmp_path)
    file = where / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(DeepSpeedCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt cannot be read"):
        read_checkpoint(where)


def test_checkpoint_saved_before_any_applied_step_imports_with_a_fresh_optimizer(tmp_path, references):
    """Every fp16 step before the save overflowed: DeepSpeed's Adam has no state yet, and neither has ours."""
    where = copy_fixture("zero2_fp32", tmp_path)
    for rank in range(recipe.DEEPSPEED_WORLD_SIZE):
        resave_plain(
            where / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            lambda state: state["base_optimizer_state"]["state"].clear(),
        )
    import_deepspeed(where, tmp_path / "out")
    model = recipe.build_model()
    engine = ZeroEngine(model, recipe.build_optimizer(model), zero_config("zero2_fp32"))
    load(tmp_path / "out", model, engine)
    assert not engine.optimizer.state
    weights = engine.full_state_dict()
    assert all(torch.equal(weights[name], value) for name, value in references["zero2_fp32"]["saved"].items())
    engine.remove_hooks()
