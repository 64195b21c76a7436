"""What a Fabric user switching from DDP, DeepSpeed, FSDP or ModelParallelStrategy to ZeroFabricStrategy writes, and
what it must do (issue 26): a bare module built empty under stage 3 is initialised as a normal build is, "-true"
precisions create 16-bit weights, single-file checkpoints load (also into a model not set up yet), several models
train side by side each sharded by its own engine, tensor parallelism composes with bf16-mixed and with a compiling
``parallelize_fn`` (on 4 ranks, dp=2 x tp=2, against one process), and clipping before setup says what is missing.

The two-rank scenarios run in one set of gloo ranks (a fixture), the tensor-parallel ones in a set of 4; each records
its outcome or its error, so every test below reports its own scenario.
"""

import traceback

import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ds_strategy import ZeroFabricStrategy, ZeroStrategy

WORLD = 2


def _fabric(rank: int, world_size: int, **strategy) -> L.Fabric:
    set_lightning_environment(rank)
    precision = strategy.pop("precision", "32-true")
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(**strategy), precision=precision
    )
    fabric.launch()
    return fabric


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


# -- item 1: a bare nn.Linear built empty under stage 3 -------------------------------------------------------------
def _bare_linear_built_empty(rank: int, world_size: int) -> dict:
    fabric = _fabric(rank, world_size, stage=3)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = nn.Linear(8, 4)
    fabric.setup(model)
    return fabric.strategy.engine.full_state_dict(rank0_only=False)


# -- item 10: init_module under "-true" precisions ------------------------------------------------------------------
def _init_module_dtypes(rank: int, world_size: int) -> dict:
    dtypes = {}
    for stage in (1, 3):
        for precision in ("bf16-true", "16-true", "bf16-mixed"):
            fabric = _fabric(rank, world_size, stage=stage, precision=precision)
            with fabric.init_module():
                dtypes[stage, precision] = nn.Linear(2, 2).weight.dtype
    return dtypes


# -- init_module(empty_init=True) created and never entered ---------------------------------------------------------
def _init_module_left_unused(rank: int, world_size: int) -> dict:
    fabric = _fabric(rank, world_size, stage=3)
    context = fabric.init_module(empty_init=True)  # e.g. built conditionally and then not used
    devices = {"created": torch.nn.Linear(1, 1).weight.device.type}
    with context:  # parameters on meta, other tensors (buffers, metric states) for real, as Lightning builds
        devices["inside"] = torch.nn.Linear(1, 1).weight.device.type
        devices["tensor inside"] = torch.empty(1).device.type
    devices["after"] = torch.nn.Linear(1, 1).weight.device.type
    return devices


# -- item 5: single-file checkpoints (DDP's, one device's) -----------------------------------------------------------
def _single_file_loads(rank: int, world_size: int, full_file: str, raw_file: str) -> dict:
    fabric = _fabric(rank, world_size, stage=3)
    outcome = {"everything": sorted(fabric.load(full_file))}
    plain = _net(seed=7)
    fabric.load_raw(raw_file, plain)  # before setup: a plain module takes the whole state dict
    outcome["raw_before_setup"] = plain.state_dict()
    model = fabric.setup(_net(seed=7))
    state = {"model": model, "step": 0}
    fabric.load(full_file, state)
    outcome["step"] = state["step"]
    outcome["loaded"] = fabric.strategy.engine.full_state_dict(rank0_only=False)
    fabric.load_raw(raw_file, model)
    outcome["raw_after_setup"] = fabric.strategy.engine.full_state_dict(rank0_only=False)
    with_optimizer = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=2))
    with_optimizer.launch()
    trained = _net(seed=7)
    trained, optimizer = with_optimizer.setup(trained, torch.optim.SGD(trained.parameters(), lr=0.1))
    try:
        with_optimizer.load(full_file, {"model": trained, "optimizer": optimizer})
        outcome["optimizer_error"] = None
    except ValueError as error:
        outcome["optimizer_error"] = str(error)
    return outcome


# -- item 9: several models, each its own engine -------------------------------------------------------------------
GAN_STEPS, GAN_BATCH = 3, 8


def _gan_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(GAN_BATCH, 4, generator=generator), torch.randn(GAN_BATCH, 4, generator=generator)


def _gan_models():
    torch.manual_seed(0)
    generator, discriminator, teacher = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 4)
    teacher.requires_grad_(False)
    return generator, discriminator, teacher


def _gan_loop(generator, discriminator, teacher, opt_g, opt_d, real, noise, backward) -> None:
    """A GAN step pair with a frozen teacher: the generator's loss flows through the discriminator, whose
    gradients from it ``opt_d.zero_grad()`` must drop, as under DDP."""
    for _ in range(GAN_STEPS):
        opt_d.zero_grad()
        loss_d = discriminator(real).mean() - discriminator(generator(noise).detach()).mean()
        backward(loss_d, None)  # no model named, as a DDP loop writes it
        opt_d.step()
        opt_g.zero_grad()
        fake = generator(noise)
        loss_g = -discriminator(fake).mean() + (fake - teacher(noise)).pow(2).mean()
        backward(loss_g, generator)
        opt_g.step()


def _several_models(rank: int, world_size: int, stage: int) -> dict:
    fabric = _fabric(rank, world_size, stage=stage)
    generator, discriminator, teacher = _gan_models()
    generator, opt_g = fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    discriminator, opt_d = fabric.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1))
    teacher = fabric.setup(teacher)
    real, noise = (t[rank::world_size] for t in _gan_data())
    _gan_loop(
        generator,
        discriminator,
        teacher,
        opt_g,
        opt_d,
        real,
        noise,
        lambda loss, model: fabric.backward(loss, model=model),
    )
    engines = fabric.strategy.engines
    return {
        "engines": len(engines),
        "states": [engine.full_state_dict(rank0_only=False) for engine in engines],
    }


def _reference_gan() -> list[dict]:
    generator, discriminator, teacher = _gan_models()
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    _gan_loop(generator, discriminator, teacher, opt_g, opt_d, *_gan_data(), lambda loss, model: loss.backward())
    return [m.state_dict() for m in (generator, discriminator, teacher)]


# -- items 11 and 12: tensor parallelism with bf16-mixed at stage 0/1, and with a compiling parallelize_fn ---------
class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _parallelize(model, device_mesh):
    """What a ModelParallelStrategy user passes as ``parallelize_fn``."""
    parallelize_module(model, device_mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _parallelize_and_compile(model, device_mesh):
    return torch.compile(_parallelize(model, device_mesh))


TP, TP_WORLD, TP_LR = 2, 4, 0.1


def _tensor_parallel_data() -> torch.Tensor:
    """3 steps of 2 micro-batches of 4 rows: [step, micro, row, feature]."""
    return torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(2))


def _dp_slice(batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    per_rank = batch.shape[0] // dp
    return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


def _tensor_parallel_loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean() / 2


def _train_tensor_parallel(rank: int, world_size: int, stage: int, precision: str, parallelize_fn) -> dict:
    """Three steps of two accumulated micro-batches (the first without gradient sync) over a (dp, tp=2) mesh, each
    data-parallel replica (mesh order: ranks ``2 d`` and ``2 d + 1`` form replica ``d``) on its slice of every
    micro-batch; plain SGD, whose step scales with the gradient."""
    fabric = _fabric(
        rank, world_size, stage=stage, precision=precision, tensor_parallel_size=TP, parallelize_fn=parallelize_fn
    )
    model = FeedForward()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=TP_LR))
    losses = []
    for step in _tensor_parallel_data():
        for micro, batch in enumerate(step):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = _tensor_parallel_loss(model(_dp_slice(batch, rank // TP, world_size // TP))) / 2
                fabric.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "state": fabric.strategy.engine.full_state_dict(rank0_only=False)}


def _reference_tensor_parallel(dp: int) -> dict:
    """One process, unsharded, in fp32: each micro-batch's loss the mean over the ``dp`` replicas' slices."""
    model = FeedForward()
    optimizer = torch.optim.SGD(model.parameters(), lr=TP_LR)
    for step in _tensor_parallel_data():
        for batch in step:
            slices = [_tensor_parallel_loss(model(_dp_slice(batch, d, dp))) for d in range(dp)]
            (torch.stack(slices).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _tensor_parallel_runs(rank: int, world_size: int) -> dict:
    runs = {stage: _train_tensor_parallel(rank, world_size, stage, "bf16-mixed", _parallelize) for stage in (0, 1, 2)}
    runs["fp32"] = _train_tensor_parallel(rank, world_size, 1, "32-true", _parallelize)
    runs["compiled"] = _train_tensor_parallel(rank, world_size, 1, "32-true", _parallelize_and_compile)
    return runs


def _capture(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _scenarios(rank: int, world_size: int, full_file: str, raw_file: str) -> dict:
    return {
        "bare_linear": _capture(_bare_linear_built_empty, rank, world_size),
        "dtypes": _capture(_init_module_dtypes, rank, world_size),
        "left_unused": _capture(_init_module_left_unused, rank, world_size),
        "single_file": _capture(_single_file_loads, rank, world_size, full_file, raw_file),
        "several_models_stage2": _capture(_several_models, rank, world_size, 2),
        "several_models_stage3": _capture(_several_models, rank, world_size, 3),
    }


def _tensor_parallel_scenarios(rank: int, world_size: int) -> dict:
    return {"tensor_parallel": _capture(_tensor_parallel_runs, rank, world_size)}


@pytest.fixture(scope="module")
def saved_by_one_device(tmp_path_factory):
    """What DDP or one device writes: ``fabric.save`` of the state dicts in one file, and a raw state dict."""
    where = tmp_path_factory.mktemp("single_file")
    model = _net(seed=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    L.Fabric(accelerator="cpu", devices=1).save(
        where / "full.ckpt", {"model": model, "optimizer": optimizer, "step": 3}
    )
    torch.save(_net(seed=5).state_dict(), where / "raw.pt")
    return {"full": str(where / "full.ckpt"), "raw": str(where / "raw.pt"), "model": model.state_dict()}


@pytest.fixture(scope="module")
def ranks(saved_by_one_device):
    return run_ranks(_scenarios, WORLD, saved_by_one_device["full"], saved_by_one_device["raw"], timeout=300)


@pytest.fixture(scope="module")
def tensor_parallel_ranks():
    return run_ranks(_tensor_parallel_scenarios, TP_WORLD, timeout=600)


def _outcome(ranks: list, name: str) -> list[dict]:
    for rank in ranks:
        assert "error" not in rank[name], rank[name].get("error")
    return [rank[name] for rank in ranks]


def _assert_same(state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.slow
def test_bare_linear_built_empty_under_stage3_is_initialised_like_a_normal_build(ranks):
    torch.manual_seed(0)
    expected = nn.Linear(8, 4).state_dict()
    for state in _outcome(ranks, "bare_linear"):
        _assert_same(state, expected)


@pytest.mark.slow
def test_fabric_init_module_under_true_16bit_precisions_creates_16bit_weights(ranks):
    for dtypes in _outcome(ranks, "dtypes"):
        for stage in (1, 3):
            assert dtypes[stage, "bf16-true"] == torch.bfloat16
            assert dtypes[stage, "16-true"] == torch.float16
            assert dtypes[stage, "bf16-mixed"] == torch.float32  # the engine makes its 16-bit buffers itself


@pytest.mark.slow
def test_fabric_init_module_enters_meta_only_inside_with(ranks):
    """The context was entered when created: ``fabric.init_module(empty_init=True)`` left unused made meta the
    default device for everything after it."""
    for devices in _outcome(ranks, "left_unused"):
        assert devices == {"created": "cpu", "inside": "meta", "tensor inside": "cpu", "after": "cpu"}


def test_trainer_init_module_under_true_16bit_precisions_creates_16bit_weights():
    for stage in (1, 3):
        for precision, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("32-true", torch.float32)):
            trainer = L.Trainer(
                accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), precision=precision, logger=False
            )
            with trainer.init_module():
                model = BoringModel()
            assert model.layer.weight.dtype == dtype, (stage, precision)
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.slow
def test_single_file_checkpoint_loads_into_the_sharded_model_and_before_setup(ranks, saved_by_one_device):
    expected = saved_by_one_device["model"]
    raw = torch.load(saved_by_one_device["raw"])
    for outcome in _outcome(ranks, "single_file"):
        assert outcome["everything"] == ["model", "optimizer", "step"]  # fabric.load(file): the whole checkpoint
        assert outcome["step"] == 3
        _assert_same(outcome["loaded"], expected)
        _assert_same(outcome["raw_before_setup"], raw)
        _assert_same(outcome["raw_after_setup"], raw)
        assert outcome["optimizer_error"] is None  # its optimizer state is cut into shards (test_full_state_dict)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_several_models_each_sharded_by_its_own_engine_train_like_one_process(ranks, stage):
    reference = _reference_gan()
    for outcome in _outcome(ranks, f"several_models_stage{stage}"):
        assert outcome["engines"] == 3
        for state, expected in zip(outcome["states"], reference):
            _assert_same(state, expected)


@pytest.mark.slow
def test_tensor_parallel_at_dp2_trains_like_one_unsharded_process(tensor_parallel_ranks):
    """fp32 at stage 1, with and without a compiling ``parallelize_fn``, on dp=2 x tp=2: the gradients are averaged
    over the replicas and summed inside each tensor-parallel group, so the parameters are one process's."""
    expected = _reference_tensor_parallel(dp=TP_WORLD // TP)
    for runs in _outcome(tensor_parallel_ranks, "tensor_parallel"):
        for run in ("fp32", "compiled"):
            assert runs[run]["state"].keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(runs[run]["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"{run} {key}")
        assert runs["compiled"]["losses"] == pytest.approx(runs["fp32"]["losses"], rel=1e-5)


@pytest.mark.slow
def test_tensor_parallel_bf16_mixed_at_stages_0_to_2_trains_like_one_process_within_bf16_rounding(
    tensor_parallel_ranks,
):
    """bf16-mixed computes in bf16 (8 significant bits) from fp32 masters: within 1e-2 of the fp32 reference, and not
    equal to the fp32 run (a run that ignored the precision would be)."""
    expected = _reference_tensor_parallel(dp=TP_WORLD // TP)
    for runs in _outcome(tensor_parallel_ranks, "tensor_parallel"):
        for stage in (0, 1, 2):
            for key, value in expected.items():
                torch.testing.assert_close(runs[stage]["state"][key], value, rtol=1e-2, atol=1e-3, msg=f"{stage} {key}")
            assert runs[stage]["losses"] != runs["fp32"]["losses"], f"stage {stage} trained in fp32, not bf16"


def test_clip_gradients_before_setup_names_what_is_missing():
    with pytest.raises(RuntimeError, match=r"fabric.clip_gradients needs the model set up first"):
        ZeroFabricStrategy().clip_gradients_norm(nn.Linear(2, 2), torch.optim.SGD([nn.Parameter(torch.ones(1))]), 1.0)
