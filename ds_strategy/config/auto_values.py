"""DeepSpeed's "auto" sizes, derived from a model's hidden size the way the Hugging Face integration does."""

from __future__ import annotations

from collections import Counter

import torch

_HIDDEN_SIZE_ATTRIBUTES = ("hidden_size", "n_embd", "d_model")


def hidden_size_of(module: torch.nn.Module) -> int:
    """The model width: a ``hidden_size`` / ``n_embd`` / ``d_model`` attribute on ``module`` or on
    ``module.config``, else the most common last dimension of the 2-D parameters (ties go to the larger).

    Call it before stage 3 shards the parameters; a sharded parameter no longer has its logical shape.
    """
    for owner in (module, getattr(module, "config", None)):
        for attribute in _HIDDEN_SIZE_ATTRIBUTES:
            value = getattr(owner, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    widths = Counter(p.shape[-1] for p in module.parameters() if p.dim() == 2)
    if not widths:
        raise ValueError(
            f"cannot infer the hidden size of {type(module).__name__}: it has no "
            f"{'/'.join(_HIDDEN_SIZE_ATTRIBUTES)} attribute and no 2-D parameters; "
            "give the sizes set to 'auto' explicit values instead"
        )
    width, _count = max(widths.items(), key=lambda item: (item[1], item[0]))
    return width


def deepspeed_auto_values(hidden_size: int) -> dict[str, int]:
    """ZeroConfig field values DeepSpeed's HF integration substitutes for ``"auto"`` at this hidden size."""
    return {
        "reduce_bucket_size": hidden_size * hidden_size,
        "prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "param_persistence_threshold": 10 * hidden_size,
    }
