"""Load pretrained weights into a sharded model, each rank reading only the byte ranges of its own shards.

Sources: a Hugging Face directory (``model.safetensors``, or shards listed in ``model.safetensors.index.json``, as
``save_pretrained`` writes them), one ``.safetensors`` file (ours from ``consolidate`` included), a ``.pt`` state
dict (opened memory-mapped), or a state dict already in memory (a model entry of Fabric's single-file checkpoint).
Names in the source are the model's ``state_dict`` names without ``prefix`` (e.g. ``prefix="model."`` when a
LightningModule holds the Hugging Face model as ``self.model``). A weight tied to another (the LM head and the
token embedding) may appear under either name.

Note: [Memory while loading]
Every check (missing, unexpected and mis-shaped names) runs on the headers before any value is read or written,
so a failed load changes nothing. Then, for each flat buffer, the rank reads the parameter pieces inside the range
its ``master`` covers (its shard at stage >= 1) through ``safe_open(...).get_slice``: the rows covering the piece,
never the whole tensor, converted to the master's dtype as they are copied in. Buffers and frozen parameters,
which every rank holds whole, are read whole, one at a time. So no rank holds more than its shards plus one
tensor's rows being read; the compute copies are then refreshed from the masters as after a checkpoint load
(see [Refreshing compute parameters after a load] in :mod:`.restore`).

Under tensor parallelism a flat buffer holds each DTensor parameter's local piece: a block of the stored tensor
(``compute_local_shape_and_global_offset`` of its ``Shard``/``Replicate`` placements), so the rows read are those
rows of that block, and only its columns. Under pipeline parallelism the model holds this rank's stages only: the
names of the other stages' tensors (the uncut model's names, ``engine.whole_model_names``) are expected in the
source and never read, and a tied copy (an LM head whose embedding lives on another stage) reads its owner's name.

Any other source of named tensors can be read the same way by implementing :class:`WeightSource`: the Hugging Face
adapter's (``ds_strategy.transformers.hf_weights``) applies transformers' weight conversions (fused MoE experts)
and holds the weights ``from_pretrained`` initialised itself (a new head, added tokens' rows).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..parallel.dtensor_params import TensorParallelSpec, local_tensor, spec_of
from ..zero.engine import ZeroEngine

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightReader(Protocol):
    """Named tensors, read a few rows at a time: what :func:`load_weights` fills a model from."""

    where: object  # named in error messages

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every tensor's name and shape, known without reading a value."""

    def read(self, name: str, lo: int, hi: int, tp: TensorParallelSpec | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` flattened, or of this rank's tensor-parallel block of it when
        ``tp`` is given."""


class WeightSource(Protocol):
    """Something :func:`load_weights` can open as a :class:`WeightReader` (files stay open until the load ends)."""

    def open(self, stack: ExitStack) -> WeightReader: ...


class WeightFiles:
    """The tensors of a pretrained checkpoint by name, opened lazily; reads row ranges of one tensor at a time.

    ``path``: a directory (``save_pretrained``'s), one file, a list of files (the shards of one checkpoint), or a
    state dict already in memory."""

    def __init__(self, path: str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, torch.Tensor], stack):
        if isinstance(path, Mapping):  # a state dict already read (an entry of a single-file checkpoint)
            self._tensors, self._handles, self.where = dict(path), {}, "the given state dict"
            return
        files, self.where = _checkpoint_files(path)
        self._tensors: dict[str, object] = {}  # name -> a safetensors slice or a memory-mapped tensor
        self._handles: dict[str, object] = {}
        for file, names in files.items():
            if file.suffix != ".safetensors":
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                self._tensors.update(state.get("state_dict", state))
                continue
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():  # a safetensors handle, not a dict
                if names is None or name in names:
                    self._tensors[name] = handle.get_slice(name)
                    self._handles[name] = handle

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: _shape(t) for name, t in self._tensors.items()}

    def read(self, name: str, lo: int, hi: int, tp: TensorParallelSpec | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` flattened, or of this rank's tensor-parallel block of it
        when ``tp`` is given, reading only the rows (of the block) that cover them."""
        source = self._tensors[name]
        if not _shape(source):
            whole = source if isinstance(source, torch.Tensor) else self._handles[name].get_tensor(name)
            return whole.reshape(1)[lo:hi]
        return read_elements(name, source, lo, hi, tp)


def read_elements(name: str, source, lo: int, hi: int, tp: TensorParallelSpec | None = None) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``source`` (a tensor, or a safetensors slice: anything indexed by row ranges)
    flattened, or of this rank's tensor-parallel block of it, reading only the rows that cover them."""
    shape = _shape(source)
    if not shape:
        return source.reshape(1)[lo:hi]
    shape, offset = _local_block(name, tp) if tp is not None else (shape, (0,) * len(shape))
    row = math.prod(shape[1:])
    first, last = lo // row, -(-hi // row)
    rows = source[
        (slice(offset[0] + first, offset[0] + last), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:])))
    ]
    return rows.reshape(-1)[lo - first * row : hi - first * row]


def _shape(source) -> tuple[int, ...]:
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


def _checkpoint_files(path) -> tuple[dict[Path, set[str] | None], object]:
    """{file: the names to read from it (None: all)} for ``path``, and how to name it in errors."""
    if not isinstance(path, (str, os.PathLike)):  # the files of one checkpoint, as transformers resolved them
        files = [Path(f) for f in path]
        return {file: None for file in files}, str(files[0].parent) if files else "no files"
    path = Path(path)
    if path.is_dir() and (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files: dict[Path, set[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, set()).add(name)
        return dict(sorted(files.items())), path
    if path.is_dir() and (path / SINGLE_FILE).is_file():
        return {path / SINGLE_FILE: None}, path / SINGLE_FILE
    if path.is_file() and path.suffix in (".safetensors", ".pt", ".pth", ".bin"):
        return {path: None}, path
    raise FileNotFoundError(
        f"load_weights({str(path)!r}): expected a directory holding {INDEX_FILE} or {SINGLE_FILE}, or a "
        f".safetensors, .pt, .pth or .bin file"
    )


def _local_block(name: str, tp: TensorParallelSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's block of the global tensor ``name`` split as ``tp`` says."""
    odd = [p for p in tp.placements if type(p) not in (Shard, Replicate)]
    if odd:
        raise ValueError(
            f"load_weights cannot cut {name!r} into its tensor-parallel piece: placement {odd[0]} is not a plain "
            f"Shard or Replicate (the ones allowed); load it before parallelizing the model"
        )
    shape, offset = compute_local_shape_and_global_offset(tp.shape, tp.mesh, tp.placements)
    return tuple(shape), tuple(offset)


def load_weights(
    engine: ZeroEngine,
    path: str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, torch.Tensor] | WeightSource,
    prefix: str = "",
) -> None:
    """Fill ``engine``'s model with the weights at ``path``, in a state dict, or of a :class:`WeightSource` (see the
    module docstring); every rank calls it."""
    with ExitStack() as stack:
        named = isinstance(path, (str, os.PathLike, Mapping, list, tuple))
        files = WeightFiles(path, stack) if named else path.open(stack)
        groups = _check_fits(engine, files, prefix)
        engine.reshard()
        with torch.no_grad():
            source_of = {id(tensor): name for tensor, name in groups}
            for fp in engine.flat_params:
                param_of = {slot.name: p for slot, p in zip(fp.slots, fp.params)}
                for slot, start, length in fp.master_slots():
                    name = source_of[id(param_of[slot.name])]
                    local = slot.offset + start - fp.master_base
                    fp.master.narrow(0, local, length).copy_(files.read(name, start, start + length, slot.tp))
            flat = {id(p) for fp in engine.flat_params for p in fp.params}
            for tensor, name in groups:
                if id(tensor) not in flat:
                    local = local_tensor(tensor)
                    local.copy_(files.read(name, 0, local.numel(), spec_of(tensor)).view(local.shape))
        engine.refresh_from_masters()


def _check_fits(engine: ZeroEngine, files: WeightReader, prefix: str) -> list[tuple[torch.Tensor, str]]:
    """(model tensor, name to read it from) for every tensor under ``prefix``; raises, naming every missing,
    unexpected and mis-shaped tensor, before anything is read."""
    slot_shape = {
        id(p): slot.tp.shape if slot.tp is not None else slot.shape
        for fp in engine.flat_params
        for p, slot in zip(fp.params, fp.slots)
    }
    names_of: dict[int, list[str]] = {}
    tensor_of: dict[int, torch.Tensor] = {}
    state = engine.module.state_dict(keep_vars=True)
    for key, tensor in state.items():
        if key.startswith(prefix):
            names_of.setdefault(id(tensor), []).append(key[len(prefix) :])
            tensor_of[id(tensor)] = tensor
    for copy, owner in engine.saved_as.items():  # a pipeline stage's copy of a weight another stage owns
        if copy in state and owner.startswith(prefix):
            names_of[id(state[copy])].append(owner[len(prefix) :])
    stored = files.shapes()
    missing, misshaped, groups = [], [], []
    for key, names in names_of.items():
        present = [name for name in names if name in stored]
        if not present:
            missing.append(names[0])
            continue
        want = tuple(slot_shape.get(key, tensor_of[key].shape))
        misshaped += [f"{name} {stored[name]} (model {want})" for name in present if stored[name] != want]
        groups.append((tensor_of[key], present[0]))
    known = {name for names in names_of.values() for name in names}
    known |= {name[len(prefix) :] for name in engine.whole_model_names if name.startswith(prefix)}  # other stages'
    unexpected = sorted(name for name in stored if name not in known)
    if missing or unexpected or misshaped:
        problems = [
            f"{label}: {', '.join(items)}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
            if items
        ]
        raise ValueError(
            f"load_weights({str(files.where)!r}, prefix={prefix!r}) does not fit the model; nothing "
            f"was loaded. " + "; ".join(problems)
        )
    return groups
