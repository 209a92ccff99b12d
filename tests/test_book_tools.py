"""The book's own tools: the kernel-free explorer (chapters/_book.py) and the
landing page's generated answer (docs/make_landing.py)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


book = _load("_book", ROOT / "chapters" / "_book.py")


def _draw(a, b):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, a * b])
    ax.set_ylim(0, 6)
    return fig


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_explorer_frames_and_controls(fmt):
    ex = book.explorer(_draw, {"a": [1, 2], "b": [1.0, 2.0, 3.0]}, alt="a={a}, b={b}",
                       default={"b": 2.0}, fmt=fmt)
    bundle = ex._repr_mimebundle_()
    html = bundle["text/html"]
    assert set(bundle) == {"text/html", "image/png", "text/plain"}
    assert len(ex.frames) == 6
    imgs = re.findall(r"<img [^>]*>", html)
    assert len(imgs) == 6
    visible = [i for i in imgs if " hidden" not in i]
    assert len(visible) == 1 and 'data-rr-key="0,1"' in visible[0]  # a=1, b=2.0
    assert 'alt="a=1, b=2"' in visible[0]  # the label the reader sees
    assert html.count('type="range"') == 2 and 'max="2"' in html
    assert f"data:image/{'svg+xml,' if fmt == 'svg' else 'png;base64,'}" in html
    assert "<script>" in html and not re.search(r'(src|href)="https?:', html)  # self-contained
    assert bundle["image/png"]  # what the PDF prints


def test_explorer_rejects_bad_grid():
    with pytest.raises(ValueError, match="at least one value"):
        book.explorer(_draw, {"a": [], "b": [1]}, alt="")
    with pytest.raises(ValueError, match="not in grid"):
        book.explorer(_draw, {"a": [1], "b": [1]}, alt="", default={"c": 1})
    with pytest.raises(ValueError, match="fmt"):
        book.explorer(_draw, {"a": [1], "b": [1]}, alt="", fmt="gif")


def test_explorer_shows_titles_and_labels_not_identifiers():
    ex = book.explorer(_draw, {"a": [1, 2], "b": [1.0]}, alt="{a} at {b}",
                       titles={"a": "λ"}, labels={"a": {1: "one", 2: "two"}})
    html = ex.to_html()
    assert "<label>λ <input" in html and "<label>b <input" in html
    assert "<output>one</output>" in html and "&quot;two&quot;" in html
    assert 'alt="one at 1"' in html
    with pytest.raises(ValueError, match=r"labels\['a'\] has no text for the values \[2\]"):
        book.explorer(_draw, {"a": [1, 2]}, alt="", labels={"a": {1: "one"}})
    with pytest.raises(ValueError, match="titles names parameters not in grid"):
        book.explorer(_draw, {"a": [1]}, alt="", titles={"z": "zed"})
    with pytest.raises(ValueError, match="dpi must be at least 200"):
        book.explorer(_draw, {"a": [1]}, alt="", fmt="png", dpi=100)


def _cells(markdown: str) -> list[list[str]]:
    from markdown_it import MarkdownIt

    rows: list[list[str]] = []
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    for i, t in enumerate(tokens):
        if t.type == "tr_open":
            rows.append([])
        elif t.type == "inline" and rows and tokens[i - 1].type in ("th_open", "td_open"):
            rows[-1].append(t.content)
    return rows


def test_table_escapes_pipes_in_text_math_and_code():
    t = book.table(["variant", r"$\max|e_{ij}|$", "note"],
                   [["dot", 10.0, "P @ [V | 1]"], ["`a | b`", 3.25, r"already \| escaped"]],
                   fmt={1: ".1f"})
    assert _cells(t.data) == [["variant", r"$\max|e_{ij}|$", "note"],
                              ["dot", "10.0", "P @ [V | 1]"],
                              ["`a | b`", "3.2", "already | escaped"]]
    assert t.data.splitlines()[1] == "|---|---:|---|"  # numbers right-aligned


def test_table_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"rows\[1\] has 1 cells, the header 2"):
        book.table(["a", "b"], [[1, 2], [3]])
    with pytest.raises(ValueError, match="line break"):
        book.table(["a"], [["x\ny"]])
    with pytest.raises(ValueError, match="align needs one of l, c, r per column"):
        book.table(["a", "b"], [[1, 2]], align="r")


def test_landing_answer_matches_the_result_file():
    """The committed sentences are what docs/make_landing.py computes now."""
    landing = _load("make_landing", ROOT / "docs" / "make_landing.py")
    committed = (ROOT / "docs" / "landing" / "answer.md").read_text()
    assert committed == landing.answer_text(landing.load()), (
        "docs/landing/answer.md is stale: run `.venv/bin/python docs/make_landing.py`")
    for name in ("rank_collapse.svg", "rank_collapse.pdf"):
        assert (ROOT / "docs" / "landing" / name).stat().st_size > 0


def test_portable_rounds_floats_only():
    import numpy as np
    import torch

    assert book.portable(0.33497680561673027) == 0.334977
    assert book.portable(2.9999791283548087, 3) == 3.0
    assert book.portable(np.float64(1164.5276621634796)) == 1164.53
    assert book.portable(torch.tensor(2.919137477874756e-05)) == 2.91914e-05
    assert book.portable(np.array(0.25)) == 0.25
    for same in (7, True, "text", None):
        assert book.portable(same) is same
    vec = np.arange(3.0)
    assert book.portable(vec) is vec  # not a scalar: unchanged


def _glued_numbers(nb: dict):
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("data", {}).get("application/papermill.record/text/plain")
            if text is not None:
                yield out.get("metadata", {}).get("scrapbook", {}).get("name"), "".join(text)


def test_stored_glued_floats_are_portable():
    """Every float a chapter glues is stored at six significant digits or fewer.

    nbval compares the stored text of a glued number with a fresh run's, so a
    float glued with all its digits fails on a CPU whose kernels round
    differently (chapters/_book.py's glue rounds; CONTRIBUTING.md, "Cells
    that pass on every CPU").
    """
    import json

    number = re.compile(r"-?\d+\.\d+(e[-+]?\d+)?")
    long = []
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        for name, text in _glued_numbers(json.loads(path.read_text())):
            if number.fullmatch(text):
                mantissa = text.split("e")[0].replace("-", "").replace(".", "").lstrip("0")
                if len(mantissa) > 6:
                    long.append(f"{path.name}: {name} = {text}")
    assert not long, "glued with more digits than any CPU reproduces:\n" + "\n".join(long)
