"""Fine-tune a small Llama with Hugging Face's ``Trainer`` on ds_strategy's ZeRO: the one-line switch from DeepSpeed.

    torchrun --nproc_per_node 2 examples/train_hf_trainer.py --deepspeed examples/ds_config.json
    torchrun --nproc_per_node 2 examples/train_hf_trainer.py --stage 3

The script is what a DeepSpeed user already runs, with ``Trainer`` replaced by ``ZeroTrainer`` and
``TrainingArguments`` by ``ZeroTrainingArguments``, which takes the DeepSpeed JSON ("auto" values included) as
``deepspeed=`` without the deepspeed package: the ``[transformers]`` extra is all it needs. (With the deepspeed package
installed, transformers' own ``TrainingArguments(deepspeed=...)`` works too and trains the same; it only adds the
DeepSpeed set-up that ``ZeroTrainer`` then undoes.) The model is built from a config (no download) and trained on
token rows of the Python standard library's source; ``save_model`` writes a directory ``from_pretrained`` loads,
gathered from the shards.
"""

import argparse

import torch
import transformers

from ds_strategy.data import stdlib_tokens
from ds_strategy.transformers import ZeroTrainer, ZeroTrainingArguments

SEQ = 64


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor):
        self.rows = tokens[: len(tokens) // SEQ * SEQ].view(-1, SEQ).long()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON config, as for transformers' Trainer")
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage when no --deepspeed config is given")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--out", default="outputs/hf_trainer")
    options = parser.parse_args()

    tokens = stdlib_tokens()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    args = ZeroTrainingArguments(  # was: transformers.TrainingArguments(
        output_dir=options.out,
        per_device_train_batch_size=16,  # examples/ds_config.json: train_micro_batch_size_per_gpu
        gradient_accumulation_steps=2,
        max_steps=options.max_steps,
        learning_rate=3e-3,
        logging_steps=5,
        save_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        deepspeed=options.deepspeed,
    )
    trainer = ZeroTrainer(  # was: transformers.Trainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=TokenRows(tokens),
        zero_config=None if options.deepspeed else {"stage": options.stage},
    )
    trainer.train()
    trainer.save_model(f"{options.out}/final")


if __name__ == "__main__":
    main()
