"""``ds_strategy.deepspeed`` beside the oracle: a DeepSpeed method we lack names itself and what to use instead,
DeepSpeed's refusals are ours, ``comm`` and the argument helpers answer as DeepSpeed's, and DeepSpeed's launcher
options become torchrun's."""

import argparse
import json
import warnings

import pytest
import torch
from distributed import run_ranks, set_torchrun_environment
from e2e_runs import DS_STRATEGY, free_port, run
from test_deepspeed_config_rules import CONFIGS, HF_FILLS, NEEDS_MISSING_FEATURE, _read_quietly

import ds_strategy.deepspeed as deepspeed
from ds_strategy.deepspeed.launcher import add_deepspeed_arguments, torchrun_arguments

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def engine_behaviour(rank, world_size):
    set_torchrun_environment(rank, world_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, config={**CONFIG, "zero_optimization": {"stage": 2}}
    )
    found = {}
    try:
        engine.train_batch()
    except AttributeError as error:
        found["train_batch"] = str(error)
    try:
        engine.not_a_deepspeed_method  # noqa: B018
    except AttributeError as error:
        found["unknown"] = str(error)
    try:
        with engine.no_sync():
            pass
    except AssertionError as error:
        found["no_sync"] = str(error)
    try:
        deepspeed.initialize(model=torch.nn.Linear(4, 2), config={**CONFIG, "pipeline": {"stages": 2}})
    except (NotImplementedError, ValueError) as error:
        found["pipeline"] = str(error)
    value = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(value)
    deepspeed.comm.barrier()
    found["comm"] = (
        deepspeed.comm.get_rank(),
        deepspeed.comm.get_world_size(),
        deepspeed.comm.get_local_rank(),
        value.item(),
    )
    found["sizes"] = (engine.train_batch_size(), engine.zero_optimization_stage(), engine.fp16_enabled())
    found["returned"] = (optimizer is engine.optimizer, loader, scheduler)
    return found


def test_engine_refuses_what_it_lacks_by_name_and_answers_as_deepspeed():
    found = run_ranks(engine_behaviour, 2)
    for rank, seen in enumerate(found):
        assert "train_batch" in seen["train_batch"] and "pipeline_parallel_size" in seen["train_batch"]
        assert "not_a_deepspeed_method" in seen["unknown"] and "ds_strategy" not in seen["unknown"]
        assert "stage 2" in seen["no_sync"]
        assert "PipelineModule" in seen["pipeline"]
        assert seen["comm"] == (rank, 2, rank, 3.0)
        assert seen["sizes"] == (4, 2, False)
        assert seen["returned"] == (True, None, None)


def save_or_load(rank, world_size, path, stage, load):
    """Train 2 steps at ``stage`` and save, or (``load``) load; the whole weights and the counters after."""
    set_torchrun_environment(rank, world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = {
        "train_batch_size": 4,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    if load:
        _, client_state = engine.load_checkpoint(path)
    else:
        for _ in range(2):
            x = torch.randn(4 // world_size, 6)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        engine.save_checkpoint(path, client_state={"epoch": 3})
        client_state = {"epoch": 3}
    return engine.module_state_dict(), engine.global_steps, engine.global_samples, client_state


@pytest.mark.slow
def test_a_checkpoint_saved_on_2_ranks_at_stage_3_loads_on_1_rank_at_stage_1(tmp_path):
    saved = run_ranks(save_or_load, 2, str(tmp_path), 3, False)[0]
    loaded = run_ranks(save_or_load, 1, str(tmp_path), 1, True)[0]
    assert saved[1:] == loaded[1:] == (2, 8, {"epoch": 3})
    assert saved[0].keys() == loaded[0].keys()
    assert all(torch.equal(saved[0][name], loaded[0][name]) for name in saved[0])


def test_a_deepspeed_module_name_we_lack_says_what_to_use_instead():
    with pytest.raises(AttributeError, match="checkpointing.*torch.utils.checkpoint"):
        deepspeed.checkpointing  # noqa: B018
    assert not hasattr(deepspeed, "not_a_deepspeed_name")
    assert callable(deepspeed.zero.GatheredParameters) and callable(deepspeed.comm.barrier)


def test_add_config_arguments_adds_deepspeeds_flags():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config) == (True, "ds.json")


def _launch_args(*argv):
    parser = argparse.ArgumentParser()
    add_deepspeed_arguments(parser)
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def test_deepspeeds_launcher_options_become_torchruns(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4  # comment\nworker-2 slots=4\n")
    mapped = torchrun_arguments(
        _launch_args("--hostfile", str(hostfile), "--exclude", "worker-2", "--node_rank", "1", "t.py", "--x", "1")
    )
    assert mapped[:5] == [
        "--nnodes=2",
        "--nproc_per_node=4",
        "--node_rank=1",
        "--master_addr=worker-0",
        "--master_port=29500",
    ]
    assert mapped[5:] == ["-m", "ds_strategy.deepspeed.launcher", "t.py", "--x", "1"]
    assert torchrun_arguments(_launch_args("--num_gpus", "2", "--no_local_rank", "t.py"))[1] == "--nproc_per_node=2"
    with pytest.raises(ValueError, match="--ssh_port"):
        torchrun_arguments(_launch_args("--ssh_port", "2222", "t.py"))


@pytest.mark.slow
def test_ds_strategy_launch_runs_a_deepspeed_script_with_local_rank(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import argparse, sys\n"
        "import ds_strategy.deepspeed as deepspeed\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--local_rank', type=int, default=-1)\n"
        "parser.add_argument('--out')\n"
        "args = parser.parse_args()\n"
        "deepspeed.init_distributed()\n"
        "open(f'{args.out}.{deepspeed.comm.get_rank()}', 'w').write(\n"
        "    f'{args.local_rank} {deepspeed.comm.get_world_size()}')\n"
    )
    out = tmp_path / "seen"
    run([DS_STRATEGY, "launch", "--num_gpus", "2", "--master_port", free_port(), script, "--out", out])
    assert [(tmp_path / f"seen.{rank}").read_text() for rank in range(2)] == ["0 2", "1 2"]


def _filled(node, fills, key=None):
    """A config with its "auto" values as Hugging Face's integration fills them (a plain script writes numbers)."""
    if isinstance(node, dict):
        return {k: _filled(v, fills, k) for k, v in node.items()}
    return fills.get(key, node) if node == "auto" else node


def start_each_config(rank, world_size, configs):
    """Each config: ``initialize`` a small model under it and take one optimizer step; the configs that failed."""
    set_torchrun_environment(rank, world_size)
    fills = {**HF_FILLS, "train_batch_size": HF_FILLS["train_micro_batch_size_per_gpu"] * world_size}
    failed = {}
    for name, raw in configs.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine, *_ = deepspeed.initialize(
                    model=model,
                    model_parameters=model.parameters(),
                    config=_filled(raw, fills),
                    optimizer=None if "optimizer" in raw else torch.optim.AdamW(model.parameters(), lr=1e-3),
                )
            x = torch.randn(4, 16, dtype=torch.float16 if engine.fp16_enabled() else torch.float32)
            x = x.bfloat16() if engine.bfloat16_enabled() else x
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
            engine.destroy()
        except Exception as error:  # noqa: BLE001  reported by name below
            failed[name] = f"{type(error).__name__}: {error}"
    return failed


def _imports_today(path) -> bool:
    """Whether ds_strategy reads the config (the corpus also holds configs DeepSpeed itself rejects)."""
    try:
        _read_quietly(path)
    except ValueError:
        return False
    return path.name not in NEEDS_MISSING_FEATURE


@pytest.mark.slow
def test_every_shipped_deepspeed_config_starts_a_deepspeed_script():
    """The public projects' DeepSpeed JSONs that ds_strategy reads (tests/data/deepspeed_configs) each start a
    ``deepspeed.initialize`` script and take a step, on 2 ranks; the one asking for automatic tensor parallelism
    (``autotp_size``) refuses this model, which has no attention to split, by name, as DeepSpeed's AutoTP needs one."""
    configs = {p.stem: json.loads(p.read_text()) for p in CONFIGS if _imports_today(p)}
    assert len(configs) >= 30
    failed = run_ranks(start_each_config, 2, configs, timeout=900)[0]
    autotp = [name for name, raw in configs.items() if "autotp_size" in json.dumps(raw)]
    assert autotp and all("plan='auto' does not recognise the attention modules" in failed.pop(n) for n in autotp)
    assert failed == {}
