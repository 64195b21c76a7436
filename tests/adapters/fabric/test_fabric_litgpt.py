"""litgpt 0.5.13's own LoRA, full-finetuning and pretraining ``main()`` loops, unchanged, with the Fabric built as
litgpt's ``setup()`` builds it but ``ZeroFabricStrategy(stage, state_dict_type="full")`` as its strategy: on 2 ranks
at stages 1-3 (pretraining: stage 2) they end where DDP ends, pretraining resumed from its first step's file ends
where the whole run ends, and the ``lit_model.pth`` they write is one file litgpt's own ``load_checkpoint`` and
``litgpt generate`` read (issue 45). litgpt cannot be in the ``test`` extra (it pins huggingface-hub below 1.4, which
transformers 5 does not allow), so this runs where it is installed beside ours (``pip install --no-deps
litgpt==0.5.13 jsonargparse==4.41.0 docstring-parser typeshed-client``) and is skipped elsewhere;
``test_fabric_frozen_parameters`` and the composition matrix's frozen cells hold the calls it makes (``setup_module``
then ``setup_optimizers`` over ``model.parameters()`` of a partly frozen model built under
``init_module(empty_init=True)``) everywhere.

The data is litgpt's own ``JSON`` data module over random word rows, the tokenizer a word-level ``tokenizer.json``, the
model a 2-layer litgpt ``GPT`` from a config. The base checkpoint holds the LoRA weights' initial values too: under
DDP ``init_module(empty_init=True)`` leaves them uninitialised (litgpt loads the base weights with ``strict=False``
after), so without them DDP's own run would start from garbage.
"""

import json
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment

pytest.importorskip("litgpt", reason="litgpt is installed beside ds_strategy by hand (see the module docstring)")
pytest.importorskip("jsonargparse", reason="litgpt saves its hyperparameters through jsonargparse")

WORDS = [f"w{i}" for i in range(40)]
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}


def _base_checkpoint(root: Path) -> Path:
    """What ``litgpt download`` leaves: tokenizer files, ``model_config.yaml``, ``lit_model.pth``; and data rows."""
    from litgpt import GPT, Config
    from litgpt.lora import GPT as LoraGPT
    from litgpt.lora import Config as LoraConfig
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = root / "base"
    base.mkdir(parents=True)
    tokenizer = Tokenizer(
        models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}, "<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(base / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (base / "tokenizer_config.json").write_text(json.dumps(special))
    config = Config(name="tiny", block_size=64, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    save_config(config, base)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), base / "lit_model.pth")
    lora_base = root / "lora_base"
    shutil.copytree(base, lora_base)
    torch.manual_seed(0)
    torch.save(
        LoraGPT(LoraConfig.from_file(base / "model_config.yaml", **LORA)).state_dict(), lora_base / "lit_model.pth"
    )
    generator = torch.Generator().manual_seed(0)
    words = lambda n: " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=generator))  # noqa: E731
    rows = [{"instruction": words(6), "input": "", "output": words(5)} for _ in range(32)]
    (root / "data.json").write_text(json.dumps(rows))
    return base


def _litgpt_main(rank: int, world_size: int, root: str, kind: str, stage: int | None) -> dict:
    """litgpt's ``main()`` as its ``setup()`` calls it, the strategy swapped (DDP for ``stage=None``)."""
    from lightning.fabric.strategies import DDPStrategy
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.finetune import full, lora
    from litgpt.lora import Config as LoraConfig

    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    root = Path(root)
    checkpoint = root / ("lora_base" if kind == "lora" else "base")
    out = root / f"{kind}_{stage}"
    lora_args = [f"--{key}={value}" for key, value in LORA.items() if key.startswith("lora_") and key != "lora_query"]
    sys.argv = [sys.argv[0], str(checkpoint), *(lora_args if kind == "lora" else [])]  # saved as hyperparameters
    strategy = DDPStrategy() if stage is None else ZeroFabricStrategy(stage=stage, state_dict_type="full")
    fabric = L.Fabric(devices=world_size, accelerator="cpu", strategy=strategy, precision="32-true")
    fabric.launch()
    data = JSON(json_path=root / "data.json", val_split_fraction=0.25, prompt_style="alpaca", seed=42, num_workers=0)
    train = TrainArgs(
        save_interval=1000,
        log_interval=1,
        global_batch_size=4,
        micro_batch_size=1,
        lr_warmup_steps=1,
        epochs=1,
        max_steps=3,
    )
    evaluation = EvalArgs(interval=1000, max_new_tokens=5, max_iters=2, initial_validation=False)
    if kind == "lora":
        config = LoraConfig.from_file(checkpoint / "model_config.yaml", **LORA)
        lora.main(fabric, world_size, 1337, config, data, checkpoint, out, train, evaluation, "AdamW")
        return torch.load(out / "final" / "lit_model.pth.lora")["model"]
    config = Config.from_file(checkpoint / "model_config.yaml")
    full.main(fabric, world_size, None, 1337, config, data, checkpoint, out, train, evaluation, "AdamW")
    return torch.load(out / "final" / "lit_model.pth")["model"]


class _TokenRows(torch.utils.data.Dataset):
    """Random token rows one longer than the sequence (pretraining's inputs and shifted targets)."""

    def __init__(self, count: int, length: int, seed: int):
        self.rows = torch.randint(0, len(WORDS) + 3, (count, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


class _ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader that checkpoints how far it got, as litdata's ``StreamingDataLoader`` (litgpt's pretraining
    loader) does: litgpt saves it in its state and a resumed run goes on with the next batch."""

    seen = 0

    def __iter__(self):
        batches, skip = super().__iter__(), self.seen
        for i, batch in enumerate(batches):
            if i >= skip:
                self.seen = i + 1
                yield batch
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _pretrain_data():
    """A litgpt ``DataModule`` over :class:`_TokenRows` (litgpt's own pretraining data modules need litdata)."""
    from litgpt.data import DataModule

    class TokenRows(DataModule):
        def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
            self.batch_size, self.length = batch_size, max_seq_length + 1

        def train_dataloader(self):
            return _ResumableLoader(_TokenRows(32, self.length, 1), self.batch_size, shuffle=False)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(_TokenRows(8, self.length, 2), self.batch_size, shuffle=False)

    return TokenRows()


def _litgpt_pretrain(rank: int, world_size: int, root: str, stage: int | None, resume: bool) -> dict:
    """litgpt's pretraining ``main()`` as its ``setup()`` calls it, the strategy swapped (DDP for ``stage=None``):
    4 micro-batches of 2 per rank (2 optimizer steps), a checkpoint after each step; ``resume`` starts again from
    the first step's checkpoint. Its ``torch.compile`` is disabled (``TORCH_COMPILE_DISABLE``): compiling on CPU
    takes minutes and is not what this checks."""
    from lightning.fabric.strategies import DDPStrategy
    from litgpt import Config
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.pretrain import main

    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    root = Path(root)
    name = "ddp" if stage is None else f"zero{stage}"
    out = root / f"pretrain_{name}{'_resumed' if resume else ''}"
    sys.argv = [sys.argv[0], "tiny"]  # saved as hyperparameters
    strategy = DDPStrategy() if stage is None else ZeroFabricStrategy(stage=stage, state_dict_type="full")
    fabric = L.Fabric(devices=world_size, accelerator="cpu", strategy=strategy, precision="32-true")
    fabric.launch()
    train = TrainArgs(
        save_interval=1,
        log_interval=1,
        global_batch_size=8,
        micro_batch_size=2,
        max_tokens=world_size * 4 * 2 * 16,
        max_seq_length=16,
        max_norm=1.0,
        min_lr=1e-4,
        lr_warmup_steps=1,
    )
    evaluation = EvalArgs(interval=1, max_iters=2, initial_validation=False, final_validation=True)
    config = Config.from_file(root / "base" / "model_config.yaml")
    start = root / f"pretrain_{name}" / "step-00000001" / "lit_model.pth" if resume else False
    main(
        fabric,
        world_size,
        42,
        None,
        start,
        config,
        _pretrain_data(),
        out,
        root / "base",
        None,
        train,
        evaluation,
        "AdamW",
    )
    return torch.load(out / "final" / "lit_model.pth", weights_only=False)["model"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("litgpt")
    _base_checkpoint(root)
    return root


# Note: [AdamW after a differently ordered sum]
# ZeRO reduces gradients in flat buckets (reduce-scatter at stage 2/3), DDP in its own buckets: the same sum in another
# order, a few fp32 roundings apart. AdamW steps by g / sqrt(v), which for a gradient near zero (a bias here) turns
# those roundings into a visible share of the step: measured at most 4.9e-6 after 3 steps at lr 1e-3 (the LoRA run:
# 9e-10; pretraining at zero2: 1.6e-5 after 2 steps, on a qkv bias of magnitude 1e-3), the losses printed equal to
# every digit. So weights are held to 2e-5 absolute. A resumed run is bitwise the whole run, under DDP and zero2.
ATOL = 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_litgpt_finetuning_main_runs_unchanged_at_every_stage_as_under_ddp(root, kind):
    ddp = run_ranks(_litgpt_main, 2, str(root), kind, None, timeout=300)[0]
    for stage in (1, 2, 3):
        zero = run_ranks(_litgpt_main, 2, str(root), kind, stage, timeout=300)[0]
        assert zero.keys() == ddp.keys()
        for name, value in ddp.items():
            torch.testing.assert_close(zero[name], value, rtol=1e-5, atol=ATOL, msg=f"stage {stage} {name}")
    if kind == "full":  # the file state_dict_type="full" wrote, read by litgpt's own loader
        from litgpt import GPT, Config
        from litgpt.utils import load_checkpoint

        model = GPT(Config.from_file(root / "base" / "model_config.yaml"))
        load_checkpoint(L.Fabric(devices=1, accelerator="cpu"), model, root / "full_3" / "final" / "lit_model.pth")
        for name, value in ddp.items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=ATOL)


@pytest.mark.slow
def test_litgpt_pretraining_main_runs_unchanged_resumes_and_generates_as_under_ddp(root, monkeypatch):
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    runs = {}
    for resume in (False, True):  # the resumed runs start from the first runs' checkpoints
        for stage in (None, 1, 2, 3):
            runs[stage, resume] = run_ranks(_litgpt_pretrain, 2, str(root), stage, resume, timeout=300)[0]
    ddp = runs[None, False]
    for (stage, resume), weights in runs.items():  # every stage ends where DDP ends, resumed or not
        assert weights.keys() == ddp.keys()
        for name, value in ddp.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=ATOL, msg=f"{stage=} {resume=} {name}")
    # `litgpt generate`, as its CLI calls it, greedy, on the file state_dict_type="full" wrote and on DDP's. Its
    # tokens are compared, not its printed text: ids past the tokenizer's 43 (the padded vocabulary's) print as "".
    import litgpt.generate.base as generate_cli

    tokens, sample = [], generate_cli.generate

    def recorded(*args, **kwargs):
        tokens.append(sample(*args, **kwargs))
        return tokens[-1]

    monkeypatch.setattr(generate_cli, "generate", recorded)
    names = ("ddp", "zero1", "zero2", "zero3")
    for name in names:
        final = root / f"pretrain_{name}" / "final"
        generate_cli.main(final, prompt="w1 w2 w3", max_new_tokens=4, top_k=1, precision="32-true")
    assert len(tokens) == len(names) and tokens[0].shape == (3 + 4,), tokens  # the prompt's 3 tokens and 4 new ones
    assert all(torch.equal(tokens[0], other) for other in tokens[1:]), tokens
