"""Sphinx extension with the book's small fixes to its toolchain.

1. Cross-references to package names, whatever path they are written with.
   The API reference documents the curated names where users import them
   (``riemannian_ref.riemannian_scores``, the names of ``riemannian_ref.__all__``;
   ``riemannian_ref.analysis.collapse_bound``, a subpackage's own published name),
   while docstrings and chapters write the defining module's path
   (``riemannian_ref.geometry.scores.riemannian_scores``), the alias
   (``rr.riemannian_scores``) or a bare name from another module
   (``LowRankMetric`` in a docstring of ``geodesics``). When such a Python
   reference finds no target, look the object up and retry with the
   curated name it is exported as (methods and attributes included), so the
   link lands on its entry in the API reference. A reference to a real
   object of the package that the reference does not document (a helper
   reached through its subpackage) renders as code, without a link; a name
   that exists nowhere still warns.

4. "Seen in": every entry of the API reference ends with the chapters that
   use the name (``rr.NAME`` in a chapter's source), found when the build
   starts, so the list cannot drift from the book.

2. Shapes in type fields stay text. Napoleon turns ``x : Tensor, shape
   [..., n, d]`` under an *Attributes* (or *Parameters*) heading into a type
   field, and Sphinx makes every word of it a class reference; under ``-n``
   each ``shape``, ``n`` or ``optional`` would be a warning. A reference from
   a docstring field whose target cannot be a class of ours (a lower-case
   word, a one-letter dimension, a phrase) is rendered as plain text. So are
   names from the standard library, which the offline build cannot link.
   A capitalised name that resolves nowhere (a typo, a class that moved)
   still warns.

3. One inline script per page. sphinx-thebe 0.3.1 (pulled in by Jupyter Book
   1.0.4) registers its inline configuration script, ``const THEBE_JS_URL =
   ...``, so that it appears twice on every page with Sphinx 7.4 (once with
   ``filename=None``, once with ``""``, so Sphinx's own de-duplication misses
   it); the second copy throws "Identifier 'THEBE_JS_URL' has already been
   declared" in every reader's console. Drop duplicates from each page's
   script list.

4. One search box. pydata-sphinx-theme 0.17 adds a full-width header bar
   holding a second search button unless ``navbar_persistent`` is set;
   sphinx-book-theme already has one in its sidebar (three boxes on the
   search page). Set here, not in _config.yml, because Jupyter Book replaces
   the whole ``html_theme_options`` (repository and launch buttons included)
   with whatever ``sphinx: config:`` gives.

5. The book's own CSS and JS on every page (files in assets/static/):
   ``rr-book.css`` (inline code wraps on a phone, figures fit the column,
   the note at frozen widgets) and ``rr-search.js`` (search snippets from
   the article text, deferred so it runs after Sphinx's searchtools.js).

6. No broken table reaches a reader. A Markdown table with a bare ``|``
   inside a cell (``$\\max|e|$``, ``P @ [V | 1]``) either splits the cell
   or stops parsing as a table and renders as a paragraph of pipes. Any
   paragraph that starts with ``|`` and reads like a table row is a warning
   (an error under ``-W``), in the chapters' text and in the Markdown their
   cells print. ``chapters/_book.table`` escapes the pipes.

7. The PDF link on the landing page exists only where the PDF does. The
   page says "Download the whole book as PDF" (a ``{raw} html`` block with
   class ``rr-pdf-link``); ``python3 dev.py pdf`` builds ``_build/latex/book.pdf``
   and then the HTML, which copies it beside the pages as
   ``riemannian-attention.pdf``. Without that file the link becomes a line
   saying how to build the PDF, so no build has a dead link. The landing page
   is re-read on every build so that the link follows the file.

8. The PDF has a book's structure (LaTeX builder only):
   * the landing page is one unnumbered front-matter chapter, "Preface"
     (its sections become run-in headings, not six chapters of one page);
   * the chapters the HTML book numbers are numbered, the rest (claims
     ledger, related work, API reference, bibliography) are not, so the
     introduction is chapter 1 in both;
   * folded cells stay out of print: a ``hide-input`` cell prints its output
     only, a ``hide-output`` cell its input only, a ``hide-cell`` cell nothing
     (the HTML book folds them behind a toggle).
"""
from __future__ import annotations

import importlib
import re
import shutil
import sys
import types
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging

LOGGER = logging.getLogger(__name__)
PDF_NAME = "riemannian-attention.pdf"  # beside the HTML; dev.py pdf builds it

PACKAGE = "riemannian_ref"
ALIASES = {PACKAGE, "rr"}  # `import riemannian_ref as rr` in every chapter
_NOT_A_CLASS = re.compile(r"^(?:[A-Za-z]|[a-z_]\w*|.*[^\w.].*)$")  # n, shape, int64, "a phrase"


def _lookup(target: str):
    """``riemannian_ref.X.Y``, ``rr.X.Y`` or a bare ``X.Y`` -> (object, attribute path) or None."""
    parts = target.lstrip("~.").split(".")
    if parts[0] in ALIASES:
        parts = parts[1:]
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        return None
    obj = pkg
    for name in parts:
        obj = getattr(obj, name, None)
        if obj is None:
            break
    if obj is not None:
        return obj, parts
    # a bare name defined in some subpackage (``LowRankMetric`` in a docstring)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith(PACKAGE + ".") and mod is not None and hasattr(mod, parts[0]):
            obj = mod
            for name in parts:
                obj = getattr(obj, name, None)
                if obj is None:
                    break
            if obj is not None:
                return obj, [*mod_name.split(".")[1:], *parts]
    return None


def _curated_path(obj, parts: list[str]) -> str | None:
    """The documented path of ``obj``: ``riemannian_ref.NAME[.member...]`` with NAME in ``__all__``, or
    ``riemannian_ref.SUBPACKAGE.NAME`` with NAME in that subpackage's ``__all__`` only."""
    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        return None
    curated = {id(getattr(pkg, n)): n for n in getattr(pkg, "__all__", ())}
    for sub, mod in vars(pkg).items():
        if isinstance(mod, types.ModuleType) and not sub.startswith("_"):
            for n in getattr(mod, "__all__", ()):
                if callable(getattr(mod, n, None)):  # functions and classes (a constant's id is not its own)
                    curated.setdefault(id(getattr(mod, n)), f"{sub}.{n}")
    if id(obj) in curated:
        return f"{PACKAGE}.{curated[id(obj)]}"
    # a member of a curated class: Class.method
    for i in range(len(parts) - 1, 0, -1):
        holder = _lookup(".".join(parts[:i]))
        if holder is not None and id(holder[0]) in curated:
            return ".".join([PACKAGE, curated[id(holder[0])], *parts[i:]])
    return None


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    found_obj = _lookup(target)
    if found_obj is not None:
        obj, parts = found_obj
        path = _curated_path(obj, parts)
        if path is not None and path != target:
            found = env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder,
                                                      node["reftype"], path, node, contnode)
            if found is not None:
                return found
        return contnode  # a real object the reference does not document: plain code
    if target.split(".")[0] in sys.stdlib_module_names:
        return contnode
    # Docstring fields (napoleon's types) make refspecific references.
    if node.get("refspecific") and node.get("reftype") in ("class", "obj") \
            and _NOT_A_CLASS.match(target):
        return contnode
    return None


_USES: dict[str, list[str]] = {}


def _collect_uses(app):
    """Which chapters use which curated name (``rr.NAME`` in a notebook or page source)."""
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        return
    names = set(getattr(pkg, "__all__", ()))
    root = Path(app.srcdir) / "chapters"
    _USES.clear()
    for path in sorted(root.glob("[0-9][0-9]_*")):
        if path.suffix not in (".ipynb", ".md"):
            continue
        text = path.read_text(encoding="utf-8")
        for name in sorted(set(re.findall(r"\brr\.(\w+)", text)) & names):
            _USES.setdefault(name, []).append(f"/chapters/{path.stem}")


def _seen_in(app, what, name, obj, options, lines):
    short = name.split(".")[-1]
    if name != f"{PACKAGE}.{short}" or short not in _USES:
        return
    docs = ", ".join(f":doc:`{d}`" for d in _USES[short])
    lines.extend(["", f"*Seen in:* {docs}.", ""])


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        attrs = getattr(js, "attributes", {}) or {}
        # The two copies differ only in filename None vs "" (no file: inline).
        key = (str(getattr(js, "filename", js) or ""), tuple(sorted(attrs.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def _one_search_box(app, config):
    config.html_theme_options.setdefault("navbar_persistent", [])


_TABLE_ROW = re.compile(r"^\|.*\|")


def _check_tables(app, doctree, docname):
    """Warn on a paragraph that is a table which did not parse (6)."""
    for para in doctree.findall(nodes.paragraph):
        text = para.astext().strip()
        first = para.children[0] if para.children else None
        if (isinstance(first, nodes.Text) and _TABLE_ROW.match(text)
                and ("|---" in text or "|:--" in text or text.count("|") >= 4)):
            LOGGER.warning("a paragraph starts with '|': a Markdown table that did not parse "
                           "(a bare | inside a cell ends the cell; build tables with "
                           "chapters/_book.table, which escapes it): %s", text[:80],
                           location=para, type="rr", subtype="table")


def _pdf_source(app) -> Path:
    return Path(app.outdir).parent / "latex" / "book.pdf"


def _pdf_link(app, doctree, docname):
    """The landing page's PDF link, or how to build the PDF (7)."""
    if app.builder.format != "html" or docname != app.config.root_doc:
        return
    have = _pdf_source(app).exists()
    for raw in list(doctree.findall(nodes.raw)):
        if "rr-pdf-link" not in raw.astext() or have:
            continue
        note = nodes.paragraph()
        note += nodes.Text("The whole book as one PDF is built by ")
        note += nodes.literal(text="python3 dev.py pdf")
        note += nodes.Text(" (it needs TeX); the published site has it beside these pages.")
        raw.replace_self(note)


def _landing_always_read(app, env, added, changed, removed):
    return [app.config.root_doc] if app.builder.format == "html" else []


def _copy_pdf(app, exception):
    if exception is None and app.builder.format == "html" and _pdf_source(app).exists():
        shutil.copy(_pdf_source(app), Path(app.outdir) / PDF_NAME)


def _raw_latex(text: str) -> nodes.raw:
    return nodes.raw("", text + "\n", format="latex")


def _cell_tags(node) -> set[str]:
    return {c[4:] for c in node.get("classes", []) if c.startswith("tag_")}


def _latex_structure(app, doctree, docname):
    """Preface, chapter numbering and folded cells in the PDF (8)."""
    if app.builder.format != "latex":
        return
    # Folded cells: what the HTML book hides behind a toggle is not printed.
    for cell in list(doctree.findall(nodes.container)):
        if "cell" not in cell.get("classes", []) or cell.parent is None:
            continue
        tags = _cell_tags(cell)
        if tags & {"hide-cell", "remove-cell"}:
            cell.parent.remove(cell)
            continue
        for part, tag in (("cell_input", "hide-input"), ("cell_output", "hide-output")):
            if tag in tags:
                for child in [c for c in cell.children
                              if isinstance(c, nodes.container) and part in c.get("classes", [])]:
                    cell.remove(child)
    if docname != app.config.root_doc:
        return
    env = app.env
    # Each inlined document: numbered where the HTML book numbers it.
    for start in doctree.findall(addnodes.start_of_file):
        numbered = bool(env.toc_secnumbers.get(start["docname"]))
        start.insert(0, _raw_latex(f"\\setcounter{{secnumdepth}}{{{2 if numbered else -1}}}"))
    # The landing page (the root document's own sections, before the first
    # inlined chapter): one front-matter chapter with run-in headings.
    top = next(iter(doctree.findall(nodes.section)), None)
    if top is None:
        return
    # (Sphinx inlines the chapters by setting start_of_file.children, which
    # leaves their parent links unset: find them from above.)
    inlined = {id(s) for sof in doctree.findall(addnodes.start_of_file)
               for s in sof.findall(nodes.section)}
    for sec in [s for s in top.findall(nodes.section) if s is not top and id(s) not in inlined]:
        title = sec.next_node(nodes.title)
        rubric = nodes.rubric("", "", *title.children) if title else nodes.rubric()
        body = [c for c in sec.children if c is not title]
        sec.replace_self([rubric, *body])
    top.insert(1 if top.children and isinstance(top[0], nodes.title) else 0, _raw_latex(
        "\\setcounter{secnumdepth}{-1}\\chapter*{Preface}"
        "\\addcontentsline{toc}{chapter}{Preface}\\markboth{Preface}{Preface}"))


def setup(app):
    app.connect("config-inited", _one_search_box)
    app.connect("doctree-resolved", _check_tables)
    app.connect("doctree-resolved", _pdf_link)
    app.connect("doctree-resolved", _latex_structure)
    app.connect("env-get-outdated", _landing_always_read)
    app.connect("build-finished", _copy_pdf)
    app.add_css_file("rr-book.css")
    app.add_js_file("rr-search.js", defer="defer")
    app.connect("missing-reference", _missing_reference)
    app.connect("builder-inited", _collect_uses)
    app.connect("autodoc-process-docstring", _seen_in)
    # Late, after myst-nb and sphinx-thebe have added their scripts.
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
