"""Sphinx extension with the book's small fixes to its toolchain.

1. Cross-references to package names, wherever they are defined. The API
   reference documents each object where it is defined
   (``riemannian_ref.scores.riemannian_scores``), while docstrings and
   chapters naturally write the name users import
   (``riemannian_ref.riemannian_scores``, ``rr.riemannian_scores``) or a bare
   name from another module (``LowRankMetric`` in a docstring of
   ``geodesics``). When such a Python reference finds no target, look the
   name up in the package and retry with the object's defining module, so the
   link lands on its entry in the API reference.

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
"""
from __future__ import annotations

import importlib
import re
import sys

PACKAGE = "riemannian_ref"
ALIASES = {PACKAGE, "rr"}  # `import riemannian_ref as rr` in every chapter
_NOT_A_CLASS = re.compile(r"^(?:[A-Za-z]|[a-z_]\w*|.*[^\w.].*)$")  # n, shape, int64, "a phrase"


def _canonical(target: str) -> str | None:
    """``riemannian_ref.X``, ``rr.X`` or a bare ``X`` -> ``riemannian_ref.module.X``."""
    parts = target.lstrip("~.").split(".")
    if parts[0] in ALIASES:
        parts = parts[1:]
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    try:
        obj = importlib.import_module(PACKAGE)
    except ImportError:
        return None
    for name in parts:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or not module.startswith(PACKAGE + "."):
        return None
    return f"{module}.{qualname}"


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    canonical = _canonical(target)
    if canonical is not None and canonical != target:
        found = env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder,
                                                  node["reftype"], canonical, node, contnode)
        if found is not None:
            return found
    if target.split(".")[0] in sys.stdlib_module_names:
        return contnode
    # Docstring fields (napoleon's types) make refspecific references.
    if node.get("refspecific") and node.get("reftype") in ("class", "obj") \
            and _NOT_A_CLASS.match(target):
        return contnode
    return None


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


def setup(app):
    app.connect("config-inited", _one_search_box)
    app.add_css_file("rr-book.css")
    app.add_js_file("rr-search.js", defer="defer")
    app.connect("missing-reference", _missing_reference)
    # Late, after myst-nb and sphinx-thebe have added their scripts.
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
