"""One rank's contiguous piece of a flattened tensor, as ``torch.distributed.checkpoint`` (DCP) writes and reads it.

Every module tensor, and every elementwise optimizer state, is stored by name as a 1-D tensor of its ``numel``
elements. A rank contributes, for each parameter its flat shard overlaps, a :class:`FlatPiece`: the elements
``[offset, offset + len(tensor))`` of that 1-D tensor (replicated tensors are written whole, by rank 0). DCP
records each piece as a chunk with explicit offsets (the same metadata it keeps for ``ShardedTensor`` shards),
so on load every rank asks for exactly the ranges its new shard covers and DCP's resharding reads the
overlapping parts of whichever files hold them. Nothing in the file layout depends on the world size or ZeRO
stage that wrote it.

Pieces speak DCP's ``_Checkpointable`` protocol (``__create_write_items__`` / ``__create_chunk_list__``); the
two planners only teach DCP's default planners to find the tensor inside a piece.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[offset, offset + tensor.numel())`` of a 1-D tensor of ``numel`` elements; ``tensor`` is a view
    of the engine's buffer when saving and the destination when loading."""

    tensor: torch.Tensor
    offset: int
    numel: int

    def size(self) -> torch.Size:
        """The whole tensor's size, as DCP checks it against the checkpoint's metadata."""
        return torch.Size([self.numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.tensor.numel()]))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, size=self.size(), properties=TensorProperties.create_from_tensor(self.tensor)
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]


@dataclass(frozen=True)
class ScatteredPiece:
    """Several pieces of one 1-D tensor that one rank holds (a tensor-parallel shard's runs in global coordinates,
    Note: [Tensor-parallel pieces in global coordinates]); DCP sees one chunk per part."""

    parts: tuple[FlatPiece, ...]

    def size(self) -> torch.Size:
        return self.parts[0].size()

    def part_at(self, offset: int) -> FlatPiece:
        return next(part for part in self.parts if part.offset == offset)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [item for part in self.parts for item in part.__create_write_items__(fqn, part)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [part._chunk() for part in self.parts]


def _tensor_of(obj, index: MetadataIndex) -> torch.Tensor | None:
    """The tensor a piece entry stands for at ``index`` (None: not a piece)."""
    if isinstance(obj, FlatPiece):
        return obj.tensor
    if isinstance(obj, ScatteredPiece):
        return obj.part_at(index.offset[0]).tensor
    return None


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving a :class:`FlatPiece` entry to its tensor."""

    def lookup_object(self, index: MetadataIndex):
        tensor = _tensor_of(self.state_dict[index.fqn], index)
        return tensor if tensor is not None else super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, resolving a :class:`FlatPiece` entry to its destination tensor.

    Takes a flat state dict (no nesting), as ds_strategy builds it.
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up materialises meta tensors in place and, knowing only tensor types, replaces any other
        # _Checkpointable object by None; put the pieces back afterwards.
        pieces = {key: value for key, value in state_dict.items() if isinstance(value, (FlatPiece, ScatteredPiece))}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.state_dict.update(pieces)
        self.original_state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        tensor = _tensor_of(self.state_dict[index.fqn], index)
        return tensor if tensor is not None else super().lookup_tensor(index)


@contextlib.contextmanager
def quiet_single_process():
    """Without a process group DCP warns on every call that it assumes a single process, which is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
