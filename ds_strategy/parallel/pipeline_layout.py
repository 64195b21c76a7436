"""Where a model's pipeline pieces are: what runs before its repeated blocks, the blocks, and what runs after.

A pipeline stage runs a contiguous run of blocks, the first stage the embedding before them and the last the
final norm and head after them. A layout finds those pieces inside the user's module (a LightningModule holding a
Hugging Face decoder, our GPT, or an ``nn.Sequential``) by their global names, and says how a stage calls them, so
nobody rewrites the model as a layer list (DeepSpeed's ``PipelineModule``). Unowned pieces are set to None in
place (``pipeline_split``), which keeps every parameter's global name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """The pieces of one model, named from the root module.

    ``blocks``: the ModuleList (or Sequential) of repeated blocks. ``before`` / ``after``: the modules the first /
    last stage owns besides its blocks. ``helpers``: parameterless modules every stage calls (rotary embeddings).
    ``embed(x, offset)``, ``run_block(block, h)`` and ``head(h)`` are what a stage calls; ``prepare(h, offset)``
    gives the keyword arguments every block of a stage takes (positions, masks), computed on each stage from its
    input. ``offset`` is the position of the input's first token in the whole sequence: 0, or under Ulysses the
    start of this rank's slice (Note: [Positions of a sequence slice on every stage] in ``pipeline.runner``).
    """

    kind: str
    blocks: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    helpers: tuple[str, ...]
    embed: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
    run_block: Callable[[nn.Module, torch.Tensor, dict], torch.Tensor]
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    prepare: Callable[[nn.Module, torch.Tensor, int], dict]


def _get(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name) if name else root


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _no_kwargs(root: nn.Module, h: torch.Tensor, offset: int) -> dict:
    return {}


def _positions(h: torch.Tensor, offset: int) -> torch.Tensor:
    """The absolute positions of ``h``'s tokens (dimension 1), its first at ``offset``, as a [1, seq] row."""
    return torch.arange(offset, offset + h.shape[1], device=h.device).unsqueeze(0)


def _hf_decoder(root: nn.Module, prefix: str, base: str) -> PipelineLayout:
    """A Hugging Face causal LM in the Llama shape (``base.embed_tokens``, ``base.layers``, ``base.norm``,
    ``base.rotary_emb``, ``lm_head``): Llama, Mistral, Qwen2/3, Mixtral and their relatives."""
    base_path = _join(prefix, base)

    def prepare(root, h, offset):
        from transformers.masking_utils import create_causal_mask  # only models from transformers get here

        model = _get(root, base_path)
        positions = _positions(h, offset)
        mask = create_causal_mask(
            config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        return {
            "attention_mask": mask,
            "position_ids": positions,
            "position_embeddings": model.rotary_emb(h, position_ids=positions),
        }

    def run_block(block, h, kwargs):
        out = block(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return PipelineLayout(
        kind="Hugging Face decoder",
        blocks=_join(base_path, "layers"),
        before=(_join(base_path, "embed_tokens"),),
        after=(_join(base_path, "norm"), _join(prefix, "lm_head")),
        helpers=(_join(base_path, "rotary_emb"),),
        embed=lambda root, ids, offset: _get(root, _join(base_path, "embed_tokens"))(ids),
        run_block=run_block,
        head=lambda root, h: _get(root, _join(prefix, "lm_head"))(_get(root, _join(base_path, "norm"))(h)),
        prepare=prepare,
    )


def _our_gpt(root: nn.Module, prefix: str) -> PipelineLayout:
    """:class:`ds_strategy.models.gpt.GPT`: ``embed``, ``blocks``, ``ln_f``, ``lm_head`` (tied to the embedding)."""
    return PipelineLayout(
        kind="GPT",
        blocks=_join(prefix, "blocks"),
        before=(_join(prefix, "embed"),),
        after=(_join(prefix, "ln_f"), _join(prefix, "lm_head")),
        helpers=(),
        embed=lambda root, idx, offset: _get(root, _join(prefix, "embed"))(idx, _positions(idx, offset)[0]),
        run_block=lambda block, h, kwargs: block(h),
        head=lambda root, h: _get(root, _join(prefix, "lm_head"))(_get(root, _join(prefix, "ln_f"))(h)),
        prepare=_no_kwargs,
    )


def _sequential(root: nn.Module, prefix: str) -> PipelineLayout:
    """An ``nn.Sequential``: every child is a block, the input goes to the first."""
    return PipelineLayout(
        kind="nn.Sequential",
        blocks=prefix,
        before=(),
        after=(),
        helpers=(),
        embed=lambda root, x, offset: x,
        run_block=lambda block, h, kwargs: block(h),
        head=lambda root, h: h,
        prepare=_no_kwargs,
    )


def _layout_at(root: nn.Module, name: str, module: nn.Module) -> PipelineLayout | None:
    from ..models.gpt import GPT  # the model package imports nothing from here

    if isinstance(module, GPT):
        return _our_gpt(root, name)
    lm_head = getattr(module, "lm_head", None)
    prefix = getattr(module, "base_model_prefix", "")
    base = getattr(module, prefix, None) if prefix else None
    if isinstance(lm_head, nn.Module) and isinstance(base, nn.Module):
        if all(isinstance(getattr(base, a, None), nn.Module) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return _hf_decoder(root, name, prefix)
    if isinstance(module, nn.Sequential) and len(module) > 1:
        return _sequential(root, name)
    return None


def find_layout(root: nn.Module) -> PipelineLayout:
    """The layout of the outermost supported model inside ``root`` (``root`` itself included)."""
    for name, module in root.named_modules():
        layout = _layout_at(root, name, module)
        if layout is not None:
            return layout
    raise ValueError(
        f"pipeline_parallel_size > 1 needs a model whose stages can be cut without rewriting it; found none in "
        f"{type(root).__name__}. Supported: a Hugging Face causal LM in the Llama shape (model.embed_tokens, "
        f"model.layers, model.norm, model.rotary_emb, lm_head: Llama, Mistral, Qwen2/3, Mixtral), "
        f"ds_strategy.models.GPT, or an nn.Sequential of blocks"
    )
