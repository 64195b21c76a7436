"""From the ranks' raw windows to one row per system, and from rows to a Markdown table, JSON and a PNG chart."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from systems import STATE_KINDS, SystemSpec

MIB = 2**20


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(spec: SystemSpec, per_rank: list[dict], tokens_per_step: int) -> dict:
    """One system's row: step-time statistics over every timed step (slowest rank each), memory maxima over
    ranks and windows, communication per step averaged over ranks, and round 0's losses."""
    windows = [rank["windows"][spec.name] for rank in per_rank]
    row = {"name": spec.name, "family": spec.family, "precision": spec.precision, "options": dict(spec.options)}
    failure = next((rank["failed"][spec.name] for rank in per_rank if spec.name in rank["failed"]), None)
    if not windows[0]:
        return {**row, "status": "failed", "error": failure or "no window completed"}
    rounds = [
        [max(times) for times in zip(*(w["step_seconds"] for w in rank_windows))] for rank_windows in zip(*windows)
    ]
    steps = [step for round_steps in rounds for step in round_steps]
    timed = sum(len(w["step_seconds"]) for w in windows[0])
    states = [w["state_bytes"] for rank_windows in windows for w in rank_windows]
    state = max(states, key=lambda s: sum(s.get(k, 0) for k in STATE_KINDS))
    comm = [sum(w["comm_bytes"].values()) for rank_windows in windows for w in rank_windows]
    comm_steps = [len(w["step_seconds"]) for rank_windows in windows for w in rank_windows]
    own = [w["own_comm_bytes"] for rank_windows in windows for w in rank_windows if w["own_comm_bytes"] is not None]
    kinds: dict[str, float] = {}
    for rank_windows in windows:
        for w in rank_windows:
            for kind, value in w["comm_bytes"].items():
                kinds[kind] = kinds.get(kind, 0) + value / sum(comm_steps)
    median = statistics.median(steps)
    return {
        **row,
        "status": "ok" if failure is None else "failed after some rounds",
        "error": failure,
        "timed_steps": timed,
        "step_seconds": steps,
        "step_median_s": median,
        "round_median_s": [statistics.median(round_steps) for round_steps in rounds],
        "step_p25_s": _quantile(steps, 0.25),
        "step_p75_s": _quantile(steps, 0.75),
        "step_min_s": min(steps),
        "step_max_s": max(steps),
        "tokens_per_s": tokens_per_step / median,
        "state_bytes": {
            **{k: state.get(k, 0) for k in STATE_KINDS},
            "nvme": state.get("nvme", 0),
            "total_in_memory": sum(state.get(k, 0) for k in STATE_KINDS),
        },
        "model_state_bytes": sum(state.get(k, 0) for k in ("params", "grads", "optimizer")),
        "peak_rss_bytes": max(w["peak_rss"] for rank_windows in windows for w in rank_windows),
        "build_peak_rss_bytes": max(w["build_peak_rss"] for rank_windows in windows for w in rank_windows),
        "comm_bytes_per_step": sum(comm) / sum(comm_steps),
        "comm_bytes_per_step_by_kind": kinds,
        "own_comm_bytes_per_step": (sum(own) / sum(comm_steps)) if own else None,
        "losses": windows[0][0]["losses"],
    }


def add_ratios(rows: list[dict]) -> None:
    """Step time and model-state ratios against DDP and FSDP2 of the same precision, and the loss difference
    from that DDP at the last step (a check that every system trains the same model)."""
    by_name = {row["name"]: row for row in rows if "step_median_s" in row}
    for row in rows:
        if "step_median_s" not in row:
            continue
        suffix = "" if row["precision"] == "32-true" else "-bf16"
        for baseline in ("ddp", "fsdp2"):
            other = by_name.get(baseline + suffix)
            row[f"step_vs_{baseline}"] = row["step_median_s"] / other["step_median_s"] if other else None
            row[f"state_vs_{baseline}"] = row["model_state_bytes"] / other["model_state_bytes"] if other else None
        ddp = by_name.get("ddp" + suffix)
        row["loss_delta_vs_ddp"] = abs(row["losses"][-1] - ddp["losses"][-1]) if ddp else None


OVERLAP_OFF = "-nooverlap"


def overlap_pairs(rows: list[dict]) -> list[dict]:
    """For every system ``X`` measured beside ``X-nooverlap`` (``overlap_comm=False``): on/off step-time ratios.

    Each round runs both once, close in time, so the ratio of their median steps within a round cancels most
    of a shared machine's slow spells; the pair reports that per-round ratio's median and range and how many
    rounds had overlap no slower than without.
    """
    by_name = {row["name"]: row for row in rows if "round_median_s" in row}
    pairs = []
    for name, off in by_name.items():
        on = by_name.get(name.removesuffix(OVERLAP_OFF)) if name.endswith(OVERLAP_OFF) else None
        if on is None:
            continue
        ratios = [a / b for a, b in zip(on["round_median_s"], off["round_median_s"])]
        pairs.append(
            {
                "system": on["name"],
                "ratios": ratios,
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "rounds_not_slower": sum(r <= 1.0 for r in ratios),
            }
        )
    return pairs


def overlap_table(pairs: list[dict]) -> str:
    lines = [
        "| system | step time, overlap on ÷ off: median of rounds (min–max) | rounds with on ≤ off |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {p['system']} | {p['median']:.3f} ({p['min']:.3f}–{p['max']:.3f}) "
        f"| {p['rounds_not_slower']} of {len(p['ratios'])} |"
        for p in pairs
    ]
    return "\n".join(lines)


def _ratio(value) -> str:
    return f"{value:.2f}×" if value is not None else "—"


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| system | precision | step ms, median (p25–p75) | tokens/s | step × DDP | step × FSDP2 "
        "| model states MiB/rank | states × DDP | peak RSS MiB/rank | comm MB/step/rank | loss Δ vs DDP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if "step_median_s" not in row:
            notes.append(f"- **{row['name']}** {row['status']}: {row['error'].strip().splitlines()[0]}")
            lines.append(f"| {row['name']} | {row['precision']} | {row['status']} | | | | | | | | |")
            continue
        delta = row["loss_delta_vs_ddp"]
        lines.append(
            f"| {row['name']} | {row['precision']} "
            f"| {1e3 * row['step_median_s']:.1f} ({1e3 * row['step_p25_s']:.1f}–{1e3 * row['step_p75_s']:.1f}) "
            f"| {row['tokens_per_s']:,.0f} | {_ratio(row['step_vs_ddp'])} | {_ratio(row['step_vs_fsdp2'])} "
            f"| {row['model_state_bytes'] / MIB:,.1f} | {_ratio(row['state_vs_ddp'])} "
            f"| {row['peak_rss_bytes'] / MIB:,.0f} | {row['comm_bytes_per_step'] / 1e6:,.2f} "
            f"| {'—' if delta is None else f'{delta:.1e}'} |"
        )
        if row["error"]:
            notes.append(f"- **{row['name']}** {row['status']}: {row['error'].strip().splitlines()[0]}")
    return "\n".join(lines + [""] + LEGEND + ([""] + notes if notes else []))


LEGEND = [
    "Step: the slowest rank's time per step, over every timed step of every round (systems interleaved). "
    "× DDP / × FSDP2: against the baseline of the same precision. Model states: parameters + gradients + "
    "optimizer state held in memory per rank (ds_strategy: `memory_report()`; peers: the storages of their "
    "tensors, local shards only), the largest total sampled as each block starts its forward (gathered units "
    "count), after backward and after the optimizer step; communication buckets and NVMe bytes are in the JSON. "
    "Peak RSS: the rank's resident-memory peak during training steps. "
    "Comm: bytes per step per rank through `torch.distributed`, ZeRO-paper convention (all-reduce counts 2×). "
    "Loss Δ: |last-step loss − DDP's| at the same precision (same seed and batches).",
]


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


def write_chart(path: Path, rows: list[dict], title: str) -> str | None:
    """Median step time (with p25–p75) and model-state bytes per rank, per system; None, or why not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no chart drawn"
    done = [row for row in rows if "step_median_s" in row]
    names = [row["name"] for row in done]
    colors = {"ddp": "#7f7f7f", "fsdp2": "#1f77b4", "deepspeed": "#ff7f0e", "ours": "#2ca02c"}
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 0.42 * len(done) + 1.8), sharey=True)
    y = list(range(len(done)))
    medians = [1e3 * row["step_median_s"] for row in done]
    errors = [
        [m - 1e3 * row["step_p25_s"] for m, row in zip(medians, done)],
        [1e3 * row["step_p75_s"] - m for m, row in zip(medians, done)],
    ]
    ax_time.barh(y, medians, xerr=errors, color=[colors[row["family"]] for row in done], capsize=3)
    ax_time.set_xlabel("step time, ms (median, p25–p75)")
    left = [0.0] * len(done)
    for kind, shade in zip(("params", "grads", "optimizer", "buffers"), ("#4c72b0", "#dd8452", "#55a868", "#c4c4c4")):
        widths = [row["state_bytes"][kind] / MIB for row in done]
        ax_mem.barh(y, widths, left=left, color=shade, label=kind)
        left = [a + b for a, b in zip(left, widths)]
    ax_mem.set_xlabel("model-state MiB per rank")
    ax_mem.legend(loc="lower right", fontsize=8)
    ax_time.set_yticks(y, names)
    ax_time.invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
