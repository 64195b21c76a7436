"""Scripts written for DDP or accelerate's DeepSpeed back-end run under ZeroAccelerator with only ``Accelerator(``
changed: a prepared model answers DDP's ``model.no_sync()`` (accelerate's ``gradient_accumulation_for_
autoregressive_models.py`` pattern) and ``accelerator.state.deepspeed_plugin`` lets a script pick ``DummyOptim``
(``deepspeed_with_config_support.py``); and ``ds-strategy launch`` fails a script that never builds one.

The ``no_sync`` run accumulates two micro-batches per step at stages 1-3 on 2 gloo ranks, the first under
``model.no_sync()``, and must end where one process training on the global batch ends (fp32, 1e-6 relative: see
tests/support/training_loops.py).
"""

import models
import pytest
import torch
from distributed import run_ranks, set_torchrun_environment
from e2e_runs import DS_STRATEGY, REPO, free_port, run

WORLD, MICRO, STEPS, LR = 2, 4, 3, 0.05
DEEPSPEED = {
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}},
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch: 2 micro-batches on each of WORLD ranks."""
    generator = torch.Generator().manual_seed(5)
    return [models.MLP.make_batch(generator, 2 * MICRO * WORLD) for _ in range(STEPS)]


def _model() -> models.MLP:
    torch.manual_seed(0)
    return models.MLP()


def _reference() -> torch.Tensor:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in _batches():
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def _script_patterns(rank: int, world_size: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    from ds_strategy.accelerate import ZeroAccelerator

    set_torchrun_environment(rank, world_size)
    results = {}
    for stage in (1, 2, 3):
        GradientState._reset_state()
        accelerator = ZeroAccelerator({"stage": stage}, cpu=True)
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        for x, y in _batches():
            mine = [(x[i :: WORLD * 2], y[i :: WORLD * 2]) for i in (rank, rank + WORLD)]  # this rank's 2 micro-batches
            for i, micro in enumerate(mine):
                with model.no_sync() if i == 0 else torch.enable_grad():  # the example's pattern
                    accelerator.backward(model(micro) / len(mine))
            optimizer.step()
            optimizer.zero_grad()
        state = accelerator.get_state_dict(model)
        results[stage] = torch.cat([state[name].flatten() for name, _ in _model().named_parameters()])
        results[f"deepspeed_plugin{stage}"] = accelerator.state.deepspeed_plugin

    GradientState._reset_state()
    accelerator = ZeroAccelerator(DEEPSPEED, cpu=True)
    plugin = accelerator.state.deepspeed_plugin  # deepspeed_with_config_support.py's test, as it writes it
    model = _model()
    groups = models.param_groups(model)
    optimizer_cls = torch.optim.AdamW if plugin is None or "optimizer" not in plugin.deepspeed_config else DummyOptim
    optimizer = optimizer_cls(groups, lr=LR)
    scheduler = DummyScheduler(optimizer, total_num_steps=STEPS, warmup_num_steps=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for x, y in _batches():
        accelerator.backward(model((x[rank::WORLD], y[rank::WORLD])))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    results["dummy"] = (plugin.zero_stage, optimizer_cls.__name__, type(optimizer.optimizer).__name__)
    results["global_state_plugin"] = AcceleratorState().deepspeed_plugin
    return results


@pytest.mark.slow
def test_ddp_and_deepspeed_script_patterns_run_under_zero_accelerator():
    results = run_ranks(_script_patterns, WORLD, timeout=300)[0]
    reference = _reference()
    for stage in (1, 2, 3):
        assert (results[stage] - reference).norm() <= 1e-6 * reference.norm(), stage
        assert results[f"deepspeed_plugin{stage}"] is None  # no DeepSpeed config: no plugin, as in accelerate
    assert results["dummy"] == (2, "DummyOptim", "AdamW")
    assert results["global_state_plugin"] is None  # accelerate and transformers take no DeepSpeed code path


@pytest.mark.slow
def test_ds_strategy_launch_fails_a_script_that_never_builds_a_zero_accelerator(tmp_path):
    script = tmp_path / "plain_accelerator.py"
    script.write_text("from accelerate import Accelerator\n\nAccelerator()\nprint('trained alone')\n")
    config = tmp_path / "accelerate.yaml"
    yaml = (REPO / "configs/accelerate/zero2.yaml").read_text().replace("num_processes: 2", "num_processes: 1")
    config.write_text(yaml + f"main_process_port: {free_port()}\n")
    result = run([DS_STRATEGY, "launch", "--config_file", config, script], check=False, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "no worker of" in result.stderr and "built a ZeroAccelerator" in result.stderr
