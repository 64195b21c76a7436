"""Sequence tiling: what acts on each token independently runs over tiles of the sequence, each tile recomputed in
backward, so that activations as long as the sequence *and* as wide as the MLP or the vocabulary never exist whole.

At long sequences two activations dominate a decoder's memory outside attention: the MLP's intermediate ones
(``tokens x intermediate_size``, several of them) and, worst, the ``[tokens, vocab]`` logits with their fp32 copy
and softmax for the loss. Both are computed per token, so running them one tile of tokens at a time is exact, and
with each tile under a non-reentrant ``checkpoint`` only the tile's input is kept: backward recomputes one tile,
differentiates it and frees it before the next. This is Arctic Long Sequence Training's tiled MLP and tiled logits
and loss (DeepSpeed's ``TiledMLP``, ``TiledFusedLogitsLoss``), written with ``torch.utils.checkpoint`` so that every
parameter's gradient arrives once, summed over the tiles by autograd, and the engine's gradient hooks fire as
without tiling (DeepSpeed instead tells its reducer to ignore all but the last tile).

A ``tile_tokens``-token tile holds ``tile_tokens x intermediate_size`` MLP activations and ``tile_tokens x vocab``
logits; "auto" is the hidden size, which makes those the size of the weight that produces them (ALST's choice for
the MLP).

:func:`apply_sequence_tiling` switches a model's MLPs and its Hugging Face causal-LM loss to tiles in place, as the
config asks (``compose_model`` calls it for every entry point); parameter names and state dicts do not change.
Other models call :func:`tiled_apply` and :func:`tiled_cross_entropy` themselves.

Note: [A tiled loss never makes the logits]
  A Hugging Face causal LM computes ``logits = lm_head(hidden)`` in its forward and then
  ``self.loss_function(logits=logits, labels=...)``. The model's own forward is kept (its arguments, its backbone,
  an MoE auxiliary loss it adds): while a forward given ``labels`` runs, the LM head hands its input through
  unchanged and the loss function, replaced on the model, gets the hidden states and computes logits and
  cross-entropy one tile at a time (:func:`tiled_cross_entropy`, with the token counts and ``shift_labels`` of
  transformers' ``ForCausalLMLoss``). The loss function checks that it received exactly what the head returned: a
  model that transforms its logits in between (soft-capping, scaling) is refused rather than trained on the wrong
  loss. That forward returns no logits (``output.logits`` is None; they were never made); one without labels
  (generation, evaluation without a loss) runs the head whole as usual.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config.auto_values import hidden_size_of
from .config.policies import ActivationPolicy
from .profiler_ranges import profiler_range

AUTO = "auto"
MLP_NAMES = ("mlp",)  # the attribute Hugging Face decoder layers (Llama, Mistral, Qwen, GPT-2...) and our GPT use


def tiled_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """``fn(x)`` for an ``fn`` that acts on each token (dimension -2 of ``x``) on its own, computed ``tile_tokens``
    tokens at a time, each tile recomputed in backward: ``fn``'s intermediate activations exist for one tile only."""
    if x.dim() < 2 or x.shape[-2] <= tile_tokens:
        return fn(x)
    tiles = x.split(tile_tokens, dim=-2)
    if not torch.is_grad_enabled():
        return torch.cat([fn(tile) for tile in tiles], dim=-2)
    return torch.cat([checkpoint(fn, tile, use_reentrant=False) for tile in tiles], dim=-2)


def _tile_loss_sum(head: Callable, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = head(hidden).float()  # upcast as transformers' loss does, one tile at a time
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def tiled_cross_entropy(
    hidden: torch.Tensor, head: Callable, labels: torch.Tensor, tile_tokens: int, ignore_index: int = -100
) -> torch.Tensor:
    """The summed cross-entropy of ``head(hidden)`` ([..., tokens, hidden] -> logits) against ``labels``
    ([..., tokens]), computed ``tile_tokens`` tokens at a time: each tile's logits are made, reduced and freed, and
    made again in backward. Divide by the token count for a mean."""
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    with profiler_range("tile.loss"):
        for start in range(0, flat_labels.numel(), tile_tokens):
            h, y = flat_hidden[start : start + tile_tokens], flat_labels[start : start + tile_tokens]
            if torch.is_grad_enabled():
                total = total + checkpoint(_tile_loss_sum, head, h, y, ignore_index, use_reentrant=False)
            else:
                total = total + _tile_loss_sum(head, h, y, ignore_index)
    return total


class TiledMlp:
    """An MLP's forward over tiles of the sequence; set as the module's instance ``forward``."""

    def __init__(self, name: str, mlp: nn.Module, tile_tokens: int):
        self.name = name
        self.original = mlp.forward
        self.original_was_set_on_instance = "forward" in mlp.__dict__
        self.tile_tokens = tile_tokens

    def __call__(self, hidden: torch.Tensor, *args, **kwargs):
        def per_tile(tile: torch.Tensor) -> torch.Tensor:
            out = self.original(tile, *args, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"tiled_mlp: {self.name} returns {type(out).__name__}, not one tensor of its input's length "
                    f"(a mixture of experts with a router output?); set tiled_mlp=False for this model"
                )
            return out

        with profiler_range("tile.mlp", self.name):
            return tiled_apply(per_tile, hidden, self.tile_tokens)


class TiledCausalLMLoss:
    """A Hugging Face causal LM's forward with its loss computed in tiles (Note: [A tiled loss never makes the
    logits]): set as the model's instance ``forward``, with :meth:`head_forward` as its LM head's and
    :meth:`loss` as its ``loss_function``."""

    def __init__(self, model: nn.Module, tile_tokens: int):
        self.model_name = type(model).__name__
        self.head = model.get_output_embeddings()
        self.tile_tokens = tile_tokens
        self.original = model.forward
        self.original_was_set_on_instance = "forward" in model.__dict__
        self.original_head = self.head.forward
        self.original_head_was_set_on_instance = "forward" in self.head.__dict__
        self.original_loss = model.loss_function
        self.original_loss_was_set_on_instance = "_loss_function" in model.__dict__  # transformers' setter
        self._armed = False
        self._deferred: torch.Tensor | None = None
        self._used = False

    def __call__(self, *args, **kwargs):
        if kwargs.get("labels") is None:
            return self.original(*args, **kwargs)
        self._armed, self._deferred, self._used = True, None, False
        try:
            output = self.original(*args, **kwargs)
        finally:
            self._armed = False
        deferred, self._deferred = self._deferred, None
        if deferred is None:  # the forward computed its loss another way (TRL's fused head): nothing to undo
            return output
        if not self._used:
            raise RuntimeError(
                f"tiled_loss: {self.model_name}'s forward ran its LM head but computed no loss through "
                f"self.loss_function, so its logits were never made; set tiled_loss=False for this model"
            )
        if not isinstance(output, Mapping):
            raise TypeError(f"tiled_loss needs {self.model_name}'s forward to return a ModelOutput (return_dict=True)")
        return type(output)(**{key: value for key, value in output.items() if key != "logits"})

    def head_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self._armed:
            return self.original_head(hidden, *args, **kwargs)
        self._deferred = hidden
        return hidden

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """transformers' ``ForCausalLMLoss`` on the hidden states the head deferred: labels shifted unless
        ``shift_labels`` are given, summed over ``num_items_in_batch`` when given, else the mean over labelled
        tokens."""
        if not self._armed:
            return self.original_loss(
                logits=logits,
                labels=labels,
                vocab_size=vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if logits is not self._deferred:
            raise ValueError(
                f"tiled_loss: {self.model_name} changes its logits between the LM head and the loss (soft-capping or "
                f"scaling), which a tiled loss would skip; set tiled_loss=False for this model"
            )
        self._used = True
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        total = tiled_cross_entropy(logits, self.original_head, shift_labels, self.tile_tokens, ignore_index)
        if num_items_in_batch is None:
            return total / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


def apply_sequence_tiling(module: nn.Module, policy: ActivationPolicy) -> list[str]:
    """Tile ``module``'s MLPs (``policy.tiled_mlp``: every submodule held under one of ``MLP_NAMES``) and the loss
    of each Hugging Face causal LM in it (``policy.tiled_loss``), ``policy.tile_tokens`` tokens per tile; returns
    the names of what was tiled. Raises when a switch finds nothing to tile. Applying again replaces the tiles."""
    remove_sequence_tiling(module)
    tiled: list[str] = []
    if policy.tiled_mlp:
        for name, sub in module.named_modules():
            if name.rpartition(".")[2] in MLP_NAMES:
                sub.forward = TiledMlp(name, sub, _tile_tokens(module, sub, policy.tile_tokens))
                tiled.append(name)
        if not tiled:
            raise ValueError(
                f"tiled_mlp=True found no MLP in {type(module).__name__}: it tiles submodules named "
                f"{list(MLP_NAMES)} (the decoder layers' feed-forward in Hugging Face models and ds_strategy's GPT)"
            )
    if policy.tiled_loss:
        models = _causal_lms(module)
        if not models:
            raise ValueError(
                f"tiled_loss=True found no Hugging Face causal language model in {type(module).__name__}; other "
                f"models call ds_strategy.sequence_tiling.tiled_cross_entropy on their hidden states themselves"
            )
        for name, model in models:
            if any(type(p).__name__ == "DTensor" for p in model.get_output_embeddings().parameters()):
                raise ValueError(
                    f"tiled_loss=True with a tensor-parallel LM head ({name or type(model).__name__}): the tiles "
                    f"need the whole vocabulary on each rank; leave the LM head out of the tensor-parallel plan"
                )
            tiled_loss = TiledCausalLMLoss(model, _tile_tokens(module, model, policy.tile_tokens))
            model.forward = tiled_loss
            tiled_loss.head.forward = tiled_loss.head_forward
            model.loss_function = tiled_loss.loss
            tiled.append(name or type(model).__name__)
    return tiled


def remove_sequence_tiling(module: nn.Module) -> None:
    """Give every tiled submodule of ``module`` back the forward (and loss function) it had."""
    for sub in module.modules():
        patched = sub.__dict__.get("forward")
        if isinstance(patched, TiledMlp):
            _restore_forward(sub, patched)
        elif isinstance(patched, TiledCausalLMLoss):
            _restore_forward(sub, patched)
            del patched.head.forward
            if patched.original_head_was_set_on_instance:
                patched.head.forward = patched.original_head
            del sub._loss_function
            if patched.original_loss_was_set_on_instance:
                sub.loss_function = patched.original_loss


def _restore_forward(sub: nn.Module, patched: TiledMlp | TiledCausalLMLoss) -> None:
    del sub.forward
    if patched.original_was_set_on_instance:
        sub.forward = patched.original


def _tile_tokens(root: nn.Module, owner: nn.Module, tile_tokens: int | str) -> int:
    """``tile_tokens``, or for "auto" the hidden size (read from the model that holds ``owner``, or ``owner``)."""
    if tile_tokens != AUTO:
        return int(tile_tokens)
    for candidate in (owner, root):
        try:
            return hidden_size_of(candidate)
        except ValueError:
            continue
    raise ValueError(f'tile_tokens="auto" cannot find the hidden size of {type(root).__name__}; give a number')


def _causal_lms(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models with an LM head and a loss function inside ``module`` (named)."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model has imported it already
    if transformers is None:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if any(name.startswith(outer + ".") or outer == "" for outer, _ in found):
            continue
        if isinstance(sub, transformers.PreTrainedModel) and isinstance(sub.get_output_embeddings(), nn.Module):
            found.append((name, sub))
    return found
