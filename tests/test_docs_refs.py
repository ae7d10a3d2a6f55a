"""Every code reference ``path.py::Name`` / ``path.py::Class.method`` in the README and docs/ names a file of the
repository and a name defined in it (module-level def / class / assignment, or a method of that class), so the
documents follow the code when it moves."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "results" / "README.md"]
REF = re.compile(r"`([\w./-]+\.py)::([\w.]+)`")


def _defined(tree: ast.Module, dotted: str) -> bool:
    body = tree.body
    for part in dotted.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def _refs() -> list[tuple[str, str, str]]:
    out = []
    for doc in DOCS:
        if doc.exists():
            out += [(doc.relative_to(REPO).as_posix(), path, name) for path, name in REF.findall(doc.read_text())]
    return out


def test_the_documents_cite_code():
    assert len(_refs()) > 40  # method.md and metrics.md cite the code of every rule and metric


@pytest.mark.parametrize("doc, path, name", sorted(set(_refs())))
def test_code_reference_resolves(doc, path, name):
    file = REPO / path
    assert file.is_file(), f"{doc}: {path} does not exist"
    assert _defined(ast.parse(file.read_text()), name), f"{doc}: {path} defines no {name}"


def _anchors(md: Path) -> set[str]:
    """GitHub-style anchors of a page's headings (lower case, punctuation dropped, spaces → '-')."""
    heads = re.findall(r"^#+ (.+)$", md.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_docs_anchor_cited_by_the_code_exists():
    """``docs/<page>.md#<anchor>`` in stapo/, scripts/, configs/ and the entry points names a heading of that page."""
    missing, cited = [], 0
    files = [*(REPO / "stapo").rglob("*.py"), *(REPO / "scripts").rglob("*.py"), *(REPO / "configs").rglob("*.yaml"),
             REPO / "train.py", REPO / "evaluate.py"]
    for f in files:
        for page, anchor in re.findall(r"docs/([\w-]+\.md)#([\w-]+)", f.read_text()):
            cited += 1
            md = REPO / "docs" / page
            if not md.is_file() or anchor not in _anchors(md):
                missing.append(f"{f.relative_to(REPO)}: docs/{page}#{anchor}")
    assert cited > 50 and missing == []


def test_the_citation_map_points_at_the_citations():
    """docs/.citation_map.tsv (which files had a METHOD.md citation rewritten to a docs/ anchor): every row's file
    exists and holds the row's first new anchor, so a move that forgets the map fails here (the map named
    stapo/grader.py after grader.py had moved to stapo/tasks/). Files, not lines: an edit above a citation must
    not fail this."""
    rows = [line.split("\t") for line in (REPO / "docs" / ".citation_map.tsv").read_text().splitlines()[1:]]
    stale = []
    for path, _old, new in rows:
        anchor = new.split(",")[0].strip()  # docs/method.md#grading; inside docs/ written method.md#grading
        f = REPO / path
        text = f.read_text() if f.is_file() else ""
        if anchor not in text and anchor.removeprefix("docs/") not in text:
            stale.append(path)
    assert len(rows) > 80 and stale == []
