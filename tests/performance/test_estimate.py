"""estimate_memory reproduces the ZeRO paper's per-device figures, places offloaded states where DeepSpeed does,
and predicts what memory_report() measures on a real run to within 10%."""

import models
import pytest
import torch
from distributed import run_ranks

from ds_strategy import estimate_memory
from ds_strategy.cli import main as cli
from ds_strategy.config import ZeroConfig
from ds_strategy.estimate import ModelSize, meta_model

GB = 1e9
PSI, N = 7.5e9, 64


def test_reproduces_zero_paper_table_for_7_5b_params_on_64_devices():
    per_stage = estimate_memory(PSI, N)  # mixed-precision Adam: 2 + 2 + 12 bytes per parameter
    assert [round(per_stage[stage].device / GB, 1) for stage in (0, 1, 2, 3)] == [120.0, 31.4, 16.6, 1.9]
    assert all(e.host == e.nvme == 0 for e in per_stage.values())


def test_one_stage_returns_one_estimate_with_memory_report_layout():
    estimate = estimate_memory(PSI, N, stage=2)
    assert estimate.label == "P_os+g"
    assert estimate.bytes["params"]["device"] == 2 * PSI
    assert estimate.bytes["grads"]["device"] == 2 * PSI / N
    assert estimate.bytes["optimizer"]["device"] == 12 * PSI / N


def test_fp32_uses_4_4_8_bytes_per_parameter():
    assert estimate_memory(PSI, N, stage=0, precision="32-true").device == 16 * PSI


def test_optimizer_offload_moves_state_and_fp32_gradient_partition_to_host():
    estimate = estimate_memory(PSI, N, stage=2, offload_optimizer="cpu")
    assert estimate.device == 2 * PSI
    assert estimate.host == 12 * PSI / N + 4 * PSI / N


def test_stage3_nvme_offload_leaves_only_the_working_set_on_device():
    estimate = estimate_memory(PSI, N, stage=3, offload_optimizer="nvme", offload_params="nvme", largest_layer=10**8)
    assert estimate.device == 2 * 10**8
    assert estimate.nvme == 12 * PSI / N + 2 * PSI / N


@pytest.mark.parametrize(
    "stage, offload_optimizer, offload_params, field",
    [
        (1, "none", "cpu", "offload_params"),
        (0, "nvme", "none", "offload_optimizer"),
        (0, "cpu", "none", "offload_optimizer"),
        (4, "none", "none", "stage"),
    ],
)
def test_offload_a_stage_cannot_do_raises_naming_it(stage, offload_optimizer, offload_params, field):
    with pytest.raises(ValueError, match=field):
        estimate_memory(PSI, N, stage, offload_optimizer, offload_params)


def test_model_size_counts_a_tied_weight_once_and_finds_the_largest_unit_on_meta():
    from ds_strategy.models import GPT, gpt_config

    model = meta_model(lambda: GPT(gpt_config("small")))
    size = ModelSize.of_module(model)
    real = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert size.params == real
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert size.largest_unit == block


def test_cli_prints_the_paper_table(capsys):
    assert cli(["estimate", "--params", "7.5e9", "--world-size", "64", "--no-offload"]) == 0
    out = capsys.readouterr().out
    for figure in ("120.00 GB", "31.41 GB", "16.64 GB", "1.88 GB"):
        assert figure in out


def test_cli_lists_every_offload_mode_per_stage(capsys):
    assert cli(["estimate", "--model", "tiny", "--world-size", "2", "--stage", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 ")]
    assert len(rows) == 9  # 3 optimizer places x 3 parameter places


# -- against a real run -------------------------------------------------------------------------------------------
STAGES = (0, 1, 2, 3)
# No persistence threshold, so stage 3 really partitions the tiny GPT's parameters; a small gradient bucket, so
# reductions are waited on as they are launched and the scratch peak does not depend on how fast gloo is.
ZERO = {"param_persistence_threshold": 0, "reduce_bucket_size": 1000}


def peak_memory_report(rank: int, world_size: int, stages: tuple) -> dict:
    """Per stage, the largest memory_report() total seen in two training steps: sampled as each block starts
    its forward (a stage-3 unit is gathered then), after backward, and after the optimizer step."""
    import torch.distributed as dist

    from ds_strategy.zero.engine import ZeroEngine

    peaks = {}
    for stage in stages:
        torch.manual_seed(0)
        model = models.TinyGPT()
        optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-3)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage, **ZERO))
        samples = []
        sample = lambda *_: samples.append(engine.memory_report())  # noqa: E731
        hooks = [block.register_forward_pre_hook(sample) for block in model.blocks]
        generator = torch.Generator().manual_seed(rank)
        for _ in range(2):
            model(models.TinyGPT.make_batch(generator, 4)).backward()
            sample()
            engine.step()
            sample()
        for hook in hooks:
            hook.remove()
        engine.remove_hooks()
        peaks[stage] = max(samples, key=lambda report: sum(sum(p.values()) for p in report.values()))
        dist.barrier()
    return peaks


@pytest.fixture(scope="module")
def measured():
    return run_ranks(peak_memory_report, 2, STAGES)[0]


def _totals(report: dict) -> dict:
    return {kind: sum(places.values()) for kind, places in report.items()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_estimate_is_within_10_percent_of_peak_memory_report(measured, stage):
    estimate = estimate_memory(models.TinyGPT(), 2, stage, precision="32-true", config=ZeroConfig(stage=stage, **ZERO))
    report = _totals(measured[stage])
    assert sum(report.values()) == pytest.approx(estimate.total(), rel=0.10)
    for kind in ("grads", "optimizer"):
        assert report[kind] == pytest.approx(sum(estimate.bytes[kind].values()), rel=0.10)


@pytest.mark.slow
def test_nvme_optimizer_offload_below_stage_3_puts_the_optimizer_state_on_nvme():
    estimate = estimate_memory(PSI, N, stage=2, offload_optimizer="nvme", precision="bf16-mixed")
    assert estimate.nvme >= 12 * PSI / N
