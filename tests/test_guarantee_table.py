"""docs/guarantees.md's table "Which test checks each guarantee" stays true.

Every test it names (``file.py::test_name``) exists as a test function in ``tests/``, so a test
renamed or removed fails here until the table follows it; every row names a test or says "none
yet"; and every section of the page that makes promises (those from "Exactly once per epoch" up to
"What is not guaranteed", with text of their own) is linked from at least one row.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PAGE = ROOT / "docs" / "guarantees.md"
TABLE = "Which test checks each guarantee"
FIRST, NOT_PROMISED = "Exactly once per epoch", "What is not guaranteed"
CITATION = re.compile(r"`(\w+\.py)::(\w+)`")


def slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) make of a heading: tests/test_docs.py's rule."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def sections(text: str) -> list[tuple[str, str]]:
    """Every ``##`` and ``###`` heading of ``text`` (outside code blocks) with its own text, up to
    the next heading of any level."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    parts = re.split(r"^(#{1,6} .+?)\s*$", text, flags=re.M)
    out = []
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        level, title = heading.split(" ", 1)
        if len(level) in (2, 3):
            out.append((title, body))
    return out


def table_rows() -> list[list[str]]:
    """The cells of the table's rows (its header and separator left out)."""
    body = dict(sections(PAGE.read_text()))[TABLE]
    rows = []
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("|") or re.fullmatch(r"\|[-|: ]+\|", line):
            continue
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    assert rows and rows[0][0] == "Guarantee", f"{PAGE.name}: the table under '## {TABLE}' has no header row"
    return rows[1:]


def collected_tests() -> dict[str, set[str]]:
    """The test functions of every ``tests/*.py``, at module level or in a class, as pytest collects them."""
    found = {}
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
        found[path.name] = {
            n.name
            for body in scopes
            for n in body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
        }
    return found


def promise_sections() -> list[str]:
    """The headings of the sections that make promises: from FIRST up to NOT_PROMISED, with text of
    their own (a heading directly followed by its subsections makes none itself)."""
    found = sections(PAGE.read_text())
    titles = [title for title, _ in found]
    assert FIRST in titles and NOT_PROMISED in titles, f"{PAGE.name} lacks '{FIRST}' or '{NOT_PROMISED}'"
    between = found[titles.index(FIRST) : titles.index(NOT_PROMISED)]
    return [title for title, body in between if title != TABLE and body.strip()]


def test_every_cited_test_exists():
    tests = collected_tests()
    cited = [m.groups() for row in table_rows() for m in CITATION.finditer(row[1])]
    assert len(cited) > 100, f"found only {len(cited)} tests named in the table: is it still parsed?"
    missing = sorted({f"{file}::{name}" for file, name in cited if name not in tests.get(file, set())})
    assert not missing, (
        f"docs/guarantees.md, '## {TABLE}', names tests that tests/ does not have (renamed or removed? "
        "put the new name in the table):\n  " + "\n  ".join(missing)
    )


def test_every_row_names_a_test_or_says_none_yet_and_links_its_section():
    anchors = {slug(title) for title in promise_sections()}
    problems = []
    for row in table_rows():
        if len(row) != 3:
            problems.append(f"{len(row)} cells, not 3: {row}")
            continue
        guarantee, checked, _ = row
        if not CITATION.search(checked) and not re.match(r"none yet|a cost, measured", checked.lower()):
            problems.append(f"names no test and says neither 'none yet' nor 'a cost, measured': {guarantee}")
        links = re.findall(r"\]\(#([^)]+)\)", guarantee)
        if not links or not set(links) <= anchors:
            problems.append(f"links no section of the page that makes promises ({links}): {guarantee}")
    assert not problems, f"docs/guarantees.md, '## {TABLE}':\n  " + "\n  ".join(problems)


def test_every_section_that_makes_promises_is_in_the_table():
    linked = {a for row in table_rows() for a in re.findall(r"\]\(#([^)]+)\)", row[0])}
    promising = promise_sections()
    assert len(promising) >= 14, promising  # the page's sections, and the parsing that finds them
    missing = [title for title in promising if slug(title) not in linked]
    assert not missing, f"docs/guarantees.md: sections with no row in '## {TABLE}': {missing}"
