"""Rank bodies for tests/adapters/hf_trainer/test_hf_sharded_loading.py: models built sharded from checkpoints
``save_pretrained`` wrote (and from a config), prepared at stage 3 with every parameter partitioned, against
transformers' own ``from_pretrained``/``from_config`` in one process, bitwise.
"""

from pathlib import Path

import hf_models
import hf_trainer_runs as runs
import torch
import transformers
from distributed import set_torchrun_environment

SEED = 21
ADDED = 3
STAGE3 = {"stage": 3, "param_persistence_threshold": 0}
QWEN3_MOE = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 16,
}


def save_checkpoints(root: Path) -> None:
    """A tiny Qwen3-MoE (per-expert names in the files), GPT-2 (tied head) and a Llama base model (no ``model.``
    prefix, no head), each by ``save_pretrained`` in several files."""
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)).save_pretrained(
        root / "qwen3_moe", max_shard_size="20KB"
    )
    hf_models.build("gpt2", seed=4).save_pretrained(root / "gpt2", max_shard_size="20KB")
    torch.manual_seed(5)
    transformers.LlamaModel(hf_models.config("llama")).save_pretrained(root / "llama_base", max_shard_size="20KB")


def _load(model_class, path: Path, resize: int | None, **kwargs):
    """``from_pretrained`` then (optionally) ``resize_token_embeddings`` from one generator state; the model, its
    loading report and the generator's state after both."""
    torch.manual_seed(SEED)
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    if resize is not None:
        model.resize_token_embeddings(model.config.vocab_size + resize)
    return model, info, torch.get_rng_state()


CASES = {
    "qwen3_moe": (transformers.AutoModelForCausalLM, "qwen3_moe", None),
    "gpt2_resized": (transformers.AutoModelForCausalLM, "gpt2", ADDED),
    "llama_base_to_causal_lm_resized": (transformers.LlamaForCausalLM, "llama_base", ADDED),
}


def sharded_equals_from_pretrained(rank: int, world_size: int, root: str) -> dict:
    """For each case: whether every tensor the engine gathers equals ``from_pretrained``'s bitwise, the reports, and
    the generator after building (and after ``prepare``, which must not move it)."""
    from ds_strategy.accelerate import ZeroAccelerator
    from ds_strategy.transformers import sharded_from_pretrained

    set_torchrun_environment(rank, world_size)
    results = {}
    for case, (model_class, folder, resize) in CASES.items():
        want, want_info, want_rng = _load(model_class, Path(root, folder), resize)
        torch.manual_seed(SEED)
        model, info = sharded_from_pretrained(model_class, Path(root, folder), output_loading_info=True)
        if resize is not None:
            model.resize_token_embeddings(model.config.vocab_size + resize)
        rng_built = torch.get_rng_state()
        on_meta = all(t.is_meta for t in [*model.parameters(), *model.buffers()])
        runs._fresh_state()
        accelerator = ZeroAccelerator(STAGE3)
        model = accelerator.prepare(model)
        got = accelerator.engine_of(model).full_state_dict(rank0_only=False)
        expected = want.state_dict()
        results[case] = {
            "names": sorted(got) == sorted(expected),
            "unequal": sorted(k for k, v in expected.items() if k in got and not torch.equal(got[k], v)),
            "reports": (info, want_info),
            "rng": torch.equal(rng_built, want_rng) and torch.equal(torch.get_rng_state(), want_rng),
            "on_meta": on_meta,
        }
    results["from_config"] = _from_config_under_stage3_arguments(Path(root))
    return results


def _from_config_under_stage3_arguments(tmp: Path) -> dict:
    """``from_config`` under ``ZeroTrainingArguments`` at stage 3: built on meta, prepared into a normal build's
    values from the same seed."""
    from ds_strategy.accelerate import ZeroAccelerator
    from ds_strategy.transformers import ZeroTrainingArguments, build_hook

    config = hf_models.config("mixtral")
    torch.manual_seed(SEED)
    want = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    runs._fresh_state()
    args = runs.arguments(
        tmp / "from_config", config_class=ZeroTrainingArguments, deepspeed={"zero_optimization": STAGE3}
    )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config)
    on_meta = all(p.is_meta for p in model.parameters())
    build_hook.disarm(args)
    runs._fresh_state()
    accelerator = ZeroAccelerator(STAGE3)
    got = accelerator.engine_of(accelerator.prepare(model)).full_state_dict(rank0_only=False)
    return {"on_meta": on_meta, "unequal": sorted(k for k, v in want.items() if not torch.equal(got[k], v))}
