"""A DeepSpeed config's optimizer and scheduler sections, put into the Lightning loop the way DeepSpeed uses them.

Lightning's DeepSpeed strategy convention: the config's ``optimizer`` is built when ``configure_optimizers``
returns None (Lightning then holds a placeholder optimizer); its ``scheduler`` steps once per optimizer step, on
whichever optimizer is used. Defining either in both places is an error rather than a silent choice.
"""

from __future__ import annotations

from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.utilities.types import LRSchedulerConfig

from ..deepspeed.optimizer_section import OptimizerSections


def apply_optimizer_sections(strategy, sections: OptimizerSections) -> None:
    """Replace Lightning's placeholder optimizer and add the scheduler, from ``sections``, on ``strategy``."""
    user_optimizers = [opt for opt in strategy.optimizers if not isinstance(opt, _MockOptimizer)]
    if sections.optimizer is not None:
        if user_optimizers:
            raise ValueError(
                "both configure_optimizers and the DeepSpeed config's optimizer section define an "
                "optimizer; return None from configure_optimizers or remove the section"
            )
        strategy.optimizers = [sections.build_optimizer(strategy.lightning_module.parameters())]
    if sections.scheduler is not None:
        if strategy.lr_scheduler_configs:
            raise ValueError(
                "both configure_optimizers and the DeepSpeed config's scheduler section define an LR "
                "scheduler; remove one"
            )
        if len(strategy.optimizers) != 1 or isinstance(strategy.optimizers[0], _MockOptimizer):
            raise ValueError(
                "the DeepSpeed config's scheduler section needs one optimizer, from configure_optimizers "
                "or the config's optimizer section"
            )
        scheduler = sections.build_scheduler(strategy.optimizers[0])
        strategy.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval="step")]
