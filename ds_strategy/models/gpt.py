"""A small nanoGPT-style decoder: the model the ZeRO engines are measured and tested on.

It keeps the features that make sharding hard in practice: a weight shared by two modules (the token
embedding and the LM head), parameters with and without weight decay, and a repeated block that is the natural
unit to gather and free. It can be built on the ``meta`` device and materialised one unit at a time.

Note: [Initialisation order]
    Initialisation follows nanoGPT (normal with std 0.02, residual projections ``c_proj`` with std
    0.02 / sqrt(2 * n_layer), zero biases, unit LayerNorms), but is split by unit so a ZeRO-3 engine can
    materialise a meta-built model without ever holding all of it. The units are ``embed``, each of
    ``blocks`` and ``ln_f``, in that (module) order; each has ``reset_parameters()`` and draws from the global
    RNG in its own module order, seeding nothing itself. Calling ``reset_parameters()`` on the units in module
    order therefore draws the same random numbers as ``GPT.reset_parameters()``. ``ln_f`` draws none, so it
    may be initialised at any point. The LM head owns no parameter of its own and is never initialised.

    An ordinary build is this same path: ``GPT.__init__`` constructs on ``meta`` (drawing no random numbers)
    and then materialises, so a normal build and a unit-by-unit meta build agree exactly under one seed.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT.

    ``block_size`` is the longest sequence the position embedding covers. ``dropout`` applies to
    embeddings, attention probabilities and residual branches; the default 0.0 keeps runs deterministic, which
    parity tests rely on. ``bias`` adds biases to every Linear and LayerNorm, giving the optimizer a
    no-weight-decay group to handle.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")


_PRESETS = {
    # Seconds per step on CPU; what the tests use. vocab 96 matches the printable-ASCII stdlib corpus.
    "tiny": GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32),
    # ~25M parameters: big enough that ZeRO's memory savings are measurable on one GPU.
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=8, n_head=8, n_embd=512),
    # ~79M parameters and 16 blocks: many units for ZeRO-3 prefetching to overlap.
    "medium": GPTConfig(vocab_size=256, block_size=512, n_layer=16, n_head=10, n_embd=640),
}


def gpt_config(name: str) -> GPTConfig:
    """The named preset: "tiny", "small" or "medium"."""
    if name not in _PRESETS:
        raise ValueError(f"gpt_config name={name!r} is not one of {sorted(_PRESETS)}")
    return _PRESETS[name]


def weight_decay_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups: matrices decay, vectors (biases, norm weights) don't.

    Shared parameters appear once, and frozen ones not at all.
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
    ]


def _init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions.

    The forward takes every shape from ``c_attn``'s output rather than from the config or the input, so a
    tensor-parallel rank holding a slice of the heads, fed a slice of the sequence, runs it unchanged (see
    ``ds_strategy.parallel.auto_plan``).

    ``attention`` is called like ``F.scaled_dot_product_attention`` (the default); sequence parallelism passes
    ``ds_strategy.parallel.ulysses.ulysses_sdpa(group)``, which attends over the whole sequence from a slice.
    """

    def __init__(self, config: GPTConfig, attention: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        self.n_head = config.n_head
        self.attention = attention or F.scaled_dot_product_attention
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)
        batch, seq, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer layer; the unit ZeRO-3 gathers and frees."""

    def __init__(self, config: GPTConfig, attention: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        self.config = config
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, attention)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def reset_parameters(self) -> None:
        """nanoGPT init, in module order (see [Initialisation order])."""
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        self.ln_1.reset_parameters()
        _init_linear(self.attn.c_attn, std=0.02)
        _init_linear(self.attn.c_proj, std=proj_std)
        self.ln_2.reset_parameters()
        _init_linear(self.mlp.c_fc, std=0.02)
        _init_linear(self.mlp.c_proj, std=proj_std)


class Embeddings(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        return self.drop(self.wte(idx) + self.wpe(pos))

    def reset_parameters(self) -> None:
        """nanoGPT init, in module order (see [Initialisation order])."""
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)


class GPT(nn.Module):
    """Decoder-only transformer whose LM head reuses the token embedding matrix.

    Built under ``torch.device("meta")`` it stays unmaterialised; otherwise it is initialised on the default
    device. After moving a meta-built model with ``to_empty``, call ``tie_weights()`` and initialise the
    units (see [Initialisation order]). ``attention`` replaces every block's sdpa call (see
    ``CausalSelfAttention``).
    """

    def __init__(self, config: GPTConfig, attention: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        self.config = config
        device = torch.get_default_device()
        with torch.device("meta"):
            self.embed = Embeddings(config)
            self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.tie_weights()
            self.reset_parameters()

    def tie_weights(self) -> None:
        """Make the LM head use the token embedding matrix; ``to_empty`` gives each module its own copy."""
        self.lm_head.weight = self.embed.wte.weight

    def reset_parameters(self) -> None:
        """nanoGPT init of every unit, in module order (see [Initialisation order])."""
        self.embed.reset_parameters()
        for block in self.blocks:
            block.reset_parameters()
        self.ln_f.reset_parameters()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position of ``idx`` (batch, seq), and the mean cross-entropy if ``targets`` given.

        Targets equal to -1 are ignored. ``positions`` (default 0..seq-1) are the tokens' places in the sequence,
        which a sequence-parallel slice must give.
        """
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size={self.config.block_size}")
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def optimizer_param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups as nanoGPT uses them; the tied embedding appears once, in the decay group."""
        return weight_decay_groups(self, weight_decay)
