"""What the GPU suite trains and how it counts: Llama-shaped models from configs, one training run of any system
(plain PyTorch, FSDP2 or ZeRO) and the FLOP formulas. Shared by ``gpu_suite.py`` and ``two_ranks.py``.

Note: [A compiled row that runs eager]
``module.compile()`` falls back to eager without failing when dynamo cannot trace a frame, and every system of a run
shares dynamo's caches (and its recompilation limit), so a "+compile" row could silently measure eager code, or
code compiled for the previous system. So each compiled run starts from ``torch._dynamo.reset()``, compiles through
a backend that counts the frames it compiles (``CompileCounterWithBackend``), and reports ``compiled_frames`` and
``graph_breaks``: a run that compiled no frame is not a compiled run.
"""

from __future__ import annotations

import time

import torch
import transformers
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from ds_strategy.config import ZeroConfig
from ds_strategy.offload import step_runner_for
from ds_strategy.precision import autocast_for
from ds_strategy.zero.engine import ZeroEngine

LLAMA = {"num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CORRECT_SHAPES = {
    "tiny": {**TINY, "num_hidden_layers": 2},
    "full": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4},
}
SPEED_SHAPES = {
    "tiny": ({**TINY, "num_hidden_layers": 2}, 2, 64),
    "full": ({"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 18}, 4, 2048),  # (shape, b, s)
}
LEARNING_RATES = {"adamw": 3e-3, "sgd": 0.05}


# -- models and formulas ----------------------------------------------------------------------------------------
def llama_config(shape: dict, seq: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        **{**LLAMA, **shape}, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False
    )


def build_llama(config: transformers.LlamaConfig, device: str | torch.device = "cpu", seed: int = 0):
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def matmul_params(config: transformers.LlamaConfig, total_params: int) -> int:
    """N of the FLOP formula: every parameter but the input embedding table, which is looked up, not multiplied."""
    return total_params - config.vocab_size * config.hidden_size


def train_flops(n_matmul: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Model FLOPs of one training step on ``tokens`` tokens (forward and backward): 6 N T + 12 L H S T."""
    return 6.0 * n_matmul * tokens + 12.0 * layers * hidden * seq * tokens


def mfu(flops_per_step: float, step_s: float, peak_flops: float | None) -> float | None:
    return None if not peak_flops else flops_per_step / step_s / peak_flops


def activation_bytes(config: transformers.LlamaConfig, batch: int, seq: int) -> int:
    """Activations kept for backward, bf16, no checkpointing: ~34 S B H per layer (Korthikanti et al. 2022, with
    a fused attention kernel) and the logits in bf16 and fp32 with their gradient, 10 S B V."""
    sbh = seq * batch * config.hidden_size
    return 34 * sbh * config.num_hidden_layers + 10 * seq * batch * config.vocab_size


# -- one training run -------------------------------------------------------------------------------------------
def token_batch(config: transformers.LlamaConfig, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_layers(model, device: torch.device) -> CompileCounterWithBackend:
    """Compile each decoder layer afresh (see [A compiled row that runs eager]); the counter of compiled frames."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("inductor" if device.type == "cuda" else "aot_eager")
    for layer in model.model.layers:
        layer.compile(backend=counter)
    return counter


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":  # its update scales with the gradient: a wrong gradient scale shows
        return torch.optim.SGD(params, lr=LEARNING_RATES[name], momentum=0.9)
    return torch.optim.AdamW(params, lr=LEARNING_RATES[name])


def train(
    system: dict,
    config,
    device: torch.device,
    batch: int,
    seq: int,
    steps: int,
    warmup: int = 0,
    exact: bool = True,
    taken: list[bool] | None = None,
    keep_params: bool = False,
) -> dict:
    """Build ``system`` (``kind``: torch, fsdp2 or zero, with ``precision``, ``optimizer`` (adamw or sgd),
    ``compile`` and ZeRO options) on a fresh Llama, train ``warmup + steps`` steps on one batch; losses, step times,
    peak allocated bytes, which steps were taken (ZeRO's fp16 loss scaling skips some) and, with ``keep_params``,
    every parameter in fp32 on the host. ``taken``: take only those steps (a reference replaying another run's
    skips). ``exact``: every system starts from the same weights, built on the host; else each is built where it is
    fastest (ZeRO from the meta device, unit by unit on the device; the others on the device itself)."""
    system = dict(system)
    kind, precision = system.pop("kind"), system.pop("precision")
    compiled, optimizer_name = system.pop("compile", False), system.pop("optimizer", "adamw")
    model = build_llama(config, "cpu" if exact else "meta" if kind == "zero" else device)
    counter = compile_layers(model, device) if compiled else None
    engine = None
    if kind == "zero":
        pin = device.type == "cuda" and any(
            system.get(k, "none") != "none" for k in ("offload_optimizer", "offload_params")
        )
        zero = ZeroConfig(**system, precision=precision, pin_memory=pin)
        optimizer = _optimizer(optimizer_name, model.parameters())
        engine = ZeroEngine(model, optimizer, zero, device=device, step_runner=step_runner_for(zero))
        backward, step = engine.backward, engine.step
    else:
        model.to(device)
        if kind == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            precision = "32-true"  # FSDP2 casts itself
        optimizer = _optimizer(optimizer_name, model.parameters())
        scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

        def backward(loss):
            (scaler.scale(loss) if scaler else loss).backward()

        def step():
            scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return True

    ids = token_batch(config, batch, seq, device)
    losses, times, stepped = [], [], []
    for index in range(warmup + steps):
        if index == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        started = time.perf_counter()
        with autocast_for(precision, device.type):
            loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        if taken is None or taken[index]:
            stepped.append(step() is not False)
        else:  # the run replayed skipped this step: drop the gradients, as its overflow did
            (engine.zero_grad if engine is not None else lambda: optimizer.zero_grad(set_to_none=True))()
            stepped.append(False)
        synchronize(device)
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    result = {
        "losses": losses,
        "times": times[warmup:],
        "stepped": stepped,
        "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if counter is not None:
        result["compiled_frames"] = counter.frame_count
        result["graph_breaks"] = sum(counters["graph_break"].values())
    if keep_params:
        state = engine.full_state_dict(rank0_only=False) if engine is not None else model.state_dict()
        result["weights"] = torch.cat([v.detach().float().cpu().reshape(-1) for v in state.values()])
    pinned = getattr(engine.step_runner, "pinned", None) if engine is not None else None
    if pinned is not None:  # Note: [Pinned host memory is bounded] in ds_strategy.offload.pinned
        mib = 2**20
        result["pinned"] = {"pinned_mib": pinned.pinned_bytes / mib, "left_pageable_mib": pinned.refused_bytes / mib}
    if engine is not None:
        engine.remove_hooks()
    return result
