"""The default working set is bounded by units, not by elements: ``memory_report(peak=True)`` over a training step
stays within the ZeRO formula x 1.05 + the two largest units' parameter bytes + two reduction buckets' gradient
bytes (a bucket: the largest unit, at least 2**18 elements; Note: [Buckets span units]), for stages 1-3, on a
Hugging Face GPT-2 and on our GPT, also when every reduction is made slow on purpose (so the bound holds by
design, not by timing). DeepSpeed's element-count default, given explicitly, exceeds it under the same delay:
the check can fail."""

import time

import pytest
import torch
from distributed import run_ranks

from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig, weight_decay_groups
from ds_strategy.zero.buckets import MIN_BUCKET_NUMEL
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

STAGES = (1, 2, 3)
SLOW_S = 0.02


def _formula(stage: int, psi: int, n: int) -> float:
    """The ZeRO paper's model-state bytes per rank for fp32 Adam (see ds_strategy.zero.memory_report)."""
    return {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


class _Slow:
    """A collective that never reports itself done early and sleeps before its wait: reductions lag backward."""

    def __init__(self, pending):
        self.pending = pending

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        time.sleep(SLOW_S)
        self.pending.wait()

    def then(self, fn) -> "_Slow":
        self.pending.then(fn)
        return self


def _slow_down(engine: ZeroEngine) -> None:
    for name in ("all_reduce", "reduce_scatter"):
        method = getattr(engine.collectives, name)
        setattr(engine.collectives, name, lambda *args, method=method, **kwargs: _Slow(method(*args, **kwargs)))


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=1024,
        n_positions=64,
        n_embd=256,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    return model, lambda x: model(input_ids=x, labels=x).loss


def _our_gpt():
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=192))
    return model, lambda x: model(x, x)[1]


def peak_against_bound(rank: int, world_size: int, jobs: list[tuple[str, int, bool, dict]]) -> list[dict]:
    """For each (model, stage, slow, zero options): the peak model-state bytes of the second step, the formula
    and the two largest units' bytes."""
    results = []
    for model_name, stage, slow, options in jobs:
        torch.manual_seed(0)
        model, loss_of = {"hf-gpt2": _hf_gpt2, "gpt": _our_gpt}[model_name]()
        optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-3)
        engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage, **options))
        if slow:
            _slow_down(engine)
        generator = torch.Generator().manual_seed(rank)
        for step in range(2):
            if step == 1:  # the optimizer state exists from the first step on
                engine.working_set.reset()
            engine.backward(loss_of(torch.randint(0, 192, (1, 32), generator=generator)))
            engine.step()
        peak = sum(sum(places.values()) for places in engine.memory_report(peak=True).values())
        psi = sum(fp.numel for fp in engine.flat_params)
        units = sorted(unit.numel for unit in engine.units)[-2:]
        buckets = 2 * max(MIN_BUCKET_NUMEL, units[-1])  # the default's, whatever the job sets
        results.append(
            {
                "job": (model_name, stage, slow),
                "peak": peak,
                "formula": _formula(stage, psi, world_size),
                "two_units": 4 * sum(units) + 4 * buckets,
            }
        )
        engine.remove_hooks()
    return results


@pytest.fixture(scope="module")
def measured():
    # every stage slowed; quiet only at stage 3, whose gathers depend on timing too
    jobs = [
        (model, stage, slow, {})
        for model in ("hf-gpt2", "gpt")
        for stage in STAGES
        for slow in (False, True)
        if slow or stage == 3
    ]
    jobs.append(("gpt", 2, True, {"reduce_bucket_size": 500_000_000}))
    results = run_ranks(peak_against_bound, 2, jobs, timeout=300)
    return {(job[0], job[1], job[2], bool(job[3])): r for job, r in zip(jobs, results[0])}


@pytest.mark.parametrize("model", ("hf-gpt2", "gpt"))
def test_peak_model_states_within_formula_plus_two_units(measured, model):
    for (name, stage, slow, explicit), r in measured.items():
        if name == model and not explicit:
            assert r["peak"] <= 1.05 * r["formula"] + r["two_units"], (stage, slow, r)


def test_deepspeed_bucket_size_given_explicitly_exceeds_the_bound_when_reductions_lag(measured):
    r = measured[("gpt", 2, True, True)]
    assert r["peak"] > 1.05 * r["formula"] + r["two_units"], r
