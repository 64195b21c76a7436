"""ZeRO-Infinity's files: the state stays out of resident memory, a bad ``nvme_path`` fails at setup naming the path
and the bytes needed, a crashed run's files are swept by the next one, offloaded state round-trips through
checkpoints, and the offload presets train through Lightning's Trainer."""

import fcntl
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_offload import build, optimizer_state, train
from torch import nn

from ds_strategy.checkpoint import load, save
from ds_strategy.config import ZeroConfig
from ds_strategy.offload import OffloadedStep, OffloadSetupError
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.groups import EngineGroups

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

WIDTH = 2560  # two 2560x2560 layers: 13.1M parameters, Adam's moments 105 MB


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def rss_growth(rank: int, world_size: int, nvme_root) -> dict:
    """Rank 0 trains with offload_optimizer="nvme", rank 1 the same with "cpu", each in its own one-rank group, at
    the same time on the same machine. Returns the resident-memory growth over 3 optimizer steps, from after the
    first backward (parameters, gradients and buckets exist by then; optimizer state does not)."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    place = (
        {"offload_optimizer": "nvme", "nvme_path": str(nvme_root), "buffer_size": 1 << 18}
        if rank == 0
        else {"offload_optimizer": "cpu"}
    )
    engine = ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters(), fused=True),
        ZeroConfig(stage=2, **place),
        EngineGroups(zero=groups[rank]),
        step_runner=OffloadedStep,
    )
    before, peak = None, 0
    for _ in range(3):
        engine.backward(model(torch.randn(4, WIDTH)).square().mean())
        before = before or _rss_bytes()
        engine.step()
        peak = max(peak, _rss_bytes())
    engine.remove_hooks()
    return {"growth": peak - before, "psi": sum(fp.master.numel() for fp in engine.flat_params)}


def test_nvme_optimizer_state_is_not_resident(tmp_path, monkeypatch):
    # glibc otherwise raises its mmap threshold as large blocks are freed and keeps later ones on the heap, which
    # then grows by a gradient bucket now and then: allocator noise the size of what is measured
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    nvme, cpu = run_ranks(rss_growth, 2, tmp_path, timeout=240)
    moments = 8 * cpu["psi"]
    assert cpu["growth"] >= 0.9 * moments  # the cpu run holds both moments in memory ...
    assert nvme["growth"] <= 0.4 * moments  # ... the nvme run its swap buffers (13 MB), not the moments (105 MB)


# -- setup errors --------------------------------------------------------------------------------------------------
def _nvme_engine(nvme_path, width: int = 8, **zero) -> ZeroEngine:
    model = nn.Linear(width, width)
    return ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters()),
        ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(nvme_path), **zero),
        step_runner=OffloadedStep,
    )


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a tmpfs with the given options (needs root); skip where mounting is not allowed."""
    mounted = []

    def mount(options: str):
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_read_only_nvme_path_fails_at_setup_naming_path_and_bytes(tmpfs):
    read_only = tmpfs("size=1M,ro")  # 16 bytes for each of the 72 elements (as below)
    with pytest.raises(
        OffloadSetupError,
        match=rf"nvme_path '{read_only}' is not writable \(Read-only file system\); "
        r"rank 0 needs 1,152 bytes \(0.00 GiB\) of NVMe offload files there",
    ):
        _nvme_engine(read_only)


def test_full_nvme_path_fails_at_setup_naming_path_and_bytes(tmpfs):
    small = tmpfs("size=64k")
    needed = 16 * (256 * 256 + 256)  # per element: fp32 master, two Adam moments and the stage-2 gradient shard
    with pytest.raises(
        OffloadSetupError,
        match=rf"nvme_path '{small}' has 65,536 bytes \(0.00 GiB\) free but rank 0 "
        rf"needs {needed:,} bytes",
    ):
        _nvme_engine(small, width=256)
    assert os.listdir(small) == []


def test_nvme_path_under_a_file_fails_at_setup(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OffloadSetupError, match=r"nvme_path '.*/file/nvme' cannot be created \(Not a directory\)"):
        _nvme_engine(tmp_path / "file" / "nvme")


# -- what a crash leaves behind --------------------------------------------------------------------------------------
def test_setup_sweeps_directories_of_dead_runs_and_keeps_live_ones(tmp_path):
    dead, live = tmp_path / "ds_strategy-offload-host-1-rank0-dead", tmp_path / "ds_strategy-offload-host-2-rank0-live"
    for directory in (dead, live):
        directory.mkdir()
        (directory / "owner.lock").touch()
        (directory / "flat0.master").write_bytes(b"\0" * 64)
    held = os.open(live / "owner.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running process holds it
    try:
        engine = _nvme_engine(tmp_path)
        own = engine.step_runner.directory.path
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, own.name])
        engine.remove_hooks()
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
    finally:
        os.close(held)


def test_files_of_a_killed_run_are_removed_by_the_next_run(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from ds_strategy.config import ZeroConfig
        from ds_strategy.offload import OffloadedStep
        from ds_strategy.zero.engine import ZeroEngine
        model = nn.Linear(8, 8)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()),
                            ZeroConfig(stage=1, offload_optimizer="nvme", nvme_path={str(tmp_path)!r}),
                            step_runner=OffloadedStep)
        print(engine.step_runner.directory.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    left = killed.stdout.strip()
    assert killed.returncode == -9 and os.path.isdir(left) and len(os.listdir(left)) == 4
    engine = _nvme_engine(tmp_path)
    assert not os.path.exists(left)
    engine.remove_hooks()


# -- checkpoints ---------------------------------------------------------------------------------------------------
RESUMES = {  # label: (config saved from, config resumed into)
    "cpu->cpu": ("stage2/cpu", "stage2/cpu"),
    "nvme->nvme": ("stage2/nvme", "stage2/nvme"),
    "nvme+params->nvme+params": ("stage3/nvme+params-nvme", "stage3/nvme+params-nvme"),
    "nvme->plain": ("stage2/nvme", "stage2"),
    "plain->nvme": ("stage2", "stage2/nvme"),
}


@pytest.mark.parametrize("label", list(RESUMES))
def test_checkpoint_of_an_offloaded_run_resumes_bit_for_bit(tmp_path, label):
    from test_offload import RUNS

    saved_as, resumed_as = RESUMES[label]
    model, engine = build(*RUNS[saved_as], nvme_path=tmp_path)
    train(model, engine, 2)
    save(tmp_path / "checkpoint", model, engine)
    losses = train(model, engine, 2, first_step=2)
    expected = optimizer_state(engine)
    engine.remove_hooks()

    model, engine = build(*RUNS[resumed_as], nvme_path=tmp_path)
    load(tmp_path / "checkpoint", model, engine)
    assert train(model, engine, 2, first_step=2) == losses
    for state, expected_state in zip(optimizer_state(engine), expected):
        for key, value in expected_state.items():
            assert torch.equal(state[key], value), key
    engine.remove_hooks()


# -- Lightning -------------------------------------------------------------------------------------------------------
def test_trainer_with_zero3_offload_preset_matches_single_process():
    from test_lightning_strategy import WORLD, _fit, _reference

    ranks = run_ranks(_fit, WORLD, "zero3_offload", timeout=180)
    reference = _reference()
    for key, value in reference.items():
        assert (ranks[0]["state"][key] - value).norm() <= 1e-5 * value.norm(), key
    memory = ranks[0]["memory"]
    assert memory["optimizer"]["device"] == 0 and memory["optimizer"]["host"] > 0
