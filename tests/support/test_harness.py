"""The test plumbing itself: multi-rank runner, reference GPT, corpus and edge-case models."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import distributed
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from models import EDGE_MODELS, MLP, FrozenParamModel, OddSizeModel, TinyGPT, param_groups, tiny_gpt
from process_tree import process

from ds_strategy.data import CharDataset, SyntheticTokens, stdlib_tokens
from ds_strategy.models import GPT, gpt_config

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, dist.get_world_size(), t


def _start_a_sleeper(pid_file: str) -> None:
    """A process that only ends when killed, started by this rank: a rank's leftover."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(pid_file).write_text(str(sleeper.pid))


def _raise_on_rank_1(rank, world_size, pid_file):
    if rank == 1:
        _start_a_sleeper(pid_file)
        raise ValueError("deliberate failure on rank 1")
    return rank


def _hang_on_rank_1(rank, world_size, pid_file):
    if rank == 1:
        _start_a_sleeper(pid_file)
        time.sleep(3600)
    return rank


def _leave_a_process_on_rank_1(rank, world_size, pid_file):
    if rank == 1:
        _start_a_sleeper(pid_file)
    return rank


def _is_running(pid_file: Path) -> bool:
    return process(int(pid_file.read_text())) is not None


def test_run_ranks_returns_each_ranks_value_after_a_real_all_reduce():
    results = run_ranks(_all_reduce_rank, 2, timeout=60)

    assert [(rank, size) for rank, size, _ in results] == [(0, 2), (1, 2)]
    assert all(torch.equal(t, torch.tensor([3.0])) for _, _, t in results)


def test_run_ranks_surfaces_a_rank_error_with_its_traceback_and_kills_what_the_rank_started(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 raised.*_raise_on_rank_1.*deliberate failure"):
        run_ranks(_raise_on_rank_1, 2, str(tmp_path / "pid"), timeout=60)
    assert not _is_running(tmp_path / "pid")


def test_run_ranks_kills_a_hung_rank_at_the_timeout_with_what_it_started_and_shows_its_stack(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)rank\(s\) \[1\] did not finish within 5 s.*_hang_on_rank_1"):
        run_ranks(_hang_on_rank_1, 2, str(tmp_path / "pid"), timeout=5)
    assert not _is_running(tmp_path / "pid")


def test_run_ranks_fails_naming_a_process_left_running_by_ranks_that_returned_and_kills_it(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "EXIT_GRACE_S", 1.0)  # the sleeper would not end by itself in any grace
    with pytest.raises(AssertionError, match=r"(?s)processes they started were still running.*time.sleep\(3600\)"):
        run_ranks(_leave_a_process_on_rank_1, 2, str(tmp_path / "pid"), timeout=60)
    assert not _is_running(tmp_path / "pid")


def test_gpt_lm_head_shares_the_token_embedding_parameter():
    model = tiny_gpt()

    assert model.lm_head.weight is model.embed.wte.weight
    assert len(list(model.named_parameters(remove_duplicate=False))) == len(list(model.parameters())) + 1


def test_gpt_optimizer_groups_decay_matrices_once_and_skip_vectors():
    model = tiny_gpt()
    decay, no_decay = model.optimizer_param_groups(weight_decay=0.1)

    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert sum(1 for p in decay["params"] if p is model.embed.wte.weight) == 1
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_gpt_init_follows_nanogpt():
    torch.manual_seed(0)
    model = GPT(gpt_config("small"))
    residual_std = 0.02 / (2 * model.config.n_layer) ** 0.5

    assert model.embed.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].mlp.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert torch.all(model.blocks[0].mlp.c_fc.bias == 0) and torch.all(model.ln_f.weight == 1)


def test_gpt_meta_build_materialised_unit_by_unit_matches_a_normal_build():
    torch.manual_seed(1234)
    reference = tiny_gpt()
    torch.manual_seed(1234)
    with torch.device("meta"):
        model = tiny_gpt()

    for unit in (model.embed, *model.blocks, model.ln_f):
        unit.to_empty(device="cpu")
        unit.reset_parameters()
    model.tie_weights()

    assert model.lm_head.weight is model.embed.wte.weight
    expected = reference.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())


def test_gpt_loss_at_init_is_near_uniform_over_the_vocabulary():
    torch.manual_seed(0)
    model = tiny_gpt()
    batch = TinyGPT.make_batch(torch.Generator().manual_seed(0), batch_size=4)

    assert model(batch).item() == pytest.approx(torch.log(torch.tensor(96.0)).item(), rel=0.1)


def test_stdlib_corpus_is_deterministic_and_built_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the corpus must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    first, second = stdlib_tokens(byte_budget=100_000), stdlib_tokens(byte_budget=100_000)

    assert first.shape == (100_000,) and first.dtype == torch.int64
    assert torch.equal(first, second)
    assert bytes(first[:3].tolist()) == b'"""'  # __future__.py opens with its docstring


def test_stdlib_corpus_in_96_symbols_fits_the_tiny_gpt_vocabulary():
    tokens = stdlib_tokens(vocab_size=96, byte_budget=100_000)

    assert 0 <= tokens.min() and tokens.max() < gpt_config("tiny").vocab_size
    assert len(tokens.unique()) > 60


def test_char_dataset_pairs_each_window_with_its_next_tokens():
    dataset = CharDataset(torch.arange(10), block_size=4)
    x, y = dataset[3]

    assert len(dataset) == 6
    assert x.tolist() == [3, 4, 5, 6] and y.tolist() == [4, 5, 6, 7]


def test_synthetic_tokens_are_fixed_by_the_seed():
    a, b = SyntheticTokens(8, 16, 96, seed=3), SyntheticTokens(8, 16, 96, seed=3)

    assert all(torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1]) for i in range(8))
    assert torch.equal(a[0][0][1:], a[0][1][:-1])


@pytest.mark.parametrize("model_cls", [MLP, *EDGE_MODELS], ids=lambda cls: cls.__name__)
def test_test_models_return_a_scalar_loss_for_their_own_batches(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    loss = model(model_cls.make_batch(torch.Generator().manual_seed(0), batch_size=4))

    assert loss.dim() == 0 and torch.isfinite(loss)


def test_odd_size_model_cannot_be_split_evenly_across_2_3_or_4_ranks():
    numel = sum(p.numel() for p in OddSizeModel().parameters())

    assert all(numel % world_size for world_size in (2, 3, 4))


def test_param_groups_leave_biases_and_norm_weights_undecayed():
    model = MLP()
    decay, no_decay = param_groups(model)
    linear_weights = {id(layer.weight) for layer in model.net if isinstance(layer, torch.nn.Linear)}

    assert {id(p) for p in decay["params"]} == linear_weights
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 5


def test_frozen_parameters_are_left_out_of_the_optimizer_groups():
    model = FrozenParamModel()
    grouped = [p for group in param_groups(model) for p in group["params"]]

    assert not any(p is model.frozen.weight or p is model.frozen.bias for p in grouped)
