"""Bytes this rank holds per kind of model state and per place (device / host / nvme)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import ZeroEngine

PLACES = ("device", "host", "nvme")


def _place(tensor: torch.Tensor, compute_device: torch.device) -> str:
    """Host means CPU memory while compute runs on an accelerator; on a CPU-only run the CPU is the device."""
    return "host" if tensor.device.type == "cpu" and compute_device.type != "cpu" else "device"


def memory_report(engine: "ZeroEngine") -> dict[str, dict[str, int]]:
    """``{"params"|"grads"|"optimizer"|"buffers": {"device"|"host"|"nvme": bytes}}`` for this rank.

    params: the compute-dtype parameters this rank holds (full buffers while gathered, shards otherwise, plus
    parameters ZeRO does not manage such as frozen ones). grads: gradient buffers and shards. optimizer: fp32
    master weights when separate from the parameters, plus the optimizer's state tensors. buffers: the peak
    bytes of gradient scratch (reduction buckets) seen so far.

    With offload, what ``engine.offload`` placed is reported where it put it (on a CPU-only run too, where host
    and device are the same memory), plus the tensors only it holds (host gradient copies, staging buffers).
    """
    device = engine.flat_params[0].device if engine.flat_params else torch.device("cpu")
    report = {kind: dict.fromkeys(PLACES, 0) for kind in ("params", "grads", "optimizer", "buffers")}
    offload = getattr(engine, "offload", None)
    placed = offload.places() if offload is not None else {}

    def add(kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            place = placed.get(tensor.untyped_storage().data_ptr()) or _place(tensor, device)
            report[kind][place] += tensor.numel() * tensor.element_size()

    managed = set()
    for fp in engine.flat_params:
        managed.update(id(p) for p in fp.params)
        if fp.is_full_allocated:
            add("params", fp.full)
        if fp.policy.params:
            add("params", fp.shard)
        add("grads", fp.grad_full)
        if fp.grad_shard is not None and (fp.grad_full is None
                                          or fp.grad_shard.untyped_storage().data_ptr() != fp.grad_full.untyped_storage().data_ptr()):
            add("grads", fp.grad_shard)
        if fp.master.untyped_storage().data_ptr() != fp.master_region().untyped_storage().data_ptr():
            add("optimizer", fp.master)
    for p in engine.module.parameters():
        if id(p) not in managed:
            add("params", p)
            add("grads", p.grad)
    if engine.optimizer is not None:
        for state in engine.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    add("optimizer", value)
    report["buffers"]["device"] += engine.reducer.peak_scratch_bytes
    if offload is not None:
        for kind, tensor in offload.own_tensors():
            add(kind, tensor)
    return report
