"""A successful run exits 0: every process group is destroyed before the interpreter finalizes (see
``ds_strategy/comm/process_exit.py``). Every end-to-end run of an entry point (``e2e_runs.run``) also fails on a
non-zero exit or the abort message; ``benchmarks/clean_exit.py`` repeats each entry point 50 times."""
from e2e_runs import assert_clean_exit, run_gloo_exit_race


def test_exit_with_gloo_work_in_flight_is_clean_once_collectives_exist():
    """The torch 2.13 reproducer (aborts about 1 run in 10 left ``bare``) exits 0 on every rank of 2 jobs."""
    for result in run_gloo_exit_race("ours", pairs=2, timeout=300):
        assert_clean_exit(result.args, result)
        assert "done" in result.stdout
