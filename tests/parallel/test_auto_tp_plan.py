"""Automatic tensor-parallel plans: on 2 gloo ranks, every planned model computes what one process computes.

Each case builds a tiny model, keeps an unsharded copy as the reference, shards the other by its plan over a
1-D mesh of 2 and runs one forward and backward on the same batch on both ranks. The loss and every parameter's
gradient (gathered with ``full_tensor()``) must match the reference to 1e-5 in relative norm, and every sharded
parameter must still be the original weight. All cases run in one pair of ranks; bad plans are refused without any.
"""

import copy

import hf_models
import pytest
import torch
from distributed import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from ds_strategy.models.gpt import GPT, GPTConfig
from ds_strategy.parallel import apply_tensor_parallel_plan, tensor_parallel_plan

RTOL = 1e-5
# num_key_value_heads=2 so that 2 ranks can split the KV heads too.
HF_SHAPE = {"num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = ("gpt", "llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral")
LIGHTNING_PLAN = {
    "layers.*.self_attn.q_proj": ColwiseParallel(),
    "layers.*.self_attn.k_proj": ColwiseParallel(),
    "layers.*.self_attn.v_proj": ColwiseParallel(),
    "layers.*.self_attn.o_proj": RowwiseParallel(),
    "layers.*.mlp.gate_proj": ColwiseParallel(),
    "layers.*.mlp.up_proj": ColwiseParallel(),
    "layers.*.mlp.down_proj": RowwiseParallel(),
}


def _build(family: str) -> nn.Module:
    if family == "gpt":
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=hf_models.VOCAB, block_size=hf_models.SEQ, n_layer=2, n_head=2, n_embd=32))
    if family == "llama-base":
        torch.manual_seed(0)
        return hf_models.transformers.LlamaModel(hf_models.config("llama", **HF_SHAPE))
    return hf_models.build(family, **({} if family == "gpt2" else HF_SHAPE))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        return model(ids, ids)[1]
    if hasattr(model, "lm_head"):
        return model(input_ids=ids, labels=ids).loss
    hidden = model(input_ids=ids).last_hidden_state
    # A fixed projection: the mean square of a normalised output would be nearly constant, its gradients noise.
    return (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))).mean()


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _run_case(family: str, sequence_parallel: bool, plan) -> dict:
    """One model sharded by ``plan`` ("auto", or a dict) against its unsharded copy: the figures the tests check."""
    reference = _build(family)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2,))
    resolved = tensor_parallel_plan(model, 2, sequence_parallel=sequence_parallel, plan=plan)
    apply_tensor_parallel_plan(model, mesh, resolved)
    ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.SEQ), generator=torch.Generator().manual_seed(1))
    reference_loss = _loss(reference, ids)
    reference_loss.backward()
    loss = _loss(model, ids)
    loss.backward()
    originals = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    return {
        "loss": (loss.item(), reference_loss.item()),
        "grad_error": {name: _relative(_full(p.grad), originals[name].grad) for name, p in params.items()},
        "weight_kept": {name: torch.equal(_full(p.detach()), originals[name].detach()) for name, p in params.items()},
        "sharded": sorted(
            name for name, p in params.items() if isinstance(p, DTensor) and p.to_local().shape != p.shape
        ),
        "partial_grads": sorted(
            name for name, p in params.items() if isinstance(p.grad, DTensor) and p.grad.placements == (Partial(),)
        ),
        "reduced_partial_matches": all(
            _relative(p.grad.redistribute(placements=[Replicate()]).to_local(), originals[name].grad) <= RTOL
            for name, p in params.items()
            if isinstance(p.grad, DTensor) and p.grad.placements == (Partial(),)
        ),
        "sequence_parallel_params": sorted(
            f"{module_name}.{name}"
            for module_name, style in resolved.items()
            if type(style) is SequenceParallel
            for name, _ in model.get_submodule(module_name).named_parameters()
        ),
        "local_c_attn": _local_c_attn(family, model, reference),
    }


def _local_c_attn(family: str, model: nn.Module, reference: nn.Module) -> bool | None:
    """GPT-2's fused q|k|v: this rank holds the same half of each of q, k and v (its own heads), in that order."""
    if family != "gpt2":
        return None
    rank = torch.distributed.get_rank()
    weight = reference.transformer.h[0].attn.c_attn.weight  # Conv1D: (in, 3 * embed)
    expected = torch.cat([block.chunk(2, dim=1)[rank] for block in weight.chunk(3, dim=1)], dim=1)
    return torch.equal(model.transformer.h[0].attn.c_attn.weight.to_local(), expected.detach())


CASES = {
    **{f"{family}/tp": (family, False, "auto") for family in FAMILIES},
    **{f"{family}/sp": (family, True, "auto") for family in FAMILIES},
    "lightning-dict": ("llama-base", False, LIGHTNING_PLAN),
}


def _all_cases(rank: int, world_size: int) -> dict:
    return {name: _run_case(*case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all_cases, 2, timeout=240)


@pytest.mark.parametrize("case", CASES)
def test_sharded_model_matches_single_process_loss_and_gradients(runs, case):
    for rank in runs:
        report = rank[case]
        loss, reference = report["loss"]
        assert loss == pytest.approx(reference, rel=RTOL)
        bad = {name: error for name, error in report["grad_error"].items() if error > RTOL}
        assert not bad, f"gradients off by more than {RTOL} in relative norm: {bad}"


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_still_holds_its_original_global_weight(runs, case):
    for rank in runs:
        report = rank[case]
        assert report["sharded"], "the plan sharded nothing"
        assert all(report["weight_kept"].values()), [name for name, kept in report["weight_kept"].items() if not kept]


@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_parallel_norm_gradients_are_partial_until_reduced(runs, family):
    for rank in runs:
        report = rank[f"{family}/sp"]
        assert report["sequence_parallel_params"], "no norm ran sequence-parallel"
        assert set(report["sequence_parallel_params"]) <= set(report["partial_grads"])
        assert report["reduced_partial_matches"]


def test_qwen3_per_head_norm_gradients_are_partial_without_sequence_parallelism(runs):
    for rank in runs:
        assert rank["qwen3/tp"]["partial_grads"] == [
            f"model.layers.{layer}.self_attn.{norm}.weight" for layer in (0, 1) for norm in ("k_norm", "q_norm")
        ]


def test_gpt2_fused_qkv_gives_each_rank_its_own_heads_of_q_k_and_v(runs):
    for rank in runs:
        assert rank["gpt2/tp"]["local_c_attn"] is True
        assert "transformer.h.0.attn.c_attn.weight" in rank["gpt2/tp"]["sharded"]


def test_auto_plan_shards_attention_and_mlp_but_replicates_embeddings_and_head(runs):
    sharded = set(runs[0]["llama/tp"]["sharded"])
    assert "model.layers.0.self_attn.k_proj.weight" in sharded
    assert "model.layers.1.mlp.down_proj.weight" in sharded
    assert "model.embed_tokens.weight" not in sharded and "lm_head.weight" not in sharded
    assert "model.layers.0.mlp.experts.gate_up_proj" in set(runs[0]["mixtral/tp"]["sharded"])


def test_unknown_plan_key_is_named_with_close_names():
    model = hf_models.build("llama", **HF_SHAPE)
    with pytest.raises(ValueError, match=r"'model\.layers\.\*\.self_attn\.q_prj' matches no module.*close names"):
        tensor_parallel_plan(model, 2, plan={"model.layers.*.self_attn.q_prj": "colwise"})


@pytest.mark.parametrize(
    ("overrides", "tp_size", "message"),
    [
        (HF_SHAPE, 3, r"tp_size=3 does not divide num_attention_heads=4 .*allowed tp sizes: \[1, 2\]"),
        (HF_SHAPE, 4, r"tp_size=4 does not divide num_key_value_heads=2 .*allowed tp sizes: \[1, 2\]"),
        (
            {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 66},
            4,
            r"tp_size=4 does not divide intermediate_size=66 .*allowed tp sizes: \[1, 2\]",
        ),
    ],
)
def test_tp_size_must_divide_heads_and_intermediate_size(overrides, tp_size, message):
    with pytest.raises(ValueError, match=message):
        tensor_parallel_plan(hf_models.build("llama", **overrides), tp_size)


def test_auto_plan_refuses_a_model_it_does_not_recognise():
    with pytest.raises(ValueError, match="recognise the attention modules of Sequential; pass plan= a dict"):
        tensor_parallel_plan(nn.Sequential(nn.Linear(4, 4)), 2)


def test_unknown_style_name_lists_the_allowed_ones():
    model = hf_models.build("llama", **HF_SHAPE)
    with pytest.raises(ValueError, match=r"style 'columnwise' .*allowed: \['colwise', 'rowwise', 'sequence_parallel'"):
        tensor_parallel_plan(model, 2, plan={"model.layers.0.self_attn.q_proj": "columnwise"})


def test_style_names_become_the_style_that_fits_each_module():
    model = hf_models.build("gpt2")
    plan = tensor_parallel_plan(model, 2, plan={"transformer.h.*.mlp.c_fc": "colwise", "lm_head": "replicate"})
    assert type(plan["transformer.h.*.mlp.c_fc"]).__name__ == "PackedColwiseParallel"  # Conv1D, not nn.Linear
    assert type(plan["lm_head"]).__name__ == "Replicated"
