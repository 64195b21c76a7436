"""Mixed precision on real gloo ranks.

bf16-mixed ZeRO trains like one process under bf16 autocast with fp32 weights; fp16 with dynamic loss scaling
trains like fp32; an overflow on one rank makes every rank skip that step; memory follows the mixed-precision
ZeRO formula; and the Lightning Trainer runs both precisions end to end.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning_precision_run
import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from ds_strategy.config import ZeroConfig
from ds_strategy.lightning import ZeroPrecision, ZeroStrategy
from ds_strategy.models import gpt_config
from ds_strategy.precision import autocast_for
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

WORLD = 2
STEPS = 20
PER_RANK_BATCH = 4
LR = 3e-3
CLIP = 1.0
STAGES = (0, 1, 2, 3)
# Losses of bf16-mixed ZeRO against the bf16-autocast reference, relative, at every one of the 20 steps. The two
# round differently: ZeRO keeps weights, activations and the residual stream in bf16 (module-level mixed
# precision, as DeepSpeed and FSDP's MixedPrecisionPolicy do), autocast only the matmul operands and keeps fp32
# weights. Measured: at most 7e-4 at every stage. Skipping a single optimizer step (step 3 of these 20) moved
# later losses by 2.3% when measured, so a wrong shard or a master that is not updated cannot pass.
BF16_LOSS_RTOL = 5e-3
FP16_LOSS_RTOL = 5e-3  # fp16 against fp32 without overflow; measured at most 3e-4
# Gradient norms after unscaling, fp16 against fp32, over the first 10 steps (measured at most 2.4e-4; later
# steps drift apart, as trajectories do). Adam's update is nearly scale-invariant, so the losses alone would hide
# a loss scale that was never divided out; the norm would be off by a factor of 65536.
FP16_NORM_RTOL, NORM_STEPS = 1e-3, 10
INJECT_AT, OVERFLOW_STEPS = 3, 6  # the step whose gradient gets an inf on rank 1, of this many


def _text_tokens() -> torch.Tensor:
    """A standard-library source file as printable-ASCII ids: text with structure to learn, read in milliseconds."""
    return (torch.tensor(list(Path(os.__file__).read_bytes()), dtype=torch.long) - 32).clamp(0, 95)


def _global_batches(steps: int):
    """The same ``steps`` global batches of ``WORLD * PER_RANK_BATCH`` text windows for every caller."""
    tokens, block = _text_tokens(), gpt_config("tiny").block_size
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - block - 1, (WORLD * PER_RANK_BATCH,), generator=generator)
        yield (
            torch.stack([tokens[s : s + block] for s in starts]),
            torch.stack([tokens[s + 1 : s + block + 1] for s in starts]),
        )


def _rank_slice(batch, rank: int):
    return tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)


def _build():
    torch.manual_seed(0)
    model = models.TinyGPT()
    return model, torch.optim.AdamW(models.param_groups(model), lr=LR)


def _poison_rank0_shard_gradient(engine: ZeroEngine):
    """Hook that puts an inf into this rank's gradient of the first element of a flat buffer (rank 0's shard).

    After the reduction only rank 0 holds the inf, so any other rank skips only if the ranks agree on overflow.
    """
    param = engine.flat_params[-1].params[0]
    assert engine.flat_params[-1].shard_numel > 0

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    return param.register_hook(poison)


def train_zero(
    rank: int, world_size: int, precision: str, stage: int, inject_at: int | None = None, steps: int = STEPS, **zero
) -> dict:
    """ZeRO on this rank: losses (averaged over ranks), whether each step was taken, full parameters around
    the injected step, the loss scales seen, and the memory report after the first step."""
    model, optimizer = _build()
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage, precision=precision, **zero))
    result = {"losses": [], "norms": [], "stepped": [], "scales": [], "params": [], "masters": []}
    for step, batch in enumerate(_global_batches(steps)):
        poison = _poison_rank0_shard_gradient(engine) if step == inject_at and rank == 1 else None
        with autocast_for(precision, "cpu"):
            loss = model(_rank_slice(batch, rank))
        engine.backward(loss)
        if poison is not None:
            poison.remove()
        result["norms"].append(engine.clip_grad_norm_(CLIP).item())
        if inject_at is not None and step in (inject_at, inject_at + 1):
            result["params"].append(_full_params(engine))
            result["masters"].append(torch.cat([fp.master.detach().clone() for fp in engine.flat_params]))
        result["stepped"].append(engine.step())
        result["scales"].append(engine.loss_scaler.scale if engine.loss_scaler else None)
        if step == 0:
            result["memory"] = engine.memory_report()
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)
        result["losses"].append(mean_loss.item() / world_size)
    result["params"].append(_full_params(engine))
    return result


def _full_params(engine: ZeroEngine) -> torch.Tensor:
    return torch.cat([v.flatten() for v in engine.full_state_dict(rank0_only=False).values()])


def train_many(rank: int, world_size: int, runs: dict) -> dict:
    """Every run in ``runs`` (name -> train_zero arguments) in one process group: spawning ranks is the slow part."""
    torch.set_num_threads(1)
    return {name: train_zero(rank, world_size, **kwargs) for name, kwargs in runs.items()}


def train_autocast_reference(steps: int) -> list[float]:
    """One process, fp32 weights and optimizer, bf16 autocast; each global batch as ``WORLD`` slices, averaged."""
    model, optimizer = _build()
    losses = []
    for batch in _global_batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.stack([model(_rank_slice(batch, r)) for r in range(WORLD)]).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


RUNS = {
    # param_persistence_threshold=0: stage 3 partitions even the tiny GPT's small parameters
    **{
        f"bf16-stage{stage}": {"precision": "bf16-mixed", "stage": stage, "param_persistence_threshold": 0}
        for stage in STAGES
    },
    "fp16-stage2": {"precision": "16-mixed", "stage": 2},
    # a short growth window: the scale doubles into overflow (2**17 overflows here), is halved, grows again
    "fp16-window4-stage2": {"precision": "16-mixed", "stage": 2, "loss_scale_window": 4},
    "fp32-stage2": {"precision": "32-true", "stage": 2},
    **{
        f"overflow-stage{stage}": {
            "precision": "16-mixed",
            "stage": stage,
            "inject_at": INJECT_AT,
            "steps": OVERFLOW_STEPS,
            "initial_scale_power": 8,
            "hysteresis": 1,
        }
        for stage in (1, 2)
    },
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(train_many, WORLD, RUNS, timeout=300)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return train_autocast_reference(STEPS)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_mixed_matches_single_process_bf16_autocast_with_fp32_weights(ranks, reference, stage):
    for rank in ranks:
        torch.testing.assert_close(
            torch.tensor(rank[f"bf16-stage{stage}"]["losses"]), torch.tensor(reference), rtol=BF16_LOSS_RTOL, atol=0.0
        )


def test_fp16_with_loss_scaling_matches_fp32_while_no_step_overflows(ranks):
    fp16, fp32 = ranks[0]["fp16-stage2"], ranks[0]["fp32-stage2"]
    assert all(fp16["stepped"]) and set(fp16["scales"]) == {2.0**16}
    torch.testing.assert_close(torch.tensor(fp16["losses"]), torch.tensor(fp32["losses"]), rtol=FP16_LOSS_RTOL, atol=0)
    torch.testing.assert_close(
        torch.tensor(fp16["norms"][:NORM_STEPS]), torch.tensor(fp32["norms"][:NORM_STEPS]), rtol=FP16_NORM_RTOL, atol=0
    )


def test_fp16_dynamic_scale_backs_off_from_overflow_and_the_loss_falls_like_fp32(ranks):
    fp16, fp32 = ranks[0]["fp16-window4-stage2"], ranks[0]["fp32-stage2"]
    scales = fp16["scales"]
    assert max(scales) > 2.0**16, "the scale never grew"
    assert any(later < earlier for earlier, later in zip(scales, scales[1:])), "the scale never backed off"
    assert sum(fp16["stepped"]) >= STEPS - 5
    fp32_drop = fp32["losses"][0] - sum(fp32["losses"][-3:]) / 3
    fp16_drop = fp16["losses"][0] - sum(fp16["losses"][-3:]) / 3
    assert fp32_drop > 1.0 and fp16_drop > 0.75 * fp32_drop


@pytest.mark.parametrize("stage", (1, 2))
def test_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, stage):
    for rank in ranks:
        run = rank[f"overflow-stage{stage}"]
        assert run["stepped"] == [step != INJECT_AT for step in range(OVERFLOW_STEPS)]
        before, after_skip, after_next = run["params"]
        assert torch.equal(before, after_skip), "parameters changed on a skipped step"
        assert torch.equal(*run["masters"]), "fp32 master weights changed on a skipped step"
        assert not torch.equal(after_skip, after_next), "training did not continue after the skip"
        assert torch.equal(run["params"][-1], ranks[0][f"overflow-stage{stage}"]["params"][-1])


@pytest.mark.parametrize("stage", (1, 2))
def test_overflow_halves_the_scale_once_hysteresis_is_spent(ranks, stage):
    scales = ranks[1][f"overflow-stage{stage}"]["scales"]
    assert scales[:INJECT_AT] == [2.0**8] * INJECT_AT
    assert scales[INJECT_AT] == 2.0**7
    assert all(torch.isfinite(torch.tensor(ranks[1][f"overflow-stage{stage}"]["losses"])))


@pytest.mark.parametrize("stage", STAGES)
def test_memory_matches_the_mixed_precision_zero_formula(ranks, stage):
    """Bytes per rank on 2 ranks, the ZeRO paper's mixed-precision Adam model: 2Ψ bf16 parameters (2Ψ/N at
    stage 3); 2Ψ bf16 gradients (the stage 0/1 accumulation buffer, whose shard the reduction writes in place on
    gloo), 2Ψ/N at stage 2/3; 12Ψ of fp32 master, momentum and variance, divided by N from stage 1. Measured
    between steps: the fp32 copy of the gradient shard exists only inside a step."""
    psi, n = sum(p.numel() for p in models.TinyGPT().parameters()), WORLD
    report = {kind: sum(places.values()) for kind, places in ranks[0][f"bf16-stage{stage}"]["memory"].items()}
    expected_grads = {0: 2 * psi, 1: 2 * psi, 2: 2 * psi / n, 3: 2 * psi / n}[stage]
    assert _close(report["params"], 2 * psi / (n if stage == 3 else 1))
    assert _close(report["grads"], expected_grads)
    assert _close(report["optimizer"], 12 * psi / (n if stage >= 1 else 1))


def _close(measured: int, expected: float) -> bool:
    """Within 2% (flat buffers are padded to a multiple of N elements; Adam keeps a few scalar steps)."""
    return abs(measured - expected) <= 0.02 * expected


def test_loss_scaler_state_round_trips_through_the_precision_plugin():
    """Lightning saves ``precision_plugin.state_dict()`` in checkpoints and restores it with ``load_state_dict``."""
    saving, loading = _plugin_with_engine(), _plugin_with_engine()
    saving.engine.loss_scaler.update(True)
    saving.engine.loss_scaler.update(True)
    state = saving.state_dict()
    loading.load_state_dict(state)
    assert loading.state_dict() == state and loading.engine.loss_scaler.scale == 2.0**14  # hysteresis 1: halved twice


def test_scaler_state_loaded_before_the_engine_exists_is_applied_when_it_attaches():
    state = {
        "loss_scaler": {
            "cur_scale": 8.0,
            "cur_iter": 3,
            "last_overflow_iter": 1,
            "cur_hysteresis": 1,
            "skipped_steps": 2,
            "consecutive_min_scale_skips": 0,
        }
    }
    plugin = ZeroPrecision("16-mixed")
    plugin.load_state_dict(state)
    engine = _plugin_with_engine().engine
    plugin.attach_engine(engine, engine.module)
    assert plugin.state_dict() == state


def _plugin_with_engine():
    model, optimizer = _build()
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2, precision="16-mixed", hysteresis=1))
    plugin = ZeroPrecision("16-mixed")
    plugin.attach_engine(engine, model)
    return plugin


def test_bf16_true_keeps_weights_gradients_and_optimizer_state_in_bf16_without_a_master_copy():
    model, optimizer = _build()
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2, precision="bf16-true"))
    with autocast_for("bf16-true", "cpu"):
        loss = model(next(_global_batches(1)))
    engine.backward(loss)
    assert engine.step()
    for fp in engine.flat_params:
        assert fp.master is fp.shard and fp.master.dtype == fp.grad_shard.dtype == torch.bfloat16
    states = [v for state in optimizer.state.values() for v in state.values() if v.numel() > 1]
    assert states and all(v.dtype == torch.bfloat16 for v in states)


@pytest.mark.parametrize(
    "config, flag, expected",
    [
        ("16-mixed", Precision(), "16-mixed"),  # a flag left at 32-true defers to the config
        ("32-true", MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),  # a config left at 32-true defers to the flag
        ("bf16-true", HalfPrecision("bf16-true"), "bf16-true"),
    ],
)
def test_trainer_precision_flag_and_config_agree_on_one_precision(config, flag, expected):
    strategy = ZeroStrategy(stage=2, precision=config)
    strategy.precision_plugin = flag
    assert isinstance(strategy.precision_plugin, ZeroPrecision)
    assert strategy.precision_plugin.precision == strategy.config.precision == expected


def test_lightning_trainer_runs_bf16_mixed_and_fp16_with_a_skipped_step(tmp_path):
    """The bf16-mixed fit's losses are one process's under bf16 autocast with fp32 weights (as the engine's are above),
    on the batches each rank was dealt."""
    results = _run_lightning_ranks(tmp_path)
    bf16_reference = lightning_precision_run.bf16_autocast_reference(WORLD)
    for rank in range(WORLD):
        bf16 = results[f"bf16-rank{rank}"]
        assert bf16["precision"] == "bf16-mixed" and bf16["global_step"] == 5
        assert bf16["param_dtypes"] == ["torch.bfloat16"] and bf16["master_dtypes"] == ["torch.float32"]
        torch.testing.assert_close(
            torch.tensor(bf16["losses"]), torch.tensor(bf16_reference[rank]), rtol=BF16_LOSS_RTOL, atol=0.0
        )

        fp16 = results[f"fp16-rank{rank}"]
        assert fp16["param_dtypes"] == ["torch.float16"]
        assert fp16["unchanged_at_injection"]
        assert fp16["global_step"] == 5  # Lightning counts the skipped step, as with its AMP plugin
        assert fp16["scheduler_last_epoch"] == 4 and fp16["lr"] == pytest.approx(lightning_precision_run.LR * 0.5**4)
        assert (fp16["logged"]["loss_scale"], fp16["logged"]["skipped_steps"]) == (128.0, 1.0)
        assert fp16["checkpoint_state"] == fp16["plugin_state"]
        assert fp16["plugin_state"]["loss_scaler"]["skipped_steps"] == 1
        assert fp16["gate_removed"]


def _run_lightning_ranks(out: Path) -> dict:
    """Start ``lightning_precision_run.py`` once per rank, as an external launcher (torchrun) would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).with_name("lightning_precision_run.py")
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(WORLD),
            NODE_RANK="0",
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out)],
                env=env,
                cwd=script.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
