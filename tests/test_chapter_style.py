"""What a reader of the built book sees, checked in the chapter sources.

* Code fits the column: every line of every code cell is at most 80
  characters (the text column shows about 80 characters of code at 1280 px,
  and folded code is shown at the same width when unfolded).
* Checking and table-building code is folded: a visible code cell builds no
  table and holds at most a few asserts (a check that teaches something);
  longer checks carry ``hide-input``/``hide-cell`` (CONTRIBUTING.md).
* No Markdown table is broken: a hand-written table has as many cells in
  every row as in its header, and no paragraph starts with ``|`` (a table
  that did not parse, usually because of a bare ``|`` inside a cell).
* Exercises are one style: every "Exercises" section is made of
  ``{exercise}`` boxes, each followed by its ``{solution}`` behind a toggle.
* The text speaks of the book as it is: no edition history.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("*.ipynb"))
PAGES = sorted(CHAPTERS.glob("*.md"))
MAX_LINE = 80
MAX_VISIBLE_ASSERTS = 3
HIDDEN = {"hide-input", "hide-cell", "remove-cell", "remove-input"}
HISTORY = re.compile(r"previous edition|first version of this book|earlier version of this|"
                     r"earlier edition|previous version of this|this edition", re.I)


def _nb(path: Path) -> dict:
    return json.loads(path.read_text())


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _markdown_sources() -> list[tuple[str, str]]:
    out = [(p.name, p.read_text()) for p in PAGES]
    for nb in NOTEBOOKS:
        out += [(f"{nb.name} cell {i}", _source(c)) for i, c in enumerate(_nb(nb)["cells"])
                if c["cell_type"] == "markdown"]
    return out


def _documents() -> list[tuple[str, str]]:
    """Each page's Markdown as one text (a section may span several cells)."""
    out = [(p.name, p.read_text()) for p in PAGES]
    out += [(nb.name, "\n\n".join(_source(c) for c in _nb(nb)["cells"] if c["cell_type"] == "markdown"))
            for nb in NOTEBOOKS]
    return out


def test_chapters_found():
    assert len(NOTEBOOKS) >= 12 and PAGES


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_code_lines_fit_the_column(nb):
    long = []
    for i, cell in enumerate(_nb(nb)["cells"]):
        if cell["cell_type"] != "code" or "remove-cell" in cell.get("metadata", {}).get("tags", []):
            continue
        long += [f"cell {i}: {len(line)} chars: {line[:60]}..."
                 for line in _source(cell).splitlines() if len(line) > MAX_LINE]
    assert not long, f"{len(long)} code lines over {MAX_LINE} characters:\n" + "\n".join(long[:20])


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_checks_and_table_builders_are_folded(nb):
    bad = []
    for i, cell in enumerate(_nb(nb)["cells"]):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] != "code" or tags & HIDDEN:
            continue
        src = _source(cell)
        if re.search(r"\b(Markdown|table)\(", src):
            bad.append(f"cell {i} builds a table in view (fold it: hide-input)")
        asserts = len(re.findall(r"^\s*assert\b", src, re.M))
        if asserts > MAX_VISIBLE_ASSERTS:
            bad.append(f"cell {i} shows {asserts} asserts (fold it: hide-cell, or keep "
                       f"the {MAX_VISIBLE_ASSERTS} that teach)")
    assert not bad, "\n".join(bad)


def _tables_and_paragraphs(text: str):
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    tables, paragraphs, cells = [], [], None
    for i, t in enumerate(tokens):
        if t.type == "table_open":
            cells = []
        elif t.type == "tr_open" and cells is not None:
            cells.append(0)
        elif t.type in ("th_open", "td_open"):
            cells[-1] += 1
        elif t.type == "table_close":
            tables.append(cells)
            cells = None
        elif t.type == "inline" and tokens[i - 1].type == "paragraph_open":
            paragraphs.append(t.content)
    return tables, paragraphs


def test_markdown_tables_are_intact():
    bad = []
    for where, text in _markdown_sources():
        # MyST directives and math are not Markdown paragraphs a reader sees as text.
        text = re.sub(r"^(```|:::).*?^\1\s*$", "", text, flags=re.S | re.M)
        text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
        tables, paragraphs = _tables_and_paragraphs(text)
        bad += [f"{where}: a table with rows of {sorted(set(t))} cells" for t in tables
                if len(set(t)) > 1]
        bad += [f"{where}: a paragraph starts with '|': {p[:70]!r}" for p in paragraphs
                if p.lstrip().startswith("|")]
    assert not bad, "\n".join(bad)


def test_exercises_are_boxes_with_solutions():
    bad = []
    for where, text in _documents():
        m = re.search(r"^#+ Exercises\s*$", text, re.M)
        if not m:
            continue
        section = text[m.end():]
        nxt = re.search(r"^#{1,2} ", section, re.M)
        section = section[:nxt.start()] if nxt else section
        exercises = len(re.findall(r"^(```+|:::+)\{exercise\}", section, re.M))
        solutions = len(re.findall(r"^(```+|:::+)\{solution\}", section, re.M))
        if exercises == 0:
            bad.append(f"{where}: exercises are not {{exercise}} boxes")
        elif solutions != exercises:
            bad.append(f"{where}: {exercises} exercises, {solutions} solutions")
    assert not bad, "\n".join(bad)


def test_no_edition_history_in_the_text():
    bad = [f"{where}: {m.group(0)!r}" for where, text in _markdown_sources()
           for m in HISTORY.finditer(text)]
    assert not bad, "edition history belongs in CHANGELOG.md:\n" + "\n".join(bad)


def _fenced_code(text: str) -> list[str]:
    return re.findall(r"^```(?:python|bash|py)?\n(.*?)^```", text, re.S | re.M)


def test_code_in_pages_fits_the_column():
    pages = sorted(CHAPTERS.rglob("*.md"))
    long = [f"{p.relative_to(ROOT)}: {len(line)} chars: {line[:60]}..."
            for p in pages for block in _fenced_code(p.read_text())
            for line in block.splitlines() if len(line) > MAX_LINE]
    assert not long, "\n".join(long)


def test_api_page_examples_run():
    """Each API page opens with a runnable example: it must run as printed."""
    for page in sorted((CHAPTERS / "api").glob("*.md")):
        ns: dict = {}
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
            exec(compile(block, str(page), "exec"), ns)  # noqa: S102 - the book's own example


def _split_row(line: str) -> list[str]:
    return re.split(r"(?<!\\)\|", line.strip().strip("|"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_tables_printed_by_cells_keep_their_cells(nb):
    """A row with more cells than its header loses the extra ones without a word."""
    bad = []
    for i, cell in enumerate(_nb(nb)["cells"]):
        for out in cell.get("outputs", []):
            text = out.get("data", {}).get("text/markdown")
            if not text:
                continue
            text = "".join(text) if isinstance(text, list) else text
            block: list[str] = []
            for line in text.splitlines() + [""]:
                if line.lstrip().startswith("|"):
                    block.append(line)
                    continue
                if len(block) >= 2:
                    widths = [len(_split_row(r)) for r in block]
                    if len(set(widths)) > 1:
                        bad.append(f"cell {i}: rows of {widths} cells: {block[0][:60]}")
                block = []
    assert not bad, "\n".join(bad)
