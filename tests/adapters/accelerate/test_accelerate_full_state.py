"""``ZeroAccelerator(state_dict_type="full")``: ``save_state`` writes accelerate's own whole files (``model.
safetensors``, ``optimizer.bin``) as DDP's ``save_state`` does, and ``load_state`` reads them, or one process's, at
another stage.

2 gloo ranks train an MLP with AdamW (two param groups) for two steps at stage 2 and save; the files must equal one
process's weights and ``optimizer.state_dict()`` after the same steps. A fresh stage-3 accelerator loads them (and,
separately, files one process wrote) into a model built from another seed, takes a third step, and must end where
one process ends (fp32, 1e-6 relative).
"""

import models
import pytest
import torch
from distributed import run_ranks, set_torchrun_environment
from safetensors.torch import load_file, save_file

WORLD, BATCH, STEPS, LR = 2, 8, 3, 0.01


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [models.MLP.make_batch(generator, BATCH * WORLD) for _ in range(STEPS)]


def _model(seed: int = 0) -> models.MLP:
    torch.manual_seed(seed)
    return models.MLP()


def _reference(steps: int) -> tuple[models.MLP, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=LR)
    for batch in _batches()[:steps]:
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _vector(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[name].flatten() for name, _ in _model().named_parameters()])


def _accelerator(stage: int):
    from accelerate.state import GradientState

    from ds_strategy.accelerate import ZeroAccelerator

    GradientState._reset_state()
    return ZeroAccelerator({"stage": stage}, state_dict_type="full", cpu=True)


def _train(rank, accelerator, model, optimizer, batches) -> None:
    for x, y in batches:
        accelerator.backward(model((x[rank::WORLD], y[rank::WORLD])))
        optimizer.step()
        optimizer.zero_grad()


def _save_then_resume(rank: int, world_size: int, out: str) -> dict:
    set_torchrun_environment(rank, world_size)
    accelerator = _accelerator(stage=2)
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(models.param_groups(model), lr=LR))
    _train(rank, accelerator, model, optimizer, _batches()[:2])
    accelerator.save_state(f"{out}/full")
    results = {}
    for source in ("full", "single"):
        accelerator = _accelerator(stage=3)
        model = _model(seed=1)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(models.param_groups(model), lr=LR))
        accelerator.load_state(f"{out}/{source}")
        _train(rank, accelerator, model, optimizer, _batches()[2:])
        results[source] = _vector(accelerator.get_state_dict(model))
    return results


@pytest.mark.slow
def test_full_save_state_is_one_process_files_and_resumes_at_another_stage(tmp_path):
    model, optimizer = _reference(steps=2)
    (tmp_path / "single").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "single" / "model.safetensors")
    torch.save(optimizer.state_dict(), tmp_path / "single" / "optimizer.bin")

    results = run_ranks(_save_then_resume, WORLD, str(tmp_path), timeout=300)[0]

    written = load_file(tmp_path / "full" / "model.safetensors")
    assert written.keys() == model.state_dict().keys()
    assert torch.allclose(_vector(written), _vector(model.state_dict()), rtol=0, atol=1e-6)
    saved, expected = torch.load(tmp_path / "full" / "optimizer.bin"), optimizer.state_dict()
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert saved["state"].keys() == expected["state"].keys()
    for key, state in expected["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(saved["state"][key][name], state[name], rtol=1e-6, atol=1e-9), (key, name)
    reference = _vector(_reference(steps=3)[0].state_dict())
    for source in ("full", "single"):
        assert (results[source] - reference).norm() <= 1e-6 * reference.norm(), source
