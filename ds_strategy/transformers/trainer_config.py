"""A ZeroTrainer's ZeRO settings: a DeepSpeed JSON (from ``TrainingArguments.deepspeed`` or ``zero_config=``), a
ZeroConfig, or ``$DS_STRATEGY_CONFIG``, with ``"auto"`` filled from ``TrainingArguments`` as transformers does.

transformers' DeepSpeed path (``HfTrainerDeepSpeedConfig``) fills a DeepSpeed JSON's ``"auto"`` values in two
passes, and so does this module: when the trainer is built (:func:`trainer_zero_config`) the batch sizes,
accumulation, clipping, the optimizer section's lr/betas/eps/weight decay, the scheduler's warmup lrs and fp16/bf16
come from the arguments; when training starts (:meth:`TrainerZeroConfig.build_scheduler`) ``total_num_steps`` and
``warmup_num_steps`` come from the step count. A concrete value that differs from the argument it mirrors is an
error listing every such key, as in transformers. Bucket sizes left "auto" are derived from the model's hidden size
by the engine (``ds_strategy.config.auto_values``).

Note: [Who owns accumulation, clipping and the batch under the Trainer]
Trainer runs gradient accumulation itself (it builds its Accelerator with one accumulation step and toggles
``sync_gradients``), clips with ``accelerator.clip_grad_norm_(max_grad_norm)`` and sizes its data loaders from
``per_device_train_batch_size``. A config's accumulation, clipping and batch sizes are therefore checked against
the arguments and then taken off the ZeroConfig the accelerator gets; leaving them on would accumulate or clip a
second time.

``TrainingArguments(deepspeed=...)`` alone switches transformers to accelerate's DeepSpeed back-end: its
``__post_init__`` builds a ``DeepSpeedPlugin`` (importing the deepspeed package) and starts the distributed state
for DeepSpeed. :func:`detach_deepspeed` takes the config off the arguments and undoes that before the Trainer builds
its accelerator. With the deepspeed package absent, ``TrainingArguments(deepspeed=...)`` fails in transformers
itself: :class:`ZeroTrainingArguments` takes the same ``deepspeed=`` (and ``--deepspeed`` through
``HfArgumentParser``) without the package, or pass the JSON as ``ZeroTrainer(..., zero_config="ds_config.json")``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import transformers

from ..config import ZeroConfig
from ..config.deepspeed.optimizer_section import read_optimizer_sections
from ..config.deepspeed.rule_kinds import AUTO
from ..config.sources import load_config
from . import build_hook


@dataclasses.dataclass(frozen=True)
class TrainerZeroConfig:
    """The ZeroConfig a ZeroTrainer's accelerator gets, and the DeepSpeed ``optimizer``/``scheduler`` sections (their
    first-pass "auto" values filled) the trainer builds its optimizer and scheduler from, those present."""

    zero: ZeroConfig
    optimizer: Mapping[str, Any] | None = None
    scheduler: Mapping[str, Any] | None = None

    def build_optimizer(self, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The section's optimizer over ``parameters`` in one group, as DeepSpeed builds it for transformers (its
        ``DummyOptim`` holds the trainable parameters, without the Trainer's no-decay group)."""
        return read_optimizer_sections(self.optimizer, None).build_optimizer(parameters)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, args: Any, num_training_steps: int) -> Any:
        """The section's scheduler, its step counts filled as ``trainer_config_finalize`` fills them."""
        section = copy.deepcopy(dict(self.scheduler))
        mismatches: list[str] = []
        warmup = max(1, args.get_warmup_steps(num_training_steps))
        for key, value, hf_key in (
            ("params.total_num_steps", num_training_steps, "num_training_steps (calculated)"),
            ("params.warmup_num_steps", warmup, "warmup_steps"),
        ):
            _fill(section, key, value, hf_key, mismatches, prefix="scheduler")
        _raise_mismatches(mismatches)
        return read_optimizer_sections(None, section).build_scheduler(optimizer)


def trainer_zero_config(source: Any, args: Any) -> TrainerZeroConfig:
    """``source`` (a DeepSpeed JSON path or dict, ZeroConfig fields, a ZeroConfig, or None for
    ``$DS_STRATEGY_CONFIG``) read for a Trainer run with ``args``: "auto" filled, the Trainer-owned settings
    checked against ``args`` and taken off (Note: [Who owns accumulation, clipping and the batch under the Trainer])."""
    loaded = load_config(source, environment=True, fill_auto=lambda options: fill_from_training_args(options, args))
    sections = loaded.written_sections
    result = TrainerZeroConfig(loaded.zero, sections.get("optimizer"), sections.get("scheduler"))
    if not loaded.deepspeed:
        _check_owned_by_trainer(loaded.zero, args)
    _refuse_pipeline_parallel(result.zero)
    owned = dict(gradient_accumulation_steps=1, gradient_clipping=0.0, train_batch_size=None)
    return dataclasses.replace(result, zero=result.zero.replace(**owned, train_micro_batch_size_per_gpu=None))


def _refuse_pipeline_parallel(zero: ZeroConfig) -> None:
    """The Trainer's loop calls ``model(**inputs)`` on whole batches; pipelining needs a schedule in place of the
    forward (``pipeline_step``). Refused here, once. (Ulysses is served: :mod:`.sequence_parallel`.)"""
    if zero.pipeline_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={zero.pipeline_parallel_size} is not supported under the Hugging Face Trainer, "
            f"whose loop runs the whole model on each batch; use 1, or train with ZeroAccelerator, Lightning or "
            f"Fabric, whose loops call pipeline_step"
        )


def sequence_parallel_size(zero: ZeroConfig, args: Any) -> int:
    """The Ulysses group size a Trainer run asks for: ``sequence_parallel_size`` in the ZeRO config or
    ``TrainingArguments.parallelism_config.sp_size`` (the accelerator checks that they agree)."""
    parallelism = getattr(args, "parallelism_config", None)
    return max(zero.sequence_parallel_size, getattr(parallelism, "sp_size", None) or 1)


def fill_from_training_args(options: Mapping[str, Any], args: Any) -> dict[str, Any]:
    """A copy of the DeepSpeed config ``options`` with the "auto" values ``HfTrainerDeepSpeedConfig.
    trainer_config_process`` fills taken from ``args``; raises listing every concrete value that differs."""
    config = copy.deepcopy(dict(options))
    mismatches: list[str] = []
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fills = [
        ("train_micro_batch_size_per_gpu", per_device, "per_device_train_batch_size", True),
        ("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps", True),
        ("train_batch_size", args.world_size * per_device * accumulation, "train_batch_size (calculated)", True),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm", True),
        ("optimizer.params.lr", args.learning_rate, "learning_rate", True),
        ("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2", True),
        ("optimizer.params.eps", args.adam_epsilon, "adam_epsilon", True),
        ("optimizer.params.weight_decay", args.weight_decay, "weight_decay", True),
        ("scheduler.params.warmup_min_lr", 0, "", False),
        ("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate", True),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval", True),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval", True),
    ]
    for key, value, hf_key, must_match in fills:
        _fill(config, key, value, hf_key, mismatches if must_match else None)
    _raise_mismatches(mismatches)
    return config


@dataclasses.dataclass
class ZeroTrainingArguments(transformers.TrainingArguments):
    """``TrainingArguments`` whose ``deepspeed=`` (a DeepSpeed JSON path or dict, for a ZeroTrainer) needs no
    deepspeed package: transformers never sees it, so nothing of DeepSpeed is set up. Without ``deepspeed=`` the
    configuration is ``$DS_STRATEGY_CONFIG``'s. At ZeRO stage 3, from these arguments' creation on,
    ``from_pretrained`` and ``from_config`` build models sharded for the ZeroTrainer (Note: [Building sharded
    before the Trainer exists] in :mod:`.build_hook`), as transformers' own ``TrainingArguments(deepspeed=...)`` makes
    them build inside DeepSpeed's ``zero.Init``. Bad configuration values fail here, naming the key."""

    def __post_init__(self):
        source, self.deepspeed = self.deepspeed, None
        super().__post_init__()
        self.deepspeed = source
        if trainer_zero_config(source, self).zero.stage >= 3:
            build_hook.arm(self)


def detach_deepspeed(args: Any) -> Any:
    """Take ``args.deepspeed`` off ``args`` and undo what transformers set up for it; returns it (None if unset).

    Undone: the ``DeepSpeedPlugin`` and ``HfTrainerDeepSpeedConfig`` (whose global weakref would make
    ``from_pretrained`` partition models with ``deepspeed.zero.Init``), and the distributed state started for
    DeepSpeed, which is rebuilt as for any other run (the process group itself stays). Models built from now on
    are built whole (:mod:`.build_hook`).
    """
    build_hook.disarm(args)
    source = getattr(args, "deepspeed", None)
    if not source:
        return None
    args.deepspeed = None
    if isinstance(args, ZeroTrainingArguments):
        return source  # transformers never saw it
    args.deepspeed_plugin = None
    if getattr(args, "hf_deepspeed_config", None) is not None:
        from transformers.integrations import deepspeed as hf_deepspeed

        if hf_deepspeed.deepspeed_config() is args.hf_deepspeed_config.config:
            hf_deepspeed.unset_hf_deepspeed_config()
        del args.hf_deepspeed_config
    if "_setup_devices" in vars(args):  # the cached_property ran with DeepSpeed's distributed state
        from accelerate.state import AcceleratorState

        del vars(args)["_setup_devices"]
        AcceleratorState._reset_state(reset_partial_state=True)
        args.device  # noqa: B018 -- rebuilds the distributed state without DeepSpeed
    return source


def _check_owned_by_trainer(zero: ZeroConfig, args: Any) -> None:
    """A ZeroConfig (not a DeepSpeed JSON) that sets accumulation or clipping must agree with the arguments."""
    problems = []
    if zero.gradient_accumulation_steps not in (1, args.gradient_accumulation_steps):
        problems.append(
            f"ZeroConfig.gradient_accumulation_steps={zero.gradient_accumulation_steps} vs "
            f"TrainingArguments.gradient_accumulation_steps={args.gradient_accumulation_steps}"
        )
    if zero.gradient_clipping not in (0.0, args.max_grad_norm):
        problems.append(
            f"ZeroConfig.gradient_clipping={zero.gradient_clipping} vs TrainingArguments.max_grad_norm="
            f"{args.max_grad_norm}"
        )
    if problems:
        raise ValueError(
            "the Trainer accumulates and clips itself, from its arguments; these ZeRO settings disagree: "
            + "; ".join(problems)
            + ". Set them in TrainingArguments only"
        )


def _fill(
    config: dict[str, Any],
    dotted: str,
    value: Any,
    hf_key: str,
    mismatches: list[str] | None,
    prefix: str | None = None,
) -> None:
    """``HfTrainerDeepSpeedConfig.fill_match``: "auto" becomes ``value``; a concrete value that differs is recorded
    in ``mismatches`` (None: not checked). A key whose section is absent is left absent."""
    *parents, key = dotted.split(".")
    node = config
    for parent in parents:
        node = node.get(parent)
        if not isinstance(node, dict):
            return
    if node.get(key) == AUTO:
        node[key] = value
    elif mismatches is not None and node.get(key) is not None and node[key] != value:
        where = f"{prefix}.{dotted}" if prefix else dotted
        mismatches.append(f"ds {where}={node[key]!r} vs hf {hf_key}={value!r}")


def _raise_mismatches(mismatches: list[str]) -> None:
    if mismatches:
        raise ValueError(
            "these DeepSpeed config values differ from the TrainingArguments values they mirror: "
            + "; ".join(mismatches)
            + '. Set them to "auto" (or to the same value)'
        )
