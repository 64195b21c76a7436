"""Chaos: training killed at random moments (a rank SIGKILLed inside a step, a save, the rename) always restarts
from the newest complete checkpoint and ends bitwise equal to the uninterrupted run; see Note: [Chaos trial
invariants] in ``checkpoint_chaos.py``. ``benchmarks/chaos.py`` runs the same trials by the hundred."""

import os
import time

import pytest
from checkpoint_chaos import KillPoint, draw, reference_run, run_trial

from ds_strategy.checkpoint import latest, save
from ds_strategy.checkpoint.directory import MANIFEST, partial_path, previous_path

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

TRIALS = 21  # three of each kill point


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"))


def test_the_suite_trials_cover_every_kill_point_and_both_namings():
    trials = [draw(seed) for seed in range(TRIALS)]
    assert {trial.point for trial in trials} == set(KillPoint)
    assert {trial.naming for trial in trials} == {"per_step", "overwrite"}
    assert {trial.victim for trial in trials if trial.point is KillPoint.SHARD_WRITTEN} | {
        trial.victim for trial in trials if trial.point is KillPoint.STEP
    } == {0, 1}


@pytest.mark.parametrize("seed", range(TRIALS))
def test_killed_run_restarts_from_latest_checkpoint_bitwise_and_leaves_nothing_behind(reference, tmp_path, seed):
    trial = draw(seed)
    result = run_trial(trial, tmp_path, reference)
    assert not result.broken, f"{trial}:\n" + "\n".join(result.broken)
    assert result.killed or trial.point is KillPoint.TIMER


def test_latest_is_the_last_completed_checkpoint_never_a_partial_one(tmp_path):
    from checkpoint_runs import saved_after_one_step

    _, model, engine = saved_after_one_step(tmp_path / "step_1")
    time.sleep(0.01)
    save(tmp_path / "step_2", model, engine)
    (tmp_path / "step_1" / MANIFEST).touch()  # an older name does not make it newer: completion time does
    os.utime(tmp_path / "step_1" / MANIFEST, ns=(0, 0))
    partial_path(tmp_path / "step_3").mkdir()
    assert latest(tmp_path) == tmp_path / "step_2"


def test_latest_names_a_checkpoint_caught_between_its_renames_by_its_own_name(tmp_path):
    from checkpoint_runs import saved_after_one_step

    path, _, _ = saved_after_one_step(tmp_path / "current")
    path.rename(previous_path(path))
    assert latest(tmp_path) == path


def test_latest_of_an_empty_or_missing_root_is_none(tmp_path):
    partial_path(tmp_path / "step_1").mkdir()
    assert latest(tmp_path) is None
    assert latest(tmp_path / "missing") is None
