"""A successful run exits 0: every process group is destroyed before the interpreter finalizes (see
``ds_strategy/comm/process_exit.py``). Every end-to-end run of an entry point (``e2e_runs.run``) also fails on a
non-zero exit or the abort message; ``benchmarks/clean_exit.py`` repeats each entry point 50 times."""

import pytest
from e2e_runs import (
    ENTRY_POINTS,
    assert_clean_exit,
    entry_point_env,
    gloo_threads_at_exit,
    run,
    run_gloo_exit_race,
    thread_listings,
)

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


def test_exit_with_gloo_work_in_flight_is_clean_once_collectives_exist():
    """The torch 2.13 reproducer (aborts about 1 run in 10 left ``bare``) exits 0 on every rank of 2 jobs."""
    for result in run_gloo_exit_race("ours", pairs=2, timeout=300):
        assert_clean_exit(result.args, result)
        assert "done" in result.stdout


@pytest.mark.parametrize("entry_point", ["lightning_deepspeed_json", "fabric", "accelerate_launch"])
def test_no_gloo_thread_outlives_the_exit_teardown(entry_point, tmp_path):
    """Both ranks of a real run have joined every gloo thread by their last ``atexit`` hook: nothing of ours still
    holds a process group, so nothing is left to race the interpreter's finalization. The abort itself is rare (a
    race); a leftover thread is there in every run, so this catches a new holder deterministically."""
    result = run(ENTRY_POINTS[entry_point](tmp_path), env=entry_point_env(entry_point, probe_threads=True), timeout=300)
    assert_clean_exit(result.args, result)
    assert len(thread_listings(result)) >= 2, result.stderr[-2000:]  # at least the two ranks (and any launcher)
    assert not gloo_threads_at_exit(result)
