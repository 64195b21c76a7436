"""mkdocs hooks: the repository's sources as pages of the site, and the pages' references to them as links.

The site is built from the clone, so it can carry the code it talks about, at the same commit, without knowing where
the repository is hosted:

* every file a page names in a code span (```` `ds_strategy/zero/engine.py` ````, or a path under ``ds_strategy/``
  written from there, ```` `config/plan.py` ````) that git tracks becomes a link to ``source/<path>/``, a page showing
  the file with numbered lines (generated here, kept out of the nav and of search);
* every ``Note: [Title]`` a page mentions links to the line of the source page where that Note is written (the
  index of ``tests/support/docs_blocks.py`` finds them), so a reader follows a reference to the invariant itself;
* reST roles the API reference shows verbatim (``:class:`ZeroEngine```) lose the role.

``mkdocs.yml`` names this file under ``hooks:`` and leaves ``docs/hooks/`` out of the site (``exclude_docs``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

REPO = Path(__file__).resolve().parents[2]
SOURCE = "source"
# a path in a code span: `benchmarks/runner.py`
CODE_PATH = re.compile(r"`(?P<path>[\w.-]+(?:/[\w.-]+)+)`")
# a code span (a path, or other code; `linked` when it already is a link's text), or a Note outside code spans
# a row of the Notes index (docs/design/notes.md): | Title | `file` |
INDEX_ROW = re.compile(r"^\| (?P<title>[^|`]+?) \| `(?P<path>[^`]+)` \|$", re.M)
SPAN_OR_NOTE = re.compile(
    r"(?P<linked>\[)?(?P<code>`(?:(?P<path>[\w.-]+(?:/[\w.-]+)+)|[^`\n]+)`)|Note: \[(?P<note>[^\]]+)\]"
)
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):(?=<code>)")
LINE_ANCHOR = re.compile(r'id="(__codelineno-0-\d+)"')
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LANGUAGES = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml", ".md": "markdown"}


@cache
def tracked() -> frozenset[str]:
    """The repository's files, as git tracks them (every file under the folders sources live in, without git)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        roots = ("ds_strategy", "kernels", "configs", "benchmarks", "examples", "tests")
        return frozenset(
            p.relative_to(REPO).as_posix() for root in roots for p in (REPO / root).rglob("*") if p.is_file()
        )
    return frozenset(listed.splitlines())


@cache
def note_lines() -> dict[tuple[str, str], int]:
    """Each Note's (title, file) -> the line its header is on, in the index's order (the first of a title first)."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    try:
        from docs_blocks import notes
    finally:
        sys.path.pop(0)
    found = {}
    for title, path in notes():
        lines = (REPO / path).read_text(encoding="utf-8").splitlines()
        found[title, path] = next(i for i, text in enumerate(lines, 1) if f"Note: [{title}]" in text)
    return found


def note_line(title: str, path: str | None = None) -> tuple[str, int] | None:
    """Where the Note of this title is written (in ``path``, when given; else the first file that holds one)."""
    return next(
        ((file, line) for (name, file), line in note_lines().items() if name == title and path in (None, file)), None
    )


def source_file(path: str) -> str | None:
    """The tracked file a code span names, as a path from the repository root, or None."""
    for candidate in (path, f"ds_strategy/{path}"):
        if candidate in tracked() and Path(candidate).suffix in LANGUAGES:
            return candidate
    return None


def source_page(path: str, here: str) -> str:
    """The link from the page whose source is ``here`` to ``path``'s page, as a link to its Markdown file, which
    mkdocs resolves (and checks) like any link between pages."""
    return get_relative_url(f"{SOURCE}/{path}.md", here)


def linked_sources() -> set[str]:
    """The files pages link to: those named in the pages' code spans, and those holding a Note."""
    named = set()
    for page in (REPO / "docs").rglob("*.md"):
        for match in CODE_PATH.finditer(page.read_text(encoding="utf-8")):
            named.add(source_file(match["path"]))
    return (named - {None}) | {path for _, path in note_lines()}


def on_files(files: Files, config) -> Files:
    """A page per file the pages link to, its lines numbered and anchored (``#__codelineno-0-LINE``)."""
    for path in sorted(linked_sources()):
        text = (REPO / path).read_text(encoding="utf-8", errors="replace")
        fence = "````" if "```" in text else "```"
        content = (
            f"---\nsearch:\n  exclude: true\n---\n\n# `{path}`\n\n"
            f'{fence}{LANGUAGES[Path(path).suffix]} linenums="1"\n{text}\n{fence}\n'
        )
        files.append(File.generated(config, f"{SOURCE}/{path}.md", content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri.startswith(f"{SOURCE}/"):
        return markdown
    here = page.file.src_uri
    pieces, last = [], 0
    for fence in FENCE.finditer(markdown):  # code blocks stay as written
        pieces += [_link(markdown[last : fence.start()], here), fence.group(0)]
        last = fence.end()
    pieces.append(_link(markdown[last:], here))
    return "".join(pieces)


def _link(text: str, here: str) -> str:
    """Code spans naming a source file become links to it, Notes outside code spans and the Notes index's titles
    links to their line."""
    text = INDEX_ROW.sub(lambda row: _index_row(row, here), text)

    def linked(match: re.Match) -> str:
        if match["code"] is None:
            return _note_link(match["note"], here) or match.group(0)
        path = match["path"] and source_file(match["path"])
        if path is None or match["linked"]:
            return match.group(0)
        return f"[{match['code']}]({source_page(path, here)})"

    return SPAN_OR_NOTE.sub(linked, text)


def _index_row(row: re.Match, here: str) -> str:
    found = note_line(row["title"].replace("/", "|"), row["path"])
    if found is None:
        return row.group(0)
    url = f"{source_page(found[0], here)}#__codelineno-0-{found[1]}"
    return f"| [{row['title']}]({url}) | `{row['path']}` |"


def _note_link(title: str, here: str) -> str | None:
    found = note_line(title)
    if found is None:
        return None
    path, line = found
    return f"[Note: \\[{title}\\]]({source_page(path, here)}#__codelineno-0-{line})"


def on_page_content(html: str, page, config, files) -> str:
    if page.file.src_uri.startswith(f"{SOURCE}/"):
        # the line anchors are the highlighter's, in HTML mkdocs stashed away from its anchor scan: told here, so
        # that a link to a line is checked against the lines that exist
        page.present_anchor_ids |= set(LINE_ANCHOR.findall(html))
    return ROLE.sub("", html)
