"""One rank SIGKILLed while it writes a sharded checkpoint, on the GPU: the other must name it, in bounded time, and
leave the save unpublished. The GPU suite's "rank killed in a save" item (CUDA only; the host's version of it is
``tests/e2e/test_rank_fault_matrix.py``).

    python benchmarks/rank_kill.py --device cuda:0 --out /tmp/rank-kill.json

Two ranks on one device (gloo over CUDA tensors: NCCL refuses two ranks on one GPU) train a small model at ZeRO-2
with its state on the device and save after every step; rank 1 SIGKILLs itself inside DCP's write of step 2's save.
Rank 0 writes its error to ``--out``; exit status 0 when it is a PeerFailedError naming rank 1 within ``TIMEOUT_S``
and step 2's checkpoint was not published.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

WORLD, STEPS, KILLED_AT = 2, 3, 2
TIMEOUT_S = 60.0


def rank_main(rank: int, device: torch.device, store: str, root: Path, out: Path) -> None:
    from ds_strategy.checkpoint import save
    from ds_strategy.checkpoint.storage import ChecksummedWriter
    from ds_strategy.config import ZeroConfig
    from ds_strategy.zero.engine import ZeroEngine

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=2, collective_timeout=TIMEOUT_S))
    step = 0
    if rank == 1:
        write_data = ChecksummedWriter.write_data

        def killed_while_writing(self, *args, **kwargs):
            if step == KILLED_AT:
                (root.parent / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return write_data(self, *args, **kwargs)

        ChecksummedWriter.write_data = killed_while_writing
    try:
        for step in range(1, STEPS + 1):
            engine.backward(model(torch.randn(8, 256, device=device)).square().mean())
            engine.step()
            save(root / f"step_{step}", model, engine)
    except Exception as error:  # noqa: BLE001 - the error is what this measures
        said = {"type": type(error).__name__, "message": str(error), "at": time.time()}
        out.write_text(json.dumps(said))
        os._exit(1)


def launch(device: str, out: Path) -> dict:
    """Both ranks; what rank 0 said, how long after the kill, and whether the cut save stayed unpublished."""
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="rank_kill_") as scratch:
        command = [sys.executable, __file__, "--device", device, "--out", str(out), "--scratch", scratch]
        ranks = [subprocess.Popen([*command, "--rank", str(rank)], start_new_session=True) for rank in range(WORLD)]
        try:
            for process in ranks:
                process.wait(timeout=4 * TIMEOUT_S)
        finally:
            for process in ranks:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        killed = Path(scratch, "killed_at")
        said = json.loads(out.read_text()) if out.exists() else {}
        root = Path(scratch, "checkpoints")
        return {
            "said": said,
            "after_s": said["at"] - float(killed.read_text()) if said and killed.exists() else None,
            "published": (root / f"step_{KILLED_AT}").exists(),
            "exit_codes": [process.returncode for process in ranks],
        }


def verdict(outcome: dict) -> tuple[bool, dict, str]:
    said = outcome["said"]
    named = said.get("type") == "PeerFailedError" and "rank 1 died without raising" in said.get("message", "")
    in_time = outcome["after_s"] is not None and outcome["after_s"] < TIMEOUT_S
    passed = named and in_time and not outcome["published"]
    return passed, {"after_s": outcome["after_s"], "exit_codes": outcome["exit_codes"]}, said.get("message", "")[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, default=Path("/tmp/rank-kill.json"))
    parser.add_argument("--rank", type=int)
    parser.add_argument("--scratch")
    args = parser.parse_args(argv)
    if args.rank is not None:
        scratch = Path(args.scratch)
        rank_main(args.rank, torch.device(args.device), str(scratch / "store"), scratch / "checkpoints", args.out)
        return 0
    passed, figures, note = verdict(launch(args.device, args.out))
    print(json.dumps({"passed": passed, **figures, "note": note}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
