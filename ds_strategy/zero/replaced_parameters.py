"""Parameters that user code moved off their flat buffers (``param.data = ...``), put back."""

from __future__ import annotations

import torch

from ..parallel.dtensor_params import local_tensor, point_param_at
from .flat_param import FlatParam


def adopt_replaced_parameters(flat_params: list[FlatParam]) -> None:
    """Note: [Parameters replaced behind the engine's back]
    Every trainable parameter is a view of its flat buffer, which the engine reduces, steps and gathers. Code
    that assigns ``param.data = ...`` (accelerate's ``LocalSGD`` averaging its replicas) moves the parameter
    onto a tensor of its own: the model would then read values no later step updates. This copies each moved
    parameter's values into its place in the buffer (and its fp32 master, when that is a separate tensor) and
    points the parameter back. Only whole buffers can take them (stages 0-2); a partitioned parameter is
    empty between gathers, and replacing it means nothing. Checked before reading the weights out
    (``ZeroEngine.full_state_dict``, checkpoints) and by adapters after user code that may replace parameters."""
    with torch.no_grad():
        for fp in flat_params:
            if fp.policy.params:
                continue
            moved = set()
            for slot, p, view in zip(fp.slots, fp.params, fp.param_views()):
                if local_tensor(p).data_ptr() != view.data_ptr():
                    view.copy_(local_tensor(p))
                    point_param_at(p, view, storage_kept=True)
                    moved.add(slot.name)
            if not moved or fp.master.data_ptr() == fp.master_region().data_ptr():
                continue
            for slot, start, length in fp.master_slots():  # a separate master: the moved pieces only
                if slot.name in moved:
                    where = slot.offset + start
                    fp.master.narrow(0, where - fp.master_base, length).copy_(fp.full.narrow(0, where, length))
