"""The README's promises hold: the quick-start main job and the usage example run as written, the test command is
the one `.ci/run` runs, and the strategy and config tables are what ``ds-strategy config-table`` generates."""

import ast
import dataclasses
import re
import shlex
import shutil
from pathlib import Path

import pytest
from e2e_runs import PYTHON, REPO, assert_trained_sharded, output, run

from ds_strategy.cli.config_table import documented_fields, markdown_tables
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, gpt_config

README = (REPO / "README.md").read_text()


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _quick_start_commands() -> tuple[str, str]:
    main_job, tests = (block.strip() for block in _code_blocks("bash")[:2])
    return main_job, tests


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = _quick_start_commands()
    assert tests in (REPO / ".ci/run").read_text().splitlines()


def test_ci_runs_the_test_command_in_a_virtual_environment_it_creates_outside_the_clone():
    """Packages installed by hand on CI's machine (DeepSpeed, for one) once hid a broken import: the command must run
    in a venv made for the run, so that only what it installs is visible."""
    _, tests = _quick_start_commands()
    lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    made = next(i for i, line in enumerate(lines) if re.search(r"python3? -m venv \S+", line))
    activated = next(i for i, line in enumerate(lines) if re.fullmatch(r"(source|\.) \"?\S+/bin/activate\"?", line))
    assert made < activated < lines.index(tests)
    assert "mktemp -d" in (REPO / ".ci/run").read_text(), "the venv must live outside the clone"


# A printed warning reads "FILE.py:LINE: ...". This one is not ours: Lightning's own code (its CombinedLoader) builds a
# torch pytree LeafSpec, which torch 2.13 deprecates, in every fit of every script.
NOT_OURS = ("lightning/pytorch/utilities/_pytree.py",)


@pytest.mark.slow
def test_readme_main_job_command_trains_sharded_and_warns_of_nothing_of_ours():
    """The quick start's last step, with the same arguments, from the repository root as the README implies. A first
    run shows no warning about the job's own choices (a checkpoint named like a file, a logger left to default)."""
    main_job, _ = _quick_start_commands()
    command = shlex.split(main_job.split("&&")[-1])
    assert command[0] == "python"
    result = run([PYTHON, *command[1:]], cwd=REPO)
    out_dir = Path(re.search(r"summary and checkpoint in (\S+)", output(result)).group(1))
    try:
        assert_trained_sharded(out_dir, stage=2)
        assert (out_dir / "checkpoint").is_dir()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    warnings = [
        line
        for line in output(result).splitlines()
        if re.match(r"\S+\.py:\d+: ", line) and not any(source in line for source in NOT_OURS)
    ]
    assert warnings == [], "the quick start warns"


@pytest.mark.slow
def test_readme_usage_example_runs_and_halves_the_optimizer_state(tmp_path):
    (usage,) = _code_blocks("python")
    script = tmp_path / "usage.py"
    script.write_text(usage)
    # The rank-1 process Lightning starts can end without flushing a buffered stdout; unbuffered, its line gets out.
    result = run([PYTHON, script], cwd=tmp_path, env={"PYTHONUNBUFFERED": "1"})
    psi = sum(p.numel() for p in GPT(gpt_config("tiny")).parameters())
    printed = re.findall(r"rank (\d) optimizer bytes: (\{[^}]*\})", output(result))  # lines may interleave
    assert sorted(rank for rank, _ in printed) == ["0", "1"]
    for _, report in printed:
        assert abs(sum(ast.literal_eval(report).values()) - 8 * psi / 2) <= 0.05 * 8 * psi / 2


def test_readme_tables_are_the_generated_ones():
    for table in markdown_tables().split("\n\n"):
        assert table in README, "README tables are stale: run `ds-strategy config-table --update README.md`"


def test_every_zero_config_field_is_documented_with_its_real_default():
    documented = documented_fields()
    for field in dataclasses.fields(ZeroConfig):
        assert field.name in documented, f"ZeroConfig.{field.name} has no 'name (default ...): meaning' entry"
        first_word = re.split(r"[ ,;]", documented[field.name][0])[0]
        assert ast.literal_eval(first_word) == field.default, f"ZeroConfig.{field.name}: doc says {first_word}"
