"""DeepSpeed-Ulysses sequence parallelism: each rank of a sequence-parallel (sp) group holds one slice of the
sequence and full, replicated weights; attention alone needs the whole sequence, so it swaps the sequence split for
a head split with one all-to-all before it and one after.

Everything outside attention (embeddings, norms, MLPs, the LM head) acts on each token independently and runs on
the local slice unchanged. What does depend on where a token sits is handled here: the global positions
(:func:`shard_sequence`), the next-token labels (Note: [Shift labels before slicing]), the loss over all tokens
(Note: [Token-weighted loss]) and the gradient reduction (Note: [Ulysses gradient scale]).

Uneven lengths are not supported: the sequence length must be a multiple of the sp size (pad it, with labels
``-100``, before :func:`shard_sequence`), and every rank's slice must be equally long.

Note: [Ulysses inside tensor parallelism]
The mesh is (dp, sp, tp), tp innermost: the tp ranks of one sp rank share its sequence slice, and each one's
attention holds heads/tp of the heads (column-parallel q/k/v projections). The sp group is the ranks at one tp
position, which hold the same head block of different slices, so the all-to-all turns that block of this slice into
heads/(tp*sp) heads of the whole sequence: the query heads must split over tp*sp ranks (:func:`check_heads_split`).
Nothing else changes. A weight's gradient, whole or a tp shard, is still each sp rank's part of the sum over the
sequence (Note: [Ulysses gradient scale]), and the ranks that hold the same weights are dp x sp, the ZeRO group.
Megatron sequence parallelism inside tp (``sequence_parallel=True``) cuts the slice once more over tp, in the norms
and the residual stream only; its all-gather before the q/k/v projections restores the whole slice, so it composes
too. ``tests/adapters/lightning/test_lightning_sequence_parallel.py`` trains both against one process.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_strategy.comm.collectives import Collectives
from ds_strategy.comm.differentiable import AllToAll, SumOverRanks
from ds_strategy.comm.group_collectives import collectives_for
from ds_strategy.profiler_ranges import profiler_range

HF_ATTENTION_NAME = "ds_strategy_ulysses_sdpa"
LAYOUTS = ("bhsd", "bshd")
# The sequence-parallel group: the mesh's Collectives (composition passes it: counted in comm_stats, the configured
# timeout), or the bare process group a user's loop holds (see ds_strategy.comm.group_collectives).
Group = dist.ProcessGroup | Collectives


def _heads_split(heads: int, kv_heads: int, sp: int) -> bool:
    """Whether query heads split evenly over ``sp`` ranks and key/value heads split or repeat evenly."""
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def check_heads_split(heads: int, kv_heads: int, sp: int, tp: int = 1) -> None:
    """Raise, naming the sp sizes that would work, unless the ``heads`` and ``kv_heads`` that attention holds on one
    rank (the model's divided by ``tp`` under tensor parallelism) split over ``sp`` ranks."""
    if _heads_split(heads, kv_heads, sp):
        return
    allowed = [size for size in range(1, heads + 1) if _heads_split(heads, kv_heads, size)]
    per_rank = f" per tensor-parallel rank (the model's / tensor_parallel_size={tp})" if tp > 1 else ""
    raise ValueError(
        f"Ulysses attention splits heads over the sequence-parallel group: query heads={heads} and key/value "
        f"heads={kv_heads}{per_rank} cannot be split over sp={sp} ranks; allowed sp sizes: {allowed}"
    )


def seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[batch, heads, seq/sp, dim] sliced by sequence -> [batch, heads/sp, seq, dim] sliced by head; differentiable.

    Rank r receives head block r of every rank's slice and lays the slices end to end in rank order.
    """
    collectives = collectives_for(group)
    sp = collectives.world_size
    batch, heads, local_seq, dim = x.shape
    # Head block j goes to rank j: all_to_all_single sends the j-th chunk of dim 0 to rank j.
    send = x.reshape(batch, sp, heads // sp, local_seq, dim).permute(1, 0, 2, 3, 4).contiguous()
    received = AllToAll.apply(send, collectives, "ulysses.seq_to_heads")
    # received[i] is rank i's sequence slice of my heads.
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // sp, sp * local_seq, dim)


def heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: [batch, heads/sp, seq, dim] -> [batch, heads, seq/sp, dim]."""
    collectives = collectives_for(group)
    sp = collectives.world_size
    batch, local_heads, seq, dim = x.shape
    send = x.reshape(batch, local_heads, sp, seq // sp, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = AllToAll.apply(send, collectives, "ulysses.heads_to_seq")
    # received[i] is head block i of my sequence slice.
    return received.permute(1, 0, 2, 3, 4).reshape(batch, sp * local_heads, seq // sp, dim)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_fn: Callable[..., torch.Tensor],
    group: Group,
    *,
    layout: str = "bhsd",
    **attention_kwargs,
) -> torch.Tensor:
    """``attention_fn(q, k, v, **attention_kwargs)`` over the full sequence, for q/k/v sliced by sequence.

    ``layout`` is "bhsd" ([batch, heads, seq/sp, head_dim], as HF hands attention functions) or "bshd"; the output
    has the input's layout and slice. ``attention_fn`` takes and returns "bhsd" tensors holding ``heads/sp`` heads
    of the whole sequence, so ``is_causal=True`` masks by global position. Key/value heads fewer than sp are
    repeated until each rank has one, as DeepSpeed does; ``attention_fn`` must accept GQA (sdpa:
    ``enable_gqa=True``) whenever key/value heads differ from query heads.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if layout == "bshd":
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    group = collectives_for(group)
    sp = group.world_size
    check_heads_split(query.shape[1], key.shape[1], sp)
    if key.shape[1] < sp:
        key, value = (t.repeat_interleave(sp // key.shape[1], dim=1) for t in (key, value))
    query, key, value = (seq_to_heads(t, group) for t in (query, key, value))
    with profiler_range("ulysses.attention"):
        out = attention_fn(query, key, value, **attention_kwargs)
    out = heads_to_seq(out, group)
    return out.transpose(1, 2) if layout == "bshd" else out


def ulysses_sdpa(group: Group) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` with Ulysses over ``group``: the same call, for sequence slices."""
    return functools.partial(
        ulysses_attention, attention_fn=F.scaled_dot_product_attention, group=collectives_for(group)
    )


def _hf_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    group: Collectives,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (the signature of its "sdpa" one): Ulysses around sdpa."""
    if attention_mask is not None:
        raise ValueError(
            "Ulysses attention masks causally over the full sequence itself and takes no attention_mask (one given "
            "to the model covers only the local slice); pad on the right with labels -100 instead"
        )
    out = ulysses_attention(
        query,
        key,
        value,
        F.scaled_dot_product_attention,
        group,
        dropout_p=dropout,
        scale=scaling,
        is_causal=getattr(module, "is_causal", True) if is_causal is None else is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register_hf_attention(group: Group, name: str = HF_ATTENTION_NAME) -> str:
    """Register Ulysses-over-sdpa with transformers' ``AttentionInterface`` under ``name``, and return the name.

    A model built with ``attn_implementation=name`` (or switched with ``model.set_attn_implementation(name)``)
    then attends over ``group``; feed it :func:`shard_sequence`'s output. The name is not registered as a mask
    function, so transformers builds no mask for the local slice and passes the 2-D mask it was given, if any.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, functools.partial(_hf_attention, group=collectives_for(group)))
    return name


def shard_sequence(
    batch: Mapping[str, torch.Tensor], group: Group, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """This rank's slice of ``batch`` ([batch, seq] tensors): ``input_ids``, ``position_ids`` and, when ``labels``
    are given, ``shift_labels``, the next-token labels (see Note: [Shift labels before slicing]).

    ``position_ids`` default to 0..seq-1; each rank keeps the global positions of its slice, which rotary and
    learned position embeddings need. An ``attention_mask`` is dropped when it masks only padding on the right
    (each row ones, then zeros): causal attention never lets a token see the positions after it, so masking them
    changes nothing that is labelled. Padding on the left, or holes, are refused: Ulysses attention masks causally
    over the full sequence and takes no mask.

    Note: [Shift labels before slicing]
    Token t predicts label t+1, so the last token of rank r's slice predicts the first token of rank r+1's. A
    causal LM that shifts its labels itself (HF's loss, when handed ``labels``) would shift within the slice and
    lose one target per rank, and mispair the rest if the slice had been cut from shifted data. The labels are
    therefore shifted over the full sequence, with ``ignore_index`` as the last target, and then sliced; they come
    back as ``shift_labels`` (the name HF's loss takes for labels already shifted) so that nothing shifts them again.
    Pass them to :func:`sequence_parallel_loss`, not as ``labels`` to the model.
    """
    unknown = set(batch) - {"input_ids", "labels", "position_ids", "attention_mask"}
    if unknown:
        raise ValueError(f"shard_sequence does not know how to slice {sorted(unknown)}")
    collectives = collectives_for(group)
    sp, rank = collectives.world_size, collectives.rank
    input_ids = batch["input_ids"]
    seq = input_ids.shape[1]
    if seq % sp:
        raise ValueError(
            f"sequence length {seq} is not divisible by the sequence-parallel size sp={sp}; pad it to "
            f"{-(-seq // sp) * sp} with labels {ignore_index}"
        )
    check_right_padded(batch.get("attention_mask"))
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    full = {"input_ids": input_ids, "position_ids": positions}
    if "labels" in batch:
        labels = batch["labels"]
        full["shift_labels"] = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    return {name: t.chunk(sp, dim=1)[rank] for name, t in full.items()}


def check_right_padded(mask: torch.Tensor | None) -> None:
    """Raise unless ``mask`` ([batch, seq], or None) masks nothing or only a run of positions at the end of a row."""
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "Ulysses attention takes no attention mask: it masks causally over the whole sequence, which is exact "
            "for padding on the right only; this attention_mask masks positions before unmasked ones (padding on "
            "the left, or packed rows): pad on the right, with labels -100"
        )


def sequence_parallel_loss(
    logits_or_loss_sum: torch.Tensor, labels: torch.Tensor, group: Group, ignore_index: int = -100
) -> torch.Tensor:
    """The mean cross-entropy over every labelled token of the full sequence, the same on every rank of ``group``.

    Give this rank's logits ([..., vocab]) or its summed loss (a 0-d tensor), and its slice of the shifted labels
    (``shard_sequence``'s ``shift_labels``).

    Note: [Token-weighted loss]
    Ranks hold different numbers of labelled tokens (padding and prompts are ``ignore_index``, and sit mostly at
    one end). Averaging per-rank means weights a rank with 3 labelled tokens like one with 300 and gives neither
    the single-process loss nor its gradient (DeepSpeed issues #6841 and #5419). Instead each rank sums its
    token losses, the sums and the counts are added over the group, and the loss is sum / count: the mean over
    the full sequence. A group with no labelled token at all gets loss 0.
    """
    if logits_or_loss_sum.dim() == 0:
        local_sum = logits_or_loss_sum
    else:
        logits = logits_or_loss_sum.float()
        local_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )
    count = (labels != ignore_index).sum()
    collectives = collectives_for(group)
    collectives.all_reduce(count, label="ulysses.token_count").wait()
    return SumOverRanks.apply(local_sum, collectives, "ulysses.loss_sum") / count.clamp(min=1)


def gradient_divide_factor(zero_group_size: int, sp_size: int) -> int:
    """What the ZeRO engine divides its dp×sp group's gradient sum by under Ulysses (``ZeroEngine.
    set_gradient_divide_factor``): the data-parallel size.

    Note: [Ulysses gradient scale]
    Every rank of an sp group holds the full weights but computes only its slice's part of the gradient: the
    backward of each all-to-all hands the other ranks' activation gradients back to them, so the gradient of the
    loss is the sum over the sp group of the ranks' parameter gradients. That holds because
    :func:`sequence_parallel_loss` passes each rank's backward the gradient of its own loss sum only (1/count,
    seeded once per rank): the ranks' backward passes together differentiate the loss exactly once. (A loss
    all-reduce whose backward all-reduces as well, like ``torch.distributed.nn.functional.all_reduce``, would
    differentiate it sp times, making each rank's gradients sp times too large: the rule would then be a plain
    mean over dp×sp.)

    Across dp, each replica's sequences give their own loss, and the step follows the mean of those losses' gradients,
    as in DDP. So the gradient wanted is a sum over sp and a mean over dp, which is DeepSpeed's rule too (it divides
    by the dp size only). The ZeRO group is dp×sp, whose mean would divide by dp·sp; dividing its sum by dp instead
    gives ``sum over sp, mean over dp``.
    """
    if sp_size < 1 or zero_group_size % sp_size:
        raise ValueError(f"sp_size={sp_size} must be at least 1 and divide the ZeRO group's size {zero_group_size}")
    return zero_group_size // sp_size


def attend_with_ulysses(module: torch.nn.Module, group: Group, tensor_parallel_size: int = 1) -> None:
    """Switch every Hugging Face model in ``module`` to Ulysses attention over ``group``: any other attention would
    attend within this rank's slice of the sequence only. Other models take ``ulysses_sdpa(group)`` themselves.
    Each model's heads are checked first, divided by ``tensor_parallel_size`` (Note: [Ulysses inside tensor
    parallelism]), so that heads that do not split are refused at setup rather than in the first forward."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model has imported it already
    if transformers is None:
        return
    models = [model for model in module.modules() if isinstance(model, transformers.PreTrainedModel)]
    group = collectives_for(group)
    for model in models:
        _check_model_heads(model.config, group.world_size, tensor_parallel_size)
    name = register_hf_attention(group)
    for model in models:
        if model.config._attn_implementation != name:
            model.set_attn_implementation(name)  # sub-models sharing the config follow


def _check_model_heads(config, sp: int, tp: int) -> None:
    """:func:`check_heads_split` for a Hugging Face config's heads; heads that tp does not split are tp's to refuse."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % tp == 0 and kv_heads % tp == 0:
        check_heads_split(heads // tp, kv_heads // tp, sp, tp)
