"""Datasets for training and testing without network access."""

from ds_strategy.data.stdlib_text import (
    CharDataset,
    SyntheticTokens,
    random_token_batch,
    stdlib_source_files,
    stdlib_tokens,
)

__all__ = ["CharDataset", "SyntheticTokens", "random_token_batch", "stdlib_source_files", "stdlib_tokens"]
