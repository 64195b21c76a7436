"""``deepspeed.zero``: ``Init`` (build a model sharded: here, parameters on the meta device, which the engine
materialises one unit at a time, keeping only this rank's shards) and ``GatheredParameters`` (a block in which
partitioned parameters are whole, one rank may change them, and every rank gets its values)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..zero.meta_parameters import parameters_on_meta
from . import comm


class Init(contextlib.ContextDecorator):
    """``with deepspeed.zero.Init(config_dict_or_path=ds_config): model = Model()``: the parameters the block builds
    go to the meta device (buffers stay real: Note: [Only parameters go to the meta device]) and
    ``deepspeed.initialize`` initialises them shard by shard (each module's ``reset_parameters``, or a Hugging Face
    model's ``_init_weights``), the whole model never held by one rank. Ranks must build under the same seed, as
    under DeepSpeed. ``enabled=False`` builds normally. DeepSpeed's other arguments are accepted and have no effect
    here (the engine places and shards by the config ``initialize`` reads)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Mapping | str | os.PathLike | None = None,
        config: Mapping | str | os.PathLike | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **unused: Any,
    ):
        if module is not None:
            raise NotImplementedError(
                "zero.Init(module=...) partitions a model built already; build it inside `with zero.Init():` "
                "instead, or pass it to deepspeed.initialize as it is"
            )
        self.enabled = enabled
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Init:
        self._stack = contextlib.ExitStack()
        if self.enabled:
            self._stack.enter_context(parameters_on_meta())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


@contextlib.contextmanager
def GatheredParameters(  # noqa: N802 (DeepSpeed's name)
    params: nn.Parameter | Iterable[nn.Parameter],
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
):
    """Within the block ``params`` hold their whole values on every rank; with ``modifier_rank``, what that rank
    writes into them is what every rank holds afterwards (broadcast, then written back into the shards). A
    collective: every rank enters it. Parameters no engine shards (a model before ``initialize``) are whole
    already, and ``modifier_rank``'s values are broadcast the same way."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not enabled or not params:
        yield
        return
    if any(p.is_meta for p in params):
        raise ValueError(
            "GatheredParameters: these parameters are on the meta device (built under zero.Init) and get their "
            "values in deepspeed.initialize; change them there (the module's reset_parameters) or after initialize"
        )
    engine = _engine_holding(params)
    if engine is None:
        yield
        _broadcast_from(params, modifier_rank)
        return
    with engine.zero.gathered_parameters():
        yield
        if modifier_rank is not None:
            _broadcast_from(params, modifier_rank)
            values = [p.detach().clone() for p in params]
    if modifier_rank is not None:
        _write_back(engine, params, values)


def _engine_holding(params: list[nn.Parameter]):
    from .initialize import ENGINES

    wanted = {id(p) for p in params}
    for engine in ENGINES:
        if any(id(p) in wanted for p in engine.zero.module.parameters()):
            return engine
    return None


def _broadcast_from(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    if modifier_rank is None:
        return
    with torch.no_grad():
        for p in params:
            comm.broadcast(p.data, src=modifier_rank)


def _write_back(engine, params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    """``values`` (the gathered ``params`` as the block left them) into the engine's fp32 masters, then every compute
    copy refreshed from them."""
    names = {id(p): name for name, p in engine.zero.module.named_parameters()}
    with torch.no_grad():
        for p, value in zip(params, values):
            flat = value.reshape(-1)
            for _, master, start in engine.zero.master_pieces(names[id(p)]):
                master.copy_(flat.narrow(0, start, master.numel()).to(master.dtype))
    engine.zero.refresh_from_masters()
