"""The one device mesh of a run: pipeline parallel outside (only when its size is above 1), then data parallel,
then sequence parallel (Ulysses, only when its size is above 1), tensor parallel inside, and the groups ZeRO uses.

Consecutive ranks form a tensor- or sequence-parallel group (they exchange activations every layer, so they belong
on one node), and ranks with the same position in it form a data-parallel group. ZeRO shards over every rank that
holds the same weights: the data-parallel group times the sequence-parallel one, since Ulysses ranks hold full
weights (or, under tensor parallelism, the same tensor-parallel shards), flattened into one group when it is not the
whole world. Pipeline stages are the outermost dimension, as in
DeepSpeed (``pipe, data, model``) and torchtitan: stages exchange one activation per micro-batch, the least traffic,
so they may span nodes; each stage's ranks form its own data-parallel groups. The dimension names are the host
framework's: Lightning's ModelParallelStrategy calls them "data_parallel" and "tensor_parallel", and users index
``self.device_mesh`` by those names (and "sequence_parallel") in ``configure_model`` and ``training_step``.

The mesh owns one :class:`~ds_strategy.comm.collectives.Collectives` per model-parallel dimension (pp, sp, tp, when
above 1), made with the run's ``collective_timeout``: tensor parallelism, Ulysses, partitioned activations, the
pipeline runner and the engine's norms all issue their collectives through these, so each dimension's traffic is
counted once, in one place, and ``comm_stats()`` adds it up. The data-parallel traffic is ZeRO's: the engine builds
the ``Collectives`` of its group itself, since it picks the algorithm (Note: [Algorithms per backend]).

Expert parallelism splits the data-parallel dimension in two, expert data parallel outside and expert parallel
inside (consecutive ranks hold different experts and exchange tokens every MoE layer, as in DeepSpeed-MoE and
torchtitan), flattened back into the data-parallel dimension under its usual name: every rank still reads its own
batch, and ZeRO shards the non-expert parameters over all of them, the experts over the expert-data-parallel group
(the ranks holding the same experts). The expert-parallel group's ``Collectives`` carry the token all-to-alls.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..comm.collectives import Collectives

PP, DP, SP, TP = "pp", "dp", "sp", "tp"
EDP, EP = "edp", "ep"  # the two halves of dp under expert parallelism
LIGHTNING_NAMES = {
    PP: "pipeline_parallel",
    DP: "data_parallel",
    SP: "sequence_parallel",
    TP: "tensor_parallel",
    EDP: "expert_data_parallel",
    EP: "expert_parallel",
}
# Accelerate's ParallelismConfig names, which its data loaders read to give a tensor-parallel group the same batches.
ACCELERATE_NAMES = {PP: "pp", DP: "dp_shard", SP: "sp", TP: "tp", EDP: "edp", EP: "ep"}
_DEFAULT_NAMES = {PP: PP, DP: DP, SP: SP, TP: TP, EDP: EDP, EP: EP}


def mesh_shape(
    world_size: int,
    tensor_parallel_size: int,
    sequence_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> dict[str, int]:
    """The size of each dimension, outer to inner: pp (only above 1), dp, or edp and ep with expert parallelism, sp
    (only above 1), tp; checked before any group is made. Which parallelisms combine is ``ZeroConfig``'s rule; this
    checks the sizes fit the world."""
    sizes = (
        ("tensor", tensor_parallel_size),
        ("sequence", sequence_parallel_size),
        ("pipeline", pipeline_parallel_size),
        ("expert", expert_parallel_size),
    )
    for name, size in sizes:
        if size < 1 or world_size % size:
            allowed = [n for n in range(1, world_size + 1) if world_size % n == 0]
            raise ValueError(
                f"{name}_parallel_size={size} does not divide the world size {world_size}; allowed: {allowed}"
            )
    model_parallel = tensor_parallel_size * sequence_parallel_size * pipeline_parallel_size
    if world_size % model_parallel:
        product = " x ".join(f"{name}_parallel_size={size}" for name, size in reversed(sizes[:3]) if size > 1)
        raise ValueError(f"{product} = {model_parallel} does not divide the world size {world_size}")
    data_parallel = world_size // model_parallel
    if data_parallel % expert_parallel_size:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} does not divide the data-parallel size {data_parallel}"
        )
    if expert_parallel_size > 1:
        data = {EDP: data_parallel // expert_parallel_size, EP: expert_parallel_size}
    else:
        data = {DP: data_parallel}
    return {
        **({PP: pipeline_parallel_size} if pipeline_parallel_size > 1 else {}),
        **data,
        **({SP: sequence_parallel_size} if sequence_parallel_size > 1 else {}),
        TP: tensor_parallel_size,
    }


@dataclasses.dataclass(frozen=True)
class ParallelMesh:
    """A ``DeviceMesh`` ([pipeline parallel,] data parallel (or expert data parallel x expert parallel, flattened
    into it), [sequence parallel,] tensor parallel), the names its dimensions have, and the ``Collectives`` of each
    model-parallel dimension above size 1, by "pp", "sp", "tp", "ep"."""

    mesh: DeviceMesh
    names: dict[str, str] = dataclasses.field(default_factory=lambda: dict(_DEFAULT_NAMES))
    collectives: dict[str, Collectives] = dataclasses.field(default_factory=dict)

    @property
    def pp_collectives(self) -> Collectives | None:
        """The pipeline group's collectives (the loss broadcast, tied weights), or None without pipelining."""
        return self.collectives.get(PP)

    @property
    def sp_collectives(self) -> Collectives | None:
        """The sequence-parallel group's collectives (Ulysses' all-to-alls and loss), or None without Ulysses."""
        return self.collectives.get(SP)

    @property
    def tp_collectives(self) -> Collectives | None:
        """The tensor-parallel group's collectives (sums, partitioned activations, norms), or None without it."""
        return self.collectives.get(TP)

    @property
    def ep_collectives(self) -> Collectives | None:
        """The expert-parallel group's collectives (the token all-to-alls), or None without expert parallelism."""
        return self.collectives.get(EP)

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_collectives is None else self.ep_collectives.world_size

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep_collectives is None else self.ep_collectives.rank

    @property
    def edp_group(self):
        """The expert-data-parallel group (the ranks holding the same experts, over which ZeRO shards them), or
        None without expert parallelism."""
        return None if self.ep_collectives is None else self.mesh[self.names[EDP]].get_group()

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """None when the mesh has no pipeline dimension (size 1)."""
        name = self.names.get(PP)
        return self.mesh[name] if name in self.mesh.mesh_dim_names else None

    @property
    def pp_size(self) -> int:
        return 1 if self.pp_mesh is None else self.pp_mesh.size()

    @property
    def pp_rank(self) -> int:
        return 0 if self.pp_mesh is None else self.pp_mesh.get_local_rank()

    @property
    def pp_group(self):
        """The group of one rank per pipeline stage (same dp and tp position), or None without pipelining."""
        return None if self.pp_mesh is None else self.pp_mesh.get_group()

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh[self.names[DP]]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[self.names[TP]]

    @property
    def sp_mesh(self) -> DeviceMesh | None:
        """None when the mesh has no sequence-parallel dimension (size 1)."""
        name = self.names.get(SP)  # names from before Ulysses may lack "sp"
        return self.mesh[name] if name in self.mesh.mesh_dim_names else None

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()

    @property
    def sp_size(self) -> int:
        return 1 if self.sp_mesh is None else self.sp_mesh.size()

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def sp_rank(self) -> int:
        return 0 if self.sp_mesh is None else self.sp_mesh.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank()

    @property
    def dp_group(self):
        """The data-parallel group; None (the default group) when it is the world."""
        return None if self.dp_size == self.mesh.size() else self.dp_mesh.get_group()

    @property
    def zero_group(self):
        """The group ZeRO shards over, every rank holding the same weights: dp x sp. None (the default group)
        without tensor or pipeline parallelism, when it is the world; with either, the data-parallel group, or
        with Ulysses too the flattened dp x sp one (:func:`build_parallel_mesh` made it)."""
        if self.tp_size == 1 and self.pp_size == 1:
            return None
        return self.dp_group if self.sp_mesh is None else self.mesh[_dp_sp_name(self.names)].get_group()

    @property
    def sp_group(self):
        """The sequence-parallel group Ulysses attention and loss run over, or None without one."""
        return None if self.sp_mesh is None else self.sp_mesh.get_group()

    @property
    def tp_group(self):
        """The tensor-parallel group, or None without tensor parallelism."""
        return None if self.tp_size == 1 else self.tp_mesh.get_group()


def build_parallel_mesh(
    device_type: str,
    tensor_parallel_size: int,
    names: dict[str, str] | None = None,
    sequence_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    collective_timeout: float = 600.0,
    expert_parallel_size: int = 1,
) -> ParallelMesh:
    """The mesh over the initialised default group; ``names`` maps "pp"/"dp"/"sp"/"tp"/"edp"/"ep" to the
    framework's dimension names; each model-parallel dimension's collectives wait up to ``collective_timeout``
    seconds."""
    names = {**_DEFAULT_NAMES, **(names or {})}
    shape = mesh_shape(
        dist.get_world_size(),
        tensor_parallel_size,
        sequence_parallel_size,
        pipeline_parallel_size,
        expert_parallel_size,
    )
    mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(names[dim] for dim in shape))
    if SP in shape and (shape[TP] > 1 or PP in shape):  # the ZeRO group, dp x sp, is not the world: make its groups
        mesh[names[DP], names[SP]]._flatten(_dp_sp_name(names))
    if EP in shape:  # dp under its usual name, for samplers and user code: every rank reads its own batch
        mesh[names[EDP], names[EP]]._flatten(names[DP])
    collectives = {
        dim: Collectives(mesh[names[dim]].get_group(), timeout=collective_timeout)
        for dim in (PP, SP, TP, EP)
        if shape.get(dim, 1) > 1
    }
    return ParallelMesh(mesh, dict(names), collectives)


def _dp_sp_name(names: dict[str, str]) -> str:
    """The name of the flattened dp x sp dimension."""
    return f"{names[DP]}_{names[SP]}"
