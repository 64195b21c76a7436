"""Each component's policy is a section of ZeroConfig: every field lands in exactly one, with ZeroConfig's value."""

import dataclasses
from collections import Counter

import pytest

from ds_strategy.config import ZeroConfig
from ds_strategy.config.policies import ActivationPolicy, CommPolicy, OffloadPolicy, ParallelismPolicy, PrecisionPolicy
from ds_strategy.config.zero_config import PRECISION_SECTION, fields_of

POLICIES = {
    "precision_policy": PrecisionPolicy,
    "offload_policy": OffloadPolicy,
    "comm_policy": CommPolicy,
    "parallelism_policy": ParallelismPolicy,
    "activation_policy": ActivationPolicy,
}
# What the engine reads itself rather than handing to a component: what is sharded and in which units, how the
# model is built, the optimizer step and the batch sizes.
ENGINE_FIELDS = {
    "stage",
    "contiguous_gradients",
    "param_persistence_threshold",
    "unit_modules",
    "unit_min_params",
    "param_init_fn",
    "sync_module_states",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
}


def _names(cls) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def test_every_zero_config_field_is_in_exactly_one_policy_or_the_engines():
    owners = Counter(name for policy in POLICIES.values() for name in _names(policy))
    owners.update(ENGINE_FIELDS)
    assert {name for name, count in owners.items() if count > 1} == set(), "fields claimed twice"
    unclaimed = set(_names(ZeroConfig)) - set(owners)
    assert unclaimed == set(), f"add {sorted(unclaimed)} to a policy in ds_strategy.config.policies or ENGINE_FIELDS"
    assert set(owners) - set(_names(ZeroConfig)) == set(), "a policy names a field ZeroConfig does not have"


@pytest.mark.parametrize("attribute", POLICIES)
def test_policy_carries_the_validated_values_of_its_fields(attribute):
    config = ZeroConfig(
        stage=3, precision=16, communication_dtype="float32", offload_params="cpu", activation_checkpointing="full"
    )
    policy = getattr(config, attribute)
    assert isinstance(policy, POLICIES[attribute])
    assert dataclasses.asdict(policy) == {name: getattr(config, name) for name in _names(policy)}


def test_policies_follow_replace_and_are_frozen():
    config = ZeroConfig(precision="bf16-mixed").replace(precision="16-mixed", loss_scale=128.0)
    assert (config.precision_policy.precision, config.precision_policy.loss_scale) == ("16-mixed", 128.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.precision_policy.loss_scale = 1.0


def test_policies_have_no_defaults_so_zero_config_stays_the_one_source():
    for policy in POLICIES.values():
        defaulted = [f.name for f in dataclasses.fields(policy) if f.default is not dataclasses.MISSING]
        assert defaulted == [], f"{policy.__name__} defaults {defaulted}; default them in ZeroConfig only"


def test_each_section_is_one_run_of_fields_under_one_policy():
    """One grouping: a section (a heading of the docs) never straddles two policies, and its fields are declared
    together, so the docs' headings, the policies and Hydra's groups cannot disagree."""
    sections = [field.metadata["section"] for field in dataclasses.fields(ZeroConfig)]
    runs = [section for i, section in enumerate(sections) if i == 0 or section is not sections[i - 1]]
    assert len(runs) == len(set(runs)), "a section's fields are split by another section's"
    for policy in POLICIES.values():
        assert _names(policy) == [
            f.name for f in dataclasses.fields(ZeroConfig) if f.metadata["section"].policy is policy
        ]
    engine = [f.name for f in dataclasses.fields(ZeroConfig) if f.metadata["section"].policy is None]
    assert set(engine) == ENGINE_FIELDS


def test_hydras_precision_group_is_the_precision_section():
    """The precision and every loss-scaling setting (``consecutive_hysteresis`` too); the gradient dtypes stay in the
    ``strategy`` group."""
    assert fields_of(PRECISION_SECTION) == [
        "precision",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "max_consecutive_min_scale_skips",
    ]
