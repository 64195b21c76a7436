"""A DeepSpeed config's optimizer and scheduler sections, honoured by every adapter the same way.

Note: [A DeepSpeed config's optimizer wins]
    Lightning's DeepSpeed strategy's convention, followed by ZeroStrategy and ZeroFabricStrategy alike: a config with
    an ``optimizer`` section trains with that optimizer, built over the model's parameters. An optimizer the program
    built as well (returned by ``configure_optimizers``, passed to ``fabric.setup``) is replaced, with a warning naming
    both, so that a config taken over from a DeepSpeed run keeps training as it did there; the program's LR schedulers
    step the replaced optimizer, so they go with it (Fabric, which would hand them back to the loop, refuses them
    instead). The config's ``scheduler`` steps the optimizer that trains, once per optimizer step, as DeepSpeed's
    engine steps it; a scheduler from both the config and the program is an error rather than a silent choice, as is a
    scheduler section with no single optimizer to step. Accelerate and the Trainer meet the same sections through
    their own placeholders (``DummyOptim``/``DummyScheduler``; ``TrainingArguments``), filling "auto" as their
    DeepSpeed back-ends do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..config.deepspeed.optimizer_section import OptimizerSections


def optimizers_to_train(
    sections: OptimizerSections,
    parameters: Iterable[torch.nn.Parameter],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    *,
    source: str,
    gave: str,
    theirs: str,
    warn: Callable[[str], None],
) -> tuple[list[torch.optim.Optimizer], list[Any], Any | None]:
    """The program's ``optimizers`` and LR ``schedulers`` (placeholders left out) as Note: [A DeepSpeed config's
    optimizer wins] leaves them, and the config's scheduler (None without a scheduler section). Messages name where
    the program's come from: ``source`` ("configure_optimizers"), ``gave`` ("configure_optimizers returned") and
    ``theirs`` ("configure_optimizers' optimizer")."""
    if sections.optimizer is not None:
        if optimizers:
            dropped = f" and its {len(schedulers)} LR scheduler(s)" if schedulers else ""
            warn(
                f"{gave} {', '.join(type(opt).__name__ for opt in optimizers)}, but the DeepSpeed config has an "
                f"optimizer section (type {sections.optimizer[0]!r}): training uses the config's optimizer, as "
                f"Lightning's DeepSpeed strategy does, and ignores {theirs}{dropped}. Remove the config's optimizer "
                f"section to train with your own."
            )
            schedulers = []
        optimizers = [sections.build_optimizer(parameters)]
    if sections.scheduler is None:
        return optimizers, schedulers, None
    if schedulers:
        raise ValueError(
            f"both {source} and the DeepSpeed config's scheduler section define an LR scheduler; remove one"
        )
    if len(optimizers) != 1:
        raise ValueError(
            f"the DeepSpeed config's scheduler section needs one optimizer, from {source} or the config's optimizer "
            f"section"
        )
    return optimizers, schedulers, sections.build_scheduler(optimizers[0])
