"""DeepSpeed-Ulysses under the Hugging Face Trainer and TRL's SFTTrainer: each rank of a sequence-parallel group
trains on its slice of the batch the group reads, and the loss it logs and differentiates is the group's.

The pieces are those of :mod:`ds_strategy.parallel.ulysses`: the accelerator's data loaders split batches over the
data-parallel ranks only, so every rank of a group reads the same batch (``prepare_over_data_parallel``);
``compose_model`` switched the model's attention to Ulysses; the engine sums gradients over the group and averages
them over data parallelism (Note: [Ulysses gradient scale]). What the Trainer's loop adds is done here, around its
``compute_loss``: :func:`slice_for_rank` before it, :func:`combine_over_group` after it.

Note: [The Trainer's loss over a sequence-parallel group]
  The Trainer counts the labelled tokens of the batches it is about to train on (``num_items_in_batch``, over the
  accumulated micro-batches, summed over every process when ``average_tokens_across_devices``), has the model divide
  its summed loss by that count, and multiplies the result by the number of processes, because DDP will average the
  gradients. The batches are sliced inside ``compute_loss``, after that count, so the count is over whole sequences:
  each rank of a group counts the same tokens, and the sum over processes is ``sp`` times the one-process count N.
  Rank r's loss comes back as ``W * s_r / (sp * N) = dp * s_r / N``, ``s_r`` the summed loss over its slice. Summed
  over the group (:class:`SumOverRanks`: forward a sum, backward the gradient unchanged to each rank's own term) it
  is ``dp * S / N``, S the replica's sum over whole sequences: exactly a DDP rank's loss, the same on every rank of
  the group, so the Trainer's mean over processes logs the one-process loss. Each rank's backward differentiates
  ``dp * s_r / N``; the engine sums that over the group and divides by dp: the gradient of the one-process loss.
  Without averaging across devices the count is the replica's own and no factor is applied: the sum is again a
  DDP rank's loss. TRL's SFTTrainer computes its loss the same way, from the same count.
  A loss without ``num_items_in_batch`` (a model that takes no loss arguments) is the mean over the rank's own
  labelled tokens; it is weighted by their count instead, as :func:`~ds_strategy.parallel.ulysses.
  sequence_parallel_loss` does (DeepSpeed issues #6841 and #5419 are what averaging the ranks' means gets wrong).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.differentiable import SumOverRanks
from ..comm.group_collectives import collectives_for
from ..parallel.ulysses import check_right_padded, shard_sequence

IGNORE_INDEX = -100  # transformers' label for "no loss here"


def slice_for_rank(inputs: Mapping[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """This rank's slice of a Trainer batch of whole sequences ([batch, seq] tensors).

    The sequence is padded on the right to a multiple of the group's size (token 0, label -100, mask 0), then cut
    into equal slices: ``input_ids``, their absolute ``position_ids``, and the labels shifted over the whole
    sequence before slicing (Note: [Shift labels before slicing]), given as ``shift_labels`` and as ``labels`` (a
    Hugging Face causal LM computes its loss only when ``labels`` are given, from ``shift_labels`` when those are).
    A mask of padding on the right is dropped (causal attention is exact without it); other [batch, seq] tensors are
    sliced like the ids, anything else passes as is. Refused: embeddings instead of ids, and packed rows (position
    ids that restart), which Ulysses attention would let attend across their borders.
    """
    if "input_ids" not in inputs:
        raise ValueError(
            f"sequence parallelism under the Trainer slices input_ids; this batch has {sorted(inputs)} (inputs_embeds "
            f"are not supported)"
        )
    if "shift_labels" in inputs:
        raise ValueError("the batch already has shift_labels; give labels, which are shifted over the whole sequence")
    ids = inputs["input_ids"]
    batch, seq = ids.shape
    _check_not_packed(inputs.get("position_ids"), seq)
    check_right_padded(inputs.get("attention_mask"))
    sp = dist.get_world_size(group)
    pad = -seq % sp
    whole = {"input_ids": F.pad(ids, (0, pad), value=0)}
    if inputs.get("labels") is not None:
        whole["labels"] = F.pad(inputs["labels"], (0, pad), value=IGNORE_INDEX)
    local = {key: t.contiguous() for key, t in shard_sequence(whole, group, IGNORE_INDEX).items()}
    if "shift_labels" in local:
        local["labels"] = local["shift_labels"]
    known = {"input_ids", "labels", "position_ids", "attention_mask"}
    for key, value in inputs.items():
        if key in known:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, seq):
            padded = F.pad(value, (0, 0) * (value.dim() - 2) + (0, pad))
            value = padded.chunk(sp, dim=1)[dist.get_rank(group)].contiguous()
        local[key] = value
    return local


def combine_over_group(
    loss: torch.Tensor,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: Any,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The group's loss from this rank's (Note: [The Trainer's loss over a sequence-parallel group]), the same on
    every rank of ``group``; this rank's backward differentiates its own part."""
    if num_items_in_batch is not None:
        return SumOverRanks.apply(loss, group, "ulysses.trainer_loss")
    if shift_labels is None:
        raise ValueError(
            "sequence parallelism under the Trainer weights each rank's loss by its labelled tokens: give labels"
        )
    count = (shift_labels != IGNORE_INDEX).sum()
    total = count.clone()
    collectives_for(group).all_reduce(total, label="ulysses.token_count").wait()
    weighted = torch.where(count > 0, loss * count, torch.zeros_like(loss))  # a slice with no label has a NaN mean
    return SumOverRanks.apply(weighted, group, "ulysses.trainer_loss") / total.clamp(min=1)


def _check_not_packed(position_ids: torch.Tensor | None, seq: int) -> None:
    if position_ids is None:
        return
    expected = torch.arange(seq, device=position_ids.device).expand_as(position_ids)
    if not torch.equal(position_ids, expected):
        raise ValueError(
            "sequence parallelism under the Trainer takes rows of one sequence each (position ids 0..seq-1): these "
            "position_ids restart within a row (packed sequences, TRL's padding_free), across whose borders Ulysses "
            "attention would attend; pad instead of packing"
        )
