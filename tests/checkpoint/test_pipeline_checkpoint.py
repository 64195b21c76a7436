"""Sharded checkpoints under pipeline parallelism: saved at one (pp, dp, tp) layout, loaded at another.

All layouts run in three process groups (4, 2 and 1 ranks) shared by the tests below: see
``pipeline_checkpoint_runs``. "gpt" ties its LM head (last stage) to its embedding (first stage), "llama" does
not. A checkpoint loaded and saved again at another layout must consolidate to the same bytes: the fp32 master
weights and AdamW moments travel unchanged, whatever the split.
"""

import functools
import json
import shutil

import pytest
import torch
from distributed import run_ranks
from pipeline_checkpoint_runs import run_jobs

from ds_strategy.checkpoint import consolidate

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

MODELS = ("gpt", "llama")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job's results per rank, by job name, and each checkpoint consolidated (once), by directory name."""
    root = tmp_path_factory.mktemp("pipeline_checkpoints")

    def path(name: str) -> str:
        return str(root / name)

    def save(model, layout, name, record=False):
        return ("save", model, dict(layout=layout, path=path(name), record=record))

    def load(model, layout, name, resave=None):
        return ("load", model, dict(layout=layout, path=path(name), resave=resave and path(resave)))

    four = {
        "pp2xdp2": save("gpt", dict(pp=2, stage=2), "pp2xdp2"),
        "pp2xdp2 resumed": load("gpt", dict(pp=2, stage=2), "pp2xdp2"),
        "pp2xtp2": save("gpt", dict(pp=2, tp=2), "pp2xtp2"),
    }
    two = {}
    for model in MODELS:
        two |= {
            f"{model} pp2": save(model, dict(pp=2), f"{model}-pp2", record=True),
            f"{model} pp2 resumed": load(model, dict(pp=2), f"{model}-pp2"),
            f"{model} pp2 -> dp2": load(model, dict(pp=1, stage=3), f"{model}-pp2", f"{model}-pp2-dp2"),
            f"{model} dp2": save(model, dict(pp=1, stage=2), f"{model}-dp2"),
            f"{model} dp2 -> pp2": load(model, dict(pp=2, stage=3), f"{model}-dp2", f"{model}-dp2-pp2"),
        }
    for model, schedule in (("gpt", "interleaved_1f1b"), ("llama", "zbv")):  # two stages per rank
        two |= {
            f"{model} {schedule}": save(model, dict(pp=2, schedule=schedule), f"{model}-{schedule}"),
            f"{model} {schedule} -> dp2": load(model, dict(pp=1), f"{model}-{schedule}", f"{model}-{schedule}-dp2"),
        }
    two |= {
        "pp2xdp2 -> pp2": load("gpt", dict(pp=2), "pp2xdp2", "pp2xdp2-pp2"),
        "pp2xtp2 -> dp2": load("gpt", dict(pp=1), "pp2xtp2", "pp2xtp2-dp2"),
    }
    one = {f"{model} pp2 -> dp1": load(model, dict(pp=1), f"{model}-pp2", f"{model}-pp2-dp1") for model in MODELS}
    one["without stage 1"] = ("failed_load", "gpt", dict(layout=dict(pp=1), path=path("without-stage-1")))

    results = {}
    for world_size, jobs in ((4, four), (2, two), (1, one)):
        if world_size == 1:
            shutil.copytree(path("pp2xdp2"), path("without-stage-1"))
            _drop_from_manifest(path("without-stage-1"), prefixes=("blocks.2.", "blocks.3.", "ln_f.", "lm_head."))
        per_rank = run_ranks(run_jobs, world_size, list(jobs.values()), timeout=180)
        results |= {name: [rank[i] for rank in per_rank] for i, name in enumerate(jobs)}
    return results, functools.cache(lambda name: consolidated(path(name), root / f"{name}.pt"))


def _drop_from_manifest(where: str, prefixes: tuple[str, ...]) -> None:
    """What a manifest built from stage 0 alone would say: the last stage's entries (``prefixes``) are not in it."""
    manifest_file = f"{where}/manifest.json"
    with open(manifest_file) as file:
        manifest = json.load(file)
    for table in ("entries", "optimizer_state"):
        manifest[table] = {k: v for k, v in manifest[table].items() if not k.startswith(prefixes)}
    with open(manifest_file, "w") as file:
        json.dump(manifest, file)


def consolidated(path: str, out) -> dict:
    return torch.load(consolidate(path, out, weights_only=False), weights_only=True)


def assert_same_bytes(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, dict):
            assert_same_bytes(actual[name], value)
        elif torch.is_tensor(value):
            assert torch.equal(actual[name], value), name
        else:
            assert actual[name] == value, name


def merged_state(results: list[dict], what: str) -> dict:
    return {name: value for result in results for name, value in result["state"][what].items()}


@pytest.mark.parametrize("model", MODELS)
def test_pipeline_checkpoint_consolidates_to_the_saving_runs_weights_and_optimizer_state(runs, model):
    results, consolidate_ = runs
    saved = results[f"{model} pp2"]
    whole = consolidate_(f"{model}-pp2")
    tensors = {n: v for n, v in whole["state_dict"].items() if n != "lm_head.weight" or model != "gpt"}
    assert_same_bytes(tensors, merged_state(saved, "params"))
    assert_same_bytes(whole["optimizer"]["state"], merged_state(saved, "optimizer"))
    if model == "gpt":
        assert whole["state_dict"]["lm_head.weight"] is whole["state_dict"]["embed.wte.weight"]


def test_tied_copy_is_not_written_but_holds_the_owners_optimizer_state(runs):
    """The last stage's copy of the embedding trains in lockstep with the first stage's, which the checkpoint
    stores alone (and the copy is loaded from)."""
    results, _ = runs
    first, last = results["gpt pp2"]
    assert set(last["state"]["tied"]) == {"embed.wte.weight"}
    assert_same_bytes(last["state"]["tied"], {"embed.wte.weight": first["state"]["optimizer"]["embed.wte.weight"]})


@pytest.mark.parametrize("saved", ["gpt pp2", "llama pp2", "pp2xdp2"])
def test_resuming_at_the_saving_layout_reproduces_the_next_losses_bitwise(runs, saved):
    results, _ = runs
    for uninterrupted, resumed in zip(results[saved], results[f"{saved} resumed"]):
        assert resumed["losses"] == uninterrupted["losses"]


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ("gpt pp2", "gpt pp2 -> dp2"),
        ("gpt pp2", "gpt pp2 -> dp1"),
        ("gpt dp2", "gpt dp2 -> pp2"),
        ("llama pp2", "llama pp2 -> dp2"),
        ("llama pp2", "llama pp2 -> dp1"),
        ("llama dp2", "llama dp2 -> pp2"),
        ("pp2xdp2", "pp2xdp2 -> pp2"),
        ("pp2xtp2", "pp2xtp2 -> dp2"),
        ("gpt interleaved_1f1b", "gpt interleaved_1f1b -> dp2"),
        ("llama zbv", "llama zbv -> dp2"),
    ],
)
def test_checkpoint_loads_at_another_layout_and_saves_the_same_state_again(runs, saved, loaded):
    """Loaded and saved again, the checkpoint consolidates to the same bytes; training on from it gives the
    uninterrupted run's losses up to the reduction order of the new layout."""
    results, consolidate_ = runs
    name = lambda label: label.replace(" -> ", "-").replace(" ", "-")  # noqa: E731
    assert_same_bytes(consolidate_(name(loaded)), consolidate_(name(saved)))
    expected = results[saved][0]["losses"]
    for rank in results[loaded]:
        torch.testing.assert_close(rank["losses"], expected, rtol=1e-5, atol=0)


def test_checkpoint_whose_manifest_lacks_a_stage_fails_naming_the_missing_tensors(runs):
    results, _ = runs
    (error,) = results["without stage 1"]
    assert error.startswith("CheckpointError") and "was saved from a different model" in error
    assert "missing from the checkpoint: blocks.2." in error
