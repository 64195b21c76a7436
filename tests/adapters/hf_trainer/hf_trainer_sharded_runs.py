"""Rank bodies for tests/adapters/hf_trainer/test_hf_trainer_sharded.py: a tiny Llama saved with ``save_pretrained`` in
several shards, trained by DDP's ``Trainer`` from ``from_pretrained`` and by ``ZeroTrainer`` at stage 3 from
``sharded_from_pretrained`` (built on meta, read sharded at ``prepare``); then greedy generation from the stage-3 model,
directly and through TRL's ``unwrap_model_for_generation``, beside generation from the saved weights in one process.
"""

from pathlib import Path

import hf_trainer_runs as runs
import torch
import transformers
from distributed import set_torchrun_environment

NEW_TOKENS = 6
# every parameter partitioned (by default this tiny model's would all stay whole, below the persistence threshold)
STAGE3 = {"stage": 3, "param_persistence_threshold": 0}


def prompts() -> torch.Tensor:
    return runs.TokenRows(2, 3).rows[:, :5]


def _train(trainer_class, model, out: Path, **trainer_kwargs):
    runs._fresh_state()
    trainer = trainer_class(
        model=model,
        args=runs.arguments(out, eval_strategy="no", save_strategy="no"),
        train_dataset=runs.TokenRows(runs.SAMPLES, 1),
        **trainer_kwargs,
    )
    trainer.train()
    return trainer


def generate(model, **kwargs) -> torch.Tensor:
    return model.generate(prompts(), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def uneven_generate(model, rank: int) -> torch.Tensor:
    return model.generate(prompts(), max_new_tokens=NEW_TOKENS - 3 * rank, do_sample=False, pad_token_id=0)


def sharded_load_and_generation(rank: int, world_size: int, pretrained: str, tmp: str) -> dict:
    """DDP from ``from_pretrained``, then ZeroTrainer stage 3 from ``sharded_from_pretrained``: logs, whether the
    model was on meta until ``prepare`` and sharded after, generations, and (rank 0) the weights it saved."""
    from trl.models.utils import unwrap_model_for_generation

    from ds_strategy.transformers import ZeroTrainer, sharded_from_pretrained

    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    ddp = _train(transformers.Trainer, model, tmp / "ddp")

    model = sharded_from_pretrained(transformers.AutoModelForCausalLM, pretrained)
    on_meta = all(p.is_meta for p in [*model.parameters(), *model.buffers()])
    trainer = _train(ZeroTrainer, model, tmp / "zero3", zero_config=STAGE3)
    engine = trainer.zero_engine
    partitioned = [p for unit in engine.units for fp in unit.partitioned for p in fp.params]
    in_layers = [p for unit in engine.units[1:] for fp in unit.partitioned for p in fp.params]
    result = {
        "ddp": runs._logged(ddp),
        "zero": runs._logged(trainer),
        "on_meta_before_prepare": on_meta,
        "sharded_after": bool(partitioned) and all(p.numel() == 0 for p in partitioned),
        "generated": generate(trainer.model, pad_token_id=0),
        # ranks that stop at different lengths: the one done first keeps running forwards until all are (synced_gpus)
        "generated_uneven": uneven_generate(trainer.model, rank),
    }
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
        result["generated_trl"] = generate(unwrapped, pad_token_id=0)
    # each decoder layer is gathered for its forward and freed after it, token by token; the root (embeddings,
    # norm, head) stays gathered until the next step, as after any forward
    result["layers_freed_after_generate"] = all(p.numel() == 0 for p in in_layers)
    with trainer.gathered_for_generation():  # each layer gathered once, held through every token's forward
        result["generated_gathered"] = generate(trainer.model, pad_token_id=0)
        result["layers_held_in_block"] = all(p.numel() > 0 for p in in_layers)
    result["layers_freed_after_block"] = all(p.numel() == 0 for p in in_layers)
    trainer.save_model(str(tmp / "final"))
    wrapped = torch.nn.ModuleDict({"inner": sharded_from_pretrained(transformers.AutoModelForCausalLM, pretrained)})
    try:
        trainer.accelerator.prepare(wrapped)
    except ValueError as error:  # its names are not the checkpoint's: never left randomly initialised
        result["wrapped_error"] = str(error)
    return result
