"""A checkpoint that cannot be used fails with an error naming the file and the problem, and the model, optimizer
and loss scaler it was to be loaded into are left exactly as they were."""

import copy

import models
import pytest
import torch
from checkpoint_runs import build, global_batches, train

from ds_strategy.checkpoint import CheckpointError, load, save
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig
from ds_strategy.zero.engine import ZeroEngine


@pytest.fixture
def checkpoint(tmp_path):
    """A one-rank zero2 TinyGPT checkpoint after one step."""
    model, engine = build("zero2")
    train(model, engine, global_batches()[:1])
    save(tmp_path / "ckpt", model, engine)
    return tmp_path / "ckpt"


@pytest.fixture
def target():
    """A model and engine with optimizer state of their own, different from the checkpoint's."""
    model, engine = build("zero2")
    train(model, engine, global_batches()[2:3])
    return model, engine


def _snapshot(engine: ZeroEngine) -> dict:
    return {
        "masters": [fp.master.clone() for fp in engine.flat_params],
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
    }


def _assert_fails_leaving_target_untouched(path, target, match: str) -> None:
    model, engine = target
    before = _snapshot(engine)
    with pytest.raises(CheckpointError, match=match):
        load(path, model, engine)
    after = _snapshot(engine)
    assert all(torch.equal(a, b) for a, b in zip(before["masters"], after["masters"]))
    assert str(after["optimizer"]) == str(before["optimizer"])
    for key, state in before["optimizer"]["state"].items():
        assert all(torch.equal(value, after["optimizer"]["state"][key][k]) for k, value in state.items())


def test_missing_shard_file_is_named(checkpoint, target):
    (checkpoint / "__0_0.distcp").unlink()
    _assert_fails_leaving_target_untouched(checkpoint, target, r"ckpt/__0_0\.distcp is missing")


def test_truncated_shard_file_is_named(checkpoint, target):
    shard = checkpoint / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _assert_fails_leaving_target_untouched(
        checkpoint,
        target,
        r"ckpt/__0_0\.distcp is truncated .* the manifest "
        r"records",
    )


def _with_engine(model: torch.nn.Module) -> tuple:
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2)
    return model, ZeroEngine(model, optimizer, ZeroConfig(stage=2))


def test_checkpoint_of_a_model_with_other_parameter_names(checkpoint):
    _assert_fails_leaving_target_untouched(
        checkpoint,
        _with_engine(models.MLP()),
        r"saved from a different model.*missing from the checkpoint: net\.0\.weight",
    )


def test_checkpoint_of_a_model_with_other_shapes(checkpoint):
    wider = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=48))
    _assert_fails_leaving_target_untouched(
        checkpoint,
        _with_engine(wider),
        r"embed\.wte\.weight: shape \[96, 32\] in the checkpoint, \[96, 48\] in the model",
    )


def test_file_is_not_a_checkpoint(tmp_path, target):
    plain = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, plain)
    _assert_fails_leaving_target_untouched(plain, target, r"model\.ckpt is a file, not a ds_strategy checkpoint")


def test_directory_is_not_a_checkpoint(tmp_path, target):
    _assert_fails_leaving_target_untouched(
        tmp_path,
        target,
        r"is not a ds_strategy checkpoint: manifest\.json is "
        r"missing",
    )


def test_missing_path_is_named(tmp_path, target):
    _assert_fails_leaving_target_untouched(tmp_path / "nowhere", target, r"nowhere: no such checkpoint")


def test_corrupt_manifest_is_named(checkpoint, target):
    (checkpoint / "manifest.json").write_text("{ not json")
    _assert_fails_leaving_target_untouched(
        checkpoint,
        target,
        r"manifest\.json is not a valid ds_strategy checkpoint "
        r"manifest",
    )


@pytest.mark.parametrize("damage", ["truncate", "empty", "garble"])
@pytest.mark.parametrize("kind", ["manifest.json", "meta.pt", ".metadata"])
def test_every_damaged_metadata_file_is_named(checkpoint, target, kind, damage):
    """Each file kind a checkpoint has besides the shards, cut short, emptied or with 64 bytes inverted."""
    file = checkpoint / kind
    data = file.read_bytes()
    middle = len(data) // 2
    damaged = {
        "truncate": data[:middle],
        "empty": b"",
        "garble": data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :],
    }
    file.write_bytes(damaged[damage])
    _assert_fails_leaving_target_untouched(checkpoint, target, rf"ckpt/{kind}")
