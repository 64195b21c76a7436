"""``ds_strategy.deepspeed`` beside the oracle: a DeepSpeed method we lack names itself and what to use instead,
DeepSpeed's refusals are ours, ``comm`` and the argument helpers answer as DeepSpeed's, and DeepSpeed's launcher
options become torchrun's."""

import argparse

import pytest
import torch
from distributed import run_ranks, set_torchrun_environment
from e2e_runs import DS_STRATEGY, free_port, run

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
