"""ZeRO-Offload and ZeRO-Infinity on real gloo ranks and real files train bit for bit like the same stage without
offload, keep their NVMe files where and as large as they should be (and out of resident memory), and remove them.

Bitwise, not approximately: the runs without offload step ``torch.optim.AdamW(fused=True)``, whose CPU kernel is
the one ``CpuAdam`` runs tile by tile, and every other step of training is the same code on the same values. The
learning rate is changed on the user's optimizer every step, so a host step that missed it would diverge.
"""

import contextlib
import os

import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.offload import step_runner_for
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

STEPS, ACCUMULATE, GLOBAL_BATCH = 3, 2, 8
NVME = {"buffer_size": 1024, "buffer_count": 3}  # many sub-groups per shard: the pipeline really streams

# name: (stage, ZeroConfig fields, optimizer); each offloaded run is compared with the run named after its stage
RUNS = {
    "stage1": (1, {}, "AdamW"),
    "stage1/cpu": (1, {"offload_optimizer": "cpu"}, "AdamW"),
    "stage1/nvme": (1, {"offload_optimizer": "nvme", **NVME}, "AdamW"),
    "stage2": (2, {}, "AdamW"),
    "stage2/cpu": (2, {"offload_optimizer": "cpu"}, "AdamW"),
    "stage2/nvme": (2, {"offload_optimizer": "nvme", **NVME}, "AdamW"),
    "stage2/cpu-half": (2, {"offload_optimizer": "cpu", "offload_ratio": 0.5}, "AdamW"),
    "stage3": (3, {"param_persistence_threshold": 0}, "AdamW"),
    "stage3/cpu": (3, {"param_persistence_threshold": 0, "offload_optimizer": "cpu"}, "AdamW"),
    "stage3/nvme": (3, {"param_persistence_threshold": 0, "offload_optimizer": "nvme", **NVME}, "AdamW"),
    "stage3/cpu+params-cpu": (
        3,
        {"param_persistence_threshold": 0, "offload_optimizer": "cpu", "offload_params": "cpu"},
        "AdamW",
    ),
    "stage3/nvme+params-nvme": (
        3,
        {"param_persistence_threshold": 0, "offload_optimizer": "nvme", "offload_params": "nvme", **NVME},
        "AdamW",
    ),
    "stage3/params-nvme": (3, {"param_persistence_threshold": 0, "offload_params": "nvme"}, "AdamW"),
    "stage2-bf16": (2, {"precision": "bf16-mixed"}, "AdamW"),
    "stage2-bf16/cpu": (2, {"precision": "bf16-mixed", "offload_optimizer": "cpu"}, "AdamW"),
    "stage2-bf16/nvme": (2, {"precision": "bf16-mixed", "offload_optimizer": "nvme", **NVME}, "AdamW"),
    "stage2-rmsprop": (2, {}, "RMSprop"),
    "stage2-rmsprop/cpu": (2, {"offload_optimizer": "cpu"}, "RMSprop"),
}


def build(stage: int, zero: dict, optimizer: str, nvme_path=None):
    torch.manual_seed(0)
    model = models.TinyGPT()
    groups = models.param_groups(model)
    if optimizer == "AdamW":
        opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, fused=True)
    else:
        opt = getattr(torch.optim, optimizer)(groups, lr=1e-3)
    needs_path = "nvme" in (zero.get("offload_optimizer"), zero.get("offload_params"))
    config = ZeroConfig(stage=stage, **zero, **({"nvme_path": str(nvme_path)} if needs_path else {}))
    return model, ZeroEngine(model, opt, config, step_runner=step_runner_for(config))


def train(model, engine: ZeroEngine, steps: int, first_step: int = 0, after_first_step=None) -> list[float]:
    """Accumulated, clipped steps on the same global batches for any world size; the learning rate is set on the
    user's optimizer object before every step."""
    rows = GLOBAL_BATCH // engine.world_size
    generator = torch.Generator().manual_seed(1234)
    batches = [
        [models.TinyGPT.make_batch(generator, GLOBAL_BATCH) for _ in range(ACCUMULATE)]
        for _ in range(first_step + steps)
    ][first_step:]
    losses = []
    for step, micro_batches in enumerate(batches, start=first_step):
        total = torch.zeros(())
        for micro, batch in enumerate(micro_batches):
            with engine.no_sync() if micro < ACCUMULATE - 1 else contextlib.nullcontext():
                loss = model(tuple(t[engine.rank * rows : (engine.rank + 1) * rows] for t in batch)) / ACCUMULATE
                engine.backward(loss)
            total += loss.detach().float()
        for group in engine.optimizer.param_groups:
            group["lr"] = 1e-2 * 0.7**step
        engine.clip_grad_norm_(1.0)
        engine.step()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / engine.world_size)
        if after_first_step is not None and step == first_step:
            after_first_step()
    return losses


def nvme_observation(engine: ZeroEngine) -> dict:
    """The rank's NVMe directory, its files' sizes, and how many optimizer shard elements were offloaded there."""
    directory, hosts = engine.step_runner.directory.path, engine.step_runner.hosts
    return {
        "directory": directory,
        "files": {name: os.path.getsize(directory / name) for name in os.listdir(directory) if name != "owner.lock"},
        "shard": sum(fp.master.numel() for host in hosts for fp in host.flat_params),
    }


def optimizer_state(engine: ZeroEngine) -> list[dict[str, torch.Tensor]]:
    """This rank's master and optimizer state per flat parameter, copied (NVMe ones are read through their maps)."""
    return [
        {"master": fp.master.clone(), **{k: v.clone() for k, v in engine.optimizer.state[fp.master].items()}}
        for fp in engine.flat_params
    ]


def train_runs(rank: int, world_size: int, names: list[str], nvme_root) -> dict:
    """Each named run on this rank: losses, full parameters, this rank's optimizer state, memory report, setup
    summary, and for NVMe runs the files seen after the first step and whether they outlived teardown."""
    torch.set_num_threads(1)
    results = {}
    for name in names:
        model, engine = build(*RUNS[name], nvme_path=nvme_root)
        seen = {}
        uses_nvme = getattr(engine.step_runner, "directory", None) is not None
        observe = (lambda: seen.update(nvme_observation(engine))) if uses_nvme else None
        losses = train(model, engine, STEPS, after_first_step=observe)
        results[name] = {
            "losses": losses,
            "params": engine.full_state_dict(rank0_only=False),
            "state": optimizer_state(engine),
            "memory": engine.memory_report(),
            "summary": engine.summary(),
            **seen,
        }
        engine.remove_hooks()
        if "directory" in seen:
            results[name]["directory_after_teardown"] = seen["directory"].exists()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(train_runs, 2, list(RUNS), tmp_path_factory.mktemp("nvme"), timeout=300)


def _assert_identical(run: dict, base: dict) -> None:
    assert run["losses"] == base["losses"]
    for name, value in base["params"].items():
        assert torch.equal(run["params"][name], value), name
    for fp_state, fp_base in zip(run["state"], base["state"]):
        assert fp_state.keys() == fp_base.keys()
        for key, value in fp_base.items():
            assert torch.equal(fp_state[key].to(value.device), value), key


@pytest.mark.parametrize("name", [name for name in RUNS if "/" in name])
def test_offloaded_run_matches_the_same_stage_without_offload_bitwise(runs, name):
    for rank in runs:
        _assert_identical(rank[name], rank[name.split("/")[0]])


@pytest.mark.parametrize("name", ["stage1/nvme", "stage2/nvme", "stage3/nvme", "stage2-bf16/nvme"])
def test_nvme_files_hold_master_and_adam_moments_12_bytes_per_shard_element(runs, name):
    for rank in runs:
        files = rank[name]["files"]
        state = {n: size for n, size in files.items() if not n.endswith(".grad")}
        assert sorted({n.rsplit(".", 1)[1] for n in state}) == ["exp_avg", "exp_avg_sq", "master"]
        assert sum(state.values()) == 12 * rank[name]["shard"]
        # partitioned gradient shards (stage 2/3) are reduced straight into their own files
        assert any(n.endswith(".grad") for n in files) == (not name.startswith("stage1"))
        assert rank[name]["memory"]["optimizer"]["nvme"] == 12 * rank[name]["shard"]
        assert rank[name]["memory"]["optimizer"]["device"] == 0


@pytest.mark.parametrize("name", ["stage1/nvme", "stage3/nvme+params-nvme", "stage3/params-nvme"])
def test_nvme_directory_is_private_to_the_rank_and_gone_after_teardown(runs, name):
    directories = [rank[name]["directory"] for rank in runs]
    assert len(set(directories)) == len(runs)
    assert all(d.name.startswith("ds_strategy-offload-") for d in directories)
    assert not any(rank[name]["directory_after_teardown"] for rank in runs)


def test_memory_report_places_offloaded_state_on_host_and_nvme(runs):
    rank = runs[0]
    assert rank["stage2"]["memory"]["optimizer"]["host"] == 0
    cpu = rank["stage2/cpu"]["memory"]
    assert cpu["optimizer"]["device"] == 0
    assert cpu["optimizer"]["host"] == rank["stage2"]["memory"]["optimizer"]["device"]
    assert cpu["grads"]["host"] > 0
    params = rank["stage3/nvme+params-nvme"]["memory"]["params"]
    assert params["nvme"] == 4 * sum(fp_state["master"].numel() for fp_state in rank["stage3"]["state"])
    assert rank["stage3/cpu+params-cpu"]["memory"]["params"]["host"] == params["nvme"]


def test_setup_summary_says_where_state_lives(runs):
    summary = runs[0]["stage3/nvme+params-nvme"]["summary"]
    assert "optimizer state of" in summary and "on nvme (CpuAdam Adam kernels)" in summary
    assert "parameter shards on nvme" in summary and "ds_strategy-offload-" in summary
    assert "torch RMSprop" in runs[0]["stage2-rmsprop/cpu"]["summary"]
