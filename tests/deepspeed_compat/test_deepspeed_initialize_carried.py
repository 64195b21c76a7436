"""DeepSpeed's own unit tests of the APIs ``ds_strategy.deepspeed`` implements, carried from deepspeedai/DeepSpeed
(``tests/unit``, commit edaa72212) and run against our module: the DeepSpeed test harness (``DistributedTest``) becomes
``run_ranks``, ``SimpleModel`` a two-layer model, and the assertions stay DeepSpeed's except where noted.

Carried:
- ``runtime/test_ds_initialize.py``: ``TestNoOptim`` (stages 0 and 3, ``zero.Init``, no optimizer, forward only),
  ``TestClientOptimizer`` (None / instance / callable), ``TestConfigOptimizer`` (with and without
  ``model_parameters``), ``TestClientLrScheduler`` (3 x 3, including the refused combination). Where DeepSpeed
  asserts its ``FusedAdam`` class, we assert the torch class computing it (``AdamW``, as Adam's ``adam_w_mode``).
- ``runtime/test_ds_config_dict.py``: ``TestBatchConfig`` (the four batch-size cases at 2 ranks).
- ``checkpoint/test_latest_checkpoint.py``: ``test_existing_latest`` (save with no tag, load through ``latest``,
  weights and optimizer state equal), ``test_missing_latest`` (a no-op).
- ``runtime/zero/test_zero_context.py``: ``TestZeroGatheredParametersFree``, ``TestScatterGather``,
  ``TestGatherUpdate``; adapted: our ``zero.Init`` builds on the meta device and ``initialize`` shards, so the
  gathering is checked on the initialised engine's parameters (empty outside the block, whole inside), not on the
  module ``zero.Init`` returned, with ``stage3_param_persistence_threshold: 0`` (DeepSpeed's ``zero.Init`` partitions
  every parameter; here the config's threshold keeps small ones whole, as DeepSpeed's engine would).

Not carried: ``TestOptimizerImplementation`` (DeepSpeed's optimizer wrapper classes per dtype), ``test_tag_validation``
(``checkpoint.tag_validation`` is not implemented; every rank is handed the tag by rank 0's ``latest``),
``TestGatheredParametersAllRanksErrorOnModification`` (DeepSpeed's sanity checks of in-place writes without a
``modifier_rank``: ours keep no such check), ``TestSerialContext``/MiCS/``ds_status`` tests (DeepSpeed's parameter
attributes, which ds_strategy does not hang on parameters), the pipeline, MoE, universal-checkpoint and
``test_reshape_checkpoint`` tests (other engines), ``test_lr_schedulers.py`` (carried earlier against the schedules in
``test_deepspeed_optimizer_sections.py``).
"""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, set_torchrun_environment
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

import ds_strategy.deepspeed as deepspeed
from ds_strategy.config.deepspeed.lr_schedules import DeepSpeedSchedule

HIDDEN = 10


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim: int = HIDDEN, nlayers: int = 1):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers))
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for linear in self.linears:
            x = linear(x)
        return self.cross_entropy_loss(x, y)


def random_batches(count: int, batch: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, HIDDEN, generator=generator), torch.randint(0, HIDDEN, (batch,), generator=generator))
        for _ in range(count)
    ]


def one_rank(fn, *args):
    return run_ranks(fn, 1, *args)[0]


# -- runtime/test_ds_initialize.py -----------------------------------------------------------------------------


def no_optim(rank, world_size, stage):
    config = {"train_batch_size": world_size, "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=config):
        model = SimpleModel(4, nlayers=12)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    for x, y in random_batches(3, 1):
        engine(x[:, :4], y % 4)
    return optimizer is None


@pytest.mark.parametrize("stage", [0, 3])
def test_no_optimizer(stage):
    assert one_rank(no_optim, stage)


def client_optimizer(rank, world_size, kind):
    model = SimpleModel()
    config = {"train_batch_size": 1}
    if kind is None:
        config["optimizer"] = {"type": "Adam"}
        given = None
    elif kind == "instance":
        given = torch.optim.Adam(model.parameters())
    else:
        given = lambda params: torch.optim.AdamW(params=params)  # noqa: E731
    _, optimizer, _, _ = deepspeed.initialize(
        config=config, model=model, model_parameters=list(model.parameters()), optimizer=given
    )
    if given is None:
        return type(optimizer) is torch.optim.AdamW  # DeepSpeed: FusedAdam, Adam in adam_w_mode
    if isinstance(given, torch.optim.Optimizer):
        return optimizer is given
    return isinstance(optimizer, torch.optim.AdamW)


@pytest.mark.parametrize("kind", [None, "instance", "callable"])
def test_client_optimizer(kind):
    assert one_rank(client_optimizer, kind)


def config_optimizer(rank, world_size, client_parameters):
    model = SimpleModel()
    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}
    parameters = list(model.parameters()) if client_parameters else None
    _, optimizer, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=parameters)
    return type(optimizer) is torch.optim.AdamW and optimizer.param_groups[0]["lr"] == 0.001


@pytest.mark.parametrize("client_parameters", [True, False])
def test_config_optimizer(client_parameters):
    assert one_rank(config_optimizer, client_parameters)


def client_lr_scheduler(rank, world_size, scheduler_kind, optimizer_kind):
    def _my_lambda(epoch):
        return epoch // 10

    model = SimpleModel()
    config = {"train_batch_size": 1}
    optimizer = None
    if optimizer_kind is None:
        config["optimizer"] = {"type": "Adam"}
    elif optimizer_kind == "instance":
        optimizer = torch.optim.Adam(model.parameters())
    else:
        optimizer = lambda params: torch.optim.AdamW(params=params)  # noqa: E731
    scheduler = None
    if scheduler_kind is None:
        config["scheduler"] = {"type": "WarmupLR", "params": {}}
    elif scheduler_kind == "instance":
        stepped = optimizer if isinstance(optimizer, torch.optim.Optimizer) else torch.optim.Adam(model.parameters())
        scheduler = LambdaLR(stepped, _my_lambda)
    else:
        scheduler = lambda optimizer: LambdaLR(optimizer, _my_lambda)  # noqa: E731
    arguments = dict(config=config, model=model, model_parameters=list(model.parameters()), optimizer=optimizer)
    if isinstance(scheduler, LRScheduler) and not isinstance(optimizer, torch.optim.Optimizer):
        with pytest.raises(AssertionError):
            deepspeed.initialize(**arguments, lr_scheduler=scheduler)
        return True
    _, _, _, returned = deepspeed.initialize(**arguments, lr_scheduler=scheduler)
    if scheduler is None:
        return isinstance(returned, DeepSpeedSchedule)  # DeepSpeed: its WarmupLR class
    if isinstance(scheduler, LRScheduler):
        return returned is scheduler
    return isinstance(returned, LambdaLR)


@pytest.mark.parametrize("scheduler_kind", [None, "instance", "callable"])
@pytest.mark.parametrize("optimizer_kind", [None, "instance", "callable"])
def test_client_lr_scheduler(scheduler_kind, optimizer_kind):
    assert one_rank(client_lr_scheduler, scheduler_kind, optimizer_kind)


# -- runtime/test_ds_config_dict.py ----------------------------------------------------------------------------


def batch_config(rank, world_size, cases):
    """DeepSpeed's ``_run_batch_config`` for each case: the engine's three sizes, or None where it refused."""
    outcomes = []
    for train_batch, micro_batch, gas in cases:
        config = {
            key: value
            for key, value in (
                ("train_batch_size", train_batch),
                ("train_micro_batch_size_per_gpu", micro_batch),
                ("gradient_accumulation_steps", gas),
            )
            if value is not None
        }
        try:
            engine, *_ = deepspeed.initialize(model=SimpleModel(), config=config)
        except ValueError:
            outcomes.append(None)
            continue
        sizes = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu())
        outcomes.append((*sizes, engine.gradient_accumulation_steps()))
        engine.destroy()
    return outcomes


BATCH_CASES = [(2, 32, 16, 1, True), (2, 32, 8, 2, True), (2, 33, 17, 2, False), (2, 32, 18, 1, False)]


@pytest.mark.slow
def test_batch_config():
    """Every case of DeepSpeed's TestBatchConfig, all three given and each combination it tries, on one pair of ranks:
    the engine's (train_batch_size, micro-batch, accumulation), or a refusal."""
    tries = []  # (the sizes given, what the engine must report, None for a refusal)
    for _, batch, micro, gas, success in BATCH_CASES:
        want = (batch, micro, gas) if success else None
        tries += [((batch, micro, gas), want), ((batch, micro, None), want)]
        if success:
            tries += [((batch, None, gas), want), ((None, micro, gas), want)]
            if gas == 1:
                tries += [((None, micro, None), want), ((batch, None, None), want)]
        else:
            tries.append(((None, None, gas), None))
            if gas != 1:
                tries.append(((batch, None, gas), None))
    outcomes = run_ranks(batch_config, 2, [sizes for sizes, _ in tries])[0]
    assert outcomes == [want for _, want in tries]


# -- checkpoint/test_latest_checkpoint.py ----------------------------------------------------------------------


CHECKPOINT_CONFIG = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}}


def existing_latest(rank, world_size, tmpdir):
    torch.manual_seed(0)
    trained = SimpleModel()
    engine, *_ = deepspeed.initialize(config=CHECKPOINT_CONFIG, model=trained, model_parameters=trained.parameters())
    for x, y in random_batches(3, 2):
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(tmpdir, client_state={"note": "saved"})
    torch.manual_seed(1)
    fresh = SimpleModel()
    loaded, *_ = deepspeed.initialize(config=CHECKPOINT_CONFIG, model=fresh, model_parameters=fresh.parameters())
    path, client_state = loaded.load_checkpoint(tmpdir)  # tag from ``latest``
    same_weights = all(
        torch.equal(a, b) for a, b in zip(engine.module_state_dict().values(), loaded.module_state_dict().values())
    )
    states = [engine.optimizer.state_dict()["state"], loaded.optimizer.state_dict()["state"]]
    same_state = all(
        torch.equal(a[key], b[key]) for a, b in zip(*(s.values() for s in states)) for key in ("exp_avg", "exp_avg_sq")
    )
    return path.endswith("global_step3"), client_state, same_weights, same_state, loaded.global_steps


def test_existing_latest(tmp_path):
    assert one_rank(existing_latest, str(tmp_path)) == (True, {"note": "saved"}, True, True, 3)


def missing_latest(rank, world_size, tmpdir):
    model = SimpleModel()
    engine, *_ = deepspeed.initialize(config=CHECKPOINT_CONFIG, model=model, model_parameters=model.parameters())
    return engine.load_checkpoint(tmpdir)  # a no-op: there is no ``latest``


def test_missing_latest(tmp_path):
    assert one_rank(missing_latest, str(tmp_path)) == (None, None)


# -- runtime/zero/test_zero_context.py -------------------------------------------------------------------------


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(6, 3)
        self.l2 = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.l2(self.l1(x))


def gathered_parameters(rank, world_size):
    set_torchrun_environment(rank, world_size)
    # no persistence threshold: DeepSpeed's zero.Init partitions every parameter, ours applies the config's threshold
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TwoLinears()
    on_meta = model.l1.weight.is_meta
    engine, *_ = deepspeed.initialize(model=model, config=config)
    weight = engine.module.l1.weight
    free_outside = weight.numel() == 0
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        whole_inside = weight.numel() == 6 * 3
    freed_after = weight.numel() == 0
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=1):  # TestGatherUpdate
        if dist.get_rank() == 1:
            with torch.no_grad():
                weight.zero_()
    with deepspeed.zero.GatheredParameters(weight):
        zero_everywhere = torch.equal(weight, torch.zeros_like(weight))
    out = engine(torch.ones(1, 6))  # the zeroed weight is what the forward computes with
    expected = engine.module.l2.bias.detach().clone()
    with deepspeed.zero.GatheredParameters(list(engine.module.l2.parameters())):
        expected = engine.module.l2(engine.module.l1.bias.detach().reshape(1, 3)).detach()
    return on_meta, free_outside, whole_inside, freed_after, zero_everywhere, torch.allclose(out, expected)


@pytest.mark.slow
def test_gathered_parameters_free_scatter_gather_and_update():
    for outcome in run_ranks(gathered_parameters, 2):
        assert outcome == (True, True, True, True, True, True)
