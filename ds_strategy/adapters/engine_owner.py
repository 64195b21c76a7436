"""What every framework adapter that owns a ZeroEngine shares: the strategy names, the reports, the teardown (the
engine itself comes from :func:`ds_strategy.compose.compose_model`)."""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint.pretrained import load_weights
from ..compose.activation_checkpointing import remove_activation_checkpointing
from ..zero.engine import ZeroEngine

# Strategy names every adapter registers (Lightning, pytorch_lightning, Fabric, Hydra's ``strategy`` group), and
# the ZeroConfig fields each one sets.
PRESETS: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu", "pin_memory": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu", "pin_memory": True},
}


class EngineOwnerMixin:
    """Reports, teardown and name registration for a strategy class whose ``engine`` is a ZeroEngine (or None
    before setup). Mixed in ahead of the framework's strategy base, whose ``teardown`` it extends."""

    engine = None

    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes per kind of model state and place; see :func:`ds_strategy.zero.memory_report`."""
        return self.engine.memory_report()

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds waited per collective kind since setup; see ``ZeroEngine.comm_stats``."""
        return self.engine.comm_stats()

    def load_pretrained(self, path, prefix: str = "") -> None:
        """Load pretrained weights into the set-up model, each rank reading only its shards (after
        ``fabric.setup``; in Lightning from a hook such as ``on_fit_start``); see
        :func:`ds_strategy.checkpoint.pretrained.load_weights`."""
        if self.engine is None:
            raise RuntimeError(
                "load_pretrained needs the model set up first (fabric.setup, or a Lightning hook from on_fit_start on)"
            )
        load_weights(self.engine, path, prefix)

    def teardown(self) -> None:
        if self.engine is not None:
            release_engine(self.engine)
        else:  # setup failed: the error already raised must not be followed by another from moving meta tensors
            _drop_meta_tensors(getattr(self, "lightning_module", None))
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, fields in PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"ZeRO {fields}", **fields)


def _drop_meta_tensors(module) -> None:
    """Point the meta parameters and buffers of a module whose setup failed at empty CPU tensors, so teardown's
    ``module.cpu()`` succeeds; such a model is unusable either way, and allocating it whole could run out of memory."""
    if module is None:
        return
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and p.is_meta:
                torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(0, dtype=p.dtype), p.requires_grad))
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty(0, dtype=buffer.dtype)


def backward_through_loss_scale(
    engines: list[ZeroEngine], loss: torch.Tensor, refusal: str, *args: Any, **kwargs: Any
) -> None:
    """Backward of ``loss`` with no model named: through the fp16 loss scale of the one trained model that has one,
    if any. One backward may reach several models (a generator's loss through the discriminator); each engine
    reduces its own model's gradients. Several fp16 models each keep their own scale: ``refusal`` then says how to
    name the one meant."""
    scaled = [engine for engine in engines if engine.optimizer is not None and engine.loss_scaler is not None]
    if len(scaled) > 1:
        raise ValueError(refusal)
    (scaled[0].scale_loss(loss) if scaled else loss).backward(*args, **kwargs)


def release_engine(engine: ZeroEngine) -> None:
    """What a strategy's teardown undoes on its model: full parameters back to shards, the engine's hooks and its
    activation checkpointing removed."""
    engine.reshard()
    engine.remove_hooks()
    remove_activation_checkpointing(engine.module)


def zero_grad_through_engine(optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> None:
    """Make ``optimizer.zero_grad()`` clear the gradients ``engine`` keeps for that optimizer's parameters.

    Note: [zero_grad through the engine]
    The engine keeps a model's reduced gradients in its own buffers, which the retargeted optimizer's ``zero_grad``
    does not reach, and ``engine.step(optimizer)`` clears only those of the optimizer it steps. A backward may
    reach parameters other than those the next step trains (a generator's loss through the discriminator; one of
    several optimizers of one model stepped at a time), and, as under DDP, the user's ``opt_d.zero_grad()`` must
    drop what it left in the discriminator's. Fabric's and Lightning's optimizer wrappers call the ``zero_grad``
    of the optimizer's class, so the optimizer gets a subclass of its own class (as Fabric's wrapper itself does)
    whose ``zero_grad`` is the engine's for that optimizer; everything else is the class it was.
    """
    base = type(optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine.zero_grad(optimizer)  # not ``self``: Lightning's wrapper shares this class and calls it as its own

    optimizer.__class__ = type(base.__name__, (base,), {"zero_grad": zero_grad, "__module__": base.__module__})
