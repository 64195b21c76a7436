"""The README's promises hold: the quick-start main job runs as written and the test command is the one `.ci/run`
runs. (The README's snippets and everything the documentation site promises: ``test_docs.py``.)"""

import re
import shlex
import shutil
from pathlib import Path

import pytest
from e2e_runs import PYTHON, REPO, assert_trained_sharded, output, run

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
        assert_trained_sharded(out_dir, stage=2, reference="train")
        assert (out_dir / "checkpoint").is_dir()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    warnings = [
        line
        for line in output(result).splitlines()
        if re.match(r"\S+\.py:\d+: ", line) and not any(source in line for source in NOT_OURS)
    ]
    assert warnings == [], "the quick start warns"


def test_readme_is_a_front_page_naming_every_entry_point():
    """At most 200 lines (the manual is docs/), and each entry point is in it with its class or how it is named."""
    assert len(README.splitlines()) <= 200
    for entry in ("Lightning", "Fabric", "ZeroAccelerator", "ZeroTrainer", "Hydra"):
        assert entry in README, entry
