"""Rank bodies for tests/adapters/hf_trainer/test_hf_trainer_sequence_parallel.py: ``ZeroTrainer`` and
``ZeroSFTTrainer`` under DeepSpeed-Ulysses on 2 ranks (one sequence-parallel group), and ``transformers.Trainer`` /
TRL's ``SFTTrainer`` in one process on the same data and arguments (``hf_trainer_runs.arguments``: accumulation 2,
clipping at 1.0; here 4 steps, evaluation after the last, no checkpoints).

Two datasets: whole rows of 16 tokens, every label counting ("unpadded"), and rows of 15 tokens (not a multiple
of the group: the trainer pads them to 16) padded on the right to 15 from 6-15 real tokens, with the padding masked
and its labels -100 and the first 3 labels of each row -100 as a prompt ("padded"), so that the two slices of a row
hold different numbers of labelled tokens.
"""

from pathlib import Path

import hf_models
import hf_trainer_runs as runs
import torch
from distributed import set_torchrun_environment

PADDED_LENGTH, PROMPT = 15, 3
STEPS = 4
QUIET = {"max_steps": STEPS, "eval_steps": STEPS, "save_strategy": "no"}


class PaddedRows(torch.utils.data.Dataset):
    """Rows of 6 to ``PADDED_LENGTH`` real tokens padded on the right, their padding and prompt labels -100."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, hf_models.VOCAB, (count, PADDED_LENGTH), generator=generator)
        lengths = torch.randint(6, PADDED_LENGTH + 1, (count,), generator=generator)
        self.mask = (torch.arange(PADDED_LENGTH) < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        self.labels[:, :PROMPT] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


DATA = {
    "unpadded": (runs.TokenRows, runs.TokenRows),
    "padded": (PaddedRows, PaddedRows),
}


def _data(name: str) -> dict:
    train_rows, eval_rows = DATA[name]
    return {"train_dataset": train_rows(runs.SAMPLES, 1), "eval_dataset": eval_rows(8, 2)}


def _model() -> torch.nn.Module:
    model = hf_models.build("llama", max_position_embeddings=hf_models.SEQ)
    model.config.use_cache = False  # Trainer leaves it on; a cache is nothing to train
    return model


# name: (dataset, ZeroConfig fields, TrainingArguments changes); every Ulysses run has 2 ranks, sp=2
SEQUENCE_PARALLEL_RUNS = {
    "stage3": ("unpadded", {"stage": 3, "sequence_parallel_size": 2}, {}),
    "stage3_padded_parallelism_config": ("padded", {"stage": 3}, {"parallelism_config": "sp2"}),
    "stage0_padded": ("padded", {"stage": 0, "sequence_parallel_size": 2}, {}),
    "stage2_tiled_offloaded_checkpoints": (
        "padded",
        {
            "stage": 2,
            "sequence_parallel_size": 2,
            "tiled_mlp": True,
            "tiled_loss": True,
            "tile_tokens": 3,
            "activation_checkpointing": "full",
            "cpu_checkpointing": True,
        },
        {},
    ),
}


def _arguments(changes: dict) -> dict:
    changes = {**QUIET, **changes}
    if changes.get("parallelism_config") == "sp2":
        from accelerate import ParallelismConfig

        changes["parallelism_config"] = ParallelismConfig(sp_size=2)
    return changes


def one_process_references(rank: int, world_size: int, tmp: str) -> dict:
    """``transformers.Trainer`` on one process, on each dataset, and TRL's ``SFTTrainer`` ("sft")."""
    import transformers

    set_torchrun_environment(rank, world_size)
    results = {
        name: runs.train(
            transformers.Trainer, Path(tmp, f"plain_{name}"), arg_changes=QUIET, model=_model, **_data(name)
        )
        for name in DATA
    }
    results["sft"] = _sft(Path(tmp, "sft_plain"), sequence_parallel=False)
    return results


def sequence_parallel_runs(rank: int, world_size: int, tmp: str) -> dict:
    """Every ``SEQUENCE_PARALLEL_RUNS`` entry under ``ZeroTrainer`` on this group of 2, and ``ZeroSFTTrainer`` at
    stage 1 ("sft")."""
    from ds_strategy.transformers import ZeroTrainer

    set_torchrun_environment(rank, world_size)
    results = {"sft": _sft(Path(tmp, "sft_sp"), sequence_parallel=True)}
    for name, (data, zero, changes) in SEQUENCE_PARALLEL_RUNS.items():
        results[name] = runs.train(
            ZeroTrainer,
            Path(tmp, name),
            arg_changes=_arguments(changes),
            model=_model,
            zero_config=zero,
            **_data(data),
        )
    return results


def _sft(out: Path, sequence_parallel: bool) -> dict:
    """TRL's SFTTrainer in one process, or ZeroSFTTrainer at stage 1 under Ulysses on 2 ranks, on 16-token rows."""
    import datasets
    import trl

    from ds_strategy.transformers import ZeroSFTTrainer

    rows = {name: runs.TokenRows(count, seed).rows.tolist() for name, count, seed in (("train", 64, 1), ("eval", 8, 2))}
    data = {name: datasets.Dataset.from_dict({"input_ids": values}) for name, values in rows.items()}
    common = dict(
        arg_changes={"config_class": trl.SFTConfig, "max_length": hf_models.SEQ, "bf16": False, **QUIET},
        train_dataset=data["train"],
        eval_dataset=data["eval"],
        processing_class=runs._word_tokenizer(),
        model=_model,
    )
    if not sequence_parallel:
        return runs.train(trl.SFTTrainer, out, **common)
    return runs.train(ZeroSFTTrainer, out, zero_config={"stage": 1, "sequence_parallel_size": 2}, **common)
