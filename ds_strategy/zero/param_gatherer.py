"""Stage 3: gather each unit's parameters just in time for its forward and backward, prefetch the next, free after.

Note: [When a gathered buffer may be freed]
  After forward: only with ``reshard_after_forward`` and not for the unit that ran last (backward needs it
  first). Autograd may have saved views of the parameters; they share the full buffer's storage, which is
  resized to zero and later re-filled in place by the backward gather, so they are valid again when read.
  After backward: once every parameter of the unit has produced its gradient and the reduction of its flat
  buffers has been launched (the gradients were copied to scratch by then), nothing reads the weights again.
  A unit whose gradients never all arrive (an unused parameter) is freed at the end of backward.
  The root unit has no backward hooks of its own: it stays gathered from the step's first forward to the
  optimizer step (``ZeroEngine.step`` frees every gathered unit, whose values the step makes stale), so that
  several forwards before their backwards, or a forward after a backward, find it whole.
  A recomputation in backward frees nothing (see Note: [Activation checkpointing under stage 3]).

Note: [Activation checkpointing under stage 3]
  A checkpointed unit's forward runs twice: in forward, and again in backward when autograd first needs a tensor
  the checkpoint did not keep. That recomputation runs inside the backward of one of the unit's own ops, so after
  the pre-backward hook on the unit's output (the gradient reaches the output before any op inside the unit) has
  put the unit in BACKWARD and gathered it. Forward hooks that fire inside a backward (``is_recomputation``):
  - the checkpointed unit's own: under ``ds_strategy.compose.activation_checkpointing`` they do not fire at all, since
    the replaced ``forward`` is recomputed, not the module; under a model's own ``checkpoint(unit, x)`` they do, find
    the unit started and gathered, and change nothing.
  - those of a unit nested inside the checkpointed one (``unit_min_params`` can nest units): its pre-forward hook
    may fire before its pre-backward hook has. Whichever fires first starts its backward (BACKWARD, gather,
    prefetch of the units before it); the other finds it started and gathers nothing.
  Neither records the forward order nor moves the prefetch position, and the post-forward hook neither frees the
  unit (its backward reads it next) nor hooks the recomputed outputs (autograd never backpropagates through
  them). So a step gathers each unit as often as without checkpointing: once in forward, and once in backward if
  ``reshard_after_forward`` freed it; a unit already freed after its backward is gathered again only when a
  later recomputation reads it (a module shared by two checkpointed units). The all-gathers are counted in
  ``tests/engine/test_activation_checkpointing.py``.

Note: [Prefetch order]
The first forward records the order in which units run; later steps gather unit k+1
while unit k computes (reverse order in backward). Every rank issues the same gathers in the same order, since
they run the same model. If a later forward deviates from the recorded order (data-dependent control flow),
prefetching is switched off with a one-time warning and units are gathered on demand, which is always safe.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten

from ..profiler_ranges import profiler_range
from .compile_boundary import eager_hook
from .memory_report import WorkingSetPeak
from .unit import ShardedState, TrainingState, Unit


def is_recomputation() -> bool:
    """A forward running while autograd executes a backward node: an activation-checkpoint recomputation
    (non-reentrant checkpoints recompute from a saved-tensor unpack, reentrant ones from their node's backward)."""
    return torch._C._current_autograd_node() is not None


class ParamGatherer:
    """Forward/backward hooks that drive the stage-3 units' gather, prefetch and release."""

    def __init__(
        self,
        units: list[Unit],
        root: Unit,
        reshard_after_forward: bool,
        prefetch_numel: int,
        max_live_numel: int,
        working_set: WorkingSetPeak,
    ):
        self.units = [u for u in units if u.partitioned and u is not root]
        self.root = root
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.order: list[Unit] = []
        self._place: dict[Unit, int] = {}  # each recorded unit's index in ``order``, looked up once per hook
        self._recording = True
        self._position = 0
        self._prefetch_enabled = True
        self._backward_started: set[Unit] = set()
        self.peak_gathered_numel = 0
        self.working_set = working_set
        self.holding = False  # ZeroEngine.gathered_parameters: no-grad forwards keep their units gathered
        self._handles = []
        for unit in self.units:  # a pipeline schedule removes them (ZeroEngine.driven_by_schedule)
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- accounting --------------------------------------------------------------------------------------------
    def gathered_numel(self) -> int:
        return sum(u.gathered_numel for u in self.units) + self.root.gathered_numel

    def _gather(self, unit: Unit, wait: bool) -> None:
        with profiler_range("unit.gather", unit.name):
            newly = unit.sharded_state is ShardedState.SHARDED  # only then can what is gathered grow
            unit.gather()
            if wait:
                unit.wait_gathered()
            if newly:
                self.peak_gathered_numel = max(self.peak_gathered_numel, self.gathered_numel())
                self.working_set.observe()

    # -- forward ---------------------------------------------------------------------------------------------
    def before_root_forward(self) -> None:
        """The root unit's leftover parameters (embeddings, final norm) stay gathered for the whole step."""
        self._gather(self.root, wait=True)
        self._position = 0

    def _make_pre_forward(self, unit: Unit):
        @eager_hook  # Note: [Hooks torch.compile must not trace]
        def hook(module, args):
            with profiler_range("unit.pre_forward", unit.name):
                if is_recomputation():  # see Note: [Activation checkpointing under stage 3]
                    self._start_backward(unit)
                    self._gather(unit, wait=True)
                    return
                self._track_order(unit)
                self._gather(unit, wait=True)
                unit.set_training_state(TrainingState.FORWARD)
                self._prefetch(self._upcoming_forward(unit))

        return hook

    def _make_post_forward(self, unit: Unit):
        @eager_hook
        def hook(module, args, output):
            with profiler_range("unit.post_forward", unit.name):
                if is_recomputation():
                    return
                unit.set_training_state(TrainingState.IDLE)
                if torch.is_grad_enabled():
                    self._register_pre_backward(unit, output)
                if self.holding and not torch.is_grad_enabled():
                    return
                last = bool(self.order) and unit is self.order[-1] and not self._recording
                if not torch.is_grad_enabled() or (self.reshard_after_forward and not last):
                    unit.release(keep_for_backward=torch.is_grad_enabled())

        return hook

    def _track_order(self, unit: Unit) -> None:
        if self._recording:
            if unit in self._place:
                self._recording = False
            else:
                self._place[unit] = len(self.order)
                self.order.append(unit)
                return
        expected = self.order[self._position] if self._position < len(self.order) else None
        if expected is not unit and self._prefetch_enabled:
            warnings.warn(
                f"ZeRO-3: unit {unit.name} ran out of the recorded order (expected "
                f"{expected.name if expected else 'no more units'}); prefetching is off from now on and "
                f"units are gathered on demand",
                stacklevel=4,
            )
            self._prefetch_enabled = False
        self._position += 1

    def _upcoming_forward(self, unit: Unit) -> list[Unit]:
        if self._recording or not self._prefetch_enabled or unit not in self._place:
            return []
        return self.order[self._place[unit] + 1 :]

    def _upcoming_backward(self, unit: Unit) -> list[Unit]:
        if not self._prefetch_enabled or unit not in self._place:
            return []
        return self.order[self._place[unit] - 1 :: -1] if self._place[unit] else []

    def _prefetch(self, candidates: list[Unit]) -> None:
        """Launch gathers for upcoming units within the prefetch and live-parameter budgets."""
        budget = self.prefetch_numel
        live = self.gathered_numel()
        for unit in candidates:
            if unit.sharded_state is not ShardedState.SHARDED:
                continue
            size = unit.partitioned_numel
            if size > budget or live + size > self.max_live_numel:
                return
            budget -= size
            live += size
            self._gather(unit, wait=False)

    # -- backward --------------------------------------------------------------------------------------------
    def _register_pre_backward(self, unit: Unit, output) -> None:
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]

        @eager_hook
        def hook(grad):
            with profiler_range("unit.pre_backward", unit.name):
                self._start_backward(unit)
                return grad

        for t in tensors:
            t.register_hook(hook)

    def _start_backward(self, unit: Unit) -> None:
        """Once per backward: gather ``unit`` for it and prefetch the units whose backward comes next."""
        if unit not in self._backward_started:
            self._backward_started.add(unit)
            self._recording = False
            unit.set_training_state(TrainingState.BACKWARD)
            self._gather(unit, wait=True)
            self._prefetch(self._upcoming_backward(unit))

    def on_flat_params_reduced(self, unit: Unit) -> None:
        """All of ``unit``'s partitioned gradients are in flight: its weights are no longer needed."""
        if unit is not self.root and unit.training_state is TrainingState.BACKWARD:
            unit.release()
            unit.set_training_state(TrainingState.IDLE)

    def end_of_backward(self) -> None:
        """Free every unit but the root, which stays gathered until the optimizer step.

        See Note: [When a gathered buffer may be freed].
        """
        for unit in self.units:
            if unit.training_state is TrainingState.BACKWARD or unit.sharded_state is not ShardedState.SHARDED:
                unit.wait_gathered()
                unit.release()
            unit.set_training_state(TrainingState.IDLE)
        self.root.set_training_state(TrainingState.IDLE)
        self._backward_started.clear()

    def release_all(self) -> None:
        """Free every gathered unit (after an evaluation forward, before saving, at teardown)."""
        for unit in self.units + [self.root]:
            if unit.sharded_state is not ShardedState.SHARDED:
                unit.wait_gathered()
                unit.release()
            unit.set_training_state(TrainingState.IDLE)
