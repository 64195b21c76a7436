"""Models the engines are trained and measured on."""

from ds_strategy.models.gpt import GPT, Block, GPTConfig, gpt_config, weight_decay_groups

__all__ = ["GPT", "Block", "GPTConfig", "gpt_config", "weight_decay_groups"]
