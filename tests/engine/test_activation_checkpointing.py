"""Activation checkpointing as configuration (``ds_strategy.compose.activation_checkpointing``): the loss and gradients
of a run without it, bit for bit, at every stage; the recomputation visible in backward FLOPs; the activations kept
shrinking by the expected factor (half of them again when partitioned over two ranks); and stage 3 gathering exactly as
often as without it (Note: [Activation checkpointing under stage 3])."""

import dataclasses

import hf_models
import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch.utils.flop_counter import FlopCounterMode

from ds_strategy.compose import compose_model
from ds_strategy.compose.activation_checkpointing import (
    SavedInputCounts,
    SavedInputHooks,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from ds_strategy.config import ZeroConfig, ZeroConfigError
from ds_strategy.config.deepspeed.translate import DeepSpeedConfigWarning
from ds_strategy.config.sources import config_from_deepspeed
from ds_strategy.models import gpt_config
from ds_strategy.zero.wrap_policy import select_unit_modules

TINY = gpt_config("tiny")  # 2 blocks, n_embd 32, block_size 32, vocab 96
PER_RANK = 2
TOKENS = PER_RANK * TINY.block_size
# What recomputing a block costs: its matmuls c_attn, attn.c_proj and c_fc, 2 * tokens * (C*3C + C*C + C*4C). Not
# its last, mlp.c_proj: torch stops a recomputation once every tensor the backward needs is back (early stop), and
# nothing inside the block saves c_proj's output. The attention kernel on CPU has no FLOP formula.
BLOCK_RECOMPUTED_FLOPS = 16 * TOKENS * TINY.n_embd**2
INPUT_BYTES = TOKENS * TINY.n_embd * 4  # what a checkpointed block keeps: its fp32 input
MODES = {
    "none": {},
    "full": {"activation_checkpointing": "full"},
    "every-2nd": {"activation_checkpointing": "full", "activation_checkpoint_interval": 2},
    "selective": {"activation_checkpointing": "selective"},
}
# Units embed.wte, blocks.0, blocks.1 (each holding the units c_attn, c_fc and mlp.c_proj) and lm_head.
NESTED = {"unit_min_params": 1100}
JOBS = {
    **{(stage, mode): (stage, zero) for stage in range(4) for mode, zero in MODES.items()},
    (3, "nested-none"): (3, NESTED),
    (3, "nested-full"): (3, {**NESTED, "activation_checkpointing": "full"}),
}


def _weight_gathers(engine) -> int:
    """Collectives that gather weights; on gloo a gather is booked as one broadcast per rank (``Collectives``)."""
    stats = engine.comm_stats()
    return sum(stats.get(kind, {}).get("calls", 0) for kind in ("all_gather", "broadcast"))


def _two_steps(rank: int, world_size: int, stage: int, zero: dict) -> dict:
    """Two steps of TinyGPT built through ``compose_model``: losses, reduced gradient shards, backward FLOPs and the
    weight gathers of each forward plus backward."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2)
    config = ZeroConfig(stage=stage, param_persistence_threshold=0, **zero)
    engine = compose_model(
        model, config, mesh=None, device=torch.device("cpu"), log=lambda _: None, optimizers=[optimizer]
    ).engine
    generator = torch.Generator().manual_seed(1)
    result = {"losses": [], "grads": [], "flops": [], "gathers": []}
    for _ in range(2):
        batch = models.TinyGPT.make_batch(generator, PER_RANK * world_size)
        before = _weight_gathers(engine)
        loss = model(tuple(t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in batch))
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        engine.reducer.wait_all()
        result["gathers"].append(_weight_gathers(engine) - before)
        result["losses"].append(loss.detach())
        result["grads"].append([engine.reducer.reduced_grad(fp).clone() for fp in engine.flat_params])
        result["flops"].append(flops.get_total_flops())
        engine.step()
    engine.remove_hooks()
    return result


def _checkpoint(model: torch.nn.Module, group=None, **zero):
    """``model``'s units checkpointed as ``ZeroConfig(**zero)`` says, the units chosen as the engine chooses them."""
    config = ZeroConfig(**zero)
    units = select_unit_modules(model, config.unit_modules, config.unit_min_params)
    return apply_activation_checkpointing(model, config.activation_policy, units, group)


def _partitioned(rank: int, world_size: int) -> dict:
    """Both ranks as one tensor-parallel group: the same batch, full checkpointing with inputs partitioned."""
    batch = models.TinyGPT.make_batch(torch.Generator().manual_seed(1), PER_RANK)
    result = {}
    partitioned = {"activation_checkpointing": "full", "partition_activations": True}
    settings = {"none": {}, "partitioned": partitioned, "partitioned+cpu": {**partitioned, "cpu_checkpointing": True}}
    for name, zero in settings.items():
        torch.manual_seed(0)
        model = models.TinyGPT()
        applied = _checkpoint(model, dist.group.WORLD, **zero)
        loss = model(batch)
        counts_after_forward = dataclasses.asdict(applied.counts)
        loss.backward()
        result[name] = {
            "loss": loss.detach(),
            "grads": [p.grad.clone() for p in model.parameters()],
            "after_forward": counts_after_forward,
            "after_backward": dataclasses.asdict(applied.counts),
        }
    hooks = SavedInputHooks("odd", dist.group.WORLD, to_host=False, counts=SavedInputCounts())
    odd = torch.arange(7.0).reshape(7, 1)
    saved = hooks.pack(odd)
    result["odd"] = {"kept": saved.kept.numel(), "restored": torch.equal(hooks.unpack(saved), odd)}
    return result


def _everything(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    runs = {key: _two_steps(rank, world_size, stage, zero) for key, (stage, zero) in JOBS.items()}
    return {"runs": runs, "partitioned": _partitioned(rank, world_size)}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_everything, 2)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])) and all(
        torch.equal(x, y) for step_a, step_b in zip(a["grads"], b["grads"]) for x, y in zip(step_a, step_b)
    )


@pytest.mark.parametrize("mode", ["full", "every-2nd", "selective"])
@pytest.mark.parametrize("stage", range(4))
def test_checkpointed_loss_and_gradients_equal_unchecked_ones_bitwise(ranks, stage, mode):
    for rank in ranks:
        assert _same(rank["runs"][stage, mode], rank["runs"][stage, "none"])


def test_checkpointing_nested_stage3_units_keeps_gradients_bitwise(ranks):
    for rank in ranks:
        assert _same(rank["runs"][3, "nested-full"], rank["runs"][3, "nested-none"])


@pytest.mark.parametrize(
    "mode, recomputed",
    [("full", 2 * BLOCK_RECOMPUTED_FLOPS), ("every-2nd", BLOCK_RECOMPUTED_FLOPS), ("selective", 0)],
)
@pytest.mark.parametrize("stage", range(4))
def test_backward_flops_grow_by_the_recomputed_forward(ranks, stage, mode, recomputed):
    """Full: both blocks' matmuls but their last again (2 x 1,048,576); every 2nd: blocks.1 only; selective keeps
    every matmul output, so it recomputes no FLOPs at all."""
    for rank in ranks:
        runs = rank["runs"]
        assert [a - b for a, b in zip(runs[stage, mode]["flops"], runs[stage, "none"]["flops"])] == [recomputed] * 2


def test_nested_units_recompute_once_with_their_outer_unit(ranks):
    """The outermost units are checkpointed (embed.wte, both blocks, lm_head), each block as before; the lookup has
    no FLOPs and lm_head's single matmul is its last op, which early stop skips."""
    runs = ranks[0]["runs"]
    extra = [a - b for a, b in zip(runs[3, "nested-full"]["flops"], runs[3, "nested-none"]["flops"])]
    assert extra == [2 * BLOCK_RECOMPUTED_FLOPS] * 2


@pytest.mark.parametrize("mode", ["full", "every-2nd", "selective", "nested"])
def test_stage3_recomputation_gathers_nothing_more(ranks, mode):
    """Every unit is gathered once in forward and, when freed after it, once in backward; a recomputation inside
    backward finds its unit (and the units nested in it) gathered for that backward."""
    for rank in ranks:
        runs = rank["runs"]
        checked, unchecked = ((3, "nested-full"), (3, "nested-none")) if mode == "nested" else ((3, mode), (3, "none"))
        assert runs[checked]["gathers"] == runs[unchecked]["gathers"]
        assert all(n > 0 for n in runs[unchecked]["gathers"])


def test_partitioned_inputs_give_exact_gradients_and_keep_half_on_each_of_two_ranks(ranks):
    for rank in ranks:
        runs = rank["partitioned"]
        for name in ("partitioned", "partitioned+cpu"):
            assert torch.equal(runs[name]["loss"], runs["none"]["loss"])
            assert all(torch.equal(a, b) for a, b in zip(runs[name]["grads"], runs["none"]["grads"]))
            assert runs[name]["after_forward"]["kept_bytes"] == 2 * INPUT_BYTES // 2
            assert (runs[name]["after_forward"]["saved"], runs[name]["after_backward"]["restored"]) == (2, 2)
        assert runs["partitioned+cpu"]["after_forward"]["host_bytes"] == INPUT_BYTES


def test_a_partitioned_input_not_divisible_by_the_group_is_padded_and_restored_exactly(ranks):
    for rank in ranks:
        assert rank["partitioned"]["odd"] == {"kept": 4, "restored": True}


# -- one process -----------------------------------------------------------------------------------------------
def _tiny_gpt(**zero):
    torch.manual_seed(0)
    model = models.TinyGPT()
    return model, _checkpoint(model, **zero)


def _batch():
    return models.TinyGPT.make_batch(torch.Generator().manual_seed(1), PER_RANK)


def _activation_bytes_kept_by_blocks(model) -> int:
    """Bytes of the distinct non-parameter storages that autograd saves while a block runs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    depth, kept = [0], {}
    handles = [h for b in model.blocks for h in _depth_hooks(b, depth)]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if depth[0] and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(_batch())
    for handle in handles:
        handle.remove()
    return sum(kept.values())


def _depth_hooks(module, depth):
    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    return module.register_forward_pre_hook(enter), module.register_forward_hook(leave)


def test_full_checkpointing_keeps_one_input_per_block_instead_of_sixteen_input_sized_activations():
    """Unchecked, a block keeps at least 16 tensors of its input's size (2 norm inputs, 2 norm outputs, q/k/v, the
    attention output and the 4x wide MLP activation before and after GELU); checkpointed, exactly its input."""
    unchecked = _activation_bytes_kept_by_blocks(_tiny_gpt()[0])
    checked = _activation_bytes_kept_by_blocks(_tiny_gpt(activation_checkpointing="full")[0])
    assert checked == 2 * INPUT_BYTES
    assert unchecked >= 16 * checked


def test_cpu_checkpointing_hooks_take_and_restore_every_checkpointed_input():
    reference, _ = _tiny_gpt()
    reference(_batch()).backward()
    model, applied = _tiny_gpt(activation_checkpointing="full", cpu_checkpointing=True)
    loss = model(_batch())
    assert dataclasses.asdict(applied.counts) == {
        "saved": 2,
        "kept_bytes": 2 * INPUT_BYTES,
        "host_bytes": 2 * INPUT_BYTES,
        "restored": 0,
    }
    loss.backward()
    assert applied.counts.restored == 2
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_checkpointing_keeps_names_and_modules_and_can_be_removed():
    plain, _ = _tiny_gpt()
    model, applied = _tiny_gpt(activation_checkpointing="full")
    assert applied.names == ("blocks.0", "blocks.1")
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [name for name, _ in model.named_modules()] == [name for name, _ in plain.named_modules()]
    again = _checkpoint(model, activation_checkpointing="full")
    assert again.names == applied.names
    assert all(block.forward.original.__func__ is type(block).forward for block in model.blocks)  # not re-wrapped
    remove_activation_checkpointing(model)
    assert all("forward" not in block.__dict__ for block in model.blocks)


def test_recomputation_shows_in_the_profiler_by_unit():
    model, _ = _tiny_gpt(activation_checkpointing="full", cpu_checkpointing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(_batch()).backward()
    names = {event.name for event in profile.events()}
    for what in ("forward", "recompute", "save_input", "load_input"):
        assert f"ds_strategy::activation.{what}[blocks.1]" in names


def test_hugging_face_llama_decoder_layers_are_found_and_recompute_exactly():
    ids = hf_models.batches(1, 1)[0]
    runs = {}
    for mode in ("none", "full"):
        model = hf_models.build("llama", use_cache=False)  # else a recomputation appends to the KV cache again
        applied = _checkpoint(model, activation_checkpointing=mode)
        loss = model(input_ids=ids, labels=ids).loss
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        runs[mode] = (applied.names, loss.detach(), [p.grad for p in model.parameters()], flops.get_total_flops())
    assert runs["full"][0] == ("model.layers.0", "model.layers.1")
    assert torch.equal(runs["full"][1], runs["none"][1])
    assert all(torch.equal(a, b) for a, b in zip(runs["full"][2], runs["none"][2]))
    # Each layer's matmuls (q 32x32, k and v 32x16, o 32x32, gate and up 32x64) run again; torch's early stop ends
    # the recomputation before down_proj, whose output nothing inside the layer saved.
    layer_matmuls_but_down = 2 * ids.numel() * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 2 * 32 * 64)
    assert runs["full"][3] - runs["none"][3] == 2 * layer_matmuls_but_down


# -- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("activation_checkpointing", "fulll"),
        ("activation_checkpointing", True),
        ("activation_checkpoint_interval", 0),
        ("partition_activations", "yes"),
        ("cpu_checkpointing", 1),
    ],
)
def test_bad_settings_fail_naming_the_field(field, value):
    with pytest.raises(ZeroConfigError, match=field):
        ZeroConfig(**{field: value})


def test_a_model_without_units_cannot_be_checkpointed():
    with pytest.raises(ValueError, match="found no units in MLP"):
        _checkpoint(models.MLP(), activation_checkpointing="full")


def test_an_interval_longer_than_the_units_fails():
    with pytest.raises(ValueError, match="activation_checkpoint_interval=3 checkpoints none of the 2 units"):
        _tiny_gpt(activation_checkpointing="full", activation_checkpoint_interval=3)


def test_a_hugging_face_model_with_a_kv_cache_is_warned_about():
    with pytest.warns(UserWarning, match="set model.config.use_cache = False"):
        _checkpoint(hf_models.build("llama"), activation_checkpointing="full")


def test_a_hugging_face_model_that_checkpoints_itself_is_not_checkpointed_twice():
    model = hf_models.build("llama", use_cache=False)
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="already checkpoints itself"):
        _checkpoint(model, activation_checkpointing="selective")


# -- DeepSpeed's section ---------------------------------------------------------------------------------------
def test_deepspeed_section_sets_what_checkpoint_inputs_become_but_turns_nothing_on():
    config = config_from_deepspeed(
        {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True, "profile": False}}
    )
    assert (config.activation_checkpointing, config.partition_activations, config.cpu_checkpointing) == (
        "none",
        True,
        True,
    )


def test_deepspeed_buffer_and_timing_keys_are_accepted_and_warned_about_when_set():
    with pytest.warns(DeepSpeedConfigWarning) as caught:
        config_from_deepspeed(
            {
                "activation_checkpointing": {
                    "number_checkpoints": 4,
                    "contiguous_memory_optimization": True,
                    "synchronize_checkpoint_boundary": True,
                    "profile": True,
                }
            }
        )
    (message,) = [str(w.message) for w in caught]
    for key in ("number_checkpoints=4", "contiguous_memory_optimization=True", "synchronize_checkpoint_boundary=True"):
        assert f"activation_checkpointing.{key}" in message
