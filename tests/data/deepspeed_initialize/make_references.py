"""Record what real DeepSpeed does with ``tests/deepspeed_compat/scripts/deepspeed_tutorial.py`` (needs DeepSpeed;
the tests do not).

    DS_ACCELERATOR=cpu python tests/data/deepspeed_initialize/make_references.py [CASE ...]

Spawns WORLD_SIZE gloo ranks that run the unmodified script (``import deepspeed``) once per case of
``deepspeed_initialize_cases.CASES``, in-process through ``runpy`` as torchrun would run it, and writes each run's
record (per-micro-step losses, per-step learning rates, applied flags and gradient norms, the counters) to
``references.json``. For the RESUMED cases DeepSpeed also trains SAVE_AT steps, saves ``<case>_checkpoint/`` (kept
here for the tests: ``load_checkpoint`` from DeepSpeed's own files), and a fresh run resumes from it. The only change
to DeepSpeed is the one the checkpoint fixtures make: this CPU lacks mkldnn fp16, so DeepSpeed would refuse fp16,
and its ``is_fp16_supported`` is made to say yes (torch's fp16 CPU kernels are enough for a tiny model). The first
run compiles DeepSpeed's shared-memory comm op and its CPU Adam ops (minutes).
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1] / "deepspeed_compat"
sys.path.insert(0, str(TESTS))
import deepspeed_initialize_cases as cases  # noqa: E402

SCRIPT = TESTS / "scripts" / "deepspeed_tutorial.py"


def run_script(arguments: list[str]) -> None:
    argv = sys.argv
    sys.argv = [str(SCRIPT), *arguments]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = argv


def run_rank(rank: int, world_size: int, port: int, chosen: list[str], scratch: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    torch.set_num_threads(1)
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    existing = HERE / "references.json"
    references = json.loads(existing.read_text()) if existing.exists() else {}
    for case in chosen:
        config, extra = cases.CASES[case]
        config_path = Path(scratch, f"{case}.json")
        if rank == 0:
            config_path.write_text(json.dumps(config))
        torch.distributed.barrier()
        common = ["--deepspeed_config", str(config_path), *extra]
        out = Path(scratch, f"{case}.out.json")
        run_script([*common, "--steps", str(cases.STEPS), "--out", str(out)])
        torch.distributed.barrier()
        record = {"full": json.loads(out.read_text()) if rank == 0 else None}
        if case in cases.RESUMED:
            saved = HERE / f"{case}_checkpoint"
            if rank == 0 and saved.exists():
                shutil.rmtree(saved)
            torch.distributed.barrier()
            run_script([*common, "--steps", str(cases.SAVE_AT), "--out", str(out), "--save_dir", str(saved),
                        "--save_every", str(cases.SAVE_AT)])
            torch.distributed.barrier()
            run_script([*common, "--steps", str(cases.STEPS - cases.SAVE_AT), "--out", str(out), "--resume",
                        str(saved)])
            torch.distributed.barrier()
            if rank == 0:
                record["resumed"] = json.loads(out.read_text())
                for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its recovery scripts
                    (saved / script).unlink(missing_ok=True)
        references[case] = record
    if rank == 0:
        references["deepspeed_version"] = deepspeed.__version__
        existing.write_text(json.dumps(references, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    chosen = sys.argv[1:] or list(cases.CASES)
    unknown = sorted(set(chosen) - set(cases.CASES))
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; the cases are {list(cases.CASES)}")
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(run_rank, args=(cases.WORLD_SIZE, 29533, chosen, scratch), nprocs=cases.WORLD_SIZE)
