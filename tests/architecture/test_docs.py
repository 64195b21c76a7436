"""The documentation site holds what it promises.

* Every ```` ```python ```` block of a page under ``docs/`` runs as a script, from an empty folder, and exits 0 (or, for
  the pages in ``IN_PROCESS``, runs in this process); a block written ```` ```py ```` is a fragment that is only read.
  Some pages' blocks print what they promise, and ``PROMISES`` checks it.
* Every Python block of the pages and of the README parses, and every ``ds_strategy`` name it imports exists.
* The generated blocks (tables from ``ZeroConfig``, the presets and the DeepSpeed rules, the composition matrix, the
  index of Notes) are what ``python tests/support/docs_blocks.py`` writes now.
* ``mkdocs.yml``'s nav lists every page and only pages that exist; Getting started shows the README's two commands;
  CI builds the site with ``mkdocs build --strict`` after the tests (the build itself needs the ``docs`` extra, so it
  is CI's step, not a test).
"""

import ast
import dataclasses
import importlib
import re

import pytest
import yaml
from docs_blocks import DOCS, REPO, generated
from e2e_runs import PYTHON, output, run

from ds_strategy.cli.config_table import documented_fields
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, gpt_config

PAGES = sorted(DOCS.rglob("*.md"))
README = REPO / "README.md"
FENCE = re.compile(r"^```(?P<language>\w+)\n(?P<code>.*?)^```$", re.S | re.M)


def _blocks(path, languages: set[str]) -> list[str]:
    return [m["code"] for m in FENCE.finditer(path.read_text(encoding="utf-8")) if m["language"] in languages]


def _name(path) -> str:
    return path.relative_to(DOCS).as_posix()


def _halves_the_optimizer_state(out: str) -> None:
    """Getting started: each of the 2 ranks holds half of AdamW's 8 bytes per parameter."""
    psi = sum(p.numel() for p in GPT(gpt_config("tiny")).parameters())
    printed = re.findall(r"rank (\d) optimizer bytes: (\{[^}]*\})", out)  # lines may interleave
    assert sorted(rank for rank, _ in printed) == ["0", "1"]
    for _, report in printed:
        assert abs(sum(ast.literal_eval(report).values()) - 8 * psi / 2) <= 0.05 * 8 * psi / 2


PROMISES = {"getting-started.md": _halves_the_optimizer_state}
# Pages whose blocks start no process and set nothing process-wide (a single-process engine, asserts of their own):
# they run in this process, which saves an interpreter's start and keeps them in the fast tier.
IN_PROCESS = {"precision.md"}
RUNNABLE = [(page, index, code) for page in PAGES for index, code in enumerate(_blocks(page, {"python"}))]
SCRIPTS = [block for block in RUNNABLE if _name(block[0]) not in IN_PROCESS]
EXECUTED = [block for block in RUNNABLE if _name(block[0]) in IN_PROCESS]


@pytest.mark.slow
@pytest.mark.parametrize("page, index, code", SCRIPTS, ids=[f"{_name(p)}-{i}" for p, i, _ in SCRIPTS])
def test_python_block_runs_as_a_script(tmp_path, page, index, code):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    # A rank process Lightning starts can end without flushing a buffered stdout; unbuffered, its lines get out.
    result = run([PYTHON, script], cwd=tmp_path, env={"PYTHONUNBUFFERED": "1"})
    if _name(page) in PROMISES:
        PROMISES[_name(page)](output(result))


@pytest.mark.parametrize("page, index, code", EXECUTED, ids=[f"{_name(p)}-{i}" for p, i, _ in EXECUTED])
def test_python_block_runs_in_this_process(page, index, code):
    exec(compile(code, str(page), "exec"), {"__name__": "__main__"})


def test_every_promise_and_in_process_page_has_a_block():
    assert set(PROMISES) <= {_name(page) for page, _, _ in SCRIPTS}
    assert IN_PROCESS <= {_name(page) for page, _, _ in EXECUTED}


def _imported_names(code: str) -> list[tuple[str, str | None]]:
    """(module, name) for each ``from ds_strategy... import name``, (module, None) for ``import ds_strategy...``."""
    imported = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ds_strategy":
            imported += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            imported += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "ds_strategy"]
    return imported


@pytest.mark.parametrize("path", [*PAGES, README], ids=lambda p: p.relative_to(REPO).as_posix())
def test_python_blocks_parse_and_import_what_exists(path):
    for code in _blocks(path, {"python", "py"}):
        for module, name in _imported_names(code):
            imported = importlib.import_module(module)
            assert name is None or hasattr(imported, name), f"{path.name}: {module} has no {name}"


def test_generated_blocks_are_current():
    texts = {page: page.read_text(encoding="utf-8") for page in PAGES}
    blocks = generated()
    for name, content in blocks.items():
        holders = [page for page, text in texts.items() if f"<!-- begin: {name} -->" in text]
        assert len(holders) == 1, f"{name}: in {holders}, wanted one page"
        marked = f"<!-- begin: {name} -->\n{content}\n<!-- end: {name} -->"
        stale = f"{_name(holders[0])}: {name} is stale: run `python tests/support/docs_blocks.py`"
        assert marked in texts[holders[0]], stale
    for page, text in texts.items():
        for name in re.findall(r"<!-- begin: (.+?) -->", text):
            assert name in blocks, f"{_name(page)}: no generator writes {name}"


def test_every_zero_config_field_is_documented_with_its_real_default():
    documented = documented_fields()
    for field in dataclasses.fields(ZeroConfig):
        assert field.name in documented, f"ZeroConfig.{field.name} has no 'name (default ...): meaning' entry"
        first_word = re.split(r"[ ,;]", documented[field.name][0])[0]
        assert ast.literal_eval(first_word) == field.default, f"ZeroConfig.{field.name}: doc says {first_word}"


def _nav_pages(entries) -> list[str]:
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, dict):
        entries = list(entries.values())
    return [page for entry in entries for page in _nav_pages(entry)]


def test_the_nav_lists_every_page_and_only_pages():
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(_name(page) for page in PAGES)


def test_getting_started_shows_the_readme_commands():
    """The same commands, which the page may wrap onto continuation lines to fit its width."""

    def commands(path):
        return [re.sub(r"\s*\\\n\s*", " ", code.strip()) for code in _blocks(path, {"bash"})[:2]]

    assert commands(DOCS / "getting-started.md") == commands(README)


def test_ci_builds_the_site_strictly_after_the_tests():
    lines = (REPO / ".ci/run").read_text().splitlines()
    tests = next(i for i, line in enumerate(lines) if "python -m pytest tests" in line)
    build = next(i for i, line in enumerate(lines) if line.startswith("mkdocs build --strict"))
    assert tests < build
