"""Regenerate the DeepSpeed checkpoints and references in this folder (needs DeepSpeed; the tests do not).

    DS_ACCELERATOR=cpu python tests/data/deepspeed_checkpoints/make_fixtures.py [CASE ...]

Spawns DEEPSPEED_WORLD_SIZE gloo ranks. For every case of ``recipe.CASES`` (or only the cases named) DeepSpeed
trains SAVE_AT steps and saves ``<case>/`` (``global_step2/`` and ``latest``); then a fresh DeepSpeed engine loads
that checkpoint and trains CONTINUE more steps on the next batches. ``references.pt`` records, per case, DeepSpeed's
own consolidation (``zero_to_fp32``) of the saved checkpoint and of the state after the continued steps, the
continued steps' losses, whether each was applied and the loss scale after it, and the loss scaler at the save.
The first run compiles DeepSpeed's shared-memory comm op for the CPU accelerator (a few minutes); later runs
take about two minutes.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import recipe  # noqa: E402


def deepspeed_config(case: str) -> dict:
    stage, precision, _ = recipe.CASES[case]
    config = {"train_micro_batch_size_per_gpu": recipe.GLOBAL_BATCH // recipe.DEEPSPEED_WORLD_SIZE,
              "gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config.update(precision or {})
    return config


def engine_for(case: str):
    import deepspeed
    model = recipe.build_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=recipe.build_optimizer(model),
                                      config=deepspeed_config(case))
    return engine


def train(engine, batches, rank: int, world_size: int, steps: list | None = None) -> list[float]:
    """One optimizer step per batch; returns the global mean losses, and appends to ``steps`` whether each step
    was applied (fp16 skips overflowing ones) and the loss scale after it."""
    losses = []
    for batch in batches:
        _, loss = engine(*recipe.rank_slice(batch, rank, world_size))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
        if steps is not None:
            scaler = getattr(engine.optimizer, "loss_scaler", None)
            steps.append((engine.was_step_applied(), float(scaler.cur_scale) if scaler is not None else 1.0))
    return losses


def fp32_weights(checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def run_rank(rank: int, world_size: int, port: int, cases: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    # This CPU lacks mkldnn fp16, so DeepSpeed refuses fp16; torch's fp16 CPU kernels are enough for a tiny model.
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    existing = HERE / "references.pt"
    references = torch.load(existing) if existing.exists() and set(cases) != set(recipe.CASES) else {}
    batches = recipe.global_batches()
    for case in cases:
        out = HERE / case
        if rank == 0 and out.exists():
            shutil.rmtree(out)
        torch.distributed.barrier()
        engine = engine_for(case)
        saved_losses = train(engine, batches[:recipe.SAVE_AT], rank, world_size)
        engine.save_checkpoint(str(out))
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        scaler_state = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))} if scaler else None
        torch.distributed.barrier()
        resumed = engine_for(case)
        resumed.load_checkpoint(str(out))
        steps = []
        losses = train(resumed, batches[recipe.SAVE_AT:], rank, world_size, steps)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = [tmp]
            torch.distributed.broadcast_object_list(tmp, src=0)
            resumed.save_checkpoint(tmp[0], tag="after")
            torch.distributed.barrier()
            if rank == 0:
                references[case] = {"saved": fp32_weights(out, f"global_step{recipe.SAVE_AT}"),
                                    "continued": fp32_weights(Path(tmp[0]), "after"), "losses": losses,
                                    "losses_before_save": saved_losses, "scaler_at_save": scaler_state,
                                    "steps_applied": [applied for applied, _ in steps],
                                    "loss_scales": [scale for _, scale in steps],
                                    "skipped_steps": resumed.skipped_steps, "global_steps": resumed.global_steps}
            torch.distributed.barrier()
        if rank == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's copies of its recovery scripts
                (out / script).unlink(missing_ok=True)
    if rank == 0:
        references["deepspeed_version"] = deepspeed.__version__
        torch.save(references, HERE / "references.pt")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    chosen = sys.argv[1:] or list(recipe.CASES)
    unknown = sorted(set(chosen) - set(recipe.CASES))
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; the cases are {list(recipe.CASES)}")
    mp.spawn(run_rank, args=(recipe.DEEPSPEED_WORLD_SIZE, 29517, chosen), nprocs=recipe.DEEPSPEED_WORLD_SIZE)
