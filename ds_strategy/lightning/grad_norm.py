"""``grad_norm`` for a LightningModule that ZeroStrategy trains: Lightning's ``grad_norm(module, norm_type)``, whose
``param.grad`` is None at stage 2/3, computed from the engine's gradient shards in one collective."""

from __future__ import annotations

import torch
from torch import nn


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """What ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` returns under DDP (each parameter's gradient
    norm under ``grad_{norm_type}_norm{group_separator}{name}`` and their total under ``grad_{norm_type}_norm_total``),
    at every ZeRO stage; call it on every rank, from ``on_before_optimizer_step``, e.g.
    ``self.log_dict(grad_norm(self, norm_type=2))``. Without a ZeroStrategy engine, Lightning's own."""
    engine = getattr(module.trainer.strategy, "engine", None)
    if engine is None:
        from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

        return lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    by_engine_name = engine.grad_norms(norm_type)
    engine_names = {id(p): name for name, p in engine.module.named_parameters()}
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": by_engine_name[engine_names[id(p)]]
        for name, p in module.named_parameters()
        if engine_names.get(id(p)) in by_engine_name
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms
