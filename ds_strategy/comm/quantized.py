"""ZeRO++ quantised collectives: block-wise int8 all-gather (qwZ) and int4/int8 all-to-all reduce-scatter (qgZ).

Both send *packets*: a piece of ``numel`` values quantised by :func:`ds_strategy.kernels.quantize_blockwise`
(one fp32 scale per block of ``block_size`` values, symmetric int8 or int4, see ``kernels/quantize_reference.py``),
laid out as the quantised bytes followed by the scales' bytes, so one int8 collective carries both. An int8
packet of a fp32 piece is about a quarter of its bytes, an int4 one an eighth (plus 4 bytes per block: 1.6% of
the fp32 bytes at the default 256). Both go through :class:`~.collectives.Collectives`, so calls, bytes (the
bytes actually sent) and waiting are accounted.

qwZ, :func:`all_gather_int8`: each rank quantises its shard, the packets are all-gathered, and every rank
dequantises all of them, its own included, so all ranks compute with the same weights.

qgZ, :func:`reduce_scatter_quantized`: the ZeRO++ paper's all-to-all reduction, one hop. A rank cuts its gradient
into N chunks, one per owner, quantises each, and an all-to-all hands every owner the N quantised versions of
its chunk; the owner dequantises them to fp32 and sums there, so quantisation error does not compound across
ranks and no partial sum is ever requantised. (The paper's two-hop variant, intra-node then inter-node, exists
to cut inter-node volume on multi-node clusters; with one level of ranks it is this.)

Note: [Packet lifetime]
The packets a rank sends are made before the launch and must stay alive until the
collective is waited on; the receive buffer is decoded into its destination in the collective's ``then``
callback, i.e. inside ``wait()``, after which both are garbage. Until ``wait()`` returns, the destination (the
gathered weights, or the reduced shard) holds nothing valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import dequantize_blockwise, quantize_blockwise
from .collectives import Collectives, PendingCollective

BLOCK_SIZE = 256


@dataclass(frozen=True)
class QuantizedPackets:
    """How pieces of ``numel`` values become packets: ``n_blocks * block_size`` values of ``bits`` each, then
    the scales."""

    numel: int
    block_size: int = BLOCK_SIZE
    bits: int = 8

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // self.block_size)

    @property
    def values(self) -> int:
        """Values per piece, padded to whole blocks."""
        return self.n_blocks * self.block_size

    @property
    def values_bytes(self) -> int:
        return self.values * self.bits // 8

    @property
    def nbytes(self) -> int:
        """Bytes of one packet: ``bits / 8`` per value (padded to whole blocks), four per block's fp32 scale."""
        return self.values_bytes + 4 * self.n_blocks

    def pack(self, pieces: Tensor) -> Tensor:
        """``pieces`` [k, numel] (any float dtype) to packets [k, nbytes] int8, each piece quantised alone."""
        count = pieces.shape[0]
        if self.numel == self.values and pieces.is_contiguous():
            padded = pieces
        else:
            padded = torch.zeros(count, self.values, dtype=pieces.dtype, device=pieces.device)
            padded[:, : self.numel] = pieces
        q, scales = quantize_blockwise(padded.reshape(-1), self.block_size, self.bits)
        return torch.cat([q.view(count, self.values_bytes), scales.view(count, self.n_blocks).view(torch.int8)], dim=1)

    def unpack(self, packets: Tensor, dtype: torch.dtype) -> Tensor:
        """Packets [k, nbytes] int8 back to values [k, numel] of ``dtype``."""
        count = packets.shape[0]
        q = packets[:, : self.values_bytes].reshape(-1)
        scales = packets[:, self.values_bytes :].contiguous().view(torch.float32).reshape(-1)
        values = dequantize_blockwise(q, scales, count * self.values, dtype, self.bits)
        return values.view(count, self.values)[:, : self.numel]


def all_gather_int8(
    collectives: Collectives,
    full: Tensor,
    shard: Tensor,
    label: str = "",
    block_size: int = BLOCK_SIZE,
    keep_packets=None,
) -> PendingCollective:
    """qwZ: fill ``full`` with every rank's dequantised ``shard`` in rank order (``full`` = N x ``shard``).

    ``keep_packets(packets)``, if given, receives the gathered packets [N, nbytes] once they have been decoded
    (hpZ keeps a slice of them as its secondary copy, see :mod:`ds_strategy.zero.hpz`).
    """
    layout = QuantizedPackets(shard.numel(), block_size)
    world = collectives.world_size
    packet = layout.pack(shard.view(1, -1)).view(-1)
    packets = torch.empty(world * layout.nbytes, dtype=torch.int8, device=shard.device)
    pending = collectives.all_gather(packets, packet, label=f"{label} [int8]")

    def decode(sent: Tensor = packet) -> None:
        decode_int8_packets(full, packets, world, block_size)
        if keep_packets is not None:
            keep_packets(packets.view(world, layout.nbytes))

    return pending.then(decode)


def decode_int8_packets(full: Tensor, packets: Tensor, world: int, block_size: int = BLOCK_SIZE) -> None:
    """Fill ``full`` from N gathered packets (flat or [N, nbytes]) of ``full.numel() / N`` values each."""
    layout = QuantizedPackets(full.numel() // world, block_size)
    full.view(world, layout.numel).copy_(layout.unpack(packets.view(world, layout.nbytes), full.dtype))


def reduce_scatter_quantized(
    collectives: Collectives, out: Tensor, full: Tensor, label: str = "", bits: int = 4, block_size: int = BLOCK_SIZE
) -> PendingCollective:
    """qgZ: ``out`` (fp32, 1/N of ``full``) becomes the sum over ranks of this rank's chunk of ``full``.

    Each of the N chunks of ``full`` is quantised on its own to ``bits`` (4, as DeepSpeed's qgZ, or 8) and sent
    to its owner with one all-to-all; the owner sums the N dequantised versions in fp32. ``full`` may be reused
    as soon as this returns.
    """
    world = collectives.world_size
    layout = QuantizedPackets(out.numel(), block_size, bits)
    send = layout.pack(full.view(world, layout.numel)).reshape(-1)
    received = torch.empty_like(send)
    pending = collectives.all_to_all(received, send, label=f"{label} [int{bits} all-to-all]")

    def reduce(sent: Tensor = send) -> None:
        out.copy_(layout.unpack(received.view(world, layout.nbytes), torch.float32).sum(dim=0))

    return pending.then(reduce)
