"""``ds-strategy consolidate``: one state dict that loads strictly into the plain module, in the asked dtype and
format, optionally with the optimizer state by parameter name, reading one tensor at a time."""

import json
import os
import subprocess
import sys

import models
import pytest
import torch
from checkpoint_runs import saved_after_one_step
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ds_strategy.checkpoint import save
from ds_strategy.cli import main
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine


@pytest.fixture
def trained(tmp_path):
    return saved_after_one_step(tmp_path / "ckpt")


def test_bf16_safetensors_loads_strictly_with_tied_weight_copied(trained, tmp_path):
    path, model, _ = trained
    assert main(["consolidate", str(path), str(tmp_path / "model.safetensors"), "--dtype", "bf16"]) == 0
    state = load_file(tmp_path / "model.safetensors")
    plain = models.TinyGPT()
    plain.load_state_dict(state, strict=True)
    assert all(state[name].dtype == torch.bfloat16 for name in state)
    assert all(torch.equal(state[name], p.detach().to(torch.bfloat16)) for name, p in model.named_parameters())
    assert torch.equal(state["lm_head.weight"], state["embed.wte.weight"])
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ds_strategy.aliases"]) == {"lm_head.weight": "embed.wte.weight"}


def test_with_optimizer_writes_optimizer_state_by_parameter_name(trained, tmp_path):
    path, model, engine = trained
    assert main(["consolidate", str(path), str(tmp_path / "full.pt"), "--with-optimizer"]) == 0
    full = torch.load(tmp_path / "full.pt")
    fp = engine.flat_params[0]
    slot = fp.slots[0]
    state = engine.optimizer.state[fp.master]
    saved = full["optimizer"]["state"][slot.name]
    assert torch.equal(saved["exp_avg"], state["exp_avg"].narrow(0, slot.offset, slot.numel).view(slot.shape))
    assert torch.equal(saved["step"], state["step"])
    groups = full["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in engine.optimizer.param_groups]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    models.TinyGPT().load_state_dict(full["state_dict"], strict=True)


def test_pth_is_written_as_pt_is(trained, tmp_path):
    """``.pth``, torch's own suffix and litgpt's file name (``lit_model.pth``), is accepted where ``.pt`` is."""
    path, model, _ = trained
    assert main(["consolidate", str(path), str(tmp_path / "out" / "lit_model.pth")]) == 0
    models.TinyGPT().load_state_dict(torch.load(tmp_path / "out" / "lit_model.pth"), strict=True)


def test_exclude_frozen_leaves_out_parameters_that_do_not_train(tmp_path):
    model = models.FrozenParamModel()
    engine = ZeroEngine(model, torch.optim.AdamW(models.param_groups(model)), ZeroConfig(stage=2))
    save(tmp_path / "ckpt", model, engine)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), "--exclude-frozen"]) == 0
    assert list(torch.load(tmp_path / "out.pt")) == ["head.weight", "head.bias"]


def test_bad_checkpoint_is_reported_and_fails(tmp_path, capsys):
    assert main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "out.pt")]) == 1
    assert "nowhere: no such checkpoint" in capsys.readouterr().err


_MEASURE = """
import os, sys, torch
from ds_strategy.checkpoint import consolidate
def status_kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
baseline = status_kib("VmRSS")
consolidate(sys.argv[1], sys.argv[2], dtype=torch.bfloat16)
print((status_kib("VmHWM") - baseline) * 1024)
"""


def test_consolidation_peak_memory_is_output_plus_a_few_tensors_not_the_checkpoint(tmp_path):
    """24 fp32 tensors of 4 MiB (96 MiB) consolidated to bf16 (48 MiB): the process grows by the output plus a
    few copies of one tensor (read buffer, fp32 tensor, its cast), far below a whole-checkpoint load.

    Note: [Measuring peak memory]
    The peak is the high-water mark of the subprocess's own image (``VmHWM``);
    ``ru_maxrss`` would carry over the forking pytest process's size across ``exec``. glibc's dynamic mmap
    threshold lets freed tensor-sized temporaries stay in a fragmenting heap, adding tens of MiB of run-to-run
    noise; a fixed threshold makes the figure the algorithm's working set.
    """
    torch.manual_seed(0)
    save(tmp_path / "ckpt", nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(24)]))
    tensor, output, checkpoint = 4 * 2**20, 48 * 2**20, 96 * 2**20
    growth = int(
        subprocess.run(
            [sys.executable, "-c", _MEASURE, str(tmp_path / "ckpt"), str(tmp_path / "out.pt")],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
        ).stdout.split()[-1]
    )
    assert growth < output + 4 * tensor + 8 * 2**20 < checkpoint
