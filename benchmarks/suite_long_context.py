"""The GPU suite's long-context part: for each system of ``long_context.py`` (the plain Hugging Face Trainer,
``ZeroTrainer`` at stage 3 with sequence tiling and host-offloaded checkpoints, and the same on 2 ranks with Ulysses
sp=2), the longest sequence of one training step within a per-rank memory cap on this device, with its tokens/s. See
``gpu_suite.py`` for the part's place in the suite and ``long_context.py`` for the probes and the search.

On CUDA the cap is the device memory the probe's process may allocate (``set_per_process_memory_fraction``), on the
host its peak anonymous resident memory. ``ulysses_sp2`` needs two CUDA devices (NCCL takes one rank per device) and
is skipped on one. Each system starts its search at the longest length the one before it reached, as
``long_context.py``'s own command does, so that the few probes a time box allows go to the lengths that decide.
"""

from __future__ import annotations

from typing import NamedTuple

import long_context
from suite_harness import ItemTimeout, Runner, SuiteContext


class LongContextSize(NamedTuple):
    """The search of one ``--size``: the cap per rank, the first and the longest length probed, the bisection's
    resolution, and the Llama (None: ``long_context.MODEL``, 110M parameters with a 32K vocabulary)."""

    cap_gib: float
    start: int
    max_length: int
    resolution: float
    model: dict | None


TINY_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
}
LONG_CONTEXT_SIZES = {
    # the host rehearsal: one probe per system, every system fits (a process with torch and transformers is ~1 GiB)
    "tiny": LongContextSize(cap_gib=4.0, start=256, max_length=256, resolution=0.5, model=TINY_MODEL),
    # one GPU: 8 GiB per rank, as a 110M model's states (1.8 GiB) and a long sequence's activations share a device
    "full": LongContextSize(cap_gib=8.0, start=8192, max_length=262144, resolution=0.25, model=None),
}
MARGIN = 0.85  # of an item's time box given to the search: stopping its last probe's processes takes the rest


def measure_longest(
    system: str, context: SuiteContext, size: LongContextSize, start: int, time_limit_s: float, rows: list[dict]
):
    """One system's row, appended to ``rows`` (the part's, in run order); passes when the search ended without an
    error. A search the time box cut short before any length fit is "overran" (the part's budget was too small),
    not a failure."""
    row = long_context.longest_sequence(
        system,
        device=context.device.type,
        memory_cap_bytes=int(size.cap_gib * 2**30),
        start=start,
        max_length=size.max_length,
        resolution=size.resolution,
        time_limit_s=time_limit_s,
        model=size.model,
        log=lambda line: print(f"  {line}", flush=True),
    )
    rows.append(row)
    if row.get("cut_short") and not row["length"]:
        raise ItemTimeout(f"cut short after {len(row['probes'])} probe(s), before any length fit")
    figures = {
        "length": row["length"],
        "bounded": bool(row.get("bounded")),
        "cut_short": bool(row.get("cut_short")),
        "cap_gib": size.cap_gib,
        "peak_gib": row["peak_bytes"] / 2**30 if row.get("peak_bytes") else None,
        "tokens_per_s": row["tokens_per_s"],
        "step_s": row["step_seconds"],
        "probes": len(row["probes"]),
        "projected_length": row["projected_length"],
    }
    plain = next((r["length"] for r in rows if r["system"] == "plain"), None)
    if plain and row["length"]:
        figures["x_plain"] = row["length"] / plain
    qualifier = "a lower bound: it fit at the longest length probed" if row.get("bounded") else ""
    if row.get("cut_short"):
        qualifier = "a lower bound: the time box ended the search"
    return "error" not in row, figures, row.get("error", qualifier)


def run_long_context(runner: Runner, context: SuiteContext) -> None:
    size = LONG_CONTEXT_SIZES[context.args.size]
    start, rows = size.start, []
    systems = list(long_context.SYSTEMS)
    for index, system in enumerate(systems):
        ranks, _ = long_context.SYSTEMS[system]
        devices = long_context._cuda_count() if context.device.type == "cuda" else ranks
        skip = f"needs {ranks} CUDA devices, {devices} here" if devices < ranks else ""
        share = 1.0 / (len(systems) - index)  # the time left, shared by the systems still to run
        box = max(share * runner.left(), runner.min_item_s)
        item = runner.run(
            f"longest sequence {system}",
            measure_longest,
            system,
            context,
            size,
            start,
            MARGIN * box,
            rows,
            skip=skip,
            share=share,
        )
        start = max(start, item.metrics.get("length") or 0)
