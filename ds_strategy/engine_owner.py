"""What every framework adapter that owns a ZeroEngine shares: the strategy names and the engine's reports."""
from __future__ import annotations

from typing import Any

# Strategy names every adapter registers (Lightning, pytorch_lightning, Fabric, Hydra's ``strategy`` group), and
# the ZeroConfig fields each one sets.
PRESETS: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu", "pin_memory": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu", "pin_memory": True},
}


class EngineOwnerMixin:
    """Reports, teardown and name registration for a strategy class whose ``engine`` is a ZeroEngine (or None
    before setup). Mixed in ahead of the framework's strategy base, whose ``teardown`` it extends."""

    engine = None

    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes per kind of model state and place; see :func:`ds_strategy.zero.memory_report`."""
        return self.engine.memory_report()

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds waited per collective kind since setup; see ``ZeroEngine.comm_stats``."""
        return self.engine.comm_stats()

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.reshard()
            self.engine.remove_hooks()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, fields in PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"ZeRO {fields}", **fields)
