"""Lightning (manual optimization), Fabric and Accelerate drive backward in every pattern users write, at every
stage and with either gradient collective, and train exactly like one unsharded process.

Each run trains the MLP for STEPS optimizer steps of ACCUMULATE micro-batches; step k uses the backward pattern
SCHEDULE[k] (tests/support/training_loops.py, Note: [Backward patterns]), so one run covers them all and a pattern that
reduced wrongly moves every later parameter. Accelerate also runs ``accumulate()`` with ``sync_each_batch=True``
on a model prepared before its optimizer, and a stage-3 teacher prepared without an optimizer. Parameters must
equal the one-process reference to 1e-6 in relative norm (fp32).
"""

import sys
from pathlib import Path

import lightning as L
import models
import pytest
import torch
from distributed import run_ranks, set_lightning_environment, set_torchrun_environment
from quiet_trainer import QUIET
from test_lightning_strategy import ACCUMULATE, BATCH, STEPS, WORLD, MLPModule, _dataset, _reference
from torch.utils.data import DataLoader, Subset
from training_loops import drive_micro_batch

from ds_strategy.config import ZeroConfig

SCHEDULE = ("every", "twice", "forwards_first", "no_sync")
CONFIGS = [(stage, reduction) for stage in (0, 1, 2, 3) for reduction in ("all_reduce", "reduce_scatter")]
assert len(SCHEDULE) == STEPS


def _config(stage: int, reduction: str) -> ZeroConfig:
    return ZeroConfig(stage=stage, gradient_reduction=reduction, param_persistence_threshold=0)


def _rank_batches(rank: int) -> list:
    mine = Subset(_dataset(), range(rank, len(_dataset()), WORLD))  # what a DistributedSampler gives rank r
    return list(DataLoader(mine, batch_size=BATCH))


def _model_and_optimizer(param_groups=models.param_groups):
    torch.manual_seed(0)
    model = models.MLP()
    return model, torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)


def _one_group(model):
    return [{"params": list(model.parameters()), "weight_decay": 0.1}]


def _train_schedule(model, batches, backward, no_sync, clip, step) -> None:
    """SCHEDULE through an entry point's own ``backward``, ``no_sync()``, ``clip(max_norm)`` and ``step()``."""
    pending = []
    for index, batch in enumerate(batches):
        step_index, micro = divmod(index, ACCUMULATE)
        boundary = micro == ACCUMULATE - 1
        drive_micro_batch(SCHEDULE[step_index], boundary, lambda: model(batch) / ACCUMULATE, backward, no_sync, pending)
        if boundary:
            clip(1.0)
            step()


def _state(engine) -> dict:
    return engine.full_state_dict(rank0_only=False)


# -- Lightning ---------------------------------------------------------------------------------------------------
class PatternModule(MLPModule):
    """Manual optimization: the module calls ``manual_backward`` itself, as in Lightning's accumulation recipe."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self._pending = []

    def training_step(self, batch, batch_idx):
        step_index, micro = divmod(batch_idx, ACCUMULATE)
        boundary = micro == ACCUMULATE - 1
        drive_micro_batch(
            SCHEDULE[step_index],
            boundary,
            lambda: self.net(batch) / ACCUMULATE,
            self.manual_backward,
            self.trainer.strategy.block_backward_sync,
            self._pending,
        )
        if boundary:
            opt = self.optimizers()
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


def _lightning_runs(rank: int, world_size: int) -> dict:
    import ds_strategy

    set_lightning_environment(rank)
    results = {}
    for stage, reduction in CONFIGS:
        module = PatternModule()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            max_steps=STEPS,
            strategy=ds_strategy.ZeroStrategy(_config(stage, reduction)),
            **QUIET,
            use_distributed_sampler=False,
        )
        trainer.fit(module, DataLoader(Subset(_dataset(), range(rank, len(_dataset()), WORLD)), batch_size=BATCH))
        results[stage, reduction] = _state(trainer.strategy.engine)
    return results


# -- Fabric ------------------------------------------------------------------------------------------------------
def _fabric_runs(rank: int, world_size: int) -> dict:
    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    results = {}
    for stage, reduction in CONFIGS:
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(_config(stage, reduction)))
        fabric.launch()
        model, optimizer = fabric.setup(*_model_and_optimizer())
        _train_schedule(
            model,
            _rank_batches(rank),
            fabric.backward,
            lambda: fabric.no_backward_sync(model),
            lambda norm: fabric.clip_gradients(model, optimizer, max_norm=norm),
            lambda: (optimizer.step(), optimizer.zero_grad()),
        )
        results[stage, reduction] = _state(fabric.strategy.engine)
    return results


# -- Accelerate --------------------------------------------------------------------------------------------------
def _accelerate_runs(rank: int, world_size: int) -> dict:
    from accelerate.state import GradientState
    from accelerate.utils import GradientAccumulationPlugin

    from ds_strategy.accelerate import ZeroAccelerator

    set_torchrun_environment(rank, world_size)
    torch.manual_seed(1)
    plain_teacher = models.MLP()
    results = {}
    for stage, reduction in CONFIGS:
        accelerator = ZeroAccelerator(_config(stage, reduction), cpu=True)
        torch.manual_seed(1)
        model, optimizer = _model_and_optimizer()
        teacher = models.MLP()
        teacher.load_state_dict(plain_teacher.state_dict())
        model, optimizer, teacher = accelerator.prepare(model, optimizer, teacher)
        batches = _rank_batches(rank)
        _train_schedule(
            model,
            batches,
            accelerator.backward,
            lambda: accelerator.no_sync(model),
            lambda norm: accelerator.clip_grad_norm_(model.parameters(), norm),
            lambda: (optimizer.step(), optimizer.zero_grad()),
        )
        with torch.no_grad():
            teacher_gap = max((teacher(b) - plain_teacher(b)).abs().item() for b in batches)
        results["schedule", stage, reduction] = {
            "state": _state(accelerator.engine_of(model)),
            "teacher_gap": teacher_gap,
            "engines": len(accelerator.engines),
        }
        GradientState._reset_state()

        # accumulate(sync_each_batch=True) on a model whose optimizer is prepared after it: at stage 0-2 the
        # engine is rebuilt for the two param groups; at stage 3 only a single group can be attached.
        plugin = GradientAccumulationPlugin(num_steps=ACCUMULATE, sync_each_batch=True)
        accelerator = ZeroAccelerator(_config(stage, reduction), cpu=True, gradient_accumulation_plugin=plugin)
        groups = _one_group if stage == 3 else models.param_groups
        model, optimizer = _model_and_optimizer(groups)
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
        for batch in batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        results["sync_each_batch", stage, reduction] = {"state": _state(accelerator.engine_of(model))}
        GradientState._reset_state()
    results["errors"] = _prepare_errors(ZeroAccelerator)
    return results


def _prepare_errors(accelerator_class) -> list[str]:
    """What prepare() refuses, with the message it gives."""
    errors = []
    accelerator = accelerator_class(_config(3, "all_reduce"), cpu=True)
    model, optimizer = _model_and_optimizer()
    model = accelerator.prepare(model)
    for attempt in (
        lambda: accelerator.prepare(optimizer),
        lambda: accelerator.prepare(model),
        lambda: accelerator.prepare(models.MLP(), *_model_and_optimizer()[1:]),
    ):
        try:
            attempt()
            errors.append("accepted")
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.fixture(scope="module")
def references():
    return {"two groups": _reference(), "one group": _reference(_one_group)}


def _assert_state_matches(state: dict, reference: dict) -> None:
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        error = (state[key] - value).norm() / value.norm()
        assert error < 1e-6, f"{key}: relative error {error:.2e}"


def _net_state(state: dict) -> dict:
    return {f"net.{key}": value for key, value in state.items()}


def test_lightning_manual_backward_patterns_match_single_process(references):
    ranks = run_ranks(_lightning_runs, WORLD, timeout=600)
    for rank in ranks:
        for config in CONFIGS:
            _assert_state_matches(rank[config], references["two groups"])


def test_fabric_backward_patterns_match_single_process(references):
    ranks = run_ranks(_fabric_runs, WORLD, timeout=600)
    for rank in ranks:
        for config in CONFIGS:
            _assert_state_matches(_net_state(rank[config]), references["two groups"])


@pytest.fixture(scope="module")
def accelerate_runs():
    return run_ranks(_accelerate_runs, WORLD, timeout=600)


@pytest.mark.parametrize("stage, reduction", CONFIGS)
def test_accelerate_backward_patterns_match_single_process_beside_a_teacher(
    accelerate_runs, references, stage, reduction
):
    for rank in accelerate_runs:
        run = rank["schedule", stage, reduction]
        _assert_state_matches(_net_state(run["state"]), references["two groups"])
        assert run["engines"] == 2
        assert run["teacher_gap"] == 0.0  # the teacher, sharded without an optimizer, computes what it computed


@pytest.mark.parametrize("stage, reduction", CONFIGS)
def test_accelerate_sync_each_batch_with_optimizer_prepared_later_matches_single_process(
    accelerate_runs, references, stage, reduction
):
    expected = references["one group" if stage == 3 else "two groups"]
    for rank in accelerate_runs:
        _assert_state_matches(_net_state(rank["sync_each_batch", stage, reduction]["state"]), expected)


def test_accelerate_prepare_refuses_what_it_cannot_shard_with_the_reason(accelerate_runs):
    split, twice, foreign = accelerate_runs[0]["errors"]
    assert "param groups split this model's flat buffers" in split
    assert "was already prepared" in twice
    assert "holds parameters of no model being prepared" in foreign


@pytest.mark.slow
def test_accelerates_own_test_sync_checks_pass_under_zero_accelerator_at_stage_1():
    """accelerate's test_sync.py under ZeroAccelerator (2 processes, torchrun): every check passes or fails for a
    reason benchmarks/accelerate_scripts.py states (the full table over scripts and stages is that script's)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        from accelerate_scripts import BY_DESIGN, run_stage, verdict
    finally:
        sys.path.pop(0)
    results = run_stage(1, ["test_sync"])
    assert {r["check"] for r in results} >= {"test_distributed_sync", "test_gradient_accumulation"}
    assert [r for r in results if verdict(r, 1) == "FAILED"] == []
    passed = {r["check"] for r in results if r["result"] == "passed"}
    assert {"test_distributed_sync", "test_distributed_sync_multiple_fwd", "test_gradient_accumulation"} <= passed
    assert "test_gradient_accumulation_with_opt_and_scheduler" in BY_DESIGN
