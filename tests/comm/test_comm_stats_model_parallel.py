"""``comm_stats()`` counts the model's own traffic over the mesh's model-parallel groups: a Hugging Face Mixtral
composed on 4 gloo ranks with tensor parallelism inside Ulysses (tp=2 x sp=2) and partitioned activation
checkpointing runs one step, and the engine's totals include the Ulysses all-to-alls (attention), the fused experts'
tensor-parallel sums and the all-gathers of checkpoint inputs, because the mesh owns one ``Collectives`` per
dimension and everything takes them from it."""

import hf_models
import pytest
import torch
from distributed import run_ranks

from ds_strategy.compose import build_mesh, compose_model
from ds_strategy.config import ZeroConfig
from ds_strategy.parallel.ulysses import sequence_parallel_loss, shard_sequence

pytestmark = pytest.mark.slow  # 4 ranks building a Llama: tens of seconds on 2 cores

MIXTRAL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False}
LAYERS = 2  # hf_models' configs: each attends once (4 all-to-alls: q, k, v, out) and sums its experts once


def _one_step(rank: int, world_size: int) -> dict:
    config = ZeroConfig(
        stage=1,
        tensor_parallel_size=2,
        sequence_parallel_size=2,
        tensor_parallel_plan="auto",
        activation_checkpointing="full",
        partition_activations=True,
        collective_timeout=55.0,
    )
    mesh = build_mesh(config, "cpu")
    model = hf_models.build("mixtral", **MIXTRAL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = compose_model(
        model, config, mesh=mesh, device=torch.device("cpu"), log=lambda _: None, optimizers=[optimizer]
    ).engine
    before = engine.comm_stats()
    ids = hf_models.batches(1, 1)[0]
    local = shard_sequence({"input_ids": ids, "labels": ids}, mesh.sp_collectives)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    forward = {"sp": engine.comm_stats("sp"), "tp": engine.comm_stats("tp")}
    engine.backward(sequence_parallel_loss(logits, local["shift_labels"], mesh.sp_collectives))
    engine.step()
    after = engine.comm_stats()
    return {
        "total": {kind: after[kind]["calls"] - before[kind]["calls"] for kind in after},
        "forward": {group: {kind: calls["calls"] for kind, calls in stats.items()} for group, stats in forward.items()},
        "sp": engine.comm_stats("sp"),
        "tp": engine.comm_stats("tp"),
        "timeouts": {dim: c.timeout for dim, c in mesh.collectives.items()},
        "same": engine.tp_collectives is mesh.tp_collectives,
    }


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_one_step, 4)


def test_ulysses_all_to_alls_are_in_comm_stats(runs):
    for run in runs:
        assert run["forward"]["sp"]["all_to_all"] == 4 * LAYERS
        assert run["total"]["all_to_all"] == run["sp"]["all_to_all"]["calls"]  # the ZeRO group issues none


def test_tensor_parallel_traffic_is_in_comm_stats(runs):
    for run in runs:
        assert run["forward"]["tp"]["all_reduce"] == LAYERS  # the experts' partial outputs, summed
        assert run["tp"]["all_gather"]["calls"] > 0  # partitioned checkpoint inputs, gathered in backward
        assert run["total"]["all_gather"] >= run["tp"]["all_gather"]["calls"]
        assert run["same"]


def test_the_mesh_collectives_wait_the_configured_timeout(runs):
    for run in runs:
        assert run["timeouts"] == {"sp": 55.0, "tp": 55.0}
