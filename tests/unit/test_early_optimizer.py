"""An optimizer built before setup follows the parameters composition leaves (Note: [An optimizer built before
composition] in ``ds_strategy.compose.early_optimizer``): replaced ones by name, tied ones under any of their names,
cut ones dropped, names with or without ``torch.compile``'s ``_orig_mod.``."""

import pytest
import torch
from torch import nn

from ds_strategy.compose.early_optimizer import names_of_parameters, rebind_optimizers


class Tied(nn.Module):
    """An embedding and a head sharing one weight, as a causal LM with tied embeddings."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


class Compiled(nn.Module):
    """What ``torch.compile`` puts around a model, as far as parameter names go."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._orig_mod = module


def rebind_optimizer(module: nn.Module, optimizers: list, change) -> nn.Module:
    """Steps 1 and 5 of the composition around ``change`` (what steps 2-4 do to the model)."""
    names = names_of_parameters(module, optimizers)
    changed = change(module)
    rebind_optimizers(optimizers, names, changed)
    return changed


def _held(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _cut_embedding(module: Tied) -> Tied:
    module.embed = None  # the last pipeline stage: the embedding is another stage's, the tied head is kept
    return module


def test_a_tied_weight_the_last_stage_keeps_stays_in_the_optimizer():
    model = Tied()
    tied = model.embed.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rebind_optimizer(model, [optimizer], _cut_embedding)
    held = _held(optimizer)
    assert any(p is tied for p in held)
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}


def test_a_parameter_all_of_whose_names_are_cut_is_dropped():
    model = nn.ModuleDict({"first": nn.Linear(2, 2), "second": nn.Linear(2, 2)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def cut(module):
        del module["first"]
        return module

    rebind_optimizer(model, [optimizer], cut)
    assert {id(p) for p in _held(optimizer)} == {id(p) for p in model["second"].parameters()}


def test_a_replaced_parameter_is_followed_by_name_through_compile():
    inner = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)

    def replace_and_compile(module):
        module.weight = nn.Parameter(module.weight.detach().clone())  # as tensor parallelism registers a DTensor
        return Compiled(module)

    result = rebind_optimizer(inner, [optimizer], replace_and_compile)
    assert {id(p) for p in _held(optimizer)} == {id(p) for p in result.parameters()}
    assert any(p is inner.weight for p in _held(optimizer))


def test_an_optimizer_that_has_stepped_is_refused():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already stepped"):
        rebind_optimizer(model, [optimizer], lambda module: module)
