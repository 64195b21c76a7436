"""The generated blocks of the documentation site, and the command that rewrites them.

A page of ``docs/`` holds a generated block between ``<!-- begin: NAME -->`` and ``<!-- end: NAME -->``:

* ``strategies table``, ``config table``, ``deepspeed table``: what ``ds-strategy config-table`` prints, from the
  strategy presets, ``ZeroConfig`` and the DeepSpeed key rules;
* ``notes index``: every ``Note: [Title]`` block in the code, with its file;
* ``composition matrix table``: the cells ``composition_runs`` runs and the configurations it checks are refused.

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
    from composition_runs import BF16_CELLS, REFUSED_CONFIGS, pairwise_cells

    lines = ["| entry point | layout | ZeRO stage | build |", "| --- | --- | --- | --- |"]
    for cell in [*pairwise_cells(), *BF16_CELLS]:
        build = cell.build if cell.precision == "32-true" else f"{cell.build} ({cell.precision})"
        lines.append(f"| {cell.entry} | {cell.layout} | {cell.stage} | {build} |")
    lines += ["", "Refused by design, whatever the entry point, each with an error naming the combination:", ""]
    for fields, words in REFUSED_CONFIGS:
        arguments = ", ".join(f"{name}={value!r}" for name, value in fields.items())
        lines.append(f'- `ZeroConfig({arguments})`: "{words}"')
    return "\n".join(lines)


def generated() -> dict[str, str]:
    """Each generated block's content by its name."""
    from ds_strategy.cli.config_table import blocks

    return {
        **blocks(),
        "notes index": notes_index(),
        "composition matrix table": composition_matrix_table(),
    }


def main() -> int:
    from ds_strategy.cli.config_table import update_blocks

    missing = update_blocks([DOCS], generated())
    for name in missing:
        print(f"{__file__}: no page of docs/ holds <!-- begin: {name} --> ... <!-- end: {name} -->")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
