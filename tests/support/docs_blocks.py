"""The generated blocks of the documentation site, and the command that rewrites them.

A page of ``docs/`` holds a generated block between ``<!-- begin: NAME -->`` and ``<!-- end: NAME -->``:

* ``strategies table``, ``config table``, ``deepspeed table``: what ``ds-strategy config-table`` prints, from the
  strategy presets, ``ZeroConfig`` and the DeepSpeed key rules;
* ``notes index``: every ``Note: [Title]`` block in the code, with its file;
* ``composition matrix table``: the cells ``composition_runs`` runs and the configurations it checks are refused;
* ``zero config reference``: every ``ZeroConfig`` field, under the heading of its section, for the API reference;
* ``estimate ...``: a ``ds-strategy estimate`` command and what it prints, for the worked examples of choosing a
  configuration.

``python tests/support/docs_blocks.py`` rewrites every block; ``tests/architecture/test_docs.py`` fails when one is
stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import import_root  # noqa: F401 - run as a script too: composition_runs is in another folder of the suite

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# where a Note may be written: the package, its kernels and presets, the tools and examples beside it, the tests
NOTE_ROOTS = ("ds_strategy", "kernels", "configs", "benchmarks", "examples", "tests")
SKIPPED = (REPO / "tests" / "data",)
# A Note's header opens a paragraph of a docstring or comment: `Note: [Title]`, alone on its line or followed by the
# Note's first sentence. References to it ("see Note: [Title]") sit inside a sentence, so they neither open a
# paragraph nor stand alone on a line, even when the sentence wraps just before them.
NOTE_HEADER = re.compile(r'^\s*(?:"""|#\s*)?Note: \[(?P<title>[^\]]+)\](?P<rest>.*)$')
PARAGRAPH_BREAK = re.compile(r'^\s*(?:#\s*)?(?:""")?\s*$')


def notes() -> list[tuple[str, str]]:
    """Every Note's title and the file that holds it (relative to the repository), in file order."""
    files = list(REPO.glob("*.py"))
    files += [path for root in NOTE_ROOTS for path in (REPO / root).rglob("*.py")]
    found = []
    for path in sorted(set(files)):
        if any(path.is_relative_to(skipped) for skipped in SKIPPED):
            continue
        previous = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            match = NOTE_HEADER.match(line)
            if match and (not match.group("rest").strip() or PARAGRAPH_BREAK.match(previous)):
                found.append((match.group("title"), path.relative_to(REPO).as_posix()))
            previous = line
    return found


def notes_index() -> str:
    lines = ["| Note | file |", "| --- | --- |"]
    lines += [f"| {title.replace('|', '/')} | `{path}` |" for title, path in notes()]
    return "\n".join(lines)


def composition_matrix_table() -> str:
    from composition_runs import BF16_CELLS, EXPERT_CELLS, REFUSED_CONFIGS, pairwise_cells

    lines = ["| entry point | layout | ZeRO stage | build |", "| --- | --- | --- | --- |"]
    for cell in [*pairwise_cells(), *BF16_CELLS, *EXPERT_CELLS]:
        build = cell.build if cell.precision == "32-true" else f"{cell.build} ({cell.precision})"
        lines.append(f"| {cell.entry} | {cell.layout} | {cell.stage} | {build} |")
    lines += ["", "Refused by design, whatever the entry point, each with an error naming the combination:", ""]
    for fields, words in REFUSED_CONFIGS:
        arguments = ", ".join(f"{name}={value!r}" for name, value in fields.items())
        lines.append(f'- `ZeroConfig({arguments})`: "{words}"')
    return "\n".join(lines)


# the estimator's commands whose output the worked examples of docs/choosing-a-configuration.md show
ESTIMATES = {
    "estimate 7B on 8": "ds-strategy estimate --params 7e9 --world-size 8",
    "estimate 70B on 64": "ds-strategy estimate --params 70e9 --world-size 64 --stage 3 --no-offload",
    "estimate 70B tp8 on 64": "ds-strategy estimate --params 8.75e9 --world-size 8 --no-offload",
    "estimate 70B on 8": "ds-strategy estimate --params 70e9 --world-size 8 --stage 3",
    "estimate MoE on 16": "ds-strategy estimate --params 46.7e9 --world-size 16 --stage 3 --no-offload",
    "estimate MoE on 8": "ds-strategy estimate --params 46.7e9 --world-size 8 --stage 3",
}


def estimate_output(command: str) -> str:
    """``command`` (a ``ds-strategy estimate ...`` line) and what it prints: its heading line and its table."""
    import contextlib
    import io
    import shlex

    from ds_strategy.cli import main as cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli(shlex.split(command)[1:]) == 0, command
    return f"```shell\n{command}\n```\n\n{printed.getvalue().strip()}"


def zero_config_reference() -> str:
    """Every ZeroConfig field as a heading of its own (``#stage`` finds it), with its type, default and meaning,
    under the heading of its section (``setting(section=...)``), in declaration order."""
    import dataclasses

    from ds_strategy.config import ZeroConfig
    from ds_strategy.config.zero_config import shown_default

    lines, section = [], None
    for field in dataclasses.fields(ZeroConfig):
        if field.metadata["section"] is not section:
            section = field.metadata["section"]
            title, _, gloss = _markdown(section.title).rstrip(":").partition(" (")
            lines += [f"### {title}", ""] + ([f"({gloss}", ""] if gloss else [])
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        lines += [f"#### `{field.name}`", "", f"`{kind}`, default {_markdown(shown_default(field))}", ""]
        lines += [_markdown(field.metadata["doc"]), ""]
    return "\n".join(lines).strip()


def _markdown(text: str) -> str:
    """A docstring's reST literals (````x````) as Markdown code spans."""
    return text.replace("``", "`")


def generated() -> dict[str, str]:
    """Each generated block's content by its name."""
    from ds_strategy.cli.config_table import blocks

    return {
        **blocks(),
        "notes index": notes_index(),
        "composition matrix table": composition_matrix_table(),
        "zero config reference": zero_config_reference(),
        **{name: estimate_output(command) for name, command in ESTIMATES.items()},
    }


def main() -> int:
    from ds_strategy.cli.config_table import update_blocks

    missing = update_blocks([DOCS], generated())
    for name in missing:
        print(f"{__file__}: no page of docs/ holds <!-- begin: {name} --> ... <!-- end: {name} -->")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
