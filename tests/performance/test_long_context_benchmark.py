"""benchmarks/long_context.py's search, with its probes stood in for by a rule (a real probe trains a 110M model at
thousands of tokens: the benchmark itself measures those): it finds the longest fitting length within its
resolution in a handful of probes, stops at the bound and says so, stops at an error, and its table divides by the
plain baseline."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import long_context  # noqa: E402


def _fits_up_to(limit: int, calls: list):
    def fake_probe(system, length, cap, device="cpu", timeout=None, model=None):
        calls.append(length)
        fits = length <= limit
        peaks = {"peak_bytes": length * 1000, "backward_peak_bytes": 2**20 + length * 100}
        return long_context.Probe(length, fits, **peaks, step_seconds=length / 100 if fits else None)

    return fake_probe


@pytest.mark.parametrize("limit", [1000, 3000, 5000])
def test_the_search_finds_the_longest_fitting_length_within_its_resolution_in_few_probes(monkeypatch, limit):
    calls = []
    monkeypatch.setattr(long_context, "probe", _fits_up_to(limit, calls))
    row = long_context.longest_sequence("plain", start=512, resolution=0.125, log=lambda _: None)
    assert row["length"] <= limit < row["length"] * 1.125 + long_context.MULTIPLE
    assert row["length"] % long_context.MULTIPLE == 0 and len(calls) <= 8
    assert row["tokens_per_s"] == pytest.approx(100) and not row.get("bounded")


def test_a_fit_at_the_bound_is_reported_as_a_lower_bound(monkeypatch):
    calls = []
    monkeypatch.setattr(long_context, "probe", _fits_up_to(10**6, calls))
    row = long_context.longest_sequence("ulysses_sp2", start=512, max_length=3000, log=lambda _: None)
    assert row["bounded"] and row["length"] == 2944 and calls == [512, 1024, 2048, 2944]
    # the forward-and-backward peak grows 100 bytes a token from 1 MiB: it meets a 2 MiB cap at 10,485 tokens
    assert long_context.projected_length([long_context.Probe(**p) for p in row["probes"]], 2**21) == 10496 - 128


def test_a_start_that_does_not_fit_halves_and_a_failure_that_is_not_memory_stops(monkeypatch):
    monkeypatch.setattr(long_context, "probe", _fits_up_to(300, []))
    assert long_context.longest_sequence("plain", start=1024, log=lambda _: None)["length"] == 256

    def broken(system, length, cap, device="cpu", timeout=None, model=None):
        return long_context.Probe(length, False, reason="Traceback: something else")

    monkeypatch.setattr(long_context, "probe", broken)
    row = long_context.longest_sequence("plain", log=lambda _: None)
    assert row["length"] == 0 and "something else" in row["error"] and len(row["probes"]) == 1


def test_the_table_gives_each_length_as_a_multiple_of_the_plain_one():
    rows = [
        {"system": "plain", "ranks": 1, "length": 1024, "peak_bytes": 2**31, "step_seconds": 10.0, "probes": [{}]},
        {"system": "ulysses_sp2", "ranks": 2, "length": 16384, "bounded": True, "probes": [{}] * 3},
    ]
    for row in rows:
        row["tokens_per_s"] = row["length"] / row["step_seconds"] if "step_seconds" in row else None
    table = long_context.markdown(rows, "python benchmarks/long_context.py")
    assert "| plain | 1 | 1,024 | 1.0 | 2.00 | 10.0 | 102 | 1 |  |" in table
    assert "| ulysses_sp2 | 2 | >= 16,384 | 16.0 |" in table
