"""The DeepSpeed configs ``scripts/deepspeed_tutorial.py`` is run with, under real DeepSpeed (recorded by
``tests/data/deepspeed_initialize/make_references.py``) and under ``ds_strategy.deepspeed``
(``test_deepspeed_initialize_oracle.py``): name -> (DeepSpeed config, the script's extra arguments).

Every case: 2 ranks, micro-batch 4, 2 accumulation steps (train_batch_size 16), global-norm clipping at 1.0 (the
norms are ~4, so it clips every step), STEPS optimizer steps; AdamW and a WarmupLR schedule from the config unless
the case passes ``--own_optimizer`` (the script's AdamW, two param groups, and the config's schedule)."""

import copy

WORLD_SIZE = 2
STEPS = 4
SAVE_AT = 2  # the resume cases: DeepSpeed saved after this many steps, then a fresh run resumed from it

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 5e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
    "zero_optimization": {"stage": 0},
}


def config(stage: int, **changes) -> dict:
    """BASE at ``stage``, with top-level keys replaced and ``zero_optimization`` keys merged."""
    result = copy.deepcopy(BASE)
    result["zero_optimization"].update(changes.pop("zero_optimization", {}), stage=stage)
    result.update(changes)
    return result


def _own_optimizer(stage: int, **changes) -> dict:
    result = config(stage, **changes)
    del result["optimizer"]
    return result


_CPU = {"device": "cpu"}
FP16 = {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}

CASES = {
    "stage0": (config(0), []),
    "stage1": (config(1), []),
    "stage2": (config(2), []),
    "stage3": (config(3, zero_optimization={"stage3_param_persistence_threshold": 0}), []),
    "stage2_own_optimizer": (_own_optimizer(2), ["--own_optimizer"]),
    "stage3_own_optimizer": (_own_optimizer(3), ["--own_optimizer"]),
    "stage2_offload": (config(2, zero_optimization={"offload_optimizer": _CPU}), []),
    "stage3_offload": (
        config(3, zero_optimization={"offload_optimizer": _CPU, "offload_param": _CPU}),
        [],
    ),
    "stage2_fp16": (config(2, fp16=FP16), []),
}
# Cases whose DeepSpeed run also saved at SAVE_AT (tag global_step<SAVE_AT>) and was resumed by a fresh run.
RESUMED = ["stage2", "stage3"]
