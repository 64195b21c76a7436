"""Parameters this rank holds as copies of a parameter another pipeline stage owns (an LM head tied to the embedding
on another rank's stage).

Note: [Tied copies]
  The engine keeps a tied copy in flat buffers of its own, names it by its owner's name (so checkpoints and
  pretrained loading find one tensor under one name) and leaves it out of the gradient norm, which the owner counts.
  Whoever cuts the model into stages marks the copies before the engine is built; the engine reads the marks when it
  lays out its units, and knows nothing else about pipelines.
"""

from __future__ import annotations

from torch import nn

_OWNER_ATTR = "_ds_strategy_tied_owner"


def mark_tied_copy(param: nn.Parameter, owner_name: str) -> None:
    """Mark ``param`` as this rank's copy of the parameter another stage saves as ``owner_name``."""
    setattr(param, _OWNER_ATTR, owner_name)


def tied_copy_owner(param: nn.Parameter) -> str | None:
    """The owner's name if ``param`` is a tied copy, else None."""
    return getattr(param, _OWNER_ATTR, None)
