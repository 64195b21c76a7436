"""A DeepSpeed config's optimizer and scheduler sections, put into the Lightning loop the way DeepSpeed uses them.

Lightning's DeepSpeed strategy convention: a config with an ``optimizer`` section trains with that optimizer, and
``configure_optimizers`` is not used (it may return None; Lightning then holds a placeholder optimizer). When it
does return an optimizer, the config's still wins, as under Lightning's DeepSpeed strategy, with a warning naming
both: a config taken over from a DeepSpeed run keeps training as it did there, and the module's optimizer (with the
LR schedulers stepping it, which would step an optimizer that no longer trains) is dropped. The config's
``scheduler`` steps once per optimizer step, on whichever optimizer is used. A scheduler defined in both places
(with the module's own optimizer) is an error rather than a silent choice.
"""

from __future__ import annotations

from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig

from ..config.deepspeed.optimizer_section import OptimizerSections


def apply_optimizer_sections(strategy, sections: OptimizerSections) -> None:
    """Replace Lightning's optimizers (a placeholder or the module's) and add the scheduler, from ``sections``,
    on ``strategy``."""
    user_optimizers = [opt for opt in strategy.optimizers if not isinstance(opt, _MockOptimizer)]
    if sections.optimizer is not None:
        if user_optimizers:
            schedulers = len(strategy.lr_scheduler_configs)
            dropped = f" and its {schedulers} LR scheduler(s)" if schedulers else ""
            rank_zero_warn(
                f"configure_optimizers returned {', '.join(type(opt).__name__ for opt in user_optimizers)}, but the "
                f"DeepSpeed config has an optimizer section (type {sections.optimizer[0]!r}): training uses the "
                f"config's optimizer, as Lightning's DeepSpeed strategy does, and ignores configure_optimizers' "
                f"optimizer{dropped}. Remove the config's optimizer section to train with your own."
            )
            strategy.lr_scheduler_configs = []
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
