"""The longest sequence a ~100M-parameter Hugging Face Llama trains one step of, within a per-rank memory cap.

    nice -n 10 python benchmarks/long_context.py                      # the docs table (CPU, 4 GiB per rank)
    python benchmarks/long_context.py --cap-gib 2 --max-length 4096   # quicker
    python benchmarks/long_context.py --device cuda --cap-gib 8       # one GPU: the first two rows

Model: ``LlamaForCausalLM`` from a config (no download): hidden 768, 12 layers, 12 heads, MLP 2048, a 32,000-token
vocabulary, tied embeddings: 109.5M parameters. One row of ``length`` random tokens (labels = the tokens), one
optimizer step of AdamW, bf16 mixed precision (bf16 compute, fp32 weights or masters), through the Hugging Face
Trainer as its users run it. Systems (``SYSTEMS``):

plain              ``transformers.Trainer``, one process: the baseline.
zero3_tiled        ``ZeroTrainer`` at ZeRO stage 3, one process, with tiled MLP and tiled loss
                   (``ds_strategy.sequence_tiling``) and every decoder layer checkpointed, its input kept on the host
                   (``cpu_checkpointing``; on a CPU run the host is where it already is).
ulysses_sp2        the same on 2 ranks with ``sequence_parallel_size=2``: each rank holds half of the sequence and
                   half of the model states (ZeRO-3 over the group).

A probe trains the step at one length on fresh processes (``launch_ranks``) and *fits* when every rank's peak stays
within the cap: on CPU the peak anonymous resident memory (``RssAnon`` in ``/proc/self/status``, sampled every
millisecond from before the model is built, with ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB so freed blocks leave), on
CUDA ``torch.cuda.max_memory_allocated`` under ``set_per_process_memory_fraction(cap)``. A rank that crosses the
cap is stopped at once, so a failing probe costs only the time to get there. :func:`longest_sequence` doubles the
length from ``start`` until a probe fails (or ``max_length`` fits), then bisects to within ``resolution`` (lengths
are multiples of ``MULTIPLE``): a handful of probes per system. Tokens/s is the length over the seconds of that one
step (a first step: it includes allocating the optimizer state) at the longest length found.

Writes ``results/<name>.json``, ``.md`` (the table, with this command) and ``.png`` (peak memory against length per
system, with the cap), after every system.

GPU suite: ``longest_sequence(system, device="cuda", memory_cap_bytes=..., max_length=..., time_limit_s=...)`` is
one row of its ``long_context`` part (``suite_long_context.py``); ``ulysses_sp2`` needs 2 devices (it reports
itself skipped on fewer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import transformers

RESULTS = Path(__file__).resolve().parent / "results"
MULTIPLE = 128  # lengths probed are multiples of this (even over 2 ranks, whole tiles of tokens)
MODEL = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
}
TILED = {
    "stage": 3,
    "tiled_mlp": True,
    "tiled_loss": True,
    "activation_checkpointing": "full",
    "cpu_checkpointing": True,
}
# name: (ranks, ZeroConfig fields, or None for transformers' own Trainer)
SYSTEMS: dict[str, tuple[int, dict | None]] = {
    "plain": (1, None),
    "zero3_tiled": (1, TILED),
    "ulysses_sp2": (2, {**TILED, "sequence_parallel_size": 2}),
}
OVER_CAP_EXIT = 77
MMAP_THRESHOLD = 1 << 20  # ds_strategy.offload.host_memory.MAP_LARGE_BLOCKS_BYTES; set before any rank starts


@dataclasses.dataclass
class Probe:
    """One step at one length: whether every rank stayed within the cap, the highest rank's peak, the step's
    seconds and tokens/s (when it ran to the end), or why not."""

    length: int
    fits: bool
    peak_bytes: int | None = None
    backward_peak_bytes: int | None = None  # the peak up to the optimizer step: forward and backward alone
    step_seconds: float | None = None
    loss: float | None = None
    reason: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return self.length / self.step_seconds if self.step_seconds else None


# -- one rank ---------------------------------------------------------------------------------------------------
class _CapGuard:
    """This rank's peak memory; past the cap the process is ended at once (exit ``OVER_CAP_EXIT``) after leaving
    ``marker``, so the parent tells "over the cap" from a failure. On CUDA the allocator enforces the cap."""

    def __init__(self, cap_bytes: int, device: str, marker: Path, interval_s: float = 0.001):
        self.cap, self.device, self.marker, self.interval_s = cap_bytes, device, marker, interval_s
        self.peak = 0
        self._stop = threading.Event()
        if device == "cuda":
            import torch

            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        from ds_strategy.offload.host_memory import rss_anon_bytes

        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            if self.peak > self.cap:
                self.marker.write_text(str(self.peak))
                os._exit(OVER_CAP_EXIT)
            time.sleep(self.interval_s)

    def current_peak(self) -> int:
        if self.device == "cuda":
            import torch

            return torch.cuda.max_memory_allocated()
        return self.peak

    def stop(self) -> int:
        if self.device != "cuda":
            self._stop.set()
            self._thread.join()
        return self.current_peak()


def _llama(shape: dict):
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=1 << 20, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False  # a training step keeps no cache (the Trainer leaves it on)
    return model


def train_one_step(
    rank: int, world_size: int, system: str, length: int, cap_bytes: int, device: str, work: str, shape: dict
):
    """One rank of one probe: build a Llama of ``shape``, train one step through the Trainer, report the peak and
    the step's seconds."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    guard = _CapGuard(cap_bytes, device, Path(work, f"over_cap.{rank}"))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")  # launch_ranks set the environment
    _, zero = SYSTEMS[system]
    ids = torch.randint(0, shape["vocab_size"], (length,), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids}]
    args = transformers.TrainingArguments(
        output_dir=work,
        per_device_train_batch_size=1,
        max_steps=1,
        learning_rate=1e-4,
        bf16=True,
        use_cpu=device == "cpu",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    timer = _StepTimer(guard)
    kwargs = dict(model=_llama(shape), args=args, train_dataset=data, callbacks=[timer])
    if zero is None:
        trainer = transformers.Trainer(**kwargs)
    else:
        from ds_strategy.transformers import ZeroTrainer

        trainer = ZeroTrainer(**kwargs, zero_config=zero)
    output = trainer.train()
    peak = guard.stop()
    dist.destroy_process_group()
    return {"peak": peak, "backward_peak": timer.backward_peak, "seconds": timer.seconds, "loss": output.training_loss}


class _StepTimer(transformers.TrainerCallback):
    """Seconds from the step's start to its end (forward, backward, optimizer step), and the peak before the
    optimizer step."""

    seconds = 0.0
    backward_peak = None

    def __init__(self, guard: _CapGuard):
        self.guard = guard

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.backward_peak = self.guard.current_peak()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self._start


# -- probes and the search --------------------------------------------------------------------------------------
def probe(
    system: str,
    length: int,
    memory_cap_bytes: int,
    device: str = "cpu",
    timeout: float = 3600.0,
    model: dict | None = None,
) -> Probe:
    """Train one step of ``system`` at ``length`` tokens on fresh processes, a Llama of ``model`` (default
    ``MODEL``); see the module docstring."""
    from ds_strategy.autotune.launcher import launch_ranks

    ranks, _ = SYSTEMS[system]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the ranks inherit it
    with tempfile.TemporaryDirectory(prefix="long_context_") as work:
        outcome = launch_ranks(
            train_one_step,
            ranks,
            system,
            length,
            memory_cap_bytes,
            device,
            work,
            model or MODEL,
            timeout=timeout,
            log_dir=work,
        )
        over = [int(path.read_text()) for path in Path(work).glob("over_cap.*")]
        if over:
            return Probe(length, False, max(over), reason="over the cap")
        if not outcome.ok:
            out_of_memory = "out of memory" in outcome.error.lower()
            return Probe(length, False, reason="over the cap" if out_of_memory else outcome.error[-2000:])
    peak = max(value["peak"] for value in outcome.values)
    backward_peak = max(value["backward_peak"] or 0 for value in outcome.values) or None
    seconds = max(value["seconds"] for value in outcome.values)
    return Probe(length, peak <= memory_cap_bytes, peak, backward_peak, seconds, outcome.values[0]["loss"])


def longest_sequence(
    system: str,
    *,
    device: str = "cpu",
    memory_cap_bytes: int = 4 << 30,
    start: int = 512,
    max_length: int = 65536,
    resolution: float = 0.125,
    time_limit_s: float | None = None,
    model: dict | None = None,
    log=print,
) -> dict[str, Any]:
    """The longest multiple of ``MULTIPLE`` tokens ``system`` trains one step of within ``memory_cap_bytes`` per rank
    on ``device`` ("cpu" or "cuda"), found by doubling from ``start`` and bisecting to ``resolution``; ``max_length``
    bounds the search (a fit there is reported as a lower bound, ``"bounded": True``), ``time_limit_s`` its wall time
    (the best length so far is reported, ``"cut_short": True``; a probe still running at the limit is stopped, and
    recorded as neither fitting nor an error). ``model``: the Llama's config fields (default ``MODEL``; the GPU
    suite's host rehearsal uses a tiny one). Returns the row: ``system``, ``ranks``, ``length`` (0 when even
    ``start`` does not fit), ``tokens_per_s``, ``peak_bytes``, and every ``probes`` entry."""
    ranks, _ = SYSTEMS[system]
    row: dict[str, Any] = {"system": system, "ranks": ranks, "device": device, "cap_bytes": memory_cap_bytes}
    if device == "cuda" and _cuda_count() < ranks:
        return {**row, "skipped": f"needs {ranks} CUDA devices, {_cuda_count()} here"}
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    probes: list[Probe] = []
    best: Probe | None = None
    low, high = 0, None  # longest fitting, shortest failing
    length = _rounded(start)
    while True:
        if deadline is not None and time.monotonic() > deadline:
            row["cut_short"] = True
            break
        remaining = 3600.0 if deadline is None else max(1.0, deadline - time.monotonic())
        result = probe(system, length, memory_cap_bytes, device, timeout=remaining, model=model)
        probes.append(result)
        if result.reason not in ("", "over the cap") and deadline is not None and time.monotonic() >= deadline:
            row["cut_short"] = True  # stopped by the limit (or failing just then): no verdict on this length
            log(f"{system} {length:>7} tokens: stopped at the time limit")
            break
        log(f"{system} {length:>7} tokens: {'fits' if result.fits else 'no'} {_gib(result.peak_bytes)} {result.reason}")
        if result.fits:
            low, best = length, result
        else:
            high = length
            if result.reason not in ("", "over the cap"):
                row["error"] = result.reason
                break
        if high is None:
            if length >= _rounded(max_length):
                row["bounded"] = True
                break
            length = min(_rounded(2 * length), _rounded(max_length))
            continue
        if low == 0:
            if length <= MULTIPLE:
                break
            length = _rounded(length // 2)
            continue
        if high <= low * (1 + resolution) or high - low <= MULTIPLE:
            break
        length = _rounded((low + high) // 2)
    row.update(
        length=low,
        tokens_per_s=best.tokens_per_s if best else None,
        step_seconds=best.step_seconds if best else None,
        peak_bytes=best.peak_bytes if best else None,
        projected_length=projected_length(probes, memory_cap_bytes),
        probes=[dataclasses.asdict(p) for p in probes],
    )
    return row


def projected_length(probes: list[Probe], memory_cap_bytes: int) -> int | None:
    """Where the forward-and-backward peak reaches the cap, on the line through the two longest fitting probes
    that measured it (activation memory grows linearly with the sequence: flash attention keeps no [seq, seq]);
    None without two such probes or growth. An extrapolation: the table marks it as one."""
    measured = sorted({p.length: p.backward_peak_bytes for p in probes if p.fits and p.backward_peak_bytes}.items())
    if len(measured) < 2:
        return None
    (short, low), (long, high) = measured[-2:]
    if high <= low:
        return None
    return _rounded(long + int((memory_cap_bytes - high) * (long - short) / (high - low)))


def _rounded(length: int) -> int:
    return max(MULTIPLE, length // MULTIPLE * MULTIPLE)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gib(value: int | None) -> str:
    return "" if value is None else f"peak {value / 2**30:.2f} GiB"


# -- the report -------------------------------------------------------------------------------------------------
def markdown(rows: list[dict], command: str) -> str:
    """The table, after the command(s) that measured its rows (a resumed run adds its own)."""
    base = next((row["length"] for row in rows if row["system"] == "plain" and row.get("length")), None)
    commands = dict.fromkeys(row.get("command", command) for row in rows) or {command: None}
    lines = [
        "Measured by:",
        "",
        *(f"- `{each}`" for each in commands),
        "",
        "| system | ranks | longest sequence (tokens) | x plain | peak per rank (GiB) | step (s) | tokens/s | probes "
        "| projected: forward+backward at the cap (tokens) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['system']} | {row['ranks']} | skipped: {row['skipped']} | | | | | | |")
            continue
        length = f"{'>= ' if row.get('bounded') else ''}{row['length']:,}"
        times = f"{row['length'] / base:.1f}" if base and row["length"] else ""
        peak = f"{row['peak_bytes'] / 2**30:.2f}" if row.get("peak_bytes") else ""
        step = f"{row['step_seconds']:.1f}" if row.get("step_seconds") else ""
        speed = f"{row['tokens_per_s']:.0f}" if row.get("tokens_per_s") else ""
        projected = f"~{row['projected_length']:,}" if row.get("projected_length") else ""
        cells = [row["system"], row["ranks"], length, times, peak, step, speed, len(row["probes"]), projected]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], cap_bytes: int, path: Path) -> str:
    """Per system: the peak per rank of each probe that fit (circles, solid), of forward and backward alone (dots,
    dashed) and its line to the projected length (dotted), and where probes were stopped at the cap (crosses).
    Returns a note when not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no plot drawn"
    gib = 2**30
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in rows:
        probes = row.get("probes", ())
        fits = sorted((p["length"], p["peak_bytes"] / gib) for p in probes if p["fits"] and p["peak_bytes"])
        if not fits:
            continue
        (line,) = ax.plot(*zip(*fits), marker="o", label=f"{row['system']} ({row['ranks']} rank(s)): step peak")
        color = line.get_color()
        stopped = [p["length"] for p in probes if not p["fits"]]
        if stopped:
            ax.plot(stopped, [cap_bytes / gib] * len(stopped), "x", color=color, markersize=8)
        back = sorted((p["length"], p["backward_peak_bytes"] / gib) for p in probes if p.get("backward_peak_bytes"))
        if back:
            ax.plot(*zip(*back), marker=".", linestyle="--", color=color)
            if row.get("projected_length"):
                ax.plot([back[-1][0], row["projected_length"]], [back[-1][1], cap_bytes / gib], ":", color=color)
    ax.axhline(cap_bytes / gib, color="black", linestyle="--", linewidth=1, label="cap per rank")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)   x: stopped at the cap; dashed: forward+backward; dotted: projected")
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.set_title("One training step of a 110M-parameter Llama (32K vocabulary) within a memory cap")
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cap-gib", type=float, default=4.0, help="per-rank memory cap")
    parser.add_argument(
        "--start", type=int, default=None, help="first length probed (default: 512, then the previous row's length)"
    )
    parser.add_argument("--max-length", type=int, default=65536, help="longest length probed")
    parser.add_argument("--resolution", type=float, default=0.125, help="stop bisecting within this fraction")
    parser.add_argument("--name", default="long-context", help="results/<name>.{json,md,png}")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--resume", action="store_true", help="keep the rows results/<name>.json has; measure the rest")
    args = parser.parse_args(argv)
    cap = int(args.cap_gib * 2**30)
    command = "python benchmarks/long_context.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = json.loads((out / f"{args.name}.json").read_text())["rows"] if args.resume else []
    start = args.start or max([512, *(row.get("length") or 0 for row in rows)])
    for system in args.systems.split(","):
        if any(row["system"] == system for row in rows):
            continue
        row = longest_sequence(
            system,
            device=args.device,
            memory_cap_bytes=cap,
            start=start,
            max_length=args.max_length,
            resolution=args.resolution,
        )
        rows.append({**row, "command": command})
        if args.start is None:  # each system holds at least as long as the one before
            start = max(start, row.get("length") or start)
        (out / f"{args.name}.json").write_text(json.dumps({"command": command, "model": MODEL, "rows": rows}, indent=1))
        (out / f"{args.name}.md").write_text(markdown(rows, command))
        note = plot(rows, cap, out / f"{args.name}.png")
        if note:
            print(note)
    print(markdown(rows, command))
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
