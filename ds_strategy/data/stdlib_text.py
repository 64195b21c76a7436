"""Token data that needs no download: the standard library's own source, and seeded random tokens.

Examples and benchmarks need real text with learnable structure, and the test machines have no network, so the
corpus is read from the installed standard library. The selection is the sorted list of its ``.py`` files,
taken in order up to a byte budget, so it is the same on every run of one Python installation. Parity tests
need no structure, only reproducible batches, and use random tokens from a seeded generator.
"""

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

_NOT_STDLIB = {"site-packages", "dist-packages"}

# Printable ASCII plus newline, 96 symbols; tab reads as space and any other byte as "?".
_ASCII96 = "\n" + "".join(chr(c) for c in range(32, 127))
_ASCII96_IDS = torch.tensor(
    [_ASCII96.index(" " if c == "\t" else c if c in _ASCII96 else "?") for c in map(chr, range(256))]
)

VOCAB_SIZES = (256, 96)


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted path order, third-party packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _NOT_STDLIB]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def stdlib_tokens(vocab_size: int = 256, byte_budget: int = 2_000_000) -> torch.Tensor:
    """The first ``byte_budget`` bytes of the standard library source as a 1-D int64 tensor of token ids.

    ``vocab_size`` 256 keeps raw bytes; 96 maps to printable ASCII plus newline (see ``_ASCII96``), matching the
    "tiny" GPT preset.
    """
    if vocab_size not in VOCAB_SIZES:
        raise ValueError(f"vocab_size={vocab_size} is not one of {VOCAB_SIZES}")
    if byte_budget <= 0:
        raise ValueError(f"byte_budget={byte_budget} must be positive")
    chunks, total = [], 0
    for path in stdlib_source_files():
        chunks.append(path.read_bytes()[: byte_budget - total])
        total += len(chunks[-1])
        if total == byte_budget:
            break
    ids = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
    return ids if vocab_size == 256 else _ASCII96_IDS[ids]


class CharDataset(Dataset):
    """Every window of ``block_size`` tokens, paired with the same window shifted one token ahead."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if len(tokens) <= block_size:
            raise ValueError(f"{len(tokens)} tokens are too few for block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i : i + self.block_size + 1]
        return window[:-1], window[1:]


def random_token_batch(
    generator: torch.Generator, batch_size: int, block_size: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, (batch_size, block_size) each, drawn only from ``generator``."""
    tokens = torch.randint(vocab_size, (batch_size, block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class SyntheticTokens(Dataset):
    """``num_samples`` random (input, target) windows, fixed by ``seed`` when the dataset is built."""

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.inputs, self.targets = random_token_batch(generator, num_samples, block_size, vocab_size)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]
