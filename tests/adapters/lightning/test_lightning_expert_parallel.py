"""Expert parallelism as a strategy setting: ``ZeroStrategy(stage=3, expert_parallel_size=2)`` on 4 gloo ranks
(2 expert-data-parallel x 2 expert-parallel) trains Qwen3-MoE and DeepSeek-V3 from small configs, each rank on its own
batches, and matches one process trained on the global batches: losses, and the weights the strategy exports, which
hold every expert in the Hugging Face layout."""

import lightning as L
import moe_models
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from hf_models import SEQ, VOCAB
from quiet_trainer import QUIET
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy

pytestmark = pytest.mark.slow  # 4-rank scenarios of tens of seconds: not in the fast tier

STEPS, PER_RANK, WORLD, CLIP, LR = 3, 2, 4, 0.05, 0.5


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, VOCAB, (STEPS * PER_RANK * WORLD, SEQ), generator=generator))


class MoeModule(L.LightningModule):
    """The model built in ``__init__``, with values (a build on meta in ``configure_model`` is a composition matrix
    expert cell)."""

    def __init__(self, name: str):
        super().__init__()
        self.model, self.losses, self.batches = moe_models.build(name), [], []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        self.batches.append(ids)
        return loss

    def configure_optimizers(self):
        return _optimizer(self.model)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD, whose update scales with the gradient (tests/README.md's parity rule): Adam would magnify the float noise
    of a near-zero gradient (an embedding row a token barely touched) past any tolerance the weights could be held to,
    and hide a wrong gradient scale."""
    return torch.optim.SGD(model.parameters(), lr=LR)


def _fit(rank: int, world_size: int, name: str, stage: int, ep: int) -> dict:
    set_lightning_environment(rank)
    module = MoeModule(name)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ds_strategy.ZeroStrategy(stage=stage, expert_parallel_size=ep),
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        **QUIET,
    )
    trainer.fit(module, DataLoader(_data(), batch_size=PER_RANK))
    return {
        "state": trainer.strategy.engine.full_state_dict(),
        "losses": module.losses,
        "batches": torch.stack(module.batches),
        "mesh": module.device_mesh.mesh_dim_names,
        "experts_held": [m.num_experts for m in module.model.modules() if hasattr(m, "global_experts")],
    }


def _reference(name: str, batches: torch.Tensor) -> tuple[list[float], dict]:
    """One process on every rank's batch of each step at once (``batches``: [step, row, token])."""
    model = moe_models.build(name)
    optimizer = _optimizer(model)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize(("name", "stage", "ep"), [("qwen3_moe", 3, 2), ("deepseek_v3", 3, 2)])
def test_lightning_expert_parallel_trains_as_one_process(name, stage, ep):
    results = run_ranks(_fit, WORLD, name, stage, ep, timeout=400)
    assert results[0]["experts_held"] and set(results[0]["experts_held"]) == {moe_models.EXPERTS // ep}
    assert "expert_parallel" in results[0]["mesh"]
    batches = torch.cat([r["batches"] for r in results], dim=1)  # each step: every rank's rows
    assert len({tuple(r["batches"][0, :, 0].tolist()) for r in results}) == WORLD  # every rank read its own batch
    losses, state = _reference(name, batches)
    mean = [sum(r["losses"][step] for r in results) / WORLD for step in range(STEPS)]
    assert mean == pytest.approx(losses, abs=1e-5)
    exported = {key.removeprefix("model."): value for key, value in results[0]["state"].items()}
    assert exported.keys() == state.keys()
    for key, value in state.items():
        # in norm, as tests/support/training_loops.py compares
        assert (exported[key] - value).norm() <= 1e-5 * value.norm() + 1e-6, key
