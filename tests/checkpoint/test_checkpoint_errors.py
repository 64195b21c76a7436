"""A checkpoint that cannot be used fails with an error naming the file and the problem, and the model, optimizer
and loss scaler it was to be loaded into are left exactly as they were."""

import copy
import json
import re

import models
import pytest
import torch
import torch.distributed as dist
from checkpoint_runs import build, global_batches, saved_after_one_step, train
from distributed import run_ranks

from ds_strategy.checkpoint import CheckpointError, consolidate, load, save
from ds_strategy.cli import main
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
    _assert_unchanged(before, _snapshot(engine))


def _assert_unchanged(before: dict, after: dict) -> None:
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


def _garbled(data: bytes) -> bytes:
    """``data`` with the 64 bytes from its middle inverted: the same size, other bytes."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :]


@pytest.mark.parametrize("damage", ["truncate", "empty", "garble"])
@pytest.mark.parametrize("kind", ["manifest.json", "meta.pt", ".metadata"])
def test_every_damaged_metadata_file_is_named(checkpoint, target, kind, damage):
    """Each file kind a checkpoint has besides the shards, cut short, emptied or with 64 bytes inverted."""
    file = checkpoint / kind
    data = file.read_bytes()
    damaged = {"truncate": data[: len(data) // 2], "empty": b"", "garble": _garbled(data)}
    file.write_bytes(damaged[damage])
    _assert_fails_leaving_target_untouched(checkpoint, target, rf"ckpt/{kind}")


DAMAGED_SHARD = r"__1_0\.distcp is damaged: its crc32 is 0x[0-9a-f]{8}, the manifest records 0x[0-9a-f]{8}"


def save_then_load_with_rank1_shard_garbled(rank: int, world_size: int, path) -> str:
    """Save a 2-rank zero2 checkpoint after one step, garble rank 1's shard file, and load it after one more step;
    returns the load's error, having checked that it left the state of the second step as it was."""
    torch.set_num_threads(1)
    model, engine = build("zero2")
    train(model, engine, global_batches()[:1])
    save(path, model, engine)
    train(model, engine, global_batches()[1:2])
    if rank == 0:
        shard = path / "__1_0.distcp"
        shard.write_bytes(_garbled(shard.read_bytes()))
    dist.barrier()
    before = _snapshot(engine)
    with pytest.raises(CheckpointError) as raised:
        load(path, model, engine)
    _assert_unchanged(before, _snapshot(engine))
    engine.remove_hooks()
    return str(raised.value)


@pytest.fixture(scope="module")
def garbled_two_rank_checkpoint(tmp_path_factory):
    """The checkpoint with rank 1's shard garbled, and the error each rank's load of it raised."""
    path = tmp_path_factory.mktemp("garbled") / "ckpt"
    return path, run_ranks(save_then_load_with_rank1_shard_garbled, 2, path)


def test_shard_with_bytes_garbled_at_its_size_fails_on_every_rank_naming_it(garbled_two_rank_checkpoint):
    """Rank 1 reads the file; rank 0, which reads nothing from it, fails with it (DCP's read is collective)."""
    path, (rank0, rank1) = garbled_two_rank_checkpoint
    where = re.escape(str(path))
    for message in (rank0, rank1):
        assert re.fullmatch(rf"reading the checkpoint {where} failed on rank 1: {where}/{DAMAGED_SHARD}", message)


def test_consolidation_refuses_a_garbled_shard_and_writes_nothing(garbled_two_rank_checkpoint, tmp_path, capsys):
    path, _ = garbled_two_rank_checkpoint
    with pytest.raises(CheckpointError, match=DAMAGED_SHARD):
        consolidate(path, tmp_path / "model.pt")
    assert main(["consolidate", str(path), str(tmp_path / "model.safetensors")]) == 1
    assert "__1_0.distcp is damaged" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_checkpoint_written_before_checksums_still_loads(tmp_path, target):
    """A manifest without ``checksums``, as every checkpoint had before them, loads unchecked."""
    path, _, saved = saved_after_one_step(tmp_path / "ckpt")
    manifest = path / "manifest.json"
    raw = json.loads(manifest.read_text())
    assert set(raw.pop("checksums")) == set(raw["files"])
    manifest.write_text(json.dumps(raw))
    model, engine = target
    load(path, model, engine)
    assert all(torch.equal(a.master, b.master) for a, b in zip(saved.flat_params, engine.flat_params))
