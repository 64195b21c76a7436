"""The weights of a model ``from_pretrained`` built on the meta device, for ``prepare`` to read into the shards.

:class:`HfWeights` is a :class:`ds_strategy.checkpoint.pretrained.WeightSource`: for every tensor of the model, where
its value comes from, decided when the model was built (:mod:`.pretrained`) and read only when the engine fills its
shards:

- a checkpoint tensor, under its stored name (transformers' renamings applied: a base model's names in a model with
  a head, legacy names);
- a tensor transformers' weight conversions make from several checkpoint tensors (a fused MoE ``experts.gate_up_proj``
  stacked from per-expert ``gate_proj``/``up_proj``, as ``save_pretrained`` writes them): the conversion is
  transformers' own ``WeightConverter``, run on the whole source tensors of one layer when its first piece is read;
- a tensor ``from_pretrained`` initialised itself (a new head the checkpoint lacks, a size it had to ignore): the value
  it drew, held whole until ``prepare``;
- an embedding resized after loading (``resize_token_embeddings``, added tokens): the checkpoint's rows, then the new
  rows transformers initialised (with mean resizing, from the old rows' mean and covariance), held until ``prepare``.

Note: [Memory of a deferred pretrained model]
Until ``prepare`` each rank holds only what transformers initialised itself (new heads, added rows), whole, as
``from_pretrained`` holds them. ``resize_token_embeddings`` reads the old embedding (and an untied LM head) whole for
the length of the call, as transformers does under DeepSpeed ZeRO-3 (``GatheredParameters``), and keeps the new rows.
While loading, a converted tensor is made whole from its layer's sources, one layer at a time; every other tensor is
read a few rows at a time, as :func:`~ds_strategy.checkpoint.pretrained.load_weights` reads checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from ..checkpoint.pretrained import WeightFiles, read_elements
from ..parallel.dtensor_params import TensorParallelSpec


class _Recipe(Protocol):
    shape: tuple[int, ...]

    def read(self, reader: _HfReader, lo: int, hi: int, tp: TensorParallelSpec | None) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A checkpoint tensor, by its stored name."""

    key: str
    shape: tuple[int, ...]

    def read(self, reader: _HfReader, lo: int, hi: int, tp: TensorParallelSpec | None) -> torch.Tensor:
        return reader.files.read(self.key, lo, hi, tp)


@dataclasses.dataclass(frozen=True)
class _Initialised:
    """A value transformers drew itself, held whole."""

    value: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def read(self, reader: _HfReader, lo: int, hi: int, tp: TensorParallelSpec | None) -> torch.Tensor:
        return read_elements("an initialised tensor", self.value, lo, hi, tp)


@dataclasses.dataclass(frozen=True)
class _Converted:
    """One output of a :class:`_ConversionGroup`."""

    group: _ConversionGroup
    target: str
    shape: tuple[int, ...]

    def read(self, reader: _HfReader, lo: int, hi: int, tp: TensorParallelSpec | None) -> torch.Tensor:
        return read_elements(self.target, reader.converted(self.group)[self.target], lo, hi, tp)


@dataclasses.dataclass(frozen=True)
class _Resized:
    """The first rows of ``kept`` (the tensor before a resize), then ``new_rows``."""

    kept: _Recipe
    new_rows: torch.Tensor
    shape: tuple[int, ...]

    def read(self, reader: _HfReader, lo: int, hi: int, tp: TensorParallelSpec | None) -> torch.Tensor:
        boundary = (self.shape[0] - self.new_rows.shape[0]) * math.prod(self.shape[1:])
        dtype = self.new_rows.dtype
        if tp is not None:  # a block of both parts: made whole (one embedding), then cut
            whole = torch.cat([self.kept.read(reader, 0, boundary, None).to(dtype), self.new_rows.reshape(-1)])
            return read_elements("a resized embedding", whole.view(self.shape), lo, hi, tp)
        pieces = []
        if lo < boundary:
            pieces.append(self.kept.read(reader, lo, min(hi, boundary), None).to(dtype))
        if hi > boundary:
            pieces.append(self.new_rows.reshape(-1)[max(lo, boundary) - boundary : hi - boundary])
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


class _ConversionGroup:
    """The checkpoint tensors one of transformers' ``WeightConverter`` makes one layer's tensors from (every expert's
    ``gate_proj`` and ``up_proj`` of a layer, for its fused ``gate_up_proj``), in the order transformers collects
    them, and the converter that does it."""

    def __init__(self, model: nn.Module, first: str, template: WeightConverter, sources: list[tuple[str, str]]):
        self._model = weakref.ref(model)
        self.first, self.template, self.sources = first, template, sources

    def convert(self, tensor_of) -> dict[str, torch.Tensor]:
        """The group's outputs by model name, ``tensor_of(key)`` giving each source tensor."""
        converter = copy.deepcopy(self.template)
        for pattern, key in self.sources:
            converter.add_tensor(self.first, key, pattern, functools.partial(tensor_of, key))
        model = self._model()
        converted = converter.convert(self.first, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in converted.items()}


def conversion_plan(
    model: nn.Module, stored: Mapping[str, torch.Tensor], weight_mapping: Sequence[Any] | None
) -> dict[str, _Recipe]:
    """For each model tensor the checkpoint provides, where it comes from: the decisions of transformers'
    ``convert_and_load_state_dict_in_model`` (the same renamings, the same converters, keys in the same order),
    taken on ``stored``'s meta tensors (names, shapes, dtypes) with the model as it is before loading."""
    weight_mapping = list(weight_mapping or [])
    renamings = [entry for entry in weight_mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in weight_mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    expected = model.state_dict()
    prefix = model.base_model_prefix
    plan: dict[str, _Recipe] = {}
    groups: dict[str, tuple[WeightConverter, list[tuple[str, str]]]] = {}
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if renamed not in expected:
            continue  # unexpected: transformers reported it, and nothing reads it
        if pattern is None:
            plan[renamed] = _Stored(key, tuple(stored[key].shape))
        else:
            groups.setdefault(renamed, (by_pattern[pattern], []))[1].append((pattern, key))
    for first, (template, sources) in groups.items():
        group = _ConversionGroup(model, first, template, sources)
        for target, value in group.convert(stored.__getitem__).items():  # on meta tensors: names and shapes only
            plan[target] = _Converted(group, target, tuple(value.shape))
    return plan


class HfWeights:
    """The :class:`~ds_strategy.checkpoint.pretrained.WeightSource` of a model built on meta by
    :func:`.pretrained.sharded_from_pretrained` (see the module docstring)."""

    def __init__(self, files: Sequence[str | os.PathLike], plan: dict[str, _Recipe]):
        self.files = [Path(file) for file in files]
        self.plan = plan

    def open(self, stack: ExitStack) -> _HfReader:
        return _HfReader(self, WeightFiles(self.files, stack))

    def keep_real_tensors(self, model: nn.Module) -> None:
        """Take every tensor of ``model`` that is not on the meta device (those transformers initialised itself)
        into this source, and leave the model wholly on meta; non-persistent buffers are dropped (materialisation
        computes them again)."""
        persistent = model.state_dict(keep_vars=True)
        for name, tensor in persistent.items():
            if not tensor.is_meta:
                self.plan[name] = _Initialised(tensor.detach())
        _to_meta(model)

    def whole(self, name: str, reader: _HfReader) -> torch.Tensor:
        recipe = self.plan[name]
        return recipe.read(reader, 0, math.prod(recipe.shape), None).view(recipe.shape)

    @contextmanager
    def values_in(self, model: nn.Module, modules: Sequence[nn.Module]) -> Iterator[None]:
        """Inside, the parameters of ``modules`` hold their whole values (read from this source); on exit whatever
        the model then holds under their names (a resize's new rows, new shapes, new modules) is recorded here and
        the model returns to the meta device."""
        held = {id(p) for module in modules for p in module.parameters(recurse=False)}
        names = [name for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) in held]
        before = {name: self.plan[name] for name in names if name in self.plan}
        with ExitStack() as stack, torch.no_grad():
            reader = self.open(stack)
            for name in before:
                p = model.get_parameter(name)
                if p.is_meta:  # a tied name's parameter is given its value once
                    torch.utils.swap_tensors(p, nn.Parameter(self.whole(name, reader), p.requires_grad))
        try:
            yield
        finally:
            after = model.state_dict(keep_vars=True)
            for name in names:
                self.plan[name] = _after_resize(before.get(name), after[name].detach())
            _to_meta(model)


class _HfReader:
    """An opened :class:`HfWeights`: the :class:`~ds_strategy.checkpoint.pretrained.WeightReader` ``load_weights``
    reads."""

    def __init__(self, source: HfWeights, files: WeightFiles):
        self.source, self.files = source, files
        self.where = source.files[0].parent if source.files else "the initialised tensors"
        self._converted: tuple[_ConversionGroup, dict[str, torch.Tensor]] | None = None
        self._stored_shapes = files.shapes()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: recipe.shape for name, recipe in self.source.plan.items()}

    def read(self, name: str, lo: int, hi: int, tp: TensorParallelSpec | None = None) -> torch.Tensor:
        return self.source.plan[name].read(self, lo, hi, tp)

    def converted(self, group: _ConversionGroup) -> dict[str, torch.Tensor]:
        """``group``'s outputs, made once and kept until another group's are needed (one layer's at a time)."""
        if self._converted is None or self._converted[0] is not group:
            self._converted = None  # free the previous layer's before making this one's
            self._converted = (group, group.convert(self._stored_whole))
        return self._converted[1]

    def _stored_whole(self, key: str) -> torch.Tensor:
        shape = self._stored_shapes[key]
        return self.files.read(key, 0, math.prod(shape)).view(shape)


def _after_resize(before: _Recipe | None, value: torch.Tensor) -> _Recipe:
    """Where a tensor's value comes from after ``resize_token_embeddings`` left ``value`` in it: unchanged, or the
    rows it kept then its new rows, or (another change) the value itself."""
    shape = tuple(value.shape)
    if before is not None and shape == before.shape:
        return before
    if before is not None and not isinstance(before, _Initialised) and shape[1:] == before.shape[1:]:
        return _Resized(before, value[before.shape[0] :].clone(), shape)
    return _Initialised(value.clone())


def _to_meta(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` on the meta device; ``swap_tensors`` keeps Parameter objects (ties
    hold)."""
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and not p.is_meta:
                    torch.utils.swap_tensors(
                        p, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                    )
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device="meta")
