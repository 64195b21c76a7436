"""How an optimizer says whether it runs on flat shards, where a whole-tensor optimizer's parameters go, several
optimizers chained into one, and what the estimator adds for them (issue 39); one process, no ranks."""

import random

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy import ChainedOptimizer, declare_optimizer, estimate_memory
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.optimizer_kinds import class_is_elementwise, group_is_elementwise
from ds_strategy.zero.owner_layout import assign_owners, owned_elements


class PlainSGD(torch.optim.Optimizer):
    """An optimizer of the user's own, updating each element from its own gradient only."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class DeclaredElementwise(PlainSGD):
    elementwise = True


class NormalizedSGD(PlainSGD):
    """Steps each parameter by its gradient divided by the gradient's norm: wrong on a slice of the tensor."""

    elementwise = False

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"])


def test_the_class_attribute_declares_the_kind_and_subclasses_inherit_it():
    assert class_is_elementwise(DeclaredElementwise)
    assert not class_is_elementwise(NormalizedSGD)
    assert class_is_elementwise(type("Sub", (DeclaredElementwise,), {}))
    assert class_is_elementwise(torch.optim.AdamW) and not class_is_elementwise(torch.optim.Muon)
    assert class_is_elementwise(type("MyAdamW", (torch.optim.AdamW,), {}))  # a subclass of a known one


def test_declare_optimizer_declares_a_class_one_does_not_own():
    cls = type("ThirdParty", (PlainSGD,), {})
    declare_optimizer(cls, elementwise=True)
    assert cls.elementwise is True and class_is_elementwise(cls)
    with pytest.raises(TypeError, match="expected True or False"):
        declare_optimizer(cls, elementwise="yes")
    with pytest.raises(TypeError, match="Optimizer subclass"):
        declare_optimizer(nn.Linear, elementwise=True)


def test_a_param_group_overrides_its_optimizer_class():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "elementwise": False}, {"params": [model.bias]}])
    assert [group_is_elementwise(optimizer, g) for g in optimizer.param_groups] == [False, True]


def test_an_undeclared_optimizer_is_kept_whole_and_warned_about_once():
    cls = type("Undeclared", (PlainSGD,), {})
    with pytest.warns(UserWarning, match="Undeclared does not declare whether it is elementwise"):
        assert not class_is_elementwise(cls)


def test_owners_are_balanced_within_the_mean_plus_the_largest_parameter():
    generator = random.Random(0)
    for world_size in (2, 3, 8):
        sizes = [generator.choice((16, 256, 4096, 11008)) * generator.randint(1, 64) for _ in range(97)]
        loads = owned_elements(sizes, assign_owners(sizes, world_size), world_size)
        assert sum(loads) == sum(sizes)
        assert max(loads) <= sum(sizes) / world_size + max(sizes)
    assert assign_owners([5, 5, 5, 5], 2) == assign_owners([5, 5, 5, 5], 2) == [0, 1, 0, 1]


def test_a_whole_tensor_optimizer_steps_views_shaped_like_its_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    matrices = [model[0].weight, model[1].weight]
    rest = [model[0].bias, model[1].bias]
    whole, flat = NormalizedSGD(matrices), torch.optim.SGD(rest, lr=0.1)
    engine = ZeroEngine(model, [whole, flat], ZeroConfig(stage=2))
    assert [tuple(p.shape) for g in whole.param_groups for p in g["params"]] == [(8, 4), (3, 8)]
    assert all(p.dim() == 1 for g in flat.param_groups for p in g["params"])  # flat shards
    assert engine.optimizers == (whole, flat) and engine.holds(whole) and not engine.holds(torch.optim.SGD(rest))


def test_several_optimizers_must_not_share_a_parameter():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="held by two optimizers"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters()), torch.optim.AdamW([model.bias])], ZeroConfig(stage=1))


def test_a_chain_is_one_optimizer_whose_groups_are_its_members():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    a, b = torch.optim.SGD(model[0].parameters(), lr=1.0), torch.optim.AdamW(model[1].parameters(), lr=0.1)
    chain = ChainedOptimizer(a, b)
    assert chain.param_groups[0] is a.param_groups[0] and chain.param_groups[1] is b.param_groups[0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(chain, lambda step: 0.5)
    assert (a.param_groups[0]["lr"], b.param_groups[0]["lr"]) == (0.5, 0.05)  # the members' own groups
    model(torch.ones(1, 4)).sum().backward()
    chain.step()
    scheduler.step()
    restored = ChainedOptimizer(torch.optim.SGD(model[0].parameters()), torch.optim.AdamW(model[1].parameters()))
    restored.load_state_dict(chain.state_dict())
    assert restored.optimizers[1].state_dict()["state"][0]["step"] == 1
    with pytest.raises(NotImplementedError, match="one of the chained optimizers"):
        chain.add_param_group({"params": [nn.Parameter(torch.ones(1))]})


def test_an_engine_takes_a_chain_apart():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    chain = ChainedOptimizer(
        NormalizedSGD([model[0].weight, model[1].weight]), torch.optim.SGD([model[0].bias, model[1].bias], lr=0.1)
    )
    engine = ZeroEngine(model, chain, ZeroConfig(stage=1))
    assert engine.optimizers == tuple(chain.optimizers) and engine.holds(chain)
    assert {fp.whole for fp in engine.flat_params_of(chain.optimizers[0])} == {True}


def test_the_estimate_adds_the_largest_whole_parameter_to_every_partitioned_term():
    psi, n, largest = 7.5e9, 64, 11008 * 4096
    base, muon = (estimate_memory(psi, n, stage=3, largest_whole_param=p) for p in (0, largest))
    for kind, per_element in (("params", 2), ("grads", 2), ("optimizer", 12)):
        assert sum(muon.bytes[kind].values()) - sum(base.bytes[kind].values()) == per_element * largest, kind
    below = [estimate_memory(psi, n, stage=s, largest_whole_param=largest) for s in (0, 1)]
    assert below[0].device == estimate_memory(psi, n, stage=0).device  # nothing partitioned: nothing added
    assert below[1].bytes["params"] == estimate_memory(psi, n, stage=1).bytes["params"]
    with pytest.raises(ValueError, match="largest_whole_param"):
        estimate_memory(psi, n, stage=1, largest_whole_param=-1)


def test_the_public_names_are_exported():
    assert ds_strategy.ChainedOptimizer is ChainedOptimizer and ds_strategy.declare_optimizer is declare_optimizer


def test_the_code_in_the_optimizers_page_runs():
    """docs/optimizers.md: its recipe splits a Llama's parameters into Muon's matrices and AdamW's rest, and its
    declarations say what the page says they do."""
    import re
    from pathlib import Path

    import hf_models

    page = (Path(__file__).parents[2] / "docs" / "optimizers.md").read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", page, flags=re.S):
        exec(block, namespace)  # noqa: S102
    muon, adamw = namespace["muon_and_adamw"](hf_models.build("llama"))
    assert {p.ndim for g in muon.param_groups for p in g["params"]} == {2}
    assert class_is_elementwise(namespace["Lion"]) and not class_is_elementwise(namespace["ThirdPartyLamb"])
