"""Sequence tiling computes what the untiled model does: the tiled MLP and the tiled causal-LM loss give the same loss
and the same gradients in fp32 (relative 1e-6), alone, together, under activation checkpointing and with the token
counts and pre-shifted labels transformers' Trainer passes; a forward given labels returns no logits, one without
labels is untouched; what tiling cannot do is refused by name. One process, tiny Hugging Face models (no ranks: the
tiles are local; Ulysses and the Trainer compose with them in ``test_hf_trainer_sequence_parallel``)."""

import hf_models
import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from ds_strategy.compose.activation_checkpointing import apply_activation_checkpointing
from ds_strategy.config import ZeroConfig, ZeroConfigError
from ds_strategy.models import GPT, GPTConfig
from ds_strategy.sequence_tiling import apply_sequence_tiling, remove_sequence_tiling, tiled_cross_entropy
from ds_strategy.zero.wrap_policy import select_unit_modules

RTOL = 1e-6
SEQ = 13  # 13 tokens in tiles of 4: the last tile is short


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _llama() -> transformers.PreTrainedModel:
    model = hf_models.build("llama", max_position_embeddings=SEQ)
    model.config.use_cache = False
    return model


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_models.VOCAB, (2, SEQ), generator=generator)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that does not count
    return ids, labels


def _loss_and_grads(model, **kwargs) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    ids, labels = _batch()
    output = model(input_ids=ids, labels=labels, **kwargs)
    output.loss.backward()
    return output, {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(got, want) -> None:
    (got_out, got_grads), (want_out, want_grads) = got, want
    assert _relative(got_out.loss, want_out.loss) <= RTOL
    for name, grad in want_grads.items():
        assert _relative(got_grads[name], grad) <= RTOL, name


def _tiled(model, **fields):
    return apply_sequence_tiling(model, ZeroConfig(tile_tokens=4, **fields).activation_policy)


@pytest.mark.parametrize(
    "fields", [{"tiled_mlp": True}, {"tiled_loss": True}, {"tiled_mlp": True, "tiled_loss": True}], ids=str
)
def test_tiled_mlp_and_tiled_loss_equal_the_untiled_model(fields):
    model = _llama()
    want = _loss_and_grads(model)
    mlps = ["model.layers.0.mlp", "model.layers.1.mlp"] if fields.get("tiled_mlp") else []
    assert _tiled(model, **fields) == mlps + (["LlamaForCausalLM"] if fields.get("tiled_loss") else [])
    got = _loss_and_grads(model)
    _assert_same(got, want)
    assert (got[0].logits is None) == fields.get("tiled_loss", False)  # the logits were never made


class _WidestRows(TorchDispatchMode):
    """The most rows (elements / last dimension) of any tensor an op makes whose last dimension is one of
    ``widths`` and whose shape is no parameter's (or its transpose): how many tokens' logits or MLP activations
    existed at once."""

    def __init__(self, widths: dict[str, int], parameter_shapes: set):
        super().__init__()
        self.widths, self.parameter_shapes = widths, parameter_shapes
        self.rows = dict.fromkeys(widths, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dim() >= 2
                and tuple(tensor.shape) not in self.parameter_shapes
            ):
                for name, width in self.widths.items():
                    if tensor.shape[-1] == width:
                        self.rows[name] = max(self.rows[name], tensor.numel() // width)
        return out


def test_no_tensor_holds_more_than_a_tiles_logits_or_mlp_activations():
    rows = {}
    for tiled in (False, True):
        model = _llama()
        if tiled:
            _tiled(model, tiled_mlp=True, tiled_loss=True)
        widths = {"logits": hf_models.VOCAB, "mlp": model.config.intermediate_size}
        shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
        with _WidestRows(widths, shapes) as widest:
            _loss_and_grads(model)
        rows[tiled] = widest.rows
    assert rows[False] == {"logits": 2 * SEQ, "mlp": 2 * SEQ}
    assert rows[True]["logits"] <= 4 and rows[True]["mlp"] <= 2 * 4  # the loss tiles the flattened batch


def test_the_tiled_loss_takes_the_trainers_token_count_and_shifted_labels():
    model = _llama()
    ids, labels = _batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    count = torch.tensor(40)
    want = _loss_and_grads(model, num_items_in_batch=count, shift_labels=shifted)
    _tiled(model, tiled_loss=True)
    got = _loss_and_grads(model, num_items_in_batch=count, shift_labels=shifted)
    _assert_same(got, want)


def test_tiling_composes_with_activation_checkpointing_of_the_units():
    model = _llama()
    want = _loss_and_grads(model)
    units = select_unit_modules(model, (), 0)
    config = ZeroConfig(tile_tokens=4, tiled_mlp=True, tiled_loss=True, activation_checkpointing="full")
    apply_activation_checkpointing(model, config.activation_policy, units)
    apply_sequence_tiling(model, config.activation_policy)
    _assert_same(_loss_and_grads(model), want)


def test_a_forward_without_labels_and_a_removed_tiling_are_the_model_as_built():
    model = _llama()
    ids, _ = _batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        _tiled(model, tiled_mlp=True, tiled_loss=True)
        assert torch.allclose(model(input_ids=ids).logits, want, rtol=RTOL, atol=1e-7)  # generation's path
        remove_sequence_tiling(model)
        assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
        assert "_loss_function" not in model.__dict__
        assert torch.equal(model(input_ids=ids).logits, want)


def test_our_gpt_tiles_its_mlps_and_the_tiled_cross_entropy_equals_the_whole_one():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, vocab_size=64, n_layer=2, n_head=2, n_embd=16, dropout=0.0))
    idx = torch.randint(0, 64, (2, SEQ))
    logits, loss = model(idx, idx)
    loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    _tiled(model, tiled_mlp=True)
    model.zero_grad()
    hidden = model.ln_f(_blocks(model, idx))
    tiled = tiled_cross_entropy(hidden, model.lm_head, idx, tile_tokens=5) / idx.numel()
    tiled.backward()
    assert _relative(tiled, loss) <= RTOL
    for name, grad in want.items():
        assert _relative(model.get_parameter(name).grad, grad) <= RTOL, name


def _blocks(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    return x


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    config = transformers.Gemma2Config(
        vocab_size=hf_models.VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=30.0,
    )
    model = transformers.Gemma2ForCausalLM(config)
    _tiled(model, tiled_loss=True)
    ids, labels = _batch()
    with pytest.raises(ValueError, match="changes its logits between the LM head and the loss"):
        model(input_ids=ids, labels=labels)


def test_switches_that_find_nothing_to_tile_and_tiled_loss_under_pipelining_are_refused():
    with pytest.raises(ValueError, match="tiled_mlp=True found no MLP in Linear"):
        _tiled(torch.nn.Linear(2, 2), tiled_mlp=True)
    with pytest.raises(ValueError, match="tiled_loss=True found no Hugging Face causal language model"):
        _tiled(GPT(GPTConfig(block_size=4, vocab_size=8, n_layer=1, n_head=1, n_embd=4)), tiled_loss=True)
    with pytest.raises(ZeroConfigError, match="tiled_loss=True is not allowed with pipeline_parallel_size=2"):
        ZeroConfig(tiled_loss=True, pipeline_parallel_size=2)
    with pytest.raises(ZeroConfigError, match="tile_tokens=0 is not allowed"):
        ZeroConfig(tile_tokens=0)
