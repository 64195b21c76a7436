"""The hook that builds a stage-3 ZeroTrainer's model sharded when the script builds it before the Trainer exists.

Note: [Building sharded before the Trainer exists]
Hugging Face scripts parse ``TrainingArguments(deepspeed="ds_config_zero3.json")`` first and build the model second,
with ``from_pretrained`` or ``from_config``; transformers then builds it inside DeepSpeed's ``zero.Init``, so that
no rank ever holds it whole. For a ZeroTrainer the model must instead be built on the meta device, its values read
(or drawn) shard by shard when the trainer prepares it (:mod:`.pretrained`). No ds_strategy code runs between the
arguments and the model except the import of ``ds_strategy.transformers``, so that import wraps two of transformers'
class methods, ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config`` (every model class and every
``AutoModel...`` class reaches them). The wrappers call transformers' own unless a stage-3 configuration is armed:

- transformers' own DeepSpeed switch (``is_deepspeed_zero3_enabled()``): a ``TrainingArguments(deepspeed=<stage 3>)``
  is alive, which needs the deepspeed package;
- a :class:`~.trainer_config.ZeroTrainingArguments` whose configuration (``deepspeed=``, else
  ``$DS_STRATEGY_CONFIG``) is stage 3, which needs no deepspeed package.

Armed, they build with :func:`.pretrained.sharded_from_pretrained` and :func:`.pretrained.sharded_from_config`;
DeepSpeed's ``zero.Init`` never runs. An arming lasts from the arguments' creation until a ZeroTrainer takes the
configuration off them (or until they are gone, as transformers' own DeepSpeed config lasts): the trainer then owns
the configuration and transformers no longer sees DeepSpeed, so a model built after the trainer exists is built
whole, as without ds_strategy. The trainer arms the hook again for the length of its own builds (``model_init``).
So nothing of the hook outlives the trainer's construction, even though a trainer itself is not promptly freed; the
wrappers then only call transformers'. ``building_whole()`` builds normally while armed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from typing import Any

import transformers
from transformers.integrations import deepspeed as hf_deepspeed

from .pretrained import is_building_sharded, sharded_from_config, sharded_from_pretrained

_ORIGINAL_FROM_PRETRAINED = transformers.PreTrainedModel.from_pretrained.__func__
_ORIGINAL_FROM_CONFIG = transformers.PreTrainedModel._from_config.__func__
ARMING_ATTR = "_ds_strategy_sharded_build"
logger = logging.getLogger(__name__)
_armings: weakref.WeakSet = weakref.WeakSet()
_whole = threading.local()


class _Arming:
    """A stage-3 configuration's hold on the hook, kept by the arguments that carry the configuration."""


def arm(holder: Any) -> None:
    """Arm the hook for as long as ``holder`` (a ``TrainingArguments``) lives, or until :func:`disarm`."""
    arming = _Arming()
    holder.__dict__[ARMING_ATTR] = arming
    _armings.add(arming)


def disarm(holder: Any) -> None:
    """Undo :func:`arm` (nothing if ``holder`` armed nothing)."""
    arming = holder.__dict__.pop(ARMING_ATTR, None)
    if arming is not None:
        _armings.discard(arming)


@contextlib.contextmanager
def armed_while(stage3: bool):
    """Inside, armed when ``stage3`` (a ZeroTrainer's own builds: ``model_init``)."""
    arming = _Arming()
    if stage3:
        _armings.add(arming)
    try:
        yield
    finally:
        _armings.discard(arming)


def armed() -> bool:
    """Whether ``from_pretrained``/``from_config`` build sharded now."""
    if is_building_sharded() or getattr(_whole, "depth", 0):
        return False
    return len(_armings) > 0 or hf_deepspeed.is_deepspeed_zero3_enabled()


@contextlib.contextmanager
def building_whole():
    """Inside, transformers builds models as it would without ds_strategy, armed or not (DeepSpeed's ``zero.Init``
    included, when transformers' own switch is on)."""
    _whole.depth = getattr(_whole, "depth", 0) + 1
    try:
        yield
    finally:
        _whole.depth -= 1


def _from_pretrained(cls, *args: Any, **kwargs: Any):
    if armed():
        logger.info(f"Detected DeepSpeed ZeRO-3: building {cls.__name__} sharded for ds_strategy's ZeroTrainer")
        return sharded_from_pretrained(cls, *args, **kwargs)
    return _ORIGINAL_FROM_PRETRAINED(cls, *args, **kwargs)


def _from_config(cls, config: Any, **kwargs: Any):
    if armed():
        logger.info(f"Detected DeepSpeed ZeRO-3: building {cls.__name__} sharded for ds_strategy's ZeroTrainer")
        return sharded_from_config(cls, config, **kwargs)
    return _ORIGINAL_FROM_CONFIG(cls, config, **kwargs)


def install() -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` and ``_from_config`` (once); see the Note above."""
    if getattr(transformers.PreTrainedModel.from_pretrained, "__wrapped__", None) is _ORIGINAL_FROM_PRETRAINED:
        return
    transformers.PreTrainedModel.from_pretrained = classmethod(
        functools.wraps(_ORIGINAL_FROM_PRETRAINED)(_from_pretrained)
    )
    transformers.PreTrainedModel._from_config = classmethod(functools.wraps(_ORIGINAL_FROM_CONFIG)(_from_config))
