"""Sharded loading of pretrained weights: a Hugging Face checkpoint in several safetensors files loads into a
stage-3 model built on the meta device, each rank reading only its shards, and trains like DDP on
``from_pretrained``; a checkpoint that does not fit fails with every bad name and changes nothing."""

import hf_models
import pytest
import torch
import transformers
from distributed import run_ranks
from safetensors.torch import load_file, save_file

from ds_strategy.checkpoint.pretrained import load_weights
from ds_strategy.config import ZeroConfig
from ds_strategy.offload.host_memory import PeakRssAnon
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

# ~29 MB of fp32 weights: 8 blocks of 3.1 MB and a 4 MB embedding, so holding the model would dwarf the bound.
SHAPE = {"vocab_size": 4096, "n_embd": 256, "n_layer": 8}
MiB = 2**20
SLACK = 3 * MiB  # allocator and interpreter noise in a sampled RssAnon


def _engine(rank: int):
    model = hf_models.build("gpt2", meta=True, seed=rank + 7, **SHAPE)  # seeds differ: values must come from disk
    return model, ZeroEngine(model, hf_models.sgd(model), ZeroConfig(stage=3, param_persistence_threshold=0))


def _load_and_train(rank: int, world_size: int, path: str, damaged: str | None) -> dict:
    torch.set_num_threads(1)
    model, engine = _engine(rank)
    largest_unit = max(sum(fp.padded_numel * 4 for fp in unit.flat_params) for unit in engine.units)
    largest_tensor = max(slot.numel * 4 for fp in engine.flat_params for slot in fp.slots)
    with PeakRssAnon() as peak:
        load_weights(engine, path)
    steps = hf_models.batches(2, world_size, vocab=SHAPE["vocab_size"])
    result = {
        "growth": peak.growth,
        "bound": largest_unit + largest_tensor + SLACK,
        "model_bytes": sum(fp.numel * 4 for fp in engine.flat_params),
        "zero": hf_models.train_zero(model, engine, rank, world_size, steps),
        "ddp": hf_models.train_ddp(transformers.GPT2LMHeadModel.from_pretrained(path), rank, world_size, steps),
    }
    if damaged is not None:
        before = engine.full_state_dict(rank0_only=False)
        with pytest.raises(ValueError) as error:
            load_weights(engine, damaged)
        after = engine.full_state_dict(rank0_only=False)
        result["error"] = str(error.value)
        result["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
    return result


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``save_pretrained`` in 4 MB shards, and a one-file copy with a tensor missing, one extra, one mis-shaped."""
    root = tmp_path_factory.mktemp("pretrained")
    hf_models.build("gpt2", seed=1, **SHAPE).save_pretrained(root / "hf", max_shard_size="4MB")
    state = {}
    for file in sorted((root / "hf").glob("*.safetensors")):
        state.update(load_file(file))
    del state["transformer.h.0.ln_1.weight"]
    state["transformer.extra.weight"] = torch.zeros(3)
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:-1].clone()
    save_file(state, root / "damaged.safetensors")
    return root


@pytest.fixture(scope="module")
def two_ranks(checkpoint, monkeypatch_module):
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # see test_stage3's Note: [glibc's mmap threshold]
    return run_ranks(_load_and_train, 2, str(checkpoint / "hf"), str(checkpoint / "damaged.safetensors"), timeout=300)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_save_pretrained_wrote_several_files_with_an_index(checkpoint):
    assert len(list((checkpoint / "hf").glob("*.safetensors"))) >= 5
    assert (checkpoint / "hf" / "model.safetensors.index.json").is_file()


def test_two_ranks_load_sharded_and_train_like_ddp_on_from_pretrained(two_ranks):
    for rank in two_ranks:
        hf_models.assert_trains_like_ddp(rank["zero"], rank["ddp"])


def test_four_ranks_load_sharded_and_train_like_ddp_on_from_pretrained(checkpoint):
    for rank in run_ranks(_load_and_train, 4, str(checkpoint / "hf"), None, timeout=300):
        hf_models.assert_trains_like_ddp(rank["zero"], rank["ddp"])


def test_loading_holds_at_most_one_unit_and_one_tensor_above_the_baseline(two_ranks):
    for rank in two_ranks:
        assert rank["bound"] < rank["model_bytes"]  # the bound is meaningful: a whole-model read would break it
        assert rank["growth"] < rank["bound"], f"loading grew RssAnon by {rank['growth'] / MiB:.1f} MiB"


def test_a_checkpoint_that_does_not_fit_names_every_bad_tensor_and_changes_nothing(two_ranks):
    for rank in two_ranks:
        assert "missing: transformer.h.0.ln_1.weight" in rank["error"]
        assert "unexpected: transformer.extra.weight" in rank["error"]
        assert "mis-shaped: transformer.wpe.weight (15, 256) (model (16, 256))" in rank["error"]
        assert rank["unchanged"]
