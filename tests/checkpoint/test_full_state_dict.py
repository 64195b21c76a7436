"""``state_dict_type="full"`` (FSDP's choice) under Fabric: ``fabric.save`` writes one ``torch.save`` file from rank 0,
laid out as DDP's (the model's state dict, ``optimizer.state_dict()`` keyed by position, frozen parameters keeping
theirs), and a single file, ours or the one a single process wrote, resumes model and optimizer at any stage and world
size as that process continues (issue 45, item 3)."""

import os

import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from torch import nn

from ds_strategy import ZeroFabricStrategy

STEPS, BATCH, WORLD = 4, 8, 2


def _model() -> nn.Sequential:
    """A frozen first layer: its position in the optimizer has no state, as under torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.05)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, 4, generator=generator) for _ in range(STEPS)]


def _one_process(tmp: str) -> dict:
    """The reference: one process, saving after half the steps as DDP saves (``{"model", "optimizer", "step"}``)."""
    model = _model()
    optimizer = _optimizer(model)
    for step, x in enumerate(_batches()):
        if step == STEPS // 2:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, f"{tmp}/one_process.pth")
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _steps(fabric, model, optimizer, batches, rank: int, world_size: int) -> None:
    per_rank = BATCH // world_size
    for x in batches:
        fabric.backward(model(x[rank * per_rank : (rank + 1) * per_rank]).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()


def _setup(world_size: int, stage: int):
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=stage, state_dict_type="full")
    )
    fabric.launch()
    model, optimizer = fabric.setup(*(lambda m: (m, _optimizer(m)))(_model()))
    return fabric, model, optimizer


def _save_and_resume(rank: int, world_size: int, tmp: str, stages: tuple[int, ...]) -> dict:
    """Per stage: train half the steps and save (one file, from rank 0); then, freshly set up, resume from the one
    process's file and from the file the previous stage saved (or, first, the last one a run before saved), each
    finishing the steps."""
    set_lightning_environment(rank)
    first, second = _batches()[: STEPS // 2], _batches()[STEPS // 2 :]
    finals = {}
    for i, stage in enumerate(stages):
        fabric, model, optimizer = _setup(world_size, stage)
        _steps(fabric, model, optimizer, first, rank, world_size)
        fabric.save(f"{tmp}/stage{stage}.pth", {"model": model, "optimizer": optimizer, "step": STEPS // 2})
        previous = f"stage{stages[i - 1]}"  # the last stage's of the run before, for the first
        for source in ("one_process", *([previous] if os.path.exists(f"{tmp}/{previous}.pth") else [])):
            fabric, model, optimizer = _setup(world_size, stage)
            state = {"model": model, "optimizer": optimizer, "step": 0}
            fabric.load(f"{tmp}/{source}.pth", state)
            assert state["step"] == STEPS // 2
            _steps(fabric, model, optimizer, second, rank, world_size)
            finals[stage, source] = fabric.strategy.engine.full_state_dict(rank0_only=False)
    return finals


@pytest.mark.slow
def test_full_file_is_ddp_s_layout_and_resumes_at_every_stage_and_world_size(tmp_path):
    expected = _one_process(str(tmp_path))
    stages = (0, 1, 2, 3)
    ranks = run_ranks(_save_and_resume, WORLD, str(tmp_path), stages, timeout=300)
    ranks += run_ranks(_save_and_resume, 1, str(tmp_path), (3, 2), timeout=300)  # one rank reads two ranks' files
    for finals in ranks:
        for (stage, source), final in finals.items():
            for name, value in expected.items():
                torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=f"{stage} {source} {name}")
    reference = torch.load(tmp_path / "one_process.pth")
    for stage in stages:
        saved = torch.load(tmp_path / f"stage{stage}.pth")  # weights_only: the file holds plain types only
        assert saved.keys() == reference.keys()
        assert saved["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
        assert saved["optimizer"]["state"].keys() == reference["optimizer"]["state"].keys()  # no frozen position
        for position, state in reference["optimizer"]["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(saved["optimizer"]["state"][position][key], value, rtol=1e-5, atol=1e-7)
        for name, value in reference["model"].items():
            torch.testing.assert_close(saved["model"][name], value, rtol=1e-5, atol=1e-7)


def test_an_unknown_state_dict_type_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="state_dict_type='whole'.*'sharded', 'full'"):
        ZeroFabricStrategy(stage=2, state_dict_type="whole")


class _Unlisted:
    """An object torch's weights_only allow-list does not hold."""

    value = 3


def _load_directory_weights_only(rank: int, world_size: int, tmp: str) -> dict:
    set_lightning_environment(rank)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=2))
    fabric.launch()
    model, optimizer = fabric.setup(*(lambda m: (m, _optimizer(m)))(_model()))
    fabric.save(f"{tmp}/ckpt", {"model": model, "optimizer": optimizer, "step": 2, "mine": _Unlisted()})
    trusted = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{tmp}/ckpt", trusted, weights_only=False, strict=False)
    try:
        fabric.load(f"{tmp}/ckpt", {"model": model, "optimizer": optimizer}, weights_only=True, strict=False)
        refused = None
    except Exception as error:  # CheckpointError naming what torch's allow-list refused
        refused = str(error)
    return {"step": trusted["step"], "refused": refused}


def test_weights_only_is_honoured_for_a_checkpoint_directory_s_metadata(tmp_path):
    """Issue 45, item 5: ``fabric.load(..., weights_only=True)`` unpickles ``meta.pt`` with torch's allow-list."""
    (outcome,) = run_ranks(_load_directory_weights_only, 1, str(tmp_path))
    assert outcome["step"] == 2
    assert outcome["refused"] is not None and "meta.pt" in outcome["refused"] and "_Unlisted" in outcome["refused"]


def test_a_whole_optimizer_state_is_refused_by_name_where_it_cannot_describe_the_shards():
    """An offloaded optimizer (like tensor and pipeline parallelism and whole-tensor optimizers) keeps
    state_dict_type='sharded': gathering or loading a whole state is refused, saying why."""
    from ds_strategy.checkpoint.full_optimizer import full_optimizer_state, load_full_optimizer_state
    from ds_strategy.config import ZeroConfig
    from ds_strategy.offload import step_runner_for
    from ds_strategy.zero.engine import ZeroEngine

    model = _model()
    config = ZeroConfig(stage=2, offload_optimizer="cpu")
    engine = ZeroEngine(model, _optimizer(model), config, step_runner=step_runner_for(config))
    with pytest.raises(ValueError, match="optimizer's state is offloaded; keep state_dict_type='sharded'"):
        full_optimizer_state(engine)
    with pytest.raises(ValueError, match="loading a whole optimizer state: the optimizer's state is offloaded"):
        load_full_optimizer_state(engine, {"state": {}, "param_groups": []})
    engine.remove_hooks()
