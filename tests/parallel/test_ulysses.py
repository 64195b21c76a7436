"""DeepSpeed-Ulysses sequence parallelism on 2 gloo ranks computes what one process does over the full sequence:
the same attention, the same token-weighted loss and, after the gradient rule, the same parameter gradients."""

import hf_models
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig
from ds_strategy.parallel.ulysses import (
    attend_with_ulysses,
    gradient_divide_factor,
    heads_to_seq,
    register_hf_attention,
    seq_to_heads,
    sequence_parallel_loss,
    shard_sequence,
    ulysses_attention,
    ulysses_sdpa,
)
from ds_strategy.sequence_tiling import apply_sequence_tiling, remove_sequence_tiling

SP = 2
RTOL = 1e-5


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def _mean_over_group_times_scale(model: torch.nn.Module, world_size: int) -> dict[str, torch.Tensor]:
    """What the engine does with each gradient over its dp×sp group (here dp=1): the sum over
    ``gradient_divide_factor``."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad / gradient_divide_factor(world_size, world_size)
    return grads


def _exchange(rank, world_size):
    full = torch.randn(2, 4, 6, 3, generator=torch.Generator().manual_seed(0))
    by_heads = seq_to_heads(full.chunk(world_size, dim=2)[rank], dist.group.WORLD)
    return {
        "by_heads": (by_heads, full.chunk(world_size, dim=1)[rank]),
        "round_trip": (heads_to_seq(by_heads, dist.group.WORLD), full.chunk(world_size, dim=2)[rank]),
    }


ATTENTION_CASES = {"heads_first": (4, 4, "bhsd"), "seq_first_gqa": (4, 2, "bshd"), "kv_heads_repeated": (4, 1, "bhsd")}


def _attention(rank, world_size):
    errors = {}
    for case, (heads, kv_heads, layout) in ATTENTION_CASES.items():
        generator = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, n, 8, 4, generator=generator) for n in (heads, kv_heads, kv_heads))
        upstream = torch.randn(2, heads, 8, 4, generator=generator)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        expected.backward(upstream)
        seq_dim = 2 if layout == "bhsd" else 1
        to_layout = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
        local = [to_layout(t).chunk(world_size, dim=seq_dim)[rank].clone().requires_grad_() for t in (q, k, v)]
        out = ulysses_attention(
            *local, F.scaled_dot_product_attention, dist.group.WORLD, layout=layout, is_causal=True, enable_gqa=True
        )
        out.backward(to_layout(upstream).chunk(world_size, dim=seq_dim)[rank])
        errors[f"{case}/out"] = _relative_error(out, to_layout(expected).chunk(world_size, dim=seq_dim)[rank])
        for name, got, reference in zip("qkv", local, full):
            expected_grad = to_layout(reference.grad).chunk(world_size, dim=seq_dim)[rank]
            errors[f"{case}/d{name}"] = _relative_error(got.grad, expected_grad)
    return errors


def _refusal(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    raise AssertionError("no ValueError")


def _refusals(rank, world_size):
    group = dist.group.WORLD
    ids = torch.zeros(1, 16, dtype=torch.long)
    left_padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 13, dtype=torch.long)], dim=1)
    return {
        "odd_heads": _refusal(lambda: ulysses_sdpa(group)(*[torch.zeros(1, 3, 4, 2)] * 3)),
        "odd_kv_heads": _refusal(
            lambda: ulysses_sdpa(group)(torch.zeros(1, 6, 4, 2), *[torch.zeros(1, 3, 4, 2)] * 2, enable_gqa=True)
        ),
        "odd_length": _refusal(lambda: shard_sequence({"input_ids": ids[:, :15]}, group)),
        "padding_mask": _refusal(lambda: shard_sequence({"input_ids": ids, "attention_mask": left_padded}, group)),
        # 2 heads, 1 per tensor-parallel rank: nothing left to split over sp=2
        "tp_heads": _refusal(
            lambda: attend_with_ulysses(hf_models.build("llama", num_key_value_heads=2), group, tensor_parallel_size=2)
        ),
    }


def _primitives(rank, world_size):
    return {
        "exchange": _exchange(rank, world_size),
        "attention": _attention(rank, world_size),
        "refusals": _refusals(rank, world_size),
    }


@pytest.fixture(scope="module")
def primitive_runs():
    return run_ranks(_primitives, SP)


def test_all_to_all_swaps_the_sequence_split_for_a_head_split_and_back(primitive_runs):
    for rank in primitive_runs:
        for got, expected in rank["exchange"].values():
            assert torch.equal(got, expected)


def test_ulysses_attention_and_its_gradients_equal_causal_sdpa_over_the_full_sequence(primitive_runs):
    for rank in primitive_runs:
        errors = rank["attention"]
        assert len(errors) == 4 * len(ATTENTION_CASES)
        assert max(errors.values()) < RTOL, errors


def test_heads_that_do_not_split_over_sp_are_refused_with_the_allowed_sizes(primitive_runs):
    refusals = primitive_runs[0]["refusals"]
    assert (
        "query heads=3 and key/value heads=3 cannot be split over sp=2 ranks; allowed sp sizes: [1, 3]"
        in (refusals["odd_heads"])
    )
    assert (
        "query heads=6 and key/value heads=3 cannot be split over sp=2 ranks; allowed sp sizes: [1, 3, 6]"
        in (refusals["odd_kv_heads"])
    )


def test_heads_that_tensor_parallelism_leaves_too_few_to_split_are_refused_at_setup(primitive_runs):
    assert (
        "query heads=1 and key/value heads=1 per tensor-parallel rank (the model's / tensor_parallel_size=2) "
        "cannot be split over sp=2 ranks; allowed sp sizes: [1]"
    ) in primitive_runs[0]["refusals"]["tp_heads"]


def test_a_sequence_that_does_not_split_over_sp_is_refused_with_the_length_to_pad_to(primitive_runs):
    message = primitive_runs[0]["refusals"]["odd_length"]
    assert "sequence length 15 is not divisible by the sequence-parallel size sp=2; pad it to 16" in message


def test_a_mask_of_padding_on_the_left_is_refused(primitive_runs):
    assert "exact for padding on the right only" in primitive_runs[0]["refusals"]["padding_mask"]


def _llama_batches() -> dict[str, dict[str, torch.Tensor]]:
    ids = torch.randint(0, hf_models.VOCAB, (2, hf_models.SEQ), generator=torch.Generator().manual_seed(2))
    uneven = ids.clone()
    uneven[0, 5:] = -100  # rank 1 holds no labelled token of row 0, rank 0 four
    uneven[1, :3] = -100
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0  # padded on the right: dropped by shard_sequence, exact under causal attention
    padded = ids.masked_fill(mask == 0, -100)
    return {
        "all_labelled": {"input_ids": ids, "labels": ids},
        "uneven_ignored": {"input_ids": ids, "labels": uneven},
        "right_padded": {"input_ids": ids, "labels": padded, "attention_mask": mask},
    }


def _llama(rank, world_size):
    group = dist.group.WORLD
    model = hf_models.build("llama", hidden_size=64, num_attention_heads=4, intermediate_size=64)
    results = {}
    for case, batch in _llama_batches().items():
        model.set_attn_implementation("sdpa")
        model.zero_grad()
        reference_loss = model(**batch).loss
        reference_loss.backward()
        reference_grads = {name: param.grad.clone() for name, param in model.named_parameters()}

        model.set_attn_implementation(register_hf_attention(group))
        model.zero_grad()
        local = shard_sequence(batch, group)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = sequence_parallel_loss(logits, local["shift_labels"], group)
        loss.backward()
        naive = F.cross_entropy(logits.flatten(0, 1), local["shift_labels"].flatten(), ignore_index=-100).detach()
        dist.all_reduce(naive)
        grads = _mean_over_group_times_scale(model, world_size)
        results[case] = {
            "loss": (loss.item(), reference_loss.item()),
            "mean_of_rank_means": naive.item() / world_size,
            "grad_errors": {name: _relative_error(grads[name], reference_grads[name]) for name in grads},
        }
        if case == "uneven_ignored":  # a tiled loss in a user's loop: the model's summed loss, combined the same way
            apply_sequence_tiling(model, ZeroConfig(tiled_loss=True, tile_tokens=3).activation_policy)
            model.zero_grad()
            summed = model(**local, labels=local["shift_labels"], num_items_in_batch=1).loss
            tiled = sequence_parallel_loss(summed, local["shift_labels"], group)
            tiled.backward()
            grads = _mean_over_group_times_scale(model, world_size)
            results["tiled_loss"] = {
                "loss": (tiled.item(), reference_loss.item()),
                "grad_errors": {name: _relative_error(grads[name], reference_grads[name]) for name in grads},
            }
            remove_sequence_tiling(model)
    return results


def _gpt(rank, world_size):
    group = dist.group.WORLD
    config = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 10:] = -1
    torch.manual_seed(0)
    reference = GPT(config)
    _, reference_loss = reference(ids, F.pad(labels[:, 1:], (0, 1), value=-1))
    reference_loss.backward()

    torch.manual_seed(0)
    model = GPT(config, attention=ulysses_sdpa(group))
    local = shard_sequence({"input_ids": ids, "labels": labels}, group, ignore_index=-1)
    logits, _ = model(local["input_ids"], positions=local["position_ids"])
    loss = sequence_parallel_loss(logits, local["shift_labels"], group, ignore_index=-1)
    loss.backward()
    grads = _mean_over_group_times_scale(model, world_size)
    return {
        "loss": (loss.item(), reference_loss.item()),
        "grad_errors": {name: _relative_error(grads[name], p.grad) for name, p in reference.named_parameters()},
    }


def _models(rank, world_size):
    return {"llama": _llama(rank, world_size), "gpt": _gpt(rank, world_size)}


@pytest.fixture(scope="module")
def model_runs():
    return run_ranks(_models, SP)


@pytest.fixture(scope="module")
def llama_runs(model_runs):
    return [rank["llama"] for rank in model_runs]


@pytest.mark.parametrize("case", ["all_labelled", "uneven_ignored", "right_padded", "tiled_loss"])
def test_llama_with_ulysses_attention_has_the_full_sequence_loss(llama_runs, case):
    for rank in llama_runs:
        got, expected = rank[case]["loss"]
        assert got == pytest.approx(expected, rel=RTOL)


def test_the_uneven_batch_tells_token_weighting_from_averaging_rank_means(llama_runs):
    """Averaging the ranks' mean losses misses the full-sequence loss by far more than the tolerance above."""
    rank = llama_runs[0]["uneven_ignored"]
    assert rank["mean_of_rank_means"] != pytest.approx(rank["loss"][1], rel=10 * RTOL)


@pytest.mark.parametrize("case", ["all_labelled", "uneven_ignored", "right_padded", "tiled_loss"])
def test_llama_gradients_after_the_ulysses_rule_equal_the_full_sequence_gradients(llama_runs, case):
    for rank in llama_runs:
        errors = rank[case]["grad_errors"]
        assert len(errors) == 21
        assert max(errors.values()) < RTOL, errors


def test_our_gpt_with_ulysses_attention_matches_the_full_sequence_loss_and_gradients(model_runs):
    for rank in model_runs:
        got, expected = rank["gpt"]["loss"]
        assert got == pytest.approx(expected, rel=RTOL)
        errors = rank["gpt"]["grad_errors"]
        assert len(errors) == 2 + 12 * 2 + 2
        assert max(errors.values()) < RTOL, errors
