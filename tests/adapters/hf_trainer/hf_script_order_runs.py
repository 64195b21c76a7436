"""Rank bodies for tests/adapters/hf_trainer/test_hf_script_order.py: a script written in Hugging Face's order
(arguments first, then ``from_pretrained`` of a saved tiny Llama causal LM into a sequence-classification model with a
new ``score`` head, two added tokens by ``resize_token_embeddings``, then the trainer), with transformers' stock ZeRO-3
JSON.

DDP's ``Trainer`` runs the same script with the JSON's optimizer and schedule built by hand (AdamW, WarmupLR), in the
ranks that then run it with ``TrainingArguments(deepspeed=...)`` (deepspeed installed); other ranks run it with
``ZeroTrainingArguments(deepspeed=...)``, the deepspeed package hidden from them as
tests/architecture/optional_absent.py hides it.
"""

import json
import sys
from pathlib import Path

import hf_models
import hf_trainer_runs as runs
import pytest
import torch
import transformers
from distributed import set_torchrun_environment

ZERO3_JSON = (
    Path(__file__).resolve().parents[2]
    / "data"
    / "deepspeed_configs"
    / "transformers__tests__deepspeed__ds_config_zero3.json"
)
LABELS, ADDED_TOKENS, PAD = 3, 2, 0
QUIET = {"eval_strategy": "no", "save_strategy": "no"}


class LabelledRows(torch.utils.data.Dataset):
    """Fixed random rows over the enlarged vocabulary (the added tokens included, the pad id never) and labels."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        vocab = hf_models.VOCAB + ADDED_TOKENS
        self.rows = torch.randint(PAD + 1, vocab, (count, hf_models.SEQ), generator=generator)
        self.labels = torch.randint(0, LABELS, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.labels[index]}


def _json_optimizer_by_hand(model) -> tuple:
    """What the JSON's ``optimizer`` and ``scheduler`` sections build, "auto" filled from ``runs.arguments``."""
    from ds_strategy.config.deepspeed.lr_schedules import build_schedule

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    schedule = {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2}
    return optimizer, build_schedule(optimizer, "WarmupLR", schedule)


def _loaded(pretrained: str):
    """``from_pretrained`` into a classifier and two added tokens, from one generator state."""
    torch.manual_seed(11)  # from_pretrained draws the new head, the resize the added rows: the same on both sides
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        pretrained, num_labels=LABELS, pad_token_id=PAD, output_loading_info=True
    )
    model.resize_token_embeddings(hf_models.VOCAB + ADDED_TOKENS)
    return model, info


def hf_script(trainer_class, args, pretrained: str, evaluate_only: bool = False, **trainer_kwargs) -> dict:
    """The script, in HF's order after ``args``; its logged figures and what the model was before the trainer.
    ``evaluate_only``: ``evaluate()`` instead of ``train()``, which the ZeroTrainer then refuses."""
    model, info = _loaded(pretrained)
    before = {
        "all_meta": all(t.is_meta for t in [*model.parameters(), *model.buffers()]),
        "zero_init": any(hasattr(p, "ds_id") for p in model.parameters()),
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
    }
    if trainer_class is transformers.Trainer:
        trainer_kwargs["optimizers"] = _json_optimizer_by_hand(model)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=LabelledRows(runs.SAMPLES, 1),
        eval_dataset=LabelledRows(8, 2),
        **trainer_kwargs,
    )
    from ds_strategy.transformers import build_hook

    before["armed_after_trainer"] = build_hook.armed()  # the trainer took the configuration: the hook is undone
    if evaluate_only:
        before["eval_loss"] = trainer.evaluate()["eval_loss"]
        with pytest.raises(RuntimeError, match="evaluate\\(\\)/predict\\(\\) sharded it for inference"):
            trainer.train()
        return before
    trainer.train()
    result = {"logged": runs._logged(trainer), **before}
    engine = getattr(trainer, "zero_engine", None)
    if engine is not None:
        result["stage"] = engine.config.stage
        result["persistence_threshold"] = engine.config.param_persistence_threshold
        result["partitioned_numel"] = sum(fp.numel for unit in engine.units for fp in unit.partitioned)
    return result


def _zero(rank: int, world_size: int, tmp: str, pretrained: str, zero_args) -> dict:
    from ds_strategy.transformers import ZeroTrainer, build_hook

    set_torchrun_environment(rank, world_size)
    runs._fresh_state()
    args = zero_args(Path(tmp, "zero"))
    results = {"armed_by_arguments": build_hook.armed(), "zero": hf_script(ZeroTrainer, args, pretrained)}
    results["whole_after"] = not transformers.AutoModelForCausalLM.from_pretrained(pretrained).model.norm.weight.is_meta
    return results


def _evaluation_only(tmp: str, pretrained: str, zero_args) -> dict:
    """``evaluate()`` with no ``train()``, on a ZeroTrainer and on DDP's Trainer."""
    from ds_strategy.transformers import ZeroTrainer

    runs._fresh_state()
    result = hf_script(ZeroTrainer, zero_args(Path(tmp, "evaluation_only")), pretrained, evaluate_only=True)
    runs._fresh_state()
    args = runs.arguments(Path(tmp, "ddp_eval"), **QUIET)
    ddp = transformers.Trainer(model=_loaded(pretrained)[0], args=args, eval_dataset=LabelledRows(8, 2))
    result["ddp_eval_loss"] = ddp.evaluate()["eval_loss"]
    return result


def with_deepspeed_installed(rank: int, world_size: int, tmp: str, pretrained: str) -> dict:
    """The script on DDP, then with ``TrainingArguments(deepspeed=<stock ZeRO-3 JSON>)``."""
    set_torchrun_environment(rank, world_size)
    runs._fresh_state()
    ddp = hf_script(transformers.Trainer, runs.arguments(Path(tmp, "ddp"), **QUIET), pretrained)
    json_config = json.loads(ZERO3_JSON.read_text())

    def zero_args(out):
        return runs.arguments(out, deepspeed=json_config, **QUIET)

    zero = _zero(rank, world_size, tmp, pretrained, zero_args)
    return {"ddp": ddp, **zero, "evaluation_only": _evaluation_only(tmp, pretrained, zero_args)}


def with_deepspeed_absent(rank: int, world_size: int, tmp: str, pretrained: str) -> dict:
    """The script with ``ZeroTrainingArguments(deepspeed=<stock ZeRO-3 JSON>)`` in ranks where the deepspeed package
    is absent (``TrainingArguments(deepspeed=...)`` then fails in transformers)."""
    import optional_absent

    optional_absent.hide(["deepspeed"])
    from ds_strategy.transformers import ZeroTrainingArguments

    json_config = json.loads(ZERO3_JSON.read_text())
    set_torchrun_environment(rank, world_size)
    try:
        runs.arguments(Path(tmp, "refused"), deepspeed=json_config, **QUIET)
        refused = None
    except Exception as error:  # noqa: BLE001 -- which error transformers raises is its own business
        refused = f"{type(error).__name__}: {error}"
    results = _zero(
        rank,
        world_size,
        tmp,
        pretrained,
        lambda out: runs.arguments(out, config_class=ZeroTrainingArguments, deepspeed=json_config, **QUIET),
    )
    results["refused_without_deepspeed"] = refused
    results["deepspeed_imported"] = sorted(name for name in sys.modules if name.partition(".")[0] == "deepspeed")
    return results
