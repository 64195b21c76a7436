"""DeepSpeed-Ulysses as a strategy setting: ``ZeroStrategy(sequence_parallel_size=2)`` on 2 gloo ranks trains a
Hugging Face Llama whose ``training_step`` gives each rank one half of every sequence, and matches one process
trained on the full sequences: losses, gradient norms before clipping, and final parameters, on labels whose ignored
(-100) tokens fall unevenly on the two halves. The same holds on 4 ranks with tensor parallelism inside each
sequence-parallel rank (sp=2 x tp=2), where Ulysses splits the heads each tensor-parallel rank holds. Also: the fp16
loss scale and the Ulysses multiplier compose, the DeepSpeed key maps, and the combinations not supported are
refused."""

import hf_models
import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ds_strategy
from ds_strategy.config import ZeroConfig, ZeroConfigError
from ds_strategy.config.sources import read_deepspeed_config
from ds_strategy.parallel.mesh import mesh_shape
from ds_strategy.parallel.ulysses import HF_ATTENTION_NAME, sequence_parallel_loss, shard_sequence
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

STEPS, PER_RANK, SP, CLIP, RTOL = 3, 2, 2, 0.5, 1e-5
# 2 key/value heads: one per tensor-parallel rank, which Ulysses then repeats over its 2 ranks
LLAMA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _data() -> TensorDataset:
    """Token rows and their labels: prompts ignored at the front of even rows, padding at the back of odd ones, of
    lengths that differ row by row; row 4's first half has no labelled target at all."""
    tokens = torch.cat(hf_models.batches(STEPS, 1, per_rank=PER_RANK))
    labels = tokens.clone()
    for row in range(len(labels)):
        if row % 2:
            labels[row, hf_models.SEQ - 2 - row :] = -100
        else:
            labels[row, : 3 + 2 * row] = -100
    return TensorDataset(tokens, labels)


class UlyssesLlama(L.LightningModule):
    """What a user writes: slice each batch over ``self.device_mesh["sequence_parallel"]`` and take the
    token-weighted loss; the strategy has switched the model's attention to Ulysses."""

    def __init__(self):
        super().__init__()
        self.losses, self.norms, self.batches = [], [], []

    def configure_model(self):
        if not hasattr(self, "model"):
            self.model = hf_models.build("llama", **LLAMA)

    def on_fit_start(self):
        self.initial = self.trainer.strategy.engine.full_state_dict(rank0_only=False)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        group = self.device_mesh["sequence_parallel"].get_group()
        local = shard_sequence({"input_ids": ids, "labels": labels}, group)
        logits = self.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = sequence_parallel_loss(logits, local["shift_labels"], group)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        self.batches.append(ids)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(self.trainer.strategy.engine.grad_norm().item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, eps=1e-6)


def _fit(rank: int, world_size: int, stage: int, **tensor_parallel) -> dict:
    """``tensor_parallel``: the strategy's tensor-parallel fields, if any."""
    set_lightning_environment(rank)
    module = UlyssesLlama()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ds_strategy.ZeroStrategy(stage=stage, sequence_parallel_size=SP, **tensor_parallel),
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        **QUIET,
    )
    trainer.fit(module, DataLoader(_data(), batch_size=PER_RANK))
    engine = trainer.strategy.engine
    return {
        "initial": module.initial,
        "state": engine.full_state_dict(rank0_only=False),
        "losses": module.losses,
        "logged_loss": trainer.callback_metrics["train_loss"].item(),
        "norms": module.norms,
        "batches": torch.stack(module.batches),
        "names": module.device_mesh.mesh_dim_names,
        "zero_ranks": engine.world_size,
        "attention": module.model.config._attn_implementation,
        "tp": module.device_mesh["tensor_parallel"].size(),
        "dtensors": sum(isinstance(p, DTensor) for p in module.parameters()),
    }


def _reference(initial: dict) -> dict:
    """One process on the full sequences, in the order Lightning's sampler gives the one data-parallel rank."""
    model = hf_models.build("llama", **LLAMA)
    model.load_state_dict({name.removeprefix("model."): value for name, value in initial.items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    data = _data()
    order = list(DistributedSampler(data, num_replicas=1, rank=0, seed=0))
    losses, norms, counts = [], [], []
    for step in range(STEPS):
        ids, labels = data[order[step * PER_RANK : (step + 1) * PER_RANK]]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        counts.append([(half != -100).sum().item() for half in labels[:, 1:].tensor_split(SP, dim=1)])
    state = {name: p.detach() for name, p in model.named_parameters()}
    return {"state": state, "losses": losses, "norms": norms, "counts": counts}


TP2 = {"tensor_parallel_size": 2, "tensor_parallel_plan": "auto"}


@pytest.fixture(
    scope="module",
    params=[(1, {}), (3, {}), (2, TP2), (2, {**TP2, "sequence_parallel": True})],
    ids=["stage1", "stage3", "stage2-tp2", "stage2-tp2-megatron-sp"],
)
def runs(request):
    """Stage 3 builds on the meta device in configure_model; every reference starts from the engine's initial
    weights. With tp=2 each sequence-parallel rank is two tensor-parallel ones: 4 ranks, dp=1."""
    stage, tensor_parallel = request.param
    world_size = SP * tensor_parallel.get("tensor_parallel_size", 1)
    ranks = run_ranks(_fit, world_size, stage, timeout=300, **tensor_parallel)
    return ranks, _reference(ranks[0]["initial"])


def test_the_labels_are_unevenly_spread_over_the_halves(runs):
    _, reference = runs
    assert any(first != second for first, second in reference["counts"]), reference["counts"]


def test_the_mesh_has_a_sequence_parallel_dimension_whose_ranks_read_the_same_batches(runs):
    ranks, _ = runs
    for run in ranks:
        assert run["names"] == ("data_parallel", "sequence_parallel", "tensor_parallel")
        assert run["zero_ranks"] == SP  # ZeRO shards over dp x sp: every rank holds the same weights (or tp shards)
        assert run["attention"] == HF_ATTENTION_NAME
        torch.testing.assert_close(run["batches"], ranks[0]["batches"], rtol=0, atol=0)


def test_the_weights_are_split_over_tensor_parallel_ranks_when_there_are_some(runs):
    ranks, _ = runs
    for run in ranks:
        assert (run["dtensors"] > 0) == (run["tp"] > 1)


def test_losses_equal_the_full_sequence_losses(runs):
    ranks, reference = runs
    for run in ranks:
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=RTOL, atol=0)


def test_the_logged_loss_is_the_loss_not_the_multiple_backward_sees(runs):
    ranks, reference = runs
    for run in ranks:
        assert run["logged_loss"] == pytest.approx(reference["losses"][-1], rel=RTOL)


def test_gradient_norms_before_clipping_equal_the_full_sequence_norms(runs):
    """The norms measure the gradients themselves (AdamW and clipping hide a constant factor in them)."""
    ranks, reference = runs
    assert min(reference["norms"]) > CLIP  # clipping acts at every step
    for run in ranks:
        torch.testing.assert_close(run["norms"], reference["norms"], rtol=RTOL, atol=0)


def test_final_parameters_equal_the_full_sequence_parameters(runs):
    ranks, reference = runs
    for run in ranks:
        for name, expected in reference["state"].items():
            error = ((run["state"][f"model.{name}"] - expected).norm() / expected.norm()).item()
            assert error < RTOL, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("through_engine", [True, False])
def test_the_gradient_divide_factor_composes_with_the_fp16_loss_scale(through_engine):
    """A divide factor of half the group (Ulysses' sp=2) doubles the reduced gradient, whether backward runs through
    the engine (loss x fp16 scale) or is the user's own ``loss.backward()`` (fp32): the reducer divides, not the
    loss; unscaling divides out the loss scale only."""
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    precision = "16-mixed" if through_engine else "32-true"
    config = ZeroConfig(stage=1, precision=precision, loss_scale=1024.0)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    engine.set_gradient_divide_factor(engine.world_size / 2)
    x = torch.randn(5, 4)
    if through_engine:
        loss = model(x.half()).float().pow(2).mean()
        assert engine.scale_loss(loss).item() == pytest.approx(loss.item() * 1024)
        engine.backward(loss)
    else:
        model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item() * 2
    assert engine.grad_norm().item() == pytest.approx(expected, rel=1e-3 if through_engine else 1e-6)


def test_deepspeed_sequence_parallel_size_maps_to_the_field():
    assert read_deepspeed_config({"sequence_parallel_size": 2}).zero.sequence_parallel_size == 2


def test_ulysses_with_tensor_parallelism_is_a_valid_configuration():
    assert ZeroConfig(sequence_parallel_size=2, tensor_parallel_size=2).sequence_parallel_size == 2


def test_the_mesh_of_ulysses_with_tensor_parallelism_puts_tp_innermost():
    assert mesh_shape(8, 2, 2) == {"dp": 2, "sp": 2, "tp": 2}


@pytest.mark.parametrize("size", [0, 1.5, "2"])
def test_a_sequence_parallel_size_that_is_not_a_positive_integer_is_refused(size):
    with pytest.raises(ZeroConfigError, match=rf"sequence_parallel_size={size!r} is not allowed"):
        ZeroConfig(sequence_parallel_size=size)


def test_a_sequence_parallel_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 does not divide the world size 4; allowed"):
        mesh_shape(4, 1, 3)
