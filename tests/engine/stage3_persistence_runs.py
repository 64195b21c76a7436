"""Rank bodies for tests/engine/test_stage3_persistence.py: stage 3 at every kind of persistence threshold, on Hugging
Face models nobody here wrote, against DDP on the same batches.

Models: the composition matrix's Llama (tests/parallel/composition_runs.py), GPT-2 (tied head, ``Conv1D``), Mixtral (a
mixture of experts), a tiny T5 (encoder-decoder, a relative-attention bias in the first block of each stack, and blocks
held in a ``ModuleList``, the container that used to become a unit) and BERT (its embeddings a unit by
``_no_split_modules``, their word embedding tied to the MLM head outside every unit). Thresholds: 0 (everything
partitioned), ``"auto"`` (10 x hidden size, what transformers' stock ZeRO-3 JSON asks for), one that splits a block into
persistent and partitioned parameters (the size of the last block's largest parameter: every smaller one stays whole),
and one above every parameter (everything persistent).
"""

import composition_runs
import hf_models
import pipeline_runs
import torch
import transformers

from ds_strategy.config import ZeroConfig
from ds_strategy.config.auto_values import hidden_size_of
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.wrap_policy import select_unit_modules

STEPS = 2
T5 = {
    "vocab_size": hf_models.VOCAB,
    "d_model": 16,
    "d_kv": 8,
    "d_ff": 32,
    "num_layers": 2,
    "num_heads": 4,
    "dropout_rate": 0.0,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}


BERT = {
    "vocab_size": hf_models.VOCAB,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": hf_models.SEQ,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def _build(name: str) -> torch.nn.Module:
    if name == "matrix llama":
        return composition_runs.build_model(seed=0)
    torch.manual_seed(0)
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**BERT))
    return hf_models.build(name, seed=0)


MODELS = ("matrix llama", "gpt2", "mixtral", "t5", "bert")


def _block_splitting_threshold(model: torch.nn.Module) -> int:
    """The size of the largest parameter of the last block: it is partitioned, the smaller ones persist."""
    *_, (_, block) = select_unit_modules(model)
    return max(p.numel() for p in block.parameters())


def thresholds_match_ddp(rank: int, world_size: int) -> dict:
    """For each model, DDP's losses and parameters and, for each threshold, stage 3's; whether some unit held
    persistent and partitioned parameters together, and the unit classes."""
    torch.set_num_threads(1)
    steps = hf_models.batches(STEPS, world_size, vocab=min(hf_models.VOCAB, pipeline_runs.VOCAB))
    results = {}
    for name in MODELS:
        model = _build(name)
        ddp = hf_models.train_ddp(model, rank, world_size, steps)
        thresholds = {0: 0, "auto": "auto", "split": _block_splitting_threshold(model), "all": 10**9}
        runs = {}
        for label, threshold in thresholds.items():
            model = _build(name)
            config = ZeroConfig(stage=3, param_persistence_threshold=threshold).resolve_auto(hidden_size_of(model))
            engine = ZeroEngine(model, hf_models.sgd(model), config)
            runs[label] = {
                "trained": hf_models.train_zero(model, engine, rank, world_size, steps),
                "threshold": config.param_persistence_threshold,
                "mixed_unit": any(
                    unit.partitioned and len(unit.partitioned) < len(unit.flat_params) for unit in engine.units[1:]
                ),
                "unit_classes": sorted({type(unit.module).__name__ for unit in engine.units[1:]}),
            }
        results[name] = {"ddp": ddp, "runs": runs}
    return results
