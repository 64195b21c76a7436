"""The deliberate breakages the mutation gate applies (``mutation_gate.py``), one per place where a silent error would
train a wrong model, each with the tests that claim to catch it: the cheapest ones that do.

A mutation replaces one snippet of one source file, which must occur there exactly once; when a change moves or
rewrites the code, the fast tier's ``test_every_mutation_still_applies`` fails naming the mutation, and its snippet
here is updated to the new spelling of the same mistake. Every test listed must fail against the mutant (Note:
[Killed, survived, broken] in ``mutation_gate.py``); a test that cannot is not listed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str  # the mistake it stands for
    path: str  # relative to the repository's root
    find: str
    replace: str
    tests: tuple[str, ...]


GRADIENT_SCALE = "tests/engine/test_gradient_scale.py"

MUTATIONS = (
    Mutation(
        "gradient sum for mean",
        "the gradients are summed over the data-parallel ranks but never divided by their number",
        "ds_strategy/zero/grad_reducer.py",
        "self.divide_factor: float = collectives.world_size",
        "self.divide_factor: float = 1.0",
        (f"{GRADIENT_SCALE}::test_one_sgd_step_moves_each_parameter_by_one_process_gradient",),
    ),
    Mutation(
        "accumulation not divided",
        "Accelerate's backward forgets to divide the loss by gradient_accumulation_steps",
        "ds_strategy/accelerate/accelerator.py",
        "loss / self.gradient_accumulation_steps, refusal",
        "loss, refusal",
        (f"{GRADIENT_SCALE}::test_accelerate_divides_the_loss_by_its_gradient_accumulation_steps",),
    ),
    Mutation(
        "tensor-parallel partial gradient not summed",
        "a Partial gradient (a sequence-parallel norm's) keeps this rank's part instead of the tp group's sum",
        "ds_strategy/parallel/dtensor_params.py",
        "grad = grad.redistribute(self.mesh, self.placements)",
        "return grad.to_local()",
        ("tests/parallel/test_tensor_parallel.py::test_tp2_matches_single_process",),
    ),
    Mutation(
        "Ulysses gradient averaged over sp",
        "the sequence-parallel ranks' gradients are averaged (divided by dp x sp) instead of summed over sp",
        "ds_strategy/parallel/ulysses.py",
        "return zero_group_size // sp_size",
        "return zero_group_size",
        (
            "tests/parallel/test_ulysses.py::"
            "test_our_gpt_with_ulysses_attention_matches_the_full_sequence_loss_and_gradients",
        ),
    ),
    Mutation(
        "qgZ sum halved",
        "the quantised reduction's sum comes out at half its value",
        "ds_strategy/comm/quantized.py",
        "out.copy_(layout.unpack(received.view(world, layout.nbytes), torch.float32).sum(dim=0))",
        "out.copy_(layout.unpack(received.view(world, layout.nbytes), torch.float32).sum(dim=0) * 0.5)",
        ("tests/comm/test_zeropp.py::test_qgz_reduces_one_backward_to_the_unquantized_shard_within_the_packet_bound",),
    ),
    Mutation(
        "qgZ only rank 0's chunk",
        "the quantised reduction keeps the first rank's chunk instead of the sum over ranks",
        "ds_strategy/comm/quantized.py",
        "out.copy_(layout.unpack(received.view(world, layout.nbytes), torch.float32).sum(dim=0))",
        "out.copy_(layout.unpack(received.view(world, layout.nbytes), torch.float32)[0] * world)",
        ("tests/comm/test_zeropp.py::test_qgz_reduces_one_backward_to_the_unquantized_shard_within_the_packet_bound",),
    ),
    Mutation(
        "loss scale unscaled by half",
        "fp16 gradients are multiplied by 2 / scale instead of 1 / scale before the step",
        "ds_strategy/precision/loss_scaler.py",
        "return 1.0 / self._state.cur_scale",
        "return 2.0 / self._state.cur_scale",
        (f"{GRADIENT_SCALE}::test_fp16_gradients_are_unscaled_once_before_the_step",),
    ),
    Mutation(
        "checkpoint model pieces at offset 0",
        "each rank saves its pieces of a parameter at the parameter's start instead of its shard's offset",
        "ds_strategy/checkpoint/rank_state.py",
        "piece = piece_of(fp.master, fp, slot, start, length, rows.get(slot.name))",
        "piece = piece_of(fp.master, fp, slot, 0, length, rows.get(slot.name))",
        ("tests/checkpoint/test_checkpoint_sharded.py::test_resumed_run_equals_uninterrupted_run_bitwise",),
    ),
    Mutation(
        "checkpoint optimizer-state pieces at offset 0",
        "each rank saves its pieces of an optimizer state at the parameter's start instead of its shard's offset",
        "ds_strategy/checkpoint/rank_state.py",
        "entries[key] = _state_piece(value, like, fp, slot, start, length, rows.get(slot.name))",
        "entries[key] = _state_piece(value, like, fp, slot, 0, length, rows.get(slot.name))",
        ("tests/checkpoint/test_checkpoint_sharded.py::test_resumed_run_equals_uninterrupted_run_bitwise",),
    ),
)
