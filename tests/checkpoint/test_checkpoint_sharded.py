"""Sharded checkpoints resume bit for bit, load at another world size or ZeRO stage, and consolidate into the
unsharded state dict: real gloo ranks, real files.

Every run trains TinyGPT for STEPS optimizer steps on the same global batches (GLOBAL_BATCH rows, split evenly
across however many ranks there are) and saves after SAVE_AT steps without disturbing the run, so one run gives
both the uninterrupted reference and the checkpoint. Resumed runs load it in a fresh process group and train the
remaining steps. Spawning ranks is the slow part, so the fixtures run every scenario of a world size in one group.
"""

import models
import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_runs import CONFIGS, build, global_batches, train
from distributed import run_ranks
from training_loops import assert_matches, full_state

from ds_strategy.checkpoint import consolidate, load, save
from ds_strategy.zero.engine import ZeroEngine

SAVE_AT = 2


def fit_saving_midway(rank: int, world_size: int, root, runs: dict[str, str]) -> dict:
    """For each ``checkpoint name: config``: train STEPS steps, saving after SAVE_AT."""
    torch.set_num_threads(1)
    results = {}
    for name, config in runs.items():
        model, engine = build(config)
        batches = global_batches()
        losses = train(model, engine, batches[:SAVE_AT])
        save(root / name, model, engine)
        at_save = full_state(engine, model)
        losses += train(model, engine, batches[SAVE_AT:])
        results[name] = {
            "losses": losses,
            "at_save": at_save,
            "final": full_state(engine, model),
            "scaler": _scaler_state(engine),
        }
        engine.remove_hooks()
    return results


def resume(rank: int, world_size: int, root, plan: dict[str, tuple[str, str]]) -> dict:
    """For each ``label: (checkpoint name, config)``: load into a fresh model and train the remaining steps."""
    torch.set_num_threads(1)
    results = {}
    for label, (name, config) in plan.items():
        model, engine = build(config)
        load(root / name, model, engine)
        loaded = full_state(engine, model)
        losses = train(model, engine, global_batches()[SAVE_AT:])
        results[label] = {
            "loaded": loaded,
            "losses": losses,
            "final": full_state(engine, model),
            "scaler": _scaler_state(engine),
        }
        engine.remove_hooks()
    return results


def _scaler_state(engine: ZeroEngine) -> dict | None:
    return engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Uninterrupted runs with a checkpoint midway: every config on 2 ranks, zero2 on 1 rank (this process)."""
    root = tmp_path_factory.mktemp("checkpoints")
    runs = run_ranks(fit_saving_midway, 2, root, {name: name for name in CONFIGS})[0]
    runs.update(fit_saving_midway(0, 1, root, {"zero2_w1": "zero2"}))
    return root, runs


@pytest.fixture(scope="module")
def resumed_on_two(saved):
    root, _ = saved
    plan = {
        **{name: (name, name) for name in CONFIGS},
        "zero2->zero1": ("zero2", "zero1"),
        "zero3->zero2": ("zero3", "zero2"),
        "1->2": ("zero2_w1", "zero2"),
    }
    return run_ranks(resume, 2, root, plan)[0]


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("config", list(CONFIGS))
def test_resumed_run_equals_uninterrupted_run_bitwise(saved, resumed_on_two, config):
    _, runs = saved
    resumed = resumed_on_two[config]
    _assert_bitwise(resumed["loaded"], runs[config]["at_save"])
    assert resumed["losses"] == runs[config]["losses"][SAVE_AT:]
    _assert_bitwise(resumed["final"], runs[config]["final"])
    assert resumed["scaler"] == runs[config]["scaler"]


@pytest.mark.parametrize(
    "label, saved_as", [("zero2->zero1", "zero2"), ("zero3->zero2", "zero3"), ("1->2", "zero2_w1")]
)
def test_checkpoint_loads_under_another_stage_or_world_size_and_trains_on(saved, resumed_on_two, label, saved_as):
    _, runs = saved
    resumed = resumed_on_two[label]
    _assert_bitwise(resumed["loaded"], runs[saved_as]["at_save"])
    assert_matches(
        {"losses": resumed["losses"], "params": resumed["final"]},
        {"losses": runs[saved_as]["losses"][SAVE_AT:], "params": runs[saved_as]["final"]},
    )


def test_two_rank_checkpoint_resumes_on_one_rank(saved):
    root, runs = saved
    resumed = resume(0, 1, root, {"2->1": ("zero2", "zero2")})["2->1"]
    _assert_bitwise(resumed["loaded"], runs["zero2"]["at_save"])
    assert_matches(
        {"losses": resumed["losses"], "params": resumed["final"]},
        {"losses": runs["zero2"]["losses"][SAVE_AT:], "params": runs["zero2"]["final"]},
    )


def test_two_rank_checkpoint_resumes_on_four_ranks(saved):
    root, runs = saved
    resumed = run_ranks(resume, 4, root, {"2->4": ("zero2", "zero2")})[0]["2->4"]
    _assert_bitwise(resumed["loaded"], runs["zero2"]["at_save"])
    assert_matches(
        {"losses": resumed["losses"], "params": resumed["final"]},
        {"losses": runs["zero2"]["losses"][SAVE_AT:], "params": runs["zero2"]["final"]},
    )


def test_each_rank_writes_only_its_own_shard(saved):
    """Every trainable element is stored once, in the file of the rank whose shard holds it: about half each."""
    root, _ = saved
    metadata = dcp.FileSystemReader(root / "zero2").read_metadata()
    elements = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            stored = metadata.state_dict_metadata[index.fqn]
            chunk = next(c for c in stored.chunks if c.offsets == index.offset)
            elements[info.relative_path] = elements.get(info.relative_path, 0) + chunk.sizes.numel()
    total = sum(p.numel() for p in models.TinyGPT().parameters())
    assert sorted(elements) == ["__0_0.distcp", "__1_0.distcp"]
    assert sum(elements.values()) == total
    assert all(abs(count - total / 2) < 0.01 * total for count in elements.values())


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_consolidated_checkpoint_is_the_unsharded_state_dict(saved, tmp_path, config):
    root, runs = saved
    state = torch.load(consolidate(root / config, tmp_path / "model.pt"))
    model = models.TinyGPT()
    model.load_state_dict(state, strict=True)
    assert list(state) == list(model.state_dict())
    assert state["lm_head.weight"].data_ptr() == state["embed.wte.weight"].data_ptr()  # tied: stored once
    _assert_bitwise({name: p.detach() for name, p in model.named_parameters()}, runs[config]["at_save"])
