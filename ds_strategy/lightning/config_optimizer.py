"""A DeepSpeed config's optimizer and scheduler sections, put into the Lightning loop by the rule every adapter
follows (Note: [A DeepSpeed config's optimizer wins] in ``ds_strategy.adapters.optimizer_sections``).

``configure_optimizers`` may return None when the config has an optimizer section; Lightning then holds a placeholder
optimizer. The config's scheduler steps through Lightning's loop, once per optimizer step.
"""

from __future__ import annotations

from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig

from ..adapters.optimizer_sections import optimizers_to_train
from ..config.deepspeed.optimizer_section import OptimizerSections


def apply_optimizer_sections(strategy, sections: OptimizerSections) -> None:
    """Replace Lightning's optimizers (a placeholder or the module's) and add the scheduler, from ``sections``,
    on ``strategy``."""
    if sections.optimizer is None and sections.scheduler is None:
        return
    given = [opt for opt in strategy.optimizers if not isinstance(opt, _MockOptimizer)]
    optimizers, schedulers, scheduler = optimizers_to_train(
        sections,
        strategy.lightning_module.parameters(),
        given,
        strategy.lr_scheduler_configs,
        source="configure_optimizers",
        gave="configure_optimizers returned",
        theirs="configure_optimizers' optimizer",
        warn=rank_zero_warn,
    )
    strategy.optimizers = optimizers if sections.optimizer is not None else strategy.optimizers
    strategy.lr_scheduler_configs = schedulers + ([LRSchedulerConfig(scheduler, interval="step")] if scheduler else [])
