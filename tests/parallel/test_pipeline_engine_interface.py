"""What pipelining hands the engine, as arguments: the cut returns the meta pieces it cut in its plan, the engine is
told the whole model once at construction (``ModelPart``), and a schedule drives it through an interface in terms of
stages and opaque buffer handles. One process, no schedule: these are the seams the multi-rank parity tests
(tests/parallel/test_pipeline_parallel.py, tests/parallel/test_meta_build_layouts.py) run through."""

import math

import torch
from pipeline_runs import mlp_stack, tiny_gpt
from torch import nn

from ds_strategy.config import ZeroConfig
from ds_strategy.parallel.pipeline_split import cut_to_stages, plan_stages
from ds_strategy.pipeline import model_part
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.schedule_interface import GradientBuffer


def test_the_cut_returns_the_meta_pieces_it_cut_in_its_plan():
    with torch.device("meta"):
        model = tiny_gpt(4)
    plan = cut_to_stages(model, plan_stages(model, 2, 1, "1f1b", "auto"))  # the last stage: blocks 2-3 and the head
    assert [(parent, name) for parent, name, _ in plan.cut_pieces] == [
        (model.blocks, "0"),
        (model.blocks, "1"),
        (model, "embed"),
    ]
    assert model.blocks[0] is None and model.embed is None
    assert all(t.is_meta for _, _, piece in plan.cut_pieces for t in piece.parameters())
    built = tiny_gpt(4)
    assert cut_to_stages(built, plan_stages(built, 2, 1, "1f1b", "auto")).cut_pieces == ()  # real pieces are freed


def test_the_engine_is_told_the_whole_model_its_stage_is_part_of():
    with torch.device("meta"):
        model = tiny_gpt(4)
    whole_names = tuple(model.state_dict(keep_vars=True))
    plan = cut_to_stages(model, plan_stages(model, 2, 1, "1f1b", "auto"))
    part = model_part(model, plan)
    assert (part.pipeline_size, part.whole_names) == (2, whole_names)
    assert dict(part.saved_as) == {"lm_head.weight": "embed.wte.weight"}  # the head, tied to stage 0's embedding,
    assert dict(part.norm_shares) == {"lm_head.weight": 0.0}  # whose stage counts it in the norm
    assert [(p.parent, p.name, p.module) for p in part.cut_pieces] == list(plan.cut_pieces)
    assert model_part(model, None) is None


def _stage3_engine() -> tuple[nn.Module, ZeroEngine]:
    torch.manual_seed(0)
    model = mlp_stack(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, ZeroEngine(model, optimizer, ZeroConfig(stage=3, unit_modules=(nn.Sequential,)))


def test_a_schedule_names_buffers_by_stage_and_never_sees_inside_them():
    model, engine = _stage3_engine()
    stages = {0: [*model[0].parameters(), *model[1].parameters()], 1: [*model[1].parameters(), *model[2].parameters()]}
    stages[1] += list(model[3].parameters())
    interface = engine.driven_by_schedule(stages, finished_later=frozenset({"3.0.weight"}))
    every = interface.buffers()
    assert len(every) == 4 and all(isinstance(b, GradientBuffer) for b in every)
    assert interface.buffers() == every  # the same handles each time, usable as set members
    block = every[::-1]  # reduced in the order backward reaches them, the last block's first
    # block 1 runs in both stages and block 3's gradient is finished after the schedule: neither is reduced early
    assert interface.buffers_only_in(0) == [block[0]]
    assert interface.buffers_only_in(1) == [block[2]]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    interface.reduce(every, scale=0.5)
    interface.finish_gradients()
    numel = sum(p.numel() for p in model.parameters())
    assert math.isclose(engine.grad_norm().item(), 0.5 * math.sqrt(numel), rel_tol=1e-6)
