"""The closing report every example prints and writes: final loss, tokens/s and ZeRO's bytes per rank.

Each example records one globally averaged loss and the gradient's global norm before clipping per optimizer step
and, at the end, passes this rank's ``memory_report()``. Rank 0 prints a short summary and writes ``summary.json``,
which the end-to-end tests read to check that the losses and norms are those of the same run at stage 0 and that
each rank held 1/N of the optimizer state.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

MIB = 2**20


class RunSummary:
    """Losses, gradient norms and timing of one training run; ``finish`` gathers every rank's memory report."""

    def __init__(self, entry_point: str, tokens_per_step: int):
        self.entry_point = entry_point
        self.tokens_per_step = tokens_per_step
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self._start = time.perf_counter()

    def record(self, loss: float, grad_norm: float) -> float:
        """Add one optimizer step's loss (already averaged over ranks) and the global norm of its gradient before
        clipping (the norm a wrong gradient scale changes, where AdamW's loss would not show it); returns tokens/s
        so far."""
        self.losses.append(float(loss))
        self.grad_norms.append(float(grad_norm))
        return self.tokens_per_second()

    def tokens_per_second(self) -> float:
        return len(self.losses) * self.tokens_per_step / (time.perf_counter() - self._start)

    def finish(self, memory_report: dict, stage: int, trainable_params: int, out_dir: str | Path) -> dict:
        """Collective: every rank calls it. Rank 0 prints the summary and writes ``out_dir/summary.json``."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        reports = [memory_report]
        if world_size > 1:
            reports = [None] * world_size
            dist.all_gather_object(reports, memory_report)
        summary = {
            "entry_point": self.entry_point,
            "stage": stage,
            "world_size": world_size,
            "trainable_params": trainable_params,
            "steps": len(self.losses),
            "first_loss": self.losses[0],
            "final_loss": self.losses[-1],
            "losses": self.losses,
            "grad_norms": self.grad_norms,
            "tokens_per_s": self.tokens_per_second(),
            "bytes_per_rank": [{kind: sum(places.values()) for kind, places in r.items()} for r in reports],
            "memory_reports": reports,
        }
        if not dist.is_initialized() or dist.get_rank() == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, "summary.json").write_text(json.dumps(summary, indent=1))
            per_rank = summary["bytes_per_rank"][0]
            print(
                f"\n{self.entry_point}: ZeRO stage {stage} on {world_size} ranks, {len(self.losses)} steps, "
                f"final loss {self.losses[-1]:.3f} (first {self.losses[0]:.3f}), "
                f"{summary['tokens_per_s']:,.0f} tokens/s\n"
                f"bytes per rank: "
                + ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in per_rank.items())
                + f"\nsummary and checkpoint in {Path(out_dir).resolve()}"
            )
        return summary
