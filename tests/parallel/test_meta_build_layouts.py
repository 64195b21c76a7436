"""A model built on the meta device equals a normal build of the whole model, bitwise, under tensor and pipeline
parallelism (Note: [A sharded build equals a normal build] in ``ds_strategy.zero.sharded_init``), and leaves the
generator where a normal build does.

The first case is the one reported: a Hugging Face Llama (hidden 64, 4 layers, 4 heads, 2 KV heads) split by the
automatic plan over tp=2 used to run the initialisers on each rank's local shard from the same generator state,
so the two halves of every column-parallel weight were the same numbers. The pipeline cases used to initialise
only the pieces a stage keeps, so the generator, and with it every later tensor, differed from a normal build.
Every layout crossed with the adapters is in ``test_composition_matrix.py``; this file is the quick check.
"""

import pipeline_runs
import pytest
import tensor_parallel_runs
import torch
from distributed import run_ranks

from ds_strategy.compose import build_mesh, compose_model
from ds_strategy.config import ZeroConfig


def issue_llama():
    """The model of the report."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


MODELS = {**pipeline_runs.MODELS, "issue_llama": lambda blocks: issue_llama(), "residual_mlp": lambda blocks: None}


def _build(name: str, meta: bool):
    torch.manual_seed(1234)
    factory = tensor_parallel_runs.ResidualMLP if name == "residual_mlp" else lambda: MODELS[name](4)
    if not meta:
        return factory()
    with torch.device("meta"):
        return factory()


def _built(rank: int, world_size: int, model: str, meta: bool, user_plan: dict | None = None, **fields) -> dict:
    """This rank's full state dict right after the engine is built, and the generator's next draw."""
    torch.set_num_threads(1)
    config = ZeroConfig(**fields)
    mesh = build_mesh(config, "cpu")
    module = _build(model, meta)
    if user_plan is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, mesh.tp_mesh, user_plan)
    optimizer = lambda: [torch.optim.SGD(module.parameters(), lr=0.1)]  # noqa: E731  over this rank's stages only
    engine = compose_model(
        module, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=optimizer
    ).engine
    next_draw = torch.rand(4)
    return {"state": engine.full_state_dict(rank0_only=False), "next_draw": next_draw}


CASES = {
    # the report: HF Llama, automatic plan, tp=2, stage 3
    "llama_tp_auto": {
        "model": "issue_llama",
        "stage": 3,
        "tensor_parallel_size": 2,
        "tensor_parallel_plan": "auto",
    },
    # a user plan with Megatron sequence parallelism (replicated norms), reset_parameters() initialisers
    "mlp_tp_user_megatron_sp": {
        "model": "residual_mlp",
        "stage": 1,
        "tensor_parallel_size": 2,
        "sequence_parallel": True,
        "user_plan": "sequence_parallel",
    },
    # two stages per rank, our GPT with its LM head tied to the embedding on the other rank
    "gpt_pp_interleaved": {
        "model": "gpt",
        "stage": 3,
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "interleaved_1f1b",
    },
    "llama_pp_zbv": {"model": "llama", "stage": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "zbv"},
}


def _cases(rank: int, world_size: int) -> dict:
    results = {}
    for name, case in CASES.items():
        fields = dict(case)
        if fields.get("user_plan"):
            fields["user_plan"] = tensor_parallel_runs.plan(fields.pop("user_plan") == "sequence_parallel")
        normal = _built(rank, world_size, meta=False, **fields)
        meta = _built(rank, world_size, meta=True, **fields)
        results[name] = {
            "differing": sorted(k for k, v in normal["state"].items() if not torch.equal(meta["state"][k], v)),
            "same_keys": set(normal["state"]) == set(meta["state"]),
            "next_draw_equal": torch.equal(normal["next_draw"], meta["next_draw"]),
            "q_halves_equal": _halves_equal(meta["state"].get("model.layers.0.self_attn.q_proj.weight")),
            "whole": {k: v for k, v in meta["state"].items() if k.startswith("model.layers.0.self_attn")},
        }
    return results


def _halves_equal(weight: torch.Tensor | None) -> bool | None:
    return None if weight is None else torch.equal(weight[: weight.shape[0] // 2], weight[weight.shape[0] // 2 :])


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_cases, 2, timeout=300)


@pytest.mark.slow
def test_meta_build_under_tp_has_distinct_halves_and_equals_a_normal_build(runs):
    for rank in runs:
        case = rank["llama_tp_auto"]
        assert case["q_halves_equal"] is False, "both tensor-parallel halves of q_proj are the same numbers"
        assert case["same_keys"] and case["differing"] == []
        assert case["next_draw_equal"]
    torch.manual_seed(1234)
    normal = issue_llama().state_dict()
    for key, value in runs[0]["llama_tp_auto"]["whole"].items():
        assert torch.equal(value, normal[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "llama_tp_auto"])
def test_meta_build_equals_a_normal_build(runs, case):
    for rank in runs:
        assert rank[case]["same_keys"], case
        assert rank[case]["differing"] == [], case
        assert rank[case]["next_draw_equal"], case
