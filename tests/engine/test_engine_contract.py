"""What the engine promises users beyond parity: clear errors, the optimizer they configured, clipping semantics,
and a core that imports no training framework."""

import ast
from pathlib import Path

import models
import pytest
import torch
from distributed import run_ranks

import ds_strategy
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def _engine(optimizer_cls=torch.optim.AdamW, stage: int = 2, **optimizer_kwargs):
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = optimizer_cls(models.param_groups(model), **optimizer_kwargs)
    return model, optimizer, ZeroEngine(model, optimizer, ZeroConfig(stage=stage))


@pytest.mark.parametrize("optimizer_cls, words", [(torch.optim.LBFGS, "two-loop"), (torch.optim.SparseAdam, "sparse")])
def test_optimizer_no_partitioning_can_run_is_refused_saying_why(optimizer_cls, words):
    torch.manual_seed(0)
    model = models.MLP()
    with pytest.raises(ValueError, match=f"{optimizer_cls.__name__} cannot run under ZeRO: .*{words}"):
        ZeroEngine(model, optimizer_cls(model.parameters()), ZeroConfig(stage=1))


def test_undeclared_optimizer_keeps_its_parameters_whole_with_a_warning():
    class MySGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])

    with pytest.warns(UserWarning, match="MySGD does not declare whether it is elementwise"):
        model, optimizer, engine = _engine(MySGD, lr=0.1)
    shapes = sorted(tuple(p.shape) for g in optimizer.param_groups for p in g["params"])
    assert shapes == sorted(tuple(p.shape) for p in model.parameters())  # whole parameters, not flat shards


def test_optimizer_keeps_its_class_hyperparameters_and_groups():
    _, optimizer, engine = _engine(torch.optim.AdamW, lr=3e-3, betas=(0.8, 0.9))
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 3e-3 and g["betas"] == (0.8, 0.9) for g in optimizer.param_groups)
    shards = [p for g in optimizer.param_groups for p in g["params"]]
    assert {id(s) for s in shards} == {id(fp.master) for fp in engine.flat_params}


def test_lr_scheduler_keeps_driving_the_retargeted_optimizer():
    model, optimizer, engine = _engine(torch.optim.SGD, lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    batch = models.MLP.make_batch(torch.Generator().manual_seed(0), 4)
    before = [p.detach().clone() for p in model.parameters()]
    model(batch).backward()
    engine.step()
    scheduler.step()
    assert all(g["lr"] == 0.5 for g in optimizer.param_groups)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_trainable_parameter_missing_from_the_optimizer_is_named():
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = torch.optim.AdamW(list(model.parameters())[:-1])
    with pytest.raises(ValueError, match=r"parameter 'net.5.bias' requires grad but is in no optimizer param group"):
        ZeroEngine(model, optimizer, ZeroConfig(stage=1))


def test_value_clipping_is_elementwise_like_torch():
    model, _, engine = _engine()
    reference = models.MLP()
    reference.load_state_dict(model.state_dict())
    batch = models.MLP.make_batch(torch.Generator().manual_seed(1), 8)
    (model(batch) * 100).backward()
    (reference(batch) * 100).backward()
    engine.clip_grad_value_(0.01)
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
    grads = dict(reference.named_parameters())
    shard = torch.cat([engine.reducer.reduced_grad(fp)[: fp.numel] for fp in engine.flat_params])
    expected = torch.cat([grads[s.name].grad.reshape(-1) for fp in engine.flat_params for s in fp.slots])
    assert shard.abs().max() <= 0.01
    torch.testing.assert_close(shard, expected)


def _grad_norm(rank: int, world_size: int, stage: int) -> float:
    model, _, engine = _engine(stage=stage)
    batch = models.MLP.make_batch(torch.Generator().manual_seed(2), 8)
    model(tuple(t[rank * 4 : (rank + 1) * 4] for t in batch)).backward()
    return engine.clip_grad_norm_(1e9).item()


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_global_gradient_norm_over_shards_equals_the_unsharded_norm(stage):
    norms = run_ranks(_grad_norm, 2, stage)
    torch.manual_seed(0)
    reference = models.MLP()
    batch = models.MLP.make_batch(torch.Generator().manual_seed(2), 8)
    loss = (reference(tuple(t[:4] for t in batch)) + reference(tuple(t[4:] for t in batch))) / 2
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    assert norms[0] == pytest.approx(expected, rel=1e-5)
    assert norms[0] == norms[1]


CORE = (
    "config",
    "estimate.py",
    "zero",
    "comm",
    "precision",
    "offload",
    "checkpoint",
    "models",
    "data",
)
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate")


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_modules_import_no_training_framework():
    """Dependencies point one way: adapters -> core -> kernels (the package __init__ wires the adapters)."""
    root = Path(ds_strategy.__file__).parent
    files = [
        p
        for entry in CORE
        for p in ([root / entry] if entry.endswith(".py") else (root / entry).rglob("*.py"))
        if p.exists()
    ]
    assert len(files) > 10
    offenders = {str(p.relative_to(root)): sorted(_imported_packages(p) & set(FRAMEWORKS)) for p in files}
    assert not {k: v for k, v in offenders.items() if v}
