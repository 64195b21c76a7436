"""Expert parallelism under the Hugging Face Trainer: ``ZeroTrainer`` with ``expert_parallel_size=2`` on 4 gloo ranks
trains a Qwen3-MoE from a small config as DDP's ``transformers.Trainer`` does (logged losses and gradient norms),
and ``save_model`` writes every expert in the layout ``from_pretrained`` reads."""

from pathlib import Path

import hf_trainer_runs as runs
import moe_models
import pytest
import torch
import transformers
from distributed import run_ranks, set_torchrun_environment

pytestmark = pytest.mark.slow  # a 4-rank scenario of tens of seconds: not in the fast tier

QUIET = {"eval_strategy": "no", "save_strategy": "no", "max_steps": 3}


def _model() -> torch.nn.Module:
    model = moe_models.build("qwen3_moe")
    model.config.use_cache = False
    return model


def ddp_and_expert_parallel(rank: int, world_size: int, tmp: str) -> dict:
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    return {
        "ddp": runs.train(transformers.Trainer, tmp / "ddp", arg_changes=QUIET, model=_model),
        "ep": runs.train(
            ZeroTrainer,
            tmp / "ep",
            arg_changes=QUIET,
            model=_model,
            zero_config={"stage": 3, "expert_parallel_size": 2},
        ),
    }


def test_zero_trainer_with_expert_parallelism_trains_and_saves_as_ddp(tmp_path):
    results = run_ranks(ddp_and_expert_parallel, 4, str(tmp_path), timeout=600)[0]
    ddp, ep = results["ddp"], results["ep"]
    for figure in ("loss", "grad_norm"):
        assert ep["logged"][figure].keys() == ddp["logged"][figure].keys()
        for step, value in ddp["logged"][figure].items():
            assert ep["logged"][figure][step] == pytest.approx(value, rel=1e-4), (figure, step)
    # save_pretrained writes one tensor per expert ("experts.3.up_proj.weight"); from_pretrained fuses them again
    for files in ("saved", "reloaded"):
        assert ep[files].keys() == ddp[files].keys()
        for key, value in ddp[files].items():
            assert ep[files][key].shape == value.shape, key  # every expert, not this rank's
            assert (ep[files][key] - value).norm() <= 1e-5 * value.norm() + 1e-6, key
