"""A DeepSpeed config's ``optimizer`` and ``scheduler`` sections, read and checked up front, built on demand.

DeepSpeed builds the optimizer named in its config when the program passes none: ``Adam``/``AdamW`` (its
FusedAdam/CPUAdam, or torch's with ``torch_adam``; ``adam_w_mode``, default true, makes even "Adam" decouple
weight decay, as AdamW), ``Adagrad``, ``Lion``, and any other ``torch.optim`` class by its exact name. Here the
same arithmetic comes from torch's classes; ds_strategy shards (and under offload replaces) whatever it gets.
A section whose every parameter is ``"auto"`` (switches such as ``torch_adam`` aside) is Hugging Face's "the
framework fills this in": it defers to the optimizer the program builds, silently. A single ``"auto"`` among
concrete values means the class's default.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .lr_schedules import (
    SCHEDULES,
    DeepSpeedSchedule,
    build_schedule,
    schedule_parameters,
)
from .rule_kinds import AUTO

_ADAM_FAMILY = ("adam", "adamw")
_DEEPSPEED_ONLY = {
    "lamb": "Lamb (FusedLamb)",
    "onebitadam": "1-bit Adam",
    "zerooneadam": "0/1 Adam",
    "onebitlamb": "1-bit LAMB",
    "muadam": "MuAdam (mup)",
    "muadamw": "MuAdamW (mup)",
    "musgd": "MuSGD (mup)",
    "muon": "Muon",
}
# Adam keys DeepSpeed's Adam takes beyond torch's, and the one value of each torch's Adam also computes.
_ADAM_EXTRAS = {"torch_adam": None, "adam_w_mode": None, "bias_correction": True, "fp32_optimizer_states": None}
_SECTION_KEYS = {"optimizer": ("type", "params", "legacy_fusion"), "scheduler": ("type", "params")}


@dataclasses.dataclass(frozen=True)
class OptimizerSections:
    """The concrete sections of a config (None where absent or all "auto", which defer to the program's)."""

    optimizer: tuple[str, Mapping[str, Any]] | None = None  # (DeepSpeed type, params without "auto")
    scheduler: tuple[str, Mapping[str, Any]] | None = None

    def build_optimizer(self, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer DeepSpeed would build from this config's ``optimizer`` section."""
        name, params = self.optimizer
        cls, kwargs = _optimizer_class(name, dict(params))
        return cls(parameters, **kwargs)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> DeepSpeedSchedule | Any:
        """The LR scheduler DeepSpeed would build on ``optimizer`` from the ``scheduler`` section."""
        name, params = self.scheduler
        if name in SCHEDULES:
            return build_schedule(optimizer, name, dict(params))
        return getattr(torch.optim.lr_scheduler, name)(optimizer, **params)


def read_optimizer_sections(optimizer: Any, scheduler: Any) -> OptimizerSections:
    """Check both sections (type known, every parameter accepted) without building anything."""
    optimizer_spec = _read_section("optimizer", optimizer)
    if optimizer_spec is not None:
        name, params = optimizer_spec
        _check_keys("optimizer", name, params, _optimizer_parameters(name, params))
    scheduler_spec = _read_section("scheduler", scheduler)
    if scheduler_spec is not None:
        name, params = scheduler_spec
        _check_keys("scheduler", name, params, _scheduler_parameters(name))
        missing = [key for key in _required(name) if key not in params]
        if missing:
            raise ValueError(
                f"DeepSpeed scheduler.params.{missing[0]} is required by {name} and has no default "
                f'("auto" is filled by Hugging Face\'s Trainer, which is not running here); give a value'
            )
    return OptimizerSections(optimizer_spec, scheduler_spec)


def _read_section(section: str, options: Any) -> tuple[str, dict[str, Any]] | None:
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise ValueError(f"DeepSpeed {section} must be a JSON object, got {type(options).__name__}: {options!r}")
    for key in options:
        if key not in _SECTION_KEYS[section]:
            raise ValueError(
                f"DeepSpeed {section}.{key} is not a key DeepSpeed accepts; expected "
                f"{', '.join(_SECTION_KEYS[section])}"
            )
    params = options.get("params") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"DeepSpeed {section}.params must be a JSON object, got {params!r}")
    hyper_parameters = [value for key, value in params.items() if key not in _ADAM_EXTRAS]
    if options.get("type") in (None, AUTO) or (hyper_parameters and all(value == AUTO for value in hyper_parameters)):
        return None  # Hugging Face's "the framework fills this in": the program's own optimizer/scheduler
    if not isinstance(options["type"], str):
        raise ValueError(f"DeepSpeed {section}.type={options['type']!r} is not allowed; expected a name")
    return options["type"], {key: value for key, value in params.items() if value != AUTO}


def _optimizer_class(name: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """torch's class computing DeepSpeed's ``name`` optimizer, and its keyword arguments."""
    lowered = name.lower()
    if "max_grad_norm" in params:
        raise ValueError(
            "DeepSpeed optimizer.params.max_grad_norm is not supported (nor by DeepSpeed); "
            "use the top-level gradient_clipping"
        )
    if lowered in _DEEPSPEED_ONLY:
        raise ValueError(
            f"DeepSpeed optimizer.type={name!r} ({_DEEPSPEED_ONLY[lowered]}) is not supported: "
            f"ds_strategy builds torch optimizers only; use Adam, AdamW, SGD, Adagrad or another "
            f"torch.optim class, or return your optimizer from configure_optimizers"
        )
    if lowered in _ADAM_FAMILY:
        return _adam(lowered, params)
    if lowered == "adagrad":
        return torch.optim.Adagrad, params
    if lowered == "lion":
        if not hasattr(torch.optim, "Lion"):
            raise ValueError(
                f"DeepSpeed optimizer.type={name!r} needs torch.optim.Lion, which torch "
                f"{torch.__version__} does not have; return a Lion optimizer from configure_optimizers"
            )
        return torch.optim.Lion, params
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"DeepSpeed optimizer.type={name!r} is neither one of DeepSpeed's (Adam, AdamW, Adagrad, "
            f"Lion) nor a torch.optim class (names are case-sensitive, e.g. 'SGD')"
        )
    return cls, params


def _adam(name: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """DeepSpeed's Adam: decoupled decay unless ``adam_w_mode`` is false for "Adam"; weight_decay defaults to 0
    (FusedAdam's) unless ``torch_adam`` asks for torch's class and its defaults."""
    params = dict(params)
    torch_adam = params.pop("torch_adam", False)
    decoupled = name == "adamw" or params.pop("adam_w_mode", True)
    params.pop("adam_w_mode", None)
    params.pop("fp32_optimizer_states", None)  # CpuAdam keeps fp32 state in any case
    if params.pop("bias_correction", True) is not True:
        raise ValueError(
            "DeepSpeed optimizer.params.bias_correction=false is not supported: torch's Adam always "
            "corrects the moments' bias"
        )
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), params


def _optimizer_parameters(name: str, params: dict[str, Any]) -> list[str]:
    cls, _ = _optimizer_class(name, {key: value for key, value in params.items() if key in _ADAM_EXTRAS})
    accepted = [key for key in inspect.signature(cls.__init__).parameters if key not in ("self", "params")]
    return accepted + (list(_ADAM_EXTRAS) if name.lower() in _ADAM_FAMILY else [])


def _scheduler_parameters(name: str) -> list[str]:
    if name in SCHEDULES:
        return schedule_parameters(name)
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"DeepSpeed scheduler.type={name!r} is neither one of DeepSpeed's "
            f"({', '.join(SCHEDULES)}) nor a torch.optim.lr_scheduler class"
        )
    return [key for key in inspect.signature(cls.__init__).parameters if key not in ("self", "optimizer")]


def _required(name: str) -> list[str]:
    if name not in SCHEDULES:
        return []
    return [
        key
        for key, parameter in inspect.signature(SCHEDULES[name]).parameters.items()
        if parameter.default is inspect.Parameter.empty
    ]


def _check_keys(section: str, name: str, params: Mapping[str, Any], accepted: list[str]) -> None:
    for key in params:
        if key not in accepted:
            raise ValueError(
                f"DeepSpeed {section}.params.{key} is not a parameter of {name}; it takes {', '.join(accepted)}"
            )
