"""One-GPU check of the paths that matter on CUDA: unit-by-unit placement, Hugging Face sharded construction,
sharded loading of pretrained safetensors and ZeRO-3 offload, each comparing the device's peak allocated bytes
(``torch.cuda.max_memory_allocated`` above the bytes allocated at the start) with the formula it must stay under.

    python benchmarks/gpu_check.py [--size small|host|tiny] [--out benchmarks/results/gpu_check.json]

Runs in one process on one device (N = 1 rank: a shard is the whole buffer), in under 10 minutes on one GPU with
the default ``small`` Llama (~170M parameters). ``--device cpu`` runs the same checks on the host, measuring
anonymous RSS instead; the test suite runs that with ``--size host`` (~10M parameters, where a whole-model copy
would break the placement bound by 35 MiB). Exit status 1 if any check fails. Formulas, with Psi the
trainable parameters, U the largest unit's and R the root unit's parameters, T the largest tensor's elements, all
fp32 (4 bytes):

    placement     peak <= 4 Psi/N + 4 U + slack     a whole-model .to(device) before flattening would be 8 Psi
    construction  peak <= 4 Psi/N + 4 (U + R) + slack, and values equal a normal build made on the device
    loading       peak <= 4 T + slack                 each rank reads only its shards, one piece at a time
    offload       peak <= 4 Psi                       a quarter of in-memory ZeRO-3's 16 Psi/N: the states live on
                                                      the host, the device holds gathered units and activations
                                                      (with --device cpu the host is the device and holds the
                                                      states too: 16 Psi/N + 4 (U + R) + slack)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers
from suite_harness import resolve_device

from ds_strategy.checkpoint.pretrained import load_weights
from ds_strategy.config import ZeroConfig
from ds_strategy.offload import OffloadedStep
from ds_strategy.offload.host_memory import PeakRssAnon
from ds_strategy.zero.engine import ZeroEngine

if TYPE_CHECKING:
    from typing_extensions import Self

SLACK = 8 * 2**20  # allocator rounding and interpreter noise (CUDA's allocator rounds to 2 MiB blocks)
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4, "vocab_size": 2048},
    "host": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8, "vocab_size": 8192},  # ~10M
    "small": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "vocab_size": 32000},
}


@dataclass(frozen=True)
class Check:
    name: str
    measured: int
    bound: int
    formula: str
    values_equal: bool = True

    @property
    def passed(self) -> bool:
        return self.measured <= self.bound and self.values_equal


class DevicePeak:
    """``with DevicePeak(device) as peak: ...``: ``peak.growth`` is the peak bytes above those at entry, from the
    CUDA allocator's statistics or, on the host, from sampled anonymous RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host = PeakRssAnon() if device.type == "cpu" else None
        self.growth = 0

    def __enter__(self) -> Self:
        if self._host is not None:
            self._host.__enter__()
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self._host is not None:
            self._host.__exit__(*exc)
            self.growth = self._host.growth
        else:
            torch.cuda.synchronize(self.device)
            self.growth = torch.cuda.max_memory_allocated(self.device) - self._start


def llama(size: str, meta: bool = False, device: torch.device | None = None, seed: int = 0):
    config = transformers.LlamaConfig(
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    with torch.device("meta" if meta else device or "cpu"):
        return transformers.LlamaForCausalLM(config)


def sizes(engine: ZeroEngine) -> dict[str, int]:
    """Psi, the largest unit U, the root unit R and the largest tensor T, in elements."""
    units = [sum(fp.padded_numel for fp in unit.flat_params) for unit in engine.units]
    return {
        "psi": sum(fp.numel for fp in engine.flat_params),
        "unit": max(units[1:] or [0]),
        "root": units[0],
        "tensor": max(slot.numel for fp in engine.flat_params for slot in fp.slots),
        "ranks": engine.world_size,
    }


def _stage3(**fields) -> ZeroConfig:
    return ZeroConfig(stage=3, param_persistence_threshold=0, **fields)


def check_placement(size: str, device: torch.device) -> Check:
    model = llama(size)
    with DevicePeak(device) as peak:
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), _stage3(), device=device)
    s = sizes(engine)
    return Check("placement", peak.growth, 4 * s["psi"] // s["ranks"] + 4 * s["unit"] + SLACK, "4 Psi/N + 4 U + slack")


def check_construction(size: str, device: torch.device) -> Check:
    model = llama(size, meta=True)
    with DevicePeak(device) as peak:
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), _stage3(), device=device)
    s = sizes(engine)
    state = engine.full_state_dict(rank0_only=False)
    normal = llama(size, device=device).state_dict()
    equal = state.keys() == normal.keys() and all(torch.equal(state[k].cpu(), v.cpu()) for k, v in normal.items())
    return Check(
        "construction",
        peak.growth,
        4 * s["psi"] // s["ranks"] + 4 * (s["unit"] + s["root"]) + SLACK,
        "4 Psi/N + 4 (U + R) + slack; values equal a normal build on the device",
        equal,
    )


def check_loading(size: str, device: torch.device, scratch: Path) -> Check:
    llama(size, seed=1).save_pretrained(scratch / "llama", max_shard_size="50MB")
    model = llama(size, meta=True)
    engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), _stage3(), device=device)
    with DevicePeak(device) as peak:
        load_weights(engine, scratch / "llama")
    reference = llama(size, seed=1).to(device)  # the model that was saved
    ids = torch.randint(0, SIZES[size]["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        engine.before_forward()
        equal = torch.allclose(
            model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=0.0
        )
    engine.reshard()
    return Check(
        "loading",
        peak.growth,
        4 * sizes(engine)["tensor"] + SLACK,
        "4 T + slack; first loss equals the saved model's",
        equal,
    )


def check_offload(size: str, device: torch.device) -> Check:
    model = llama(size, meta=True)
    engine = ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters()),
        _stage3(offload_optimizer="cpu", offload_params="cpu"),
        device=device,
        step_runner=OffloadedStep,
    )
    ids = torch.randint(0, SIZES[size]["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    with DevicePeak(device) as peak:
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.step()
            losses.append(loss.item())
    s = sizes(engine)
    bound, formula = (
        (
            16 * s["psi"] // s["ranks"] + 4 * (s["unit"] + s["root"]) + SLACK,
            "16 Psi/N + 4 (U + R) + slack (the host is the device)",
        )
        if device.type == "cpu"
        else (4 * s["psi"], "4 Psi (in-memory ZeRO-3: 16 Psi/N)")
    )
    return Check("offload", peak.growth, bound, formula, all(torch.isfinite(torch.tensor(losses))))


def run_checks(size: str, device: torch.device) -> list[Check]:
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        return [
            check_placement(size, device),
            check_construction(size, device),
            check_loading(size, device, Path(scratch)),
            check_offload(size, device),
        ]


def table(checks: list[Check]) -> str:
    rows = [f"{'check':<13} {'peak MiB':>9} {'bound MiB':>10}  result  formula"]
    rows += [
        f"{c.name:<13} {c.measured / 2**20:>9.1f} {c.bound / 2**20:>10.1f}  {'pass' if c.passed else 'FAIL':<6}  "
        f"{c.formula}"
        for c in checks
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (this rank's: LOCAL_RANK), cuda:N or cpu")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)  # "cuda" alone has no index, which set_device refuses
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transformers.logging.set_verbosity_error()
    checks = run_checks(args.size, device)
    print(table(checks))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([{**asdict(c), "passed": c.passed} for c in checks], indent=2))
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
