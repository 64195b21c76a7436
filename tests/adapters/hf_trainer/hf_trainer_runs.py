"""Rank bodies for tests/adapters/hf_trainer/test_hf_trainer*.py: a tiny ``LlamaForCausalLM`` (built from a config, no
downloads) trained by ``transformers.Trainer`` or TRL's SFT, DPO and GRPO trainers (DDP, the reference) and by their
ZeRO counterparts on the same data and arguments, with accumulation 2, clipping at 1.0, and evaluation and checkpoints
every 3 of 6 steps.

Each body returns what the Trainer logged (training losses, gradient norms, evaluation losses, per step) and, from
rank 0, the weights ``save_model`` wrote, so the test compares runs figure by figure.
"""

import os
from pathlib import Path

import hf_models
import torch
import transformers
from accelerate.state import AcceleratorState, GradientState
from distributed import set_torchrun_environment
from safetensors.torch import load_file

WORLD, PER_DEVICE, ACCUMULATION, STEPS, EVERY = 2, 2, 2, 6, 3
SAMPLES = WORLD * PER_DEVICE * ACCUMULATION * STEPS


class TokenRows(torch.utils.data.Dataset):
    """Fixed random token rows (no padding, every label counts), the same in every process."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, hf_models.VOCAB, (count, hf_models.SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def arguments(out: Path, per_device: int = PER_DEVICE, config_class=None, **changes) -> transformers.TrainingArguments:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=EVERY,
        save_strategy="steps",
        save_steps=EVERY,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_only_model=False,
    )
    settings.update(changes)
    return (config_class or transformers.TrainingArguments)(**settings)


def _model() -> transformers.PreTrainedModel:
    return hf_models.build("llama")


def _fresh_state() -> None:
    """Accelerate's process-wide singletons, as a new script would find them."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _logged(trainer) -> dict:
    history = trainer.state.log_history
    return {
        "loss": {e["step"]: e["loss"] for e in history if "loss" in e},
        "grad_norm": {e["step"]: float(e["grad_norm"]) for e in history if "grad_norm" in e},
        "eval_loss": {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e},
    }


def _saved(out: Path, name: str = "model.safetensors") -> dict:
    return {key: value.clone() for key, value in load_file(out / name).items()}


def _with_lora(model: transformers.PreTrainedModel, targets: tuple[str, ...]):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(targets)))


def train(trainer_class, out: Path, resume: str | None = None, arg_changes=None, **trainer_kwargs) -> dict:
    """One Trainer run (``arg_changes`` to ``arguments``); its logs, and on rank 0 the weights ``save_model`` wrote
    and those ``from_pretrained`` reads back from them."""
    _fresh_state()
    args = arguments(out, **(arg_changes or {}))
    lora = trainer_kwargs.pop("lora", None)
    build = trainer_kwargs.pop("model", _model)
    trainer = trainer_class(
        model=build() if lora is None else _with_lora(build(), lora),
        args=args,
        train_dataset=trainer_kwargs.pop("train_dataset", TokenRows(SAMPLES, 1)),
        eval_dataset=trainer_kwargs.pop("eval_dataset", TokenRows(8, 2)),
        **trainer_kwargs,
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    result = {"logged": _logged(trainer), "best": trainer.state.best_model_checkpoint}
    result["scheduler_steps"] = trainer.lr_scheduler.last_epoch  # Trainer skips it after a skipped optimizer step
    engine = getattr(trainer, "zero_engine", None)
    if engine is not None and engine.loss_scaler is not None:
        result["loss_scale"] = engine.loss_scaler.scale
    if engine is not None and lora is None:
        result["gathered"] = engine.full_state_dict()  # the engine's own fp32 weights, which save_model must keep
    frozen = [getattr(trainer, "ref_model", None), *getattr(trainer, "reward_funcs", ())]  # TRL's, prepared for eval
    frozen = [model for model in frozen if isinstance(model, torch.nn.Module)]
    if frozen:
        engines = [trainer.accelerator.engine_of(model) if engine is not None else None for model in frozen]
        result["frozen_engines"] = [None if e is None else (e.config.stage, e.optimizer) for e in engines]
    if trainer.args.process_index == 0 and lora is not None:
        result["files"] = sorted(path.name for path in (out / "final").iterdir())
        result["saved"] = _saved(out / "final", "adapter_model.safetensors")
    elif trainer.args.process_index == 0:
        result["saved"] = _saved(out / "final")
        result["reloaded"] = {
            key: value.clone()
            for key, value in transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict().items()
        }
    return result


def stages_match_ddp(rank: int, world_size: int, tmp: str) -> dict:
    """DDP's Trainer and ZeroTrainer at stages 1-3 on the same run, stage 2 also in bf16, stage 3 also with LoRA
    adapters (against DDP's) and loading the best checkpoint at the end; stages 2 and 3 also resume from
    checkpoint-3."""
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    results = {"ddp": train(transformers.Trainer, tmp / "ddp")}
    for stage in (1, 2, 3):
        results[stage] = train(ZeroTrainer, tmp / f"zero{stage}", zero_config={"stage": stage})
    lora = ("q_proj", "v_proj")
    results["lora_ddp"] = train(transformers.Trainer, tmp / "lora_ddp", lora=lora)
    results["lora3"] = train(ZeroTrainer, tmp / "lora3", lora=lora, zero_config={"stage": 3})
    best = {"load_best_model_at_end": True}
    results["best3"] = train(ZeroTrainer, tmp / "best3", arg_changes=best, zero_config={"stage": 3})
    bf16 = {"bf16": True, "eval_strategy": "no", "save_strategy": "no"}
    results["bf16"] = train(ZeroTrainer, tmp / "bf16", arg_changes=bf16, zero_config={"stage": 2})
    for stage in (2, 3):
        results[f"resumed{stage}"] = train(
            ZeroTrainer,
            tmp / f"resumed{stage}",
            resume=str(tmp / f"zero{stage}" / f"checkpoint-{EVERY}"),
            zero_config={"stage": stage},
        )
    return results


def full_state_dict_runs(rank: int, world_size: int, tmp: str) -> dict:
    """DDP's Trainer, and ZeroTrainer(state_dict_type="full") at stage 2, each writing checkpoint-3; then stage 3
    resumes from each of the two checkpoints."""
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    results = {"ddp": train(transformers.Trainer, tmp / "ddp")}
    results["full2"] = train(ZeroTrainer, tmp / "full2", zero_config={"stage": 2}, state_dict_type="full")
    for source in ("ddp", "full2"):
        results[f"resumed_{source}"] = train(
            ZeroTrainer,
            tmp / f"resumed_{source}",
            resume=str(tmp / source / f"checkpoint-{EVERY}"),
            zero_config={"stage": 3},
            state_dict_type="full",
        )
    return results


def sft_stages_match_ddp(rank: int, world_size: int, tmp: str) -> dict:
    """TRL's SFTTrainer on DDP and ZeroSFTTrainer at stages 1-3, on pre-tokenized rows and a word-level tokenizer
    built here (no downloads)."""
    import datasets
    import trl

    from ds_strategy.transformers import ZeroSFTTrainer

    set_torchrun_environment(rank, world_size)
    rows = {name: TokenRows(count, seed).rows.tolist() for name, count, seed in (("train", SAMPLES, 1), ("eval", 8, 2))}
    data = {name: datasets.Dataset.from_dict({"input_ids": values}) for name, values in rows.items()}
    common = dict(
        # SFTConfig defaults to bf16 autocast, whose rounding differs between DDP's fp32 parameters and the
        # engine's bf16 compute copies; fp32 compares the two exactly
        arg_changes={"config_class": trl.SFTConfig, "max_length": hf_models.SEQ, "bf16": False},
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        processing_class=_word_tokenizer(),
    )
    results = {"ddp": train(trl.SFTTrainer, Path(tmp, "sft_ddp"), **common)}
    for stage in (1, 2, 3):
        results[stage] = train(ZeroSFTTrainer, Path(tmp, f"sft{stage}"), zero_config={"stage": stage}, **common)
    return results


def _word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Token ``t<i>`` is id i; SFTTrainer needs a tokenizer even for pre-tokenized rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf_models.VOCAB)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="t0", pad_token="t0", unk_token="t1"
    )


def resume_at_one_rank(rank: int, world_size: int, tmp: str) -> dict:
    """Resume each 2-rank stage-2 and stage-3 checkpoint on one rank with the same global batch (twice the
    per-device batch)."""
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    changes = {"per_device": PER_DEVICE * WORLD}
    return {
        stage: train(
            ZeroTrainer,
            Path(tmp, f"one_rank{stage}"),
            str(Path(tmp, f"zero{stage}", f"checkpoint-{EVERY}")),
            changes,
            zero_config={"stage": stage},
        )
        for stage in (2, 3)
    }


def deepspeed_json_runs(rank: int, world_size: int, tmp: str) -> dict:
    """An HF DeepSpeed JSON with "auto" values and optimizer/scheduler sections, through
    ``TrainingArguments(deepspeed=...)``; and the same optimizer and schedule built by hand for DDP's Trainer."""
    from ds_strategy.config.deepspeed.lr_schedules import build_schedule
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    schedule = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    ds_config = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {"type": "WarmupDecayLR", "params": {**schedule, "total_num_steps": "auto"}},
    }
    changes = {"weight_decay": 0.01, "deepspeed": ds_config}
    results = {"zero": train(ZeroTrainer, tmp / "json", arg_changes=changes)}

    def by_hand(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        params = {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "total_num_steps": STEPS}
        return optimizer, build_schedule(optimizer, "WarmupDecayLR", params)

    _fresh_state()
    model = _model()
    trainer = transformers.Trainer(
        model=model,
        args=arguments(tmp / "json_ddp", weight_decay=0.01),
        train_dataset=TokenRows(SAMPLES, 1),
        eval_dataset=TokenRows(8, 2),
        optimizers=by_hand(model),
    )
    trainer.train()
    results["ddp"] = {"logged": _logged(trainer)}
    results["no_deepspeed_plugin"] = os.environ.get("ACCELERATE_USE_DEEPSPEED") is None
    return results


def _preference_rows(count: int, seed: int) -> dict[str, list[str]]:
    """Prompt, chosen and rejected texts of random word tokens (never ``t0``, the EOS, nor ``t1``, the unknown)."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(2, hf_models.VOCAB, (count, 13), generator=generator).tolist()
    text = [[f"t{i}" for i in row] for row in words]
    # each completion ends in a space: DPOTrainer appends the EOS token to it as text
    return {
        "prompt": [" ".join(row[:5]) for row in text],
        "chosen": [" " + " ".join(row[5:9]) + " " for row in text],
        "rejected": [" " + " ".join(row[9:]) + " " for row in text],
    }


def dpo_stages_match_ddp(rank: int, world_size: int, tmp: str) -> dict:
    """TRL's DPOTrainer on DDP and ZeroDPOTrainer at stages 2 and 3, each with a reference model of its own (built
    like the policy); where each put the reference model; and a stage-3 ``sync_ref_model`` refused."""
    import datasets
    import trl

    from ds_strategy.transformers import ZeroDPOTrainer

    set_torchrun_environment(rank, world_size)
    data = {
        name: datasets.Dataset.from_dict(_preference_rows(count, seed))
        for name, count, seed in (("train", SAMPLES, 1), ("eval", 8, 2))
    }
    inputs = dict(train_dataset=data["train"], eval_dataset=data["eval"], processing_class=_word_tokenizer())
    dpo = {"config_class": trl.DPOConfig, "bf16": False}  # fp32, as for SFT: DPOConfig defaults to bf16 autocast
    results = {"ddp": train(trl.DPOTrainer, Path(tmp, "dpo_ddp"), arg_changes=dpo, ref_model=_model(), **inputs)}
    for stage in (2, 3):
        results[stage] = train(
            ZeroDPOTrainer,
            Path(tmp, f"dpo{stage}"),
            arg_changes=dpo,
            ref_model=_model(),
            zero_config={"stage": stage},
            **inputs,
        )
    _fresh_state()
    args = arguments(Path(tmp, "dpo_sync"), **dpo, sync_ref_model=True)
    try:
        ZeroDPOTrainer(model=_model(), ref_model=_model(), args=args, zero_config={"stage": 3}, **inputs)
    except ValueError as error:
        results["sync_refused"] = str(error)
    return results


def fp16_runs(rank: int, world_size: int, tmp: str) -> dict:
    """``TrainingArguments(fp16=True)`` under DDP's Trainer and under ZeroTrainer at stages 2 and 3, the fp32 DDP
    run, and a stage-2 run whose first loss scale (2^24) overflows fp16; each with the count of optimizer steps
    the scheduler saw (Trainer steps it only when ``optimizer_step_was_skipped`` is False) and the final loss
    scale."""
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    tmp = Path(tmp)
    quiet = {"eval_strategy": "no", "save_strategy": "no"}
    fp16 = {**quiet, "fp16": True}
    overflowing = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": "auto", "initial_scale_power": 24}}
    plans = {
        "ddp": (transformers.Trainer, quiet, {}),
        "ddp_fp16": (transformers.Trainer, fp16, {}),
        2: (ZeroTrainer, fp16, {"zero_config": {"stage": 2}}),
        3: (ZeroTrainer, fp16, {"zero_config": {"stage": 3}}),
        "overflow": (ZeroTrainer, fp16, {"zero_config": overflowing}),
    }
    results = {}
    for name, (trainer_class, changes, kwargs) in plans.items():
        results[name] = train(trainer_class, tmp / str(name), arg_changes=changes, **kwargs)
    return results


def _distinct_words(completions: list[str], **_) -> list[float]:
    """GRPO's reward: how many different words a completion has (so completions of one prompt differ in reward)."""
    return [float(len(set(completion.split()))) for completion in completions]


def grpo_stage3_matches_ddp(rank: int, world_size: int, tmp: str, pretrained: str) -> dict:
    """TRL's GRPOTrainer on DDP and ZeroGRPOTrainer at stage 3, with a reference model (``beta`` > 0, built by TRL
    from the policy's directory), a reward model beside a reward function, and sampled generation; where each put
    the reference and reward models."""
    import datasets
    import trl

    from ds_strategy.transformers import ZeroGRPOTrainer

    set_torchrun_environment(rank, world_size)
    grpo = {
        "config_class": trl.GRPOConfig,
        "bf16": False,
        "beta": 0.1,
        "num_generations": 2,
        "max_completion_length": 4,
        "eval_strategy": "no",
        "save_strategy": "no",
    }
    tokenizer = _word_tokenizer()
    torch.manual_seed(7)
    reward_model = transformers.LlamaForSequenceClassification(hf_models.config("llama", num_labels=1, pad_token_id=0))
    inputs = dict(
        train_dataset=datasets.Dataset.from_dict({"prompt": _preference_rows(SAMPLES, 3)["prompt"]}),
        eval_dataset=None,
        processing_class=tokenizer,
        reward_funcs=[_distinct_words, reward_model],
        reward_processing_classes=[None, tokenizer],
    )

    def policy():
        return transformers.AutoModelForCausalLM.from_pretrained(pretrained)

    return {
        "ddp": train(trl.GRPOTrainer, Path(tmp, "grpo_ddp"), arg_changes=grpo, model=policy, **inputs),
        3: train(
            ZeroGRPOTrainer, Path(tmp, "grpo3"), arg_changes=grpo, model=policy, zero_config={"stage": 3}, **inputs
        ),
    }
