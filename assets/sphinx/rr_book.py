"""Sphinx extension with the book's two small fixes to its toolchain.

1. Cross-references to re-exported package names. The API reference documents each object where it is defined
(``riemannian_ref.scores.riemannian_scores``), while docstrings and chapters
naturally write the name users import: ``riemannian_ref.riemannian_scores``
or ``rr.riemannian_scores``. When such a reference finds no target, look the
name up in the package and retry with the object's defining module, so the
link lands on its entry in the API reference instead of failing under -n.

2. One inline script per page. sphinx-thebe 0.3.1 (pulled in by Jupyter Book
1.0.4) registers its inline configuration script, ``const THEBE_JS_URL =
...``, so that it appears twice on every page with Sphinx 7.4 (once with
``filename=None``, once with ``""``, so Sphinx's own de-duplication misses
it); the second
copy throws "Identifier 'THEBE_JS_URL' has already been declared" in every
reader's console. Drop duplicates from the page's script list.
"""
from __future__ import annotations

import importlib

PACKAGE = "riemannian_ref"
ALIASES = {PACKAGE, "rr"}  # `import riemannian_ref as rr` in every chapter


def _canonical(target: str) -> str | None:
    parts = target.split(".")
    if parts[0] not in ALIASES or len(parts) < 2:
        return None
    try:
        obj = importlib.import_module(PACKAGE)
    except ImportError:
        return None
    for name in parts[1:]:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or not module.startswith(PACKAGE):
        return None
    return f"{module}.{qualname}"


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = _canonical(node.get("reftarget", ""))
    if target is None or target == node.get("reftarget"):
        return None
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder,
                                             node["reftype"], target, node, contnode)


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


def setup(app):
    app.connect("missing-reference", _missing_reference)
    # Late, after myst-nb and sphinx-thebe have added their scripts.
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
