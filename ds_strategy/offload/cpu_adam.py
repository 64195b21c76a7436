"""CpuAdam: the host optimizer step of ZeRO-Offload, one tiled multi-threaded pass over a flat shard.

Note: [One pass over the shard: torch's fused kernels, tiled on our own threads]
PyTorch ships fused CPU kernels for Adam/AdamW, Adagrad and SGD (``torch._fused_adamw_`` and friends, what
``torch.optim.AdamW(fused=True)`` runs): one vectorised, multi-threaded pass that reads p, g, m, v and writes p, m,
v, 28 bytes per fp32 element for Adam, at memory bandwidth. They are the arithmetic here, so nothing is compiled at
import or first use, and without a copy-out a shard is stepped by one call of them, as shipped. What they lack is
the 16-bit copy of the updated parameters that mixed precision needs; as a second pass it re-reads p (6 more bytes
per element). With a copy-out the shard is instead cut into tiles of ``TILE`` elements, each updated by the fused
kernel and copied out at once, while it is still in cache (2 more bytes per element). Many small calls would each
pay ATen's parallel fork/join, which stalls whenever a core is busy elsewhere, so the tiles run on a
:class:`TilePool`: one contiguous span per thread, each pool thread running torch with one intra-op thread.
``benchmarks/host_optimizer.py`` measures all of these against the machine's copy bandwidth.
Every kernel is elementwise and spans start at multiples of ``TILE``, so the result is the same bits whichever
way the shard is cut and however many threads run.

The update rules keep ``torch.optim``'s state layout (``step`` as a CPU fp32 scalar tensor, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, ``sum``, ``momentum_buffer``) and read hyperparameters from the param group
at every step, so a user's ``torch.optim.AdamW`` can be stepped by these kernels while its object, its LR
scheduler and its ``state_dict`` keep working (see :mod:`.host_optimizer`).
"""

from __future__ import annotations

import abc
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

TILE = 1 << 18  # elements per kernel call: 1 MiB of fp32 per tensor, so a tile's p/g/m/v stay in L2/L3


class TilePool:
    """Runs ``fn(lo, hi)`` over contiguous, ``TILE``-aligned spans of ``[0, n)``, one per thread.

    Pool threads run torch with one intra-op thread each; ``threads`` defaults to the caller's torch thread count,
    and with one thread everything runs inline on the caller's thread.
    """

    def __init__(self, threads: int | None = None):
        self.threads = max(1, threads if threads is not None else torch.get_num_threads())
        self._executor = (
            ThreadPoolExecutor(
                self.threads,
                thread_name_prefix="ds_strategy_host_step",
                initializer=torch.set_num_threads,
                initargs=(1,),
            )
            if self.threads > 1
            else None
        )
        if self._executor is not None:
            weakref.finalize(self, self._executor.shutdown, wait=False)

    def run(self, n: int, fn: Callable[[int, int], None]) -> None:
        tiles = math.ceil(n / TILE)
        if self._executor is None or tiles < 2:
            fn(0, n)
            return
        per_thread = math.ceil(tiles / self.threads) * TILE
        spans = [(lo, min(n, lo + per_thread)) for lo in range(0, n, per_thread)]
        for future in [self._executor.submit(fn, lo, hi) for lo, hi in spans]:
            future.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


# -- update rules --------------------------------------------------------------------------------------------------
class UpdateRule(abc.ABC):
    """One optimizer family's elementwise update of a tile, as one call of a fused torch kernel.

    ``keys(group)``: the elementwise state tensors, in the order ``update`` takes them. ``initial(key, optimizer)``:
    the value a fresh state starts at (None: the first step writes it). ``counts_steps``: keeps ``state["step"]``.
    """

    name = ""
    counts_steps = True

    @abc.abstractmethod
    def keys(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        """See the class docstring."""

    def initial(self, key: str, optimizer: torch.optim.Optimizer) -> float | None:
        return 0.0

    def is_first(self, state: Mapping[str, Any], group: Mapping[str, Any]) -> bool:
        return len(state) == 0

    @abc.abstractmethod
    def hyper(self, group: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """See the class docstring."""

    @abc.abstractmethod
    def update(
        self,
        hyper: dict[str, Any],
        param: torch.Tensor,
        grad: torch.Tensor,
        states: list[torch.Tensor],
        step: torch.Tensor | None,
        first: bool,
    ) -> None:
        """Update ``param`` and ``states`` in place for one tile."""


class AdamRule(UpdateRule):
    """``torch.optim.Adam`` (L2 weight decay) and ``AdamW`` (decoupled), with ``amsgrad`` and ``maximize``."""

    name = "Adam"

    def keys(self, group):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def hyper(self, group, optimizer):
        beta1, beta2 = (float(b) for b in group["betas"])
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        return {
            "kernel": torch._fused_adamw_ if decoupled else torch._fused_adam_,
            "lr": float(group["lr"]),
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": float(group["weight_decay"]),
            "eps": float(group["eps"]),
            "amsgrad": bool(group["amsgrad"]),
            "maximize": bool(group["maximize"]),
        }

    def update(self, hyper, param, grad, states, step, first):
        kernel = hyper["kernel"]
        kernel(
            [param],
            [grad],
            [states[0]],
            [states[1]],
            states[2:3],
            [step],
            lr=hyper["lr"],
            beta1=hyper["beta1"],
            beta2=hyper["beta2"],
            weight_decay=hyper["weight_decay"],
            eps=hyper["eps"],
            amsgrad=hyper["amsgrad"],
            maximize=hyper["maximize"],
        )


class AdagradRule(UpdateRule):
    """``torch.optim.Adagrad``: ``sum`` starts at the optimizer's ``initial_accumulator_value``."""

    name = "Adagrad"

    def keys(self, group):
        return ("sum",)

    def initial(self, key, optimizer):
        return float(optimizer.defaults["initial_accumulator_value"])

    def hyper(self, group, optimizer):
        return {
            "lr": float(group["lr"]),
            "lr_decay": float(group["lr_decay"]),
            "weight_decay": float(group["weight_decay"]),
            "eps": float(group["eps"]),
            "maximize": bool(group["maximize"]),
        }

    def update(self, hyper, param, grad, states, step, first):
        torch._fused_adagrad_([param], [grad], [states[0]], [step], **hyper)


class SgdRule(UpdateRule):
    """``torch.optim.SGD`` with momentum, dampening and Nesterov; the first step sets the buffer to the gradient."""

    name = "SGD"
    counts_steps = False

    def keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def initial(self, key, optimizer):
        return None

    def is_first(self, state, group):
        return group["momentum"] != 0 and state.get("momentum_buffer") is None

    def hyper(self, group, optimizer):
        return {
            "weight_decay": float(group["weight_decay"]),
            "momentum": float(group["momentum"]),
            "lr": float(group["lr"]),
            "dampening": float(group["dampening"]),
            "nesterov": bool(group["nesterov"]),
            "maximize": bool(group["maximize"]),
        }

    def update(self, hyper, param, grad, states, step, first):
        torch._fused_sgd_([param], [grad], states, **hyper, is_first_step=first)


def rule_for(optimizer: torch.optim.Optimizer) -> UpdateRule | None:
    """The host rule for exactly these classes (a subclass may change ``step``), or None: torch's own step."""
    if isinstance(optimizer, TiledOptimizer):
        return optimizer.rule
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return None
    rules = {
        torch.optim.Adam: AdamRule,
        torch.optim.AdamW: AdamRule,
        torch.optim.Adagrad: AdagradRule,
        torch.optim.SGD: SgdRule,
    }
    rule = rules.get(type(optimizer))
    return rule() if rule is not None else None


# -- the pass ------------------------------------------------------------------------------------------------------
def prepare_state(
    rule: UpdateRule,
    optimizer: torch.optim.Optimizer,
    group: Mapping[str, Any],
    state: dict,
    allocate: Callable[[str, float | None], torch.Tensor],
) -> bool:
    """Create a missing state as torch does on a parameter's first step (``allocate(key, initial)`` makes each
    tensor) and advance ``state["step"]``: once per parameter and step, before any of its tiles. Returns whether
    this is the first step (the rule's kernels may treat it specially)."""
    first = rule.is_first(state, group)
    if first:
        for key in rule.keys(group):
            state[key] = allocate(key, rule.initial(key, optimizer))
        if rule.counts_steps:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
    if rule.counts_steps:
        state["step"] += 1
    return first


def tiled_update(
    pool: TilePool,
    rule: UpdateRule,
    hyper: dict[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    step: torch.Tensor | None,
    first: bool,
    out: torch.Tensor | None = None,
) -> None:
    """Update 1-D ``param`` and ``states`` in place from ``grad``; with ``out`` (any dtype), tile by tile, each
    updated tile copied into ``out`` in the same pass (see [One pass over the shard])."""
    if out is None:  # torch's kernel over the whole shard is the fastest there is
        with torch.no_grad():
            rule.update(hyper, param, grad, states, step, first)
        return

    @torch.no_grad()  # grad mode is per thread: pool threads need it off as much as the caller
    def span(lo: int, hi: int) -> None:
        for a in range(lo, hi, TILE):
            b = min(hi, a + TILE)
            tile = param[a:b]
            rule.update(hyper, tile, grad[a:b], [s[a:b] for s in states], step, first)
            out[a:b].copy_(tile)

    pool.run(param.numel(), span)


# -- optimizers ----------------------------------------------------------------------------------------------------
class TiledOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` stepping host tensors with an :class:`UpdateRule` in one tiled pass each.

    ``step(param_copies={param: tensor})`` also writes each updated parameter into its tensor (e.g. the bf16 compute
    copy) in the same pass. Parameters must be contiguous CPU tensors.
    """

    rule: UpdateRule

    def __init__(self, params: Iterable, defaults: dict[str, Any], threads: int | None = None):
        super().__init__(params, defaults)
        self.pool = TilePool(threads)

    @torch.no_grad()
    def step(self, closure=None, param_copies: Mapping[torch.Tensor, torch.Tensor] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = param_copies or {}
        for group in self.param_groups:
            hyper = self.rule.hyper(group, self)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                first = prepare_state(
                    self.rule,
                    self,
                    group,
                    state,
                    lambda key, fill, p=p: torch.full_like(p, 0.0 if fill is None else fill),
                )
                out = copies.get(p)
                tiled_update(
                    self.pool,
                    self.rule,
                    hyper,
                    p.view(-1),
                    p.grad.view(-1),
                    [state[key].view(-1) for key in self.rule.keys(group)],
                    state.get("step"),
                    first,
                    None if out is None else out.view(-1),
                )
        return loss


class CpuAdam(TiledOptimizer):
    """Adam/AdamW on the host, with ``torch.optim.AdamW``'s semantics (``adamw_mode=False``: ``torch.optim.Adam``'s
    L2 weight decay), ``amsgrad`` and ``maximize``, and the 16-bit copy-out of :class:`TiledOptimizer`."""

    rule = AdamRule()

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        adamw_mode: bool = True,
        maximize: bool = False,
        threads: int | None = None,
    ):
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"CpuAdam: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                amsgrad=amsgrad,
                maximize=maximize,
                decoupled_weight_decay=adamw_mode,
            ),
            threads,
        )


class CpuAdagrad(TiledOptimizer):
    """Adagrad on the host with ``torch.optim.Adagrad``'s semantics."""

    rule = AdagradRule()

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        threads: int | None = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
                initial_accumulator_value=initial_accumulator_value,
            ),
            threads,
        )


class CpuSGD(TiledOptimizer):
    """SGD with momentum on the host with ``torch.optim.SGD``'s semantics."""

    rule = SgdRule()

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        threads: int | None = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                maximize=maximize,
            ),
            threads,
        )
