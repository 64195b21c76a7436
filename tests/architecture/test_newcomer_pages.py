"""The pages a newcomer reads first hold what they promise (``test_docs.py`` checks the site as a whole).

* Every shell command of the README and of Getting started, in a code block or a code span, is accounted for: a
  ``pip install`` names extras that exist (``ds-strategy[...]`` only where the page says it applies once published);
  ``ds-strategy`` runs (``estimate``, ``--version``) or names a subcommand that exists; an example's command parses its
  arguments (argparse stopped after parsing, Hydra's ``--cfg job``) without training; the quick start and the test
  command are run by ``test_readme.py`` and ``.ci/run``. A command of none of these kinds fails the test, so a new one
  gets a check.
* The README's Python fragments (```` ```py ````) are fragments: they compile, and every name they use that they do
  not define is one of ``FRAGMENT_INPUTS`` (the user's model, data, ...). Getting started's ```` ```python ```` block
  runs whole (``test_docs.py``).
* Code blocks of the site fit the page: no line over ``CODE_WIDTH`` characters (what a 1280-pixel window shows with
  the table of contents in the left column, ``toc.integrate`` in mkdocs.yml), so nothing is cut off on the right;
  ```` ```text ```` blocks (quoted messages) wrap instead (``docs/stylesheets/extra.css``).
* Troubleshooting quotes the code's own messages: each line of its ```` ```text ```` blocks, cut at its ``<...>``
  placeholders, is pieces of one string literal of ``ds_strategy`` (in order).
* No paragraph of the site is longer than ``PARAGRAPH_WORDS`` words.
* Choosing a configuration's figures are the estimator's: every ``NN.NN GB`` its prose names is in one of the page's
  generated ``ds-strategy estimate`` outputs (which ``test_docs.py`` keeps current).
"""

import ast
import builtins
import contextlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from docs_blocks import DOCS, ESTIMATES, REPO

from ds_strategy.cli import main as cli

README = REPO / "README.md"
GETTING_STARTED = DOCS / "getting-started.md"
CODE_WIDTH = 100
FENCE = re.compile(r"^```(?P<language>\w*)[^\n]*\n(?P<code>.*?)^```$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`(?P<code>[^`]+)`(?!`)")
SHELL = {"bash", "shell", "sh", "console"}
COMMAND_WORDS = ("pip", "python", "python3", "ds-strategy", "torchrun", "mkdocs", "ruff", "source")
# what the README's fragments take from the reader's own script
FRAGMENT_INPUTS = {"model", "data", "optimizer", "loader", "train", "inputs", "targets"}
# run elsewhere, as written: the quick start (test_readme.py) and the test command (.ci/run, test_readme.py)
RUN_ELSEWHERE = ("python -m pytest tests", "ruff check .", "ruff format --check .")


def _without_fences(text: str) -> str:
    return FENCE.sub("", text)


def _commands(path: Path) -> list[str]:
    """Every shell command the page shows: each line of its shell blocks, each code span that starts with a command
    word (a span may wrap onto the next line), split at ``&&``."""
    text = path.read_text(encoding="utf-8")
    blocks = [re.sub(r"\\\n\s*", " ", m["code"]) for m in FENCE.finditer(text) if m["language"] in SHELL]
    lines = [line for code in blocks for line in code.splitlines()]
    spans = [" ".join(m["code"].split()) for m in SPAN.finditer(_without_fences(text))]
    lines += [span for span in spans if span.split(" ")[0] in COMMAND_WORDS]
    return [part.strip() for line in lines for part in line.split("&&") if part.strip()]


PAGES_WITH_COMMANDS = (README, GETTING_STARTED)
COMMANDS = sorted({(path.name, command) for path in PAGES_WITH_COMMANDS for command in _commands(path)})
EXTRAS = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _extras(command: str) -> set[str]:
    return {extra for group in re.findall(r"\[([\w,]+)\]", command) for extra in group.split(",")}


def _example(words: list[str]) -> tuple[Path, list[str]] | None:
    """The example script a command runs and its arguments (after ``python``, ``torchrun ...`` or ``ds-strategy
    launch ...``), or None."""
    scripts = [i for i, word in enumerate(words) if word.startswith("examples/") and word.endswith(".py")]
    return (REPO / words[scripts[0]], words[scripts[0] + 1 :]) if scripts else None


# argparse parses the command line as usual, then the script stops before it trains
PARSE_ONLY = """
import argparse, os, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parsed(self, *args, **kwargs):
    parse(self, *args, **kwargs)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parsed
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py` has it, not the working folder
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _arguments_parse(script: Path, arguments: list[str]) -> None:
    if "hydra" in script.read_text():
        command = [sys.executable, str(script), *arguments, "--cfg", "job"]  # composes the overrides, trains nothing
    else:
        command = [sys.executable, "-c", PARSE_ONLY, str(script), *arguments]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command}: {result.stderr[-3000:]}"


def _check(page: str, command: str) -> None:
    words = shlex.split(command)
    if command.startswith(("pip install", "pip wheel")):
        unknown = _extras(command) - EXTRAS
        assert unknown == set(), f"{page}: {command!r} names extras pyproject.toml does not define: {unknown}"
        if "ds-strategy[" in command:
            text = (README if page == README.name else GETTING_STARTED).read_text()
            assert "once ds-strategy is published" in text.lower() or "once it is published" in text, command
    elif (example := _example(words)) is not None:
        script, arguments = example
        assert script.is_file(), f"{page}: {command!r}: no {script}"
        for word in words[: words.index(str(script.relative_to(REPO)))]:
            assert not word.endswith((".yaml", ".json")) or (REPO / word).is_file(), f"{page}: no {word}"
        _arguments_parse(script, arguments)
    elif words[0] == "ds-strategy":
        if words[1:2] in (["estimate"], ["--version"]):
            with pytest.raises(SystemExit) if words[1] == "--version" else contextlib.nullcontext():
                assert cli(words[1:]) == 0
        else:
            assert words[1] in _subcommands(), f"{page}: {command!r}: no such ds-strategy command"
    elif (
        command.startswith(RUN_ELSEWHERE) or words[0] in ("mkdocs", "source") or words[:3] == ["python3", "-m", "venv"]
    ):
        pass  # CI runs these as written (.ci/run); `mkdocs serve` starts a server; a venv is made and activated
    else:
        pytest.fail(f"{page}: {command!r} is a command no check covers: add one")


def _subcommands() -> set[str]:
    from ds_strategy.cli import _subcommands

    return set(_subcommands())


def _runs_a_script(command: str) -> bool:
    return _example(shlex.split(command)) is not None


@pytest.mark.parametrize(
    "page, command",
    [c for c in COMMANDS if not _runs_a_script(c[1])],
    ids=[f"{p}: {c}" for p, c in COMMANDS if not _runs_a_script(c)],
)
def test_every_command_is_checked(page, command):
    _check(page, command)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, command",
    [c for c in COMMANDS if _runs_a_script(c[1])],
    ids=[f"{p}: {c}" for p, c in COMMANDS if _runs_a_script(c)],
)
def test_every_example_command_parses_its_arguments(page, command):
    _check(page, command)


def test_the_readme_fragments_take_only_the_readers_own_objects():
    for code in (m["code"] for m in FENCE.finditer(README.read_text()) if m["language"] == "py"):
        tree = ast.parse(code)
        defined = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        defined |= {
            node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
        }
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        unknown = used - defined - set(dir(builtins)) - FRAGMENT_INPUTS
        assert unknown == set(), f"a README fragment uses {unknown}, neither defined nor among {FRAGMENT_INPUTS}"


def test_no_code_line_is_cut_off_on_the_right():
    long = [
        f"{page.relative_to(REPO)}: {len(line)} characters: {line[:60]}..."
        for page in sorted(DOCS.rglob("*.md"))
        for m in FENCE.finditer(page.read_text(encoding="utf-8"))
        if m["language"] != "text"  # quoted messages, which wrap (docs/stylesheets/extra.css)
        for line in m["code"].splitlines()
        if len(line) > CODE_WIDTH
    ]
    assert long == [], f"code lines wider than the page ({CODE_WIDTH}):\n" + "\n".join(long)


def _string_literals() -> list[str]:
    """Every string literal of ds_strategy, an f-string's fields as ``\\0``."""
    found = []
    for path in (REPO / "ds_strategy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                found.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
    return found


def _quoted(line: str, literals: list[str]) -> bool:
    pieces = [piece for piece in re.split(r"<[^>]*>", line) if piece.strip()]

    def holds(literal: str) -> bool:
        at = 0
        for piece in pieces:
            at = literal.find(piece, at)
            if at < 0:
                return False
            at += len(piece)
        return True

    return any(holds(literal) for literal in literals)


def test_troubleshooting_quotes_messages_the_code_raises():
    text = (DOCS / "troubleshooting.md").read_text()
    lines = [line for m in FENCE.finditer(text) if m["language"] == "text" for line in m["code"].splitlines()]
    assert len(lines) >= 12
    literals = _string_literals()
    # a message built from two literals ("..." + "; ".join(...) + "...") is checked piece by piece
    missing = [
        line
        for line in lines
        if not _quoted(line, literals)
        and not all(_quoted(part.strip(), literals) for part in re.split(r"<[^>]*>", line) if part.strip())
    ]
    assert missing == [], "troubleshooting.md quotes messages the code no longer has:\n" + "\n".join(missing)


def test_the_choosing_page_figures_are_the_estimators():
    text = (DOCS / "choosing-a-configuration.md").read_text()
    blocks = re.findall(r"<!-- begin: (estimate [^>]+) -->\n(.*?)<!-- end: ", text, flags=re.S)
    assert {name for name, _ in blocks} == set(ESTIMATES)
    prose = re.sub(r"<!-- begin: .*?<!-- end: [^>]*-->", "", text, flags=re.S)
    shown = {figure for _, block in blocks for figure in re.findall(r"\d[\d,]*\.\d\d GB", block)}
    named = set(re.findall(r"\d[\d,]*\.\d\d GB", prose))
    assert named and named <= shown, f"figures the estimator does not print: {named - shown}"


PARAGRAPH_WORDS = 120


def test_no_paragraph_is_a_wall_of_text():
    """A paragraph (or list item) of more than ``PARAGRAPH_WORDS`` words is split where its subject turns."""
    long = []
    for page in sorted(DOCS.rglob("*.md")):
        text = re.sub(r"<!-- begin:.*?<!-- end:[^>]*-->", "", _without_fences(page.read_text()), flags=re.S)
        for paragraph in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", text):
            words = len(paragraph.split())
            if words > PARAGRAPH_WORDS and not paragraph.lstrip().startswith(("|", "#")):
                long.append(f"{page.relative_to(REPO)}: {words} words: {' '.join(paragraph.split()[:8])} ...")
    assert long == [], "\n".join(long)
