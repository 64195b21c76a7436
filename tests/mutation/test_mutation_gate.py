"""The mutation gate in the suite: every deliberate breakage of ``mutations.py`` still applies to the source (fast), and
every test that claims one fails against it (slow: each mutant runs its tests in a pytest of its own, against a copy
of the package; Note: [A mutant is a copy on PYTHONPATH] in ``mutation_gate.py``)."""

import re

import pytest
from mutation_gate import ROOT, mutated_source, report, run_mutation
from mutations import MUTATIONS

IDS = [mutation.name.replace(" ", "-") for mutation in MUTATIONS]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=IDS)
def test_every_mutation_still_applies_and_names_tests_that_exist(mutation):
    """Fails naming the mutation when its snippet moved: ``mutations.py`` must be given the new spelling."""
    assert mutated_source(mutation) != (ROOT / mutation.path).read_text()
    for test in mutation.tests:
        path, _, function = test.partition("::")
        assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.MULTILINE), f"{test} does not exist"


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS, ids=IDS)
def test_every_test_claiming_a_mutation_fails_against_it(mutation):
    outcome = run_mutation(mutation)
    assert outcome.killed, report(outcome)
