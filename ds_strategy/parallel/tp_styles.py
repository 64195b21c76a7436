"""Tensor-parallel styles torch does not ship: packed projections, HF ``Conv1D``, head counts, fused experts.

Each is a ``ParallelStyle``, so a plan mixing them with torch's own runs through ``parallelize_module`` unchanged,
and every sharded parameter is a DTensor whose ``full_tensor()`` is the original weight under its original name.

Note: [Packed projections keep their global layout]
    GPT's ``c_attn`` computes q|k|v in one matmul and splits the output into three equal blocks; Mixtral's
    ``gate_up_proj`` does the same with gate|up. A plain ``Shard`` of the output dimension would give rank 0 all
    of q and half of k, so the split after it would mix heads. ``_StridedShard(dim, split_factor=packs)`` instead
    gives each rank the same slice of every block (q_r|k_r|v_r), which is what the split needs, while the DTensor
    still describes the unpermuted global weight: ``full_tensor()`` and checkpoints under global names see the
    original matrix. torch 2.13 propagates ``_StridedShard`` through ``mm``/``addmm`` without communication, and
    the module's output, made local, is the packed local slice that the module's own ``split``/``chunk`` expects
    once its per-rank width is right (see ``LocalHeadCount``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from ..comm.collectives import Collectives
from ..comm.differentiable import SumGradOverRanks, SumOverRanks
from ..comm.group_collectives import collectives_for


def is_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (GPT-2): a Linear whose weight is stored (in, out). Recognised by shape, not by import, so
    transformers stays optional."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def packed_shard(dim: int, packs: int) -> Placement:
    """The placement sharding each of ``packs`` equal blocks of ``dim``: see Note: [Packed projections keep their
    global layout]."""
    return Shard(dim) if packs == 1 else _StridedShard(dim, split_factor=packs)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement, src_data_rank) -> None:
    param = getattr(module, name)
    if param is None:
        return
    sharded = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _local_output(use_local_output: bool, module: nn.Module, outputs: DTensor, mesh: DeviceMesh):
    """A colwise output is already in its packed layout; only unwrap it."""
    return outputs.to_local() if use_local_output else outputs


class PackedColwiseParallel(ColwiseParallel):
    """Column-wise sharding of an ``nn.Linear`` or HF ``Conv1D`` whose output packs ``packs`` equal blocks.

    ``packs=3`` is a fused q|k|v projection, ``packs=1`` an ordinary one (the only way to shard a ``Conv1D``
    colwise, which torch's ``ColwiseParallel`` rejects). The input is made replicated as in ``ColwiseParallel``;
    the local output is this rank's slice of every block, in block order.
    """

    def __init__(self, *, packs: int = 1, input_layouts: Placement | None = None, use_local_output: bool = True):
        if packs < 1:
            raise ValueError(f"PackedColwiseParallel packs={packs} must be >= 1")
        super().__init__(
            input_layouts=input_layouts, output_layouts=packed_shard(-1, packs), use_local_output=use_local_output
        )
        self.packs = packs

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        weight_dim = 1 if is_conv1d(module) else 0
        _distribute(module, "weight", mesh, packed_shard(weight_dim, self.packs), self.src_data_rank)
        _distribute(module, "bias", mesh, packed_shard(0, self.packs), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise NotImplementedError(f"PackedColwiseParallel shards nn.Linear or Conv1D, not {type(module).__name__}")
        input_fn = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        output_fn = partial(_local_output, self.use_local_output)
        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(packs={self.packs}, input_layouts={self.input_layouts})"


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for HF ``Conv1D``: its weight is (in, out), so the input dimension is dim 0."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _distribute(module, "weight", mesh, Shard(0), self.src_data_rank)
        _distribute(module, "bias", mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            raise NotImplementedError(f"Conv1DRowwiseParallel shards Conv1D, not {type(module).__name__}")
        self.desired_input_layouts = (Shard(-1),)
        input_fn = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        output_fn = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        return distribute_module(module, device_mesh, self._partition, input_fn, output_fn)


class LocalHeadCount(ParallelStyle):
    """Divide an attention module's per-rank width attributes by the TP size; it owns no parameter.

    For modules whose forward reads a global count, e.g. GPT-2's ``split_size`` (the width of each of q, k, v in
    ``c_attn``'s output). Raises if the TP size does not divide a count.
    """

    def __init__(self, *attributes: str):
        self.attributes = attributes

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp_size = device_mesh.size()
        for attribute in self.attributes:
            value = getattr(module, attribute)
            if value % tp_size:
                raise ValueError(f"{type(module).__name__}.{attribute}={value} is not divisible by tp_size={tp_size}")
            setattr(module, attribute, value // tp_size)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.attributes}"


class HiddenStatesLayout(ParallelStyle):
    """Redistribute a module's hidden states (its first positional argument, else ``hidden_states=``) on the way
    in, and optionally its output on the way out; both are passed on as local tensors.

    Sequence parallelism uses it at the boundaries torch's ``PrepareModuleInput`` cannot express for HF layers
    (whose other arguments vary in number and kind): ``(Replicate(), Shard(1))`` into the first layer,
    ``(Shard(1), Replicate())`` into attention, the MLP and the final norm.
    """

    def __init__(self, into: tuple[Placement, Placement], out_of: tuple[Placement, Placement] | None = None) -> None:
        self.into = into
        self.out_of = out_of

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def before(module, args, kwargs):
            if args:
                return (_relayout(args[0], device_mesh, *self.into), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": _relayout(kwargs["hidden_states"], device_mesh, *self.into)}

        module.register_forward_pre_hook(before, with_kwargs=True)
        if self.out_of is not None:
            module.register_forward_hook(lambda module, args, output: _relayout(output, device_mesh, *self.out_of))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(into={self.into}, out_of={self.out_of})"


def _relayout(tensor: torch.Tensor, mesh: DeviceMesh, source: Placement, target: Placement) -> torch.Tensor:
    """``tensor`` (local under ``source``, or a DTensor) as the local tensor of layout ``target``."""
    if not isinstance(tensor, DTensor):
        if isinstance(target, Shard) and tensor.shape[target.dim] % mesh.size():
            raise ValueError(
                f"sequence parallelism splits dim {target.dim} of size {tensor.shape[target.dim]} over "
                f"tp_size={mesh.size()} ranks; pad it to a multiple of {mesh.size()}"
            )
        tensor = DTensor.from_local(tensor, mesh, (source,), run_check=False)
    return tensor.redistribute(placements=(target,)).to_local()


class FusedExpertsParallel(ParallelStyle):
    """Shard the intermediate dimension of fused 3-D expert weights (transformers 5 ``MixtralExperts``).

    ``gate_up_proj`` (experts, 2*intermediate, hidden) is packed gate|up and gets ``_StridedShard(1, 2)``;
    ``down_proj`` (experts, hidden, intermediate) gets ``Shard(2)``. Every rank routes all tokens to all experts
    on its slice of each, so the output is a partial sum, all-reduced here. The forward indexes the weights per
    expert with plain tensors, which DTensor cannot dispatch, so it runs on the local shards; their gradients still
    arrive on the DTensor parameters through ``to_local``. The inputs' gradients are partial on each rank and are
    all-reduced on the way back (Megatron's f/g pair).

    ``collectives``: the tensor-parallel group's ``Collectives`` those sums run through (the mesh's, which
    composition passes: its timeout, counted in ``comm_stats``); None: one made over the mesh it is applied with.
    """

    def __init__(self, collectives: Collectives | None = None):
        self.collectives = collectives

    def over(self, collectives: Collectives) -> FusedExpertsParallel:
        """This style, its sums running through ``collectives``."""
        return FusedExpertsParallel(collectives)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # only the experts module's own parameters
            return
        _distribute(module, "gate_up_proj", mesh, packed_shard(1, 2), self.src_data_rank)
        _distribute(module, "down_proj", mesh, Shard(2), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition)
        group = self.collectives or collectives_for(device_mesh.get_group())  # made once: every forward sums over it
        names = ("gate_up_proj", "down_proj")
        held: dict[str, nn.Parameter] = {}

        def before(module, args):
            for name in names:
                held[name] = module._parameters[name]
                module._parameters[name] = held[name].to_local()
            hidden_states, top_k_index, top_k_weights, *rest = args
            return (
                SumGradOverRanks.apply(hidden_states, group),
                top_k_index,
                SumGradOverRanks.apply(top_k_weights, group),
                *rest,
            )

        def after(module, args, output):
            module._parameters.update(held)
            held.clear()
            return output if output is None else SumOverRanks.apply(output, group)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, always_call=True)
        return module
