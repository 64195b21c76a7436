"""What the ZeRO stage-3 build context (Lightning's ``configure_model`` at stage 3, ``init_module(empty_init=True)``)
does with each kind of parameter, and that each kind it accepts trains as one process trains it (Note: [What the build
context moves to meta], Note: [Parameter types the engine shards], Note: [Values built before the meta build]):

- a parameter it builds goes to meta keeping its type: ``DTensor`` (placements, global shape), an ``nn.Parameter``
  subclass (its attributes), a storage-sharing ``torch.Tensor`` subclass; tied weights stay one object;
- a parameter that replaces a real one (``parallelize_module``) or existed before keeps its values;
- a frozen quantized (wrapper subclass) weight stays real, an ``nn.Buffer`` keeps its value;
- a trainable wrapper subclass and PEFT adapters built on meta are refused, naming them.
"""

import contextlib

import pytest
import torch
from build_context_models import BodyAndHead, Int8Weight, SubclassNet, Tagged, TaggedParameter
from distributed import run_ranks
from torch import nn

from ds_strategy.zero.meta_parameters import parameters_on_meta
from ds_strategy.zero.param_types import UnsupportedParameterType

STEPS = 2


def test_a_built_parameter_goes_to_meta_keeping_its_type_and_ties():
    with parameters_on_meta():
        model = SubclassNet()
    assert type(model.tagged.weight) is Tagged and model.tagged.weight.is_meta
    assert isinstance(model.tagged.weight, nn.Parameter) and model.tagged.weight.requires_grad
    assert type(model.parameter.weight) is TaggedParameter and model.parameter.weight.is_meta
    assert model.parameter.weight.tag == "kept"
    assert model.head.weight is model.embed.weight and model.embed.weight.is_meta
    assert type(model.frozen.weight) is Int8Weight and not model.frozen.weight.is_meta  # left real: its values stay
    assert torch.equal(model.scale, torch.full((8,), 0.5))  # an nn.Buffer is built for real


def test_parameters_from_before_the_block_keep_their_values():
    torch.manual_seed(0)
    model = BodyAndHead()
    before = {name: p.detach().clone() for name, p in model.body.named_parameters()}
    with parameters_on_meta(existing=model):
        model.add_head()
    assert all(torch.equal(p, before[name]) for name, p in model.body.named_parameters())
    assert model.unembed.weight is model.body[0].weight  # shared into a new module, still real
    assert model.head.weight.is_meta and model.head.bias.is_meta  # what the block built


def test_a_trainable_wrapper_subclass_is_refused_naming_it():
    holder = nn.Module()
    with pytest.raises(UnsupportedParameterType, match=r"'Module\.q' is a trainable .*Int8Weight"):
        with parameters_on_meta():
            holder.q = nn.Parameter(Int8Weight.quantize(torch.ones(2, 2)), requires_grad=True)


def _dtensor_registrations(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    built_before = nn.Linear(4, 4)
    values = built_before.weight.detach().clone()
    fresh = nn.Module()
    with parameters_on_meta():
        parallelize_module(built_before, mesh, ColwiseParallel())  # replaces real weights: they stay
        fresh.w = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))  # built here: to meta
    return {
        "kept": isinstance(built_before.weight, DTensor) and torch.equal(built_before.weight.full_tensor(), values),
        "fresh": (type(fresh.w), fresh.w.is_meta, tuple(fresh.w.placements), tuple(fresh.w.shape)),
    }


def test_a_dtensor_replacing_a_real_weight_keeps_it_and_a_built_one_goes_to_meta_with_its_placements():
    from torch.distributed.tensor import DTensor, Shard

    (result,) = run_ranks(_dtensor_registrations, 1)
    assert result["kept"]
    assert result["fresh"] == (DTensor, True, (Shard(0),), (4, 2))


# -- trained on 2 ranks at stage 3 ---------------------------------------------------------------------------------


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=generator) for _ in range(STEPS)]


def _subclass_net(in_context: bool) -> nn.Module:
    torch.manual_seed(0)
    with parameters_on_meta() if in_context else contextlib.nullcontext():
        return SubclassNet()


def _body_and_head(in_context: bool) -> nn.Module:
    torch.manual_seed(0)
    model = BodyAndHead()
    with parameters_on_meta(existing=model) if in_context else contextlib.nullcontext():
        model.add_head()
    return model


MODELS = {"subclasses": _subclass_net, "body_and_head": _body_and_head}


def _plain(state: dict) -> dict:
    return {k: (v.dequantize() if isinstance(v, Int8Weight) else v).detach().clone() for k, v in state.items()}


def _train_built_in_context(model: nn.Module, rank: int) -> dict:
    from ds_strategy.compose import compose_model
    from ds_strategy.config import ZeroConfig

    def optimizers():
        return [torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)]

    composed = compose_model(
        model, ZeroConfig(stage=3), mesh=None, device=torch.device("cpu"), log=print, optimizers=optimizers
    )
    types = {name: type(p).__name__ for name, p in model.named_parameters()}
    initial = _plain(composed.engine.full_state_dict(rank0_only=False))
    for x in _batches():
        composed.engine.backward(model(x[2 * rank : 2 * rank + 2]).pow(2).mean())
        composed.engine.step()
    tag = getattr(getattr(getattr(model, "parameter", None), "weight", None), "tag", None)
    return {"types": types, "tag": tag, "initial": initial, "final": _plain(composed.engine.full_state_dict(False))}


def _refusal(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _trainable_quantized_engine() -> None:
    from ds_strategy.compose import compose_model
    from ds_strategy.config import ZeroConfig

    model = nn.Linear(2, 2)
    model.q = nn.Parameter(Int8Weight.quantize(torch.ones(2, 2)), requires_grad=True)
    compose_model(model, ZeroConfig(stage=1), mesh=None, device=torch.device("cpu"), log=print)


def _peft_in_configure_model() -> None:
    from peft import LoraConfig, get_peft_model
    from pipeline_runs import tiny_llama

    from ds_strategy.compose import compose_model
    from ds_strategy.config import ZeroConfig

    holder = nn.Module()
    holder.model = tiny_llama(2, 2)
    with parameters_on_meta(existing=holder):
        holder.model = get_peft_model(holder.model, LoraConfig(r=2, target_modules=["q_proj"]))
    compose_model(holder, ZeroConfig(stage=3), mesh=None, device=torch.device("cpu"), log=print)


def _run(rank: int, world_size: int) -> dict:
    trained = {name: _train_built_in_context(build(True), rank) for name, build in MODELS.items()}
    refusals = {
        "trainable quantized": _refusal(_trainable_quantized_engine),
        "peft": _refusal(_peft_in_configure_model),
    }
    return {"trained": trained, "refusals": refusals}


def _one_process(model: nn.Module) -> dict:
    initial = _plain(model.state_dict())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for x in _batches():
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"initial": initial, "final": _plain(model.state_dict())}


@pytest.mark.slow
def test_each_accepted_kind_trains_at_stage_3_as_one_process_and_the_others_are_refused_by_name():
    ranks = run_ranks(_run, 2, timeout=300)
    for name, build in MODELS.items():
        expected = _one_process(build(False))
        for rank in ranks:
            run = rank["trained"][name]
            assert set(run["initial"]) == set(expected["initial"]), name
            for key, value in expected["initial"].items():
                assert torch.equal(run["initial"][key], value), f"{name}: {key} differs from a normal build"
            for key, value in expected["final"].items():
                torch.testing.assert_close(run["final"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    subclasses = ranks[0]["trained"]["subclasses"]
    assert subclasses["types"]["tagged.weight"] == "Tagged" and subclasses["types"]["frozen.weight"] == "Int8Weight"
    assert subclasses["types"]["parameter.weight"] == "TaggedParameter" and subclasses["tag"] == "kept"
    refusals = ranks[0]["refusals"]
    assert refusals["trainable quantized"].startswith("UnsupportedParameterType: parameter 'q' is a trainable")
    assert "Int8Weight" in refusals["trainable quantized"]
    assert refusals["peft"].startswith("ValueError: PEFT adapter weights ['model.base_model.model.model.layers.0")
