"""Composition: the one function every adapter calls to turn a model into this rank's trained-in-parallel part of it
(:func:`compose_model`, in the order of Note: [The order of composition] in :mod:`.model`), the mesh it composes
over (:func:`build_mesh`); under pipelining it builds ``ds_strategy.pipeline``'s runner last."""

from .model import Composed, build_mesh, compose_model, recompose_engine
from .tensor_parallel import TensorParallelism, Unparallelized

__all__ = ["Composed", "TensorParallelism", "Unparallelized", "build_mesh", "compose_model", "recompose_engine"]
