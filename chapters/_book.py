"""Figures that move without a kernel: precomputed frames behind sliders.

An ipywidgets explorer needs a running Python kernel; in the static book its
sliders move while its plot stays put. :func:`explorer` instead draws the
figure once for every point of a small grid of parameter values and returns
one self-contained HTML block: a slider per parameter and the frames as
embedded SVG (or PNG) images, switched by a few lines of inline JavaScript. It needs no
kernel, no network and no file beside the page, so the cell's stored output
works in the built book, under ``file://`` and in Jupyter alike.

Use it from a chapter (the notebooks run from ``chapters/``, so this module
imports as ``_book`` under nbval, ``dev.py execute``, Binder and the Colab
bootstrap cell)::

    from _book import explorer, glue

    def draw(side, strength):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ...
        return fig

    glue("fig-explore", explorer(draw, {"side": ["key", "query", "mean"],
                                        "strength": [0.25, 1, 4]},
                                 alt="Residual against depth, {side}-side metric, "
                                     "strength {strength}"), display=False)

and in a Markdown cell ``{glue:figure} fig-explore`` with a caption and a
``:name:``, as for any other figure (CONTRIBUTING.md). The output also carries
the default frame as ``image/png``, which is what the PDF prints.

Keep grids small (every frame is in the page): about 10 to 30 frames of a
6.4-inch figure; SVG frames of a line plot are about 30 kB each (5 kB as the
site serves them, gzipped), palette PNG frames 20 to 40 kB.
"""
from __future__ import annotations

import base64
import html
import io
import itertools
import json
from urllib.parse import quote
from typing import Callable, Mapping, Sequence

__all__ = ["explorer", "Explorer", "glue", "portable", "table"]

# One delegated listener per page, installed by the first explorer's script;
# each explorer finds its frames from its own DOM (no ids, no currentScript).
_SCRIPT = """<script>(function () {
  if (window.rrExplorerReady) return;
  window.rrExplorerReady = true;
  function update(root) {
    var sliders = root.querySelectorAll("input[data-rr-dim]");
    var key = [];
    sliders.forEach(function (s) {
      var labels = JSON.parse(s.getAttribute("data-rr-labels"));
      var out = s.parentElement.querySelector("output");
      if (out) out.textContent = labels[+s.value];
      s.setAttribute("aria-valuetext", labels[+s.value]);
      key.push(s.value);
    });
    key = key.join(",");
    root.querySelectorAll("img[data-rr-key]").forEach(function (img) {
      img.hidden = img.getAttribute("data-rr-key") !== key;
    });
  }
  document.addEventListener("input", function (e) {
    var root = e.target.closest && e.target.closest(".rr-explorer");
    if (root && e.target.hasAttribute("data-rr-dim")) update(root);
  });
})();</script>"""

_STYLE = (
    "<style>.rr-explorer{margin:0.5rem 0}"
    ".rr-explorer-controls{display:flex;flex-wrap:wrap;gap:0.25rem 1.5rem;"
    "font-size:0.9rem;margin-bottom:0.25rem}"
    ".rr-explorer-controls label{display:flex;align-items:center;gap:0.5rem}"
    ".rr-explorer-controls input{width:9rem}"
    ".rr-explorer-controls output{min-width:3rem;font-variant-numeric:tabular-nums}"
    ".rr-explorer img{display:block;width:100%;max-width:100%;height:auto}"
    ".rr-explorer img[hidden]{display:none!important}</style>"
)


def _svg_uri(fig) -> str:
    """The figure as an SVG data URI (percent-encoded, so it gzips well)."""
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "rr-explorer"}):  # reproducible ids
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return "data:image/svg+xml," + quote(buf.getvalue().decode(), safe=" /=:;,.-_()'!*~@")


def _png(fig, dpi: int, colors: int | None) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    if not colors:
        return buf.getvalue()
    from PIL import Image  # matplotlib depends on Pillow

    img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=colors, dither=Image.Dither.NONE).save(out, format="PNG", optimize=True)
    return out.getvalue()


class Explorer:
    """The frames and their HTML; displays as the interactive block.

    Attributes
    ----------
    names : list of str
        Parameter names, one slider each, in the order given.
    values : list of list
        The grid of each parameter.
    frames : dict
        ``(i, j, ...)`` index tuple -> the frame as a data URI (SVG or PNG).
    default : tuple of int
        Index of the frame shown first.
    default_png : bytes
        The default frame as PNG: what the PDF (and nbconvert) prints.
    """

    def __init__(self, names, values, frames, default, default_png, alt, width_px,
                 titles=None, shown=None):
        self.names, self.values, self.frames = names, values, frames
        self.default, self.default_png = default, default_png
        self.alt, self.width_px = alt, width_px
        # What the reader sees: a title per slider, a label per value.
        self.titles = titles or {n: n for n in names}
        self.shown = shown or [[_label(v) for v in vals] for vals in values]

    def _alt(self, idx) -> str:
        params = {n: s[i] for n, s, i in zip(self.names, self.shown, idx)}
        return self.alt.format(**params)

    def to_html(self) -> str:
        parts = ['<div class="rr-explorer">', _STYLE, '<div class="rr-explorer-controls">']
        for dim, (name, labels) in enumerate(zip(self.names, self.shown)):
            parts.append(
                f'<label>{html.escape(self.titles[name])} <input type="range" min="0" '
                f'max="{len(labels) - 1}" '
                f'step="1" value="{self.default[dim]}" data-rr-dim="{dim}" '
                f"data-rr-labels='{html.escape(json.dumps(labels, ensure_ascii=False), quote=True)}' "
                f'aria-valuetext="{html.escape(labels[self.default[dim]])}">'
                f"<output>{html.escape(labels[self.default[dim]])}</output></label>")
        parts.append("</div>")
        for idx, uri in self.frames.items():
            hidden = "" if idx == self.default else " hidden"
            parts.append(
                f'<img data-rr-key="{",".join(map(str, idx))}"{hidden} width="{self.width_px}" '
                f'alt="{html.escape(self._alt(idx), quote=True)}" src="{uri}">')
        parts += [_SCRIPT, "</div>"]
        return "\n".join(parts)

    def _repr_mimebundle_(self, include=None, exclude=None):
        summary = ", ".join(f"{n}: {len(v)} values" for n, v in zip(self.names, self.values))
        return {
            "text/html": self.to_html(),
            "image/png": base64.b64encode(self.default_png).decode(),
            "text/plain": f"<explorer: {len(self.frames)} frames ({summary})>",
        }


def _label(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def explorer(draw: Callable[..., object], grid: Mapping[str, Sequence], *, alt: str,
             default: Mapping[str, object] | None = None, fmt: str = "svg",
             dpi: int = 200, colors: int | None = 64,
             titles: Mapping[str, str] | None = None,
             labels: Mapping[str, Mapping[object, str]] | None = None) -> Explorer:
    """Draw ``draw(**params)`` for every point of ``grid``; sliders switch frames.

    Parameters
    ----------
    draw : callable
        Returns a matplotlib figure for one combination of keyword arguments;
        the figure is closed after it is saved. Frames fill the text column
        (about 690 px), so size fonts for that: 5.6 inches wide with 11-point
        text stays legible on a 390 px phone. Give every frame the same
        ``figsize`` and fixed axis limits, so that only the data move.
    grid : mapping of str to sequence
        Parameter name -> the values its slider steps through.
    alt : str
        Alt text of each frame, a format string over the parameter names
        (``"... strength {strength}"``): what the frame shows, in words. The
        names are filled with the labels the reader sees (``labels``).
    default : mapping, optional
        The frame shown first and printed in the PDF (default: the first value
        of every parameter).
    fmt : {"svg", "png"}
        Format of the frames. SVG (default) is sharp at any size and small for
        line plots (about 30 kB a frame, 5 kB gzipped as the site serves it);
        PNG suits images and dense scatter plots.
    dpi : int
        Resolution of PNG frames (and of the PDF's default frame); at least
        200, so that a frame has twice the pixels of the column it fills and
        stays sharp on high-DPI screens.
    colors : int or None
        Reduce PNG frames to this many colours (a palette PNG, about a third of
        the size); None keeps full colour.
    titles : mapping of str to str, optional
        The title shown beside each slider (default: the parameter name).
        Readers see these, so write words and symbols (``"λ"``,
        ``"angle (degrees)"``), not identifiers.
    labels : mapping of str to mapping, optional
        Per parameter, value -> the text shown for it (``{"variant":
        {"rope-keys": "RoPE keys"}}``); every value of that parameter needs
        one. Default: the value itself (floats with ``:g``).

    Returns
    -------
    Explorer
        Displays as the interactive HTML block (``text/html``) with the default
        frame as ``image/png`` beside it.
    """
    names = list(grid)
    values = [list(grid[n]) for n in names]
    if not names or any(len(v) == 0 for v in values):
        raise ValueError(f"grid needs at least one value per parameter, got {dict(grid)!r}")
    default = default or {}
    unknown = set(default) - set(names)
    if unknown:
        raise ValueError(f"default names parameters not in grid: {sorted(unknown)}")
    if fmt not in ("svg", "png"):
        raise ValueError(f"fmt must be 'svg' or 'png', got {fmt!r}")
    if fmt == "png" and dpi < 200:
        raise ValueError(f"dpi must be at least 200 for PNG frames (twice the column's "
                         f"pixels, so frames stay sharp), got {dpi}")
    titles = dict(titles or {})
    if set(titles) - set(names):
        raise ValueError(f"titles names parameters not in grid: {sorted(set(titles) - set(names))}")
    labels = dict(labels or {})
    if set(labels) - set(names):
        raise ValueError(f"labels names parameters not in grid: {sorted(set(labels) - set(names))}")
    shown = []
    for n, vals in zip(names, values):
        if n in labels:
            missing = [v for v in vals if v not in labels[n]]
            if missing:
                raise ValueError(f"labels[{n!r}] has no text for the values {missing!r}")
            shown.append([str(labels[n][v]) for v in vals])
        else:
            shown.append([_label(v) for v in vals])
    import matplotlib.pyplot as plt

    start = tuple(v.index(default[n]) if n in default else 0 for n, v in zip(names, values))
    frames, width_px, default_png = {}, None, b""
    for idx in itertools.product(*(range(len(v)) for v in values)):
        fig = draw(**{n: v[i] for n, v, i in zip(names, values, idx)})
        width_px = width_px or round(fig.get_figwidth() * 100)
        if fmt == "svg":
            frames[idx] = _svg_uri(fig)
        else:
            frames[idx] = "data:image/png;base64," + base64.b64encode(_png(fig, dpi, colors)).decode()
        if idx == start:
            default_png = _png(fig, dpi, colors)
        plt.close(fig)
    return Explorer(names, values, frames, start, default_png, alt, width_px,
                    titles={n: titles.get(n, n) for n in names}, shown=shown)


def portable(value, digits: int = 6):
    """``value`` rounded to ``digits`` significant digits if it is a float (else unchanged).

    A float computed by torch or numpy differs in its last digits between CPUs
    (AVX-512, AVX2 and plain kernels sum in different orders), while the stored
    output of a notebook is compared as text by nbval. Six significant digits
    hold through round-off of about 1e-10 relative; a number that moves more
    than that from one kernel set to another (a fitted exponent, an error
    measured at round-off level, a training outcome) gets fewer digits, as
    many as its interval supports. numpy scalars and 0-d arrays or tensors
    become Python floats.
    """
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    return value


def glue(name: str, value, display: bool = True, *, digits: int = 6) -> None:
    """myst_nb's ``glue`` with floats stored at ``digits`` significant digits (:func:`portable`).

    The prose formats the number itself (``{glue:text}`name:.3f```); the
    stored value only has to carry the digits the prose shows, which are the
    digits the computation determines on every CPU. Figures and other objects
    are glued unchanged.
    """
    from myst_nb import glue as _glue

    _glue(name, portable(value, digits), display=display)


def _cell(value, fmt: str | None) -> str:
    text = format(value, fmt) if fmt and not isinstance(value, str) else str(value)
    if "\n" in text:
        raise ValueError(f"a table cell cannot hold a line break, got {text!r}")
    # A bare | ends the cell (also inside $...$ and `...`): escaped, it is a
    # character of the cell again, in math and code alike.
    return text.replace("\\|", "|").replace("|", "\\|")


def table(header: Sequence[str], rows: Sequence[Sequence], *, align: str | None = None,
          fmt: Mapping[int, str] | None = None):
    """A Markdown table that renders as the table it says: every ``|`` escaped.

    Parameters
    ----------
    header : sequence of str
        Column titles (Markdown and ``$math$`` allowed).
    rows : sequence of sequences
        One sequence per row, as many cells as ``header``; a cell is any
        value, formatted with ``fmt`` (by column index) or ``str``.
    align : str, optional
        One letter per column, ``l``, ``c`` or ``r`` (default: numbers right,
        text left, read from the first row).
    fmt : mapping of int to str, optional
        Column index -> format spec for non-string cells (``{2: ".2e"}``).

    Returns
    -------
    IPython.display.Markdown
        The table; displayed by a cell, the book renders it as an HTML table
        (``nb_render_markdown_format: myst``) and nbval compares its text.

    A ``|`` in a cell (``$\\max|e|$``, ``P @ [V | 1]``) would end the cell
    early and shift the rest of the row, or turn the table into text: here
    every ``|`` is escaped and the table is parsed once to check that each
    row has as many cells as the header.
    """
    from IPython.display import Markdown

    header = list(header)
    rows = [list(r) for r in rows]
    if not header:
        raise ValueError("header needs at least one column")
    for i, r in enumerate(rows):
        if len(r) != len(header):
            raise ValueError(f"rows[{i}] has {len(r)} cells, the header {len(header)}")
    if align is None:
        first = rows[0] if rows else [""] * len(header)
        align = "".join("r" if isinstance(v, (int, float)) and not isinstance(v, bool) else "l"
                        for v in first)
    if len(align) != len(header) or set(align) - set("lcr"):
        raise ValueError(f"align needs one of l, c, r per column ({len(header)}), got {align!r}")
    fmt = dict(fmt or {})
    rule = {"l": "---", "c": ":---:", "r": "---:"}
    lines = ["| " + " | ".join(_cell(h, None) for h in header) + " |",
             "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(v, fmt.get(j)) for j, v in enumerate(r)) + " |" for r in rows]
    text = "\n".join(lines)
    _check_table(text, len(header), len(rows))
    return Markdown(text)


def _check_table(text: str, columns: int, rows: int) -> None:
    """Parse ``text`` as the book does; raise unless it is one table of that shape."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:  # pragma: no cover - myst-nb depends on markdown-it-py
        return
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    kinds = [t.type for t in tokens]
    cells: list[int] = []
    for t in tokens:
        if t.type == "tr_open":
            cells.append(0)
        elif t.type in ("th_open", "td_open"):
            cells[-1] += 1
    if kinds.count("table_open") != 1 or len(cells) != rows + 1 or set(cells) != {columns}:
        raise ValueError(f"the table does not parse as {rows + 1} rows of {columns} cells: "
                         f"got rows of {cells}")
