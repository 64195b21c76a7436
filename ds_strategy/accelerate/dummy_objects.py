"""Accelerate's ``DummyOptim``/``DummyScheduler`` turned into the optimizer and scheduler a DeepSpeed config names.

With ``accelerate`` + DeepSpeed, a program whose DeepSpeed config has ``optimizer``/``scheduler`` sections passes
placeholders to ``prepare``, and the back-end builds the real ones from the sections, filling their ``"auto"``
values from the placeholders (accelerate's ``Accelerator._prepare_deepspeed``):

- ``optimizer.params.lr`` / ``weight_decay`` <- ``DummyOptim(lr=..., weight_decay=...)``; here also any other key
  from ``DummyOptim``'s keyword arguments (accelerate would fail on those);
- ``scheduler.params.warmup_min_lr`` <- 0, ``warmup_max_lr`` <- the optimizer's lr, ``warmup_num_steps`` <-
  ``max(1, DummyScheduler.warmup_num_steps)``, ``total_num_steps`` <- ``ceil(total_num_steps / num_processes)``
  (``total_num_steps`` itself under ``split_batches``): the total counts the unsharded loader's batches;
- ``DummyScheduler(lr_scheduler_callable=f)``: the scheduler is ``f(optimizer)``, whatever the config says.

Concrete values in a section win over the placeholders' (accelerate's ``must_match=False``); an ``"auto"`` left
unfilled is an error naming its key. A placeholder without its section, or a real optimizer/scheduler beside a
section, is an error, as in accelerate. The built scheduler steps once per optimizer step, as DeepSpeed's engine
steps it (see ``ZeroAccelerator._prepare_built_scheduler``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer

# accelerate.utils re-exports these only when deepspeed is installed; accelerate.utils.deepspeed always defines them
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch.optim.lr_scheduler import LRScheduler

from ..config.deepspeed.optimizer_section import read_optimizer_sections
from ..config.deepspeed.rule_kinds import AUTO


@dataclasses.dataclass(frozen=True)
class ResolvedObjects:
    """``prepare``'s arguments with every placeholder replaced, and where the schedulers built here sit."""

    args: tuple[Any, ...]
    built_schedulers: frozenset[int]


def resolve_dummies(
    args: tuple[Any, ...], sections: Mapping[str, Any], num_processes: int, split_batches: bool
) -> ResolvedObjects:
    """Replace each ``DummyOptim``/``DummyScheduler`` in ``args`` by the object ``sections`` (the DeepSpeed config's
    ``optimizer``/``scheduler`` entries as written) describe, after checking what accelerate checks."""
    _check_pairing(args, sections)
    result = list(args)
    built: dict[int, torch.optim.Optimizer] = {}  # index of a DummyOptim in args -> its real optimizer
    for i, obj in enumerate(args):
        if isinstance(obj, DummyOptim):
            built[i] = result[i] = _build_optimizer(obj, sections["optimizer"])
    schedulers = set()
    for i, obj in enumerate(args):
        if isinstance(obj, DummyScheduler):
            optimizer = _real_optimizer(obj.optimizer, args, built)
            if obj.lr_scheduler_callable is not None:
                result[i] = obj.lr_scheduler_callable(optimizer)  # DeepSpeed: a client callable wins over the config
            else:
                result[i] = _build_scheduler(obj, optimizer, sections["scheduler"], num_processes, split_batches)
            schedulers.add(i)
    return ResolvedObjects(tuple(result), frozenset(schedulers))


def _check_pairing(args: tuple[Any, ...], sections: Mapping[str, Any]) -> None:
    """accelerate's rules: each placeholder needs its section; a section rules out the real object."""
    optimizers = [obj for obj in args if isinstance(obj, (torch.optim.Optimizer, AcceleratedOptimizer, DummyOptim))]
    schedulers = [obj for obj in args if isinstance(obj, (LRScheduler, DummyScheduler))]
    for obj in optimizers:
        if "optimizer" in sections and not isinstance(obj, DummyOptim):
            raise ValueError(
                "You cannot specify an optimizer in the config file and in the code at the same time: "
                "the DeepSpeed config has an 'optimizer' section, so pass "
                "accelerate.utils.DummyOptim(model.parameters(), lr=..., weight_decay=...) to prepare() "
                "or remove the section"
            )
        if "optimizer" not in sections and isinstance(obj, DummyOptim):
            raise ValueError(
                "You cannot create a DummyOptim without specifying an optimizer in the config file: "
                'add an \'optimizer\' section ({"type": ..., "params": {...}}) to the DeepSpeed config '
                "or pass a torch optimizer to prepare()"
            )
    for obj in schedulers:
        if "scheduler" in sections and not isinstance(obj, DummyScheduler):
            raise ValueError(
                "You cannot specify a scheduler in the config file and in the code at the same time: "
                "the DeepSpeed config has a 'scheduler' section, so pass "
                "accelerate.utils.DummyScheduler(optimizer, total_num_steps=..., warmup_num_steps=...) to "
                "prepare() or remove the section"
            )
        if "scheduler" not in sections and isinstance(obj, DummyScheduler) and obj.lr_scheduler_callable is None:
            raise ValueError(
                "Either specify a scheduler in the config file or pass lr_scheduler_callable to "
                "DummyScheduler: the DeepSpeed config has no 'scheduler' section"
            )
    if any(isinstance(obj, DummyOptim) for obj in optimizers) and any(
        not isinstance(obj, DummyScheduler) for obj in schedulers
    ):
        raise ValueError(
            "You can only specify accelerate.utils.DummyScheduler in the code when using "
            "accelerate.utils.DummyOptim: a DummyOptim's real optimizer exists only after prepare()"
        )


def _build_optimizer(dummy: DummyOptim, section: Any) -> torch.optim.Optimizer:
    values = {**dummy.kwargs, "lr": dummy.lr, "weight_decay": dummy.weight_decay}
    filled = _fill("optimizer", section, values, "DummyOptim's keyword arguments")
    return read_optimizer_sections(filled, None).build_optimizer(dummy.params)


def _build_scheduler(
    dummy: DummyScheduler, optimizer: torch.optim.Optimizer, section: Any, num_processes: int, split_batches: bool
) -> Any:
    values = {
        "warmup_min_lr": 0,
        "warmup_max_lr": _max_lr(dummy.optimizer, optimizer),
        "warmup_num_steps": max(1, dummy.warmup_num_steps),
    }
    if dummy.total_num_steps is not None:
        values["total_num_steps"] = (
            dummy.total_num_steps if split_batches else math.ceil(dummy.total_num_steps / num_processes)
        )
    filled = _fill("scheduler", section, values, "DummyScheduler(total_num_steps=..., warmup_num_steps=...)")
    return read_optimizer_sections(None, filled).build_scheduler(optimizer)


def _max_lr(given: Any, optimizer: torch.optim.Optimizer) -> float:
    """accelerate's ``warmup_max_lr``: the DummyOptim's lr, else the real optimizer's default lr."""
    return given.lr if isinstance(given, DummyOptim) else optimizer.defaults["lr"]


def _real_optimizer(
    given: Any, args: tuple[Any, ...], built: Mapping[int, torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    if isinstance(given, DummyOptim):
        index = next((i for i, obj in enumerate(args) if obj is given), None)
        if index is None:
            raise ValueError(
                "DummyScheduler's DummyOptim is not in this prepare() call: prepare the DummyOptim and "
                "its DummyScheduler together, as accelerate's DeepSpeed back-end requires"
            )
        return built[index]
    if isinstance(given, AcceleratedOptimizer):
        return given.optimizer
    if isinstance(given, torch.optim.Optimizer):
        return given
    raise ValueError(f"DummyScheduler's optimizer is a {type(given).__name__}; expected a DummyOptim or an optimizer")


def _fill(section: str, options: Any, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``options`` with each ``"auto"`` parameter taken from ``values``; raises naming the key none fills."""
    if not isinstance(options, Mapping):
        raise ValueError(f"DeepSpeed {section} must be a JSON object, got {type(options).__name__}: {options!r}")
    params = dict(options.get("params") or {})
    for key, value in params.items():
        if value == AUTO:
            if key not in values:
                raise ValueError(
                    f'DeepSpeed {section}.params.{key} is "auto" but nothing fills it: accelerate fills '
                    f"only {', '.join(values)} from {where}; give it a value in the config"
                )
            params[key] = values[key]
    return {**options, "params": params}
