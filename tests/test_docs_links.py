"""The repository's documents point only at things the repository has: every relative Markdown link
resolves to a file (and, with ``#anchor``, to one of its headings), every ``docs/*.md`` a source
file or document names exists, and a document named without its directory is one of ours."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: directories that hold no documents of ours, besides hidden ones (``.git``, virtual environments such as
#: ``.venv``, caches)
SKIPPED = {"site-packages", "node_modules", "build", "dist", "__pycache__"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_NAME = re.compile(r"\bdocs/[\w-]+\.md\b")
#: a document named without its directory, as a README names its neighbours
BARE_NAME = re.compile(r"(?<![\w/.-])([A-Za-z][\w-]*\.md)\b")


def _files(*suffixes: str) -> list[Path]:
    found = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and name not in SKIPPED]
        found += [Path(folder) / name for name in names if Path(name).suffix in suffixes]
    return sorted(found)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # commands, not links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z+.-]*:", target)]


def test_the_slug_rule_matches_githubs():
    assert _slug(" Notation and layer ids") == "notation-and-layer-ids"
    assert _slug(" D-PACE") == "d-pace"
    assert _slug(" `specforge run`: what it does, step by step") == "specforge-run-what-it-does-step-by-step"


def test_the_checks_see_the_documents():
    names = {path.relative_to(ROOT).as_posix() for path in _files(".md")}
    assert {"README.md", "docs/algorithms.md", "docs/benchmarks.md", "plugins/dflash/README.md"} <= names


@pytest.mark.parametrize("document", _files(".md"), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(document: Path):
    broken = []
    for target in _links(document):
        where, _, anchor = target.partition("#")
        path = (document.parent / where).resolve() if where else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_named_documents_exist():
    missing = set()
    for path in _files(".md", ".py", ".tmpl", ".toml"):
        for name in DOCS_NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            if not (ROOT / name).exists():
                missing.add(f"{path.relative_to(ROOT)} names {name}")
    assert not missing, sorted(missing)


def test_documents_named_bare_are_ours():
    ours = {path.name for path in _files(".md")}
    foreign = set()
    for path in _files(".md", ".py", ".tmpl", ".toml"):
        for name in BARE_NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            if name not in ours:
                foreign.add(f"{path.relative_to(ROOT)} names {name}")
    assert not foreign, sorted(foreign)
