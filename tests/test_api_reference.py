"""The API reference documents exactly the curated names; every public name has its own docstring;
the package has one version.

(a) ``chapters/api/*.md`` (one page per subpackage, plus an index) document
    names with ``.. autofunction:: riemannian_ref.NAME`` and
    ``.. autoclass:: riemannian_ref.NAME`` inside ```{eval-rst} blocks; the
    set of those names is ``riemannian_ref.__all__``, each documented once,
    on the page of the subpackage that defines it. The other names of a
    subpackage's ``__all__`` are documented there as
    ``riemannian_ref.SUBPACKAGE.NAME``; nothing else is. The published surface
    (every subpackage's ``__all__``) stays small, and no public module lists a
    name that its subpackage does not publish.
(b) Every name in ``riemannian_ref.__all__`` and in the ``__all__`` of every
    public module carries its own docstring, and each callable that takes
    arguments documents them: a numpydoc ``Parameters`` section (types with
    shapes: ``q : Tensor, shape [..., n, d]``) or an explicit pointer to the
    function that does (``See :func:`other` for the arguments``). The Sphinx
    build with ``-W -n`` then checks that those docstrings parse.
(c) ``riemannian_ref.__version__`` is the installed distribution's version
    and the one in CITATION.cff, and setuptools reads it from there.
(d) Every ``riemannian_ref.x.y`` or ``rr.x.y`` written in the package's
    docstrings and comments, the scripts and the book resolves.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import riemannian_ref

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "chapters" / "api"
# One page per subpackage (and per module of the flat part), as the reference is laid out.
PAGES = {"geometry": ("riemannian_ref.geometry", "riemannian_ref.plotting"), "attention": "riemannian_ref.attention",
         "models": "riemannian_ref.models", "analysis": "riemannian_ref.analysis",
         "optim": "riemannian_ref.optim", "data": "riemannian_ref.data",
         "training": ("riemannian_ref.training", "riemannian_ref.protocol")}
# The subpackages whose __all__ lists are the published surface (riemannian_ref.__all__ is drawn from them).
SUBPACKAGES = ("geometry", "attention", "models", "analysis", "optim", "data", "training", "protocol", "plotting")
MAX_PUBLISHED = 70  # names in all those lists together
DIRECTIVE = re.compile(r"^\s*\.\. (autofunction|autoclass|autodata):: riemannian_ref\.([\w.]+)\s*$")
EVAL_RST = re.compile(r"^(`{3,}|~{3,})\{eval-rst\}[^\n]*\n(.*?)^\1\s*$", re.M | re.S)


def _directives(path: Path) -> list[tuple[str, str]]:
    """(directive, name) of every autofunction/autoclass of riemannian_ref.NAME inside eval-rst blocks."""
    out = []
    for block in EVAL_RST.finditer(path.read_text(encoding="utf-8")):
        for line in block.group(2).splitlines():
            m = DIRECTIVE.match(line)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def _documented() -> dict[str, list[tuple[str, str]]]:
    """Per page, (directive, path after ``riemannian_ref.``): ``NAME`` or ``SUBPACKAGE.NAME``."""
    return {p.stem: _directives(p) for p in sorted(API.glob("*.md"))}


def _page_modules(page: str) -> tuple[str, ...]:
    mods = PAGES.get(page, ())
    return (mods,) if isinstance(mods, str) else mods


def test_the_reference_has_one_page_per_subpackage():
    assert API.is_dir(), f"{API.relative_to(ROOT)} is missing: the API reference is one page per subpackage"
    pages = {p.stem for p in API.glob("*.md")}
    missing = sorted({"index", *PAGES} - pages)
    assert not missing, f"missing API pages: {[f'chapters/api/{m}.md' for m in missing]}"


def test_documented_names_are_exactly_the_curated_all():
    per_page = _documented()
    names = [name for entries in per_page.values() for _, name in entries if "." not in name]
    curated = set(riemannian_ref.__all__)
    assert len(riemannian_ref.__all__) == len(curated), "riemannian_ref.__all__ lists a name twice"
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"documented more than once in chapters/api: {dupes}"
    missing = sorted(curated - set(names))
    extra = sorted(set(names) - curated)
    assert not missing, f"in riemannian_ref.__all__ but not in chapters/api/*.md: {missing}"
    assert not extra, f"documented in chapters/api/*.md but not in riemannian_ref.__all__: {extra}"


def test_each_name_is_on_its_subpackages_page_with_the_right_directive():
    problems = []
    for page, entries in _documented().items():
        for directive, name in entries:
            if "." in name:
                continue  # a subpackage's own name: test_every_published_name_is_documented_on_its_page
            obj = getattr(riemannian_ref, name, None)
            want = "autoclass" if inspect.isclass(obj) else "autofunction"
            if directive != want:
                problems.append(f"{page}.md: {name} is a {'class' if want == 'autoclass' else 'function'}, "
                                f"use .. {want}::")
            modules = _page_modules(page)
            if page in PAGES and not any(name in importlib.import_module(m).__all__ for m in modules):
                problems.append(f"{page}.md documents {name}, which {' or '.join(modules)} does not export")
            if page not in PAGES:
                problems.append(f"{page}.md documents {name}: names belong on a subpackage's page")
    assert not problems, "\n".join(problems)


def _published() -> dict[str, list[str]]:
    return {sub: list(importlib.import_module(f"riemannian_ref.{sub}").__all__) for sub in SUBPACKAGES}


def test_the_published_surface_is_small():
    """Every subpackage's __all__ holds what a user needs; the rest is reached through its module."""
    published = _published()
    total = sum(len(names) for names in published.values())
    sizes = ", ".join(f"{sub} {len(names)}" for sub, names in published.items())
    assert total <= MAX_PUBLISHED, (f"the subpackages publish {total} names ({sizes}), more than {MAX_PUBLISHED}: "
                                    "keep helpers out of __all__ (reached as riemannian_ref.SUB.MODULE.NAME)")
    twice = sorted({n for names in published.values() for n in names
                    if sum(n in other for other in published.values()) > 1})
    assert not twice, f"published by two subpackages: {twice}"
    top = set(riemannian_ref.__all__)
    assert top <= {n for names in published.values() for n in names}, \
        f"in riemannian_ref.__all__ but in no subpackage's __all__: {sorted(top - set().union(*published.values()))}"


def test_every_published_name_is_documented_on_its_page():
    """A subpackage's name in riemannian_ref.__all__ is documented as riemannian_ref.NAME, any other as
    riemannian_ref.SUBPACKAGE.NAME, on the subpackage's page, once; and nothing else is documented."""
    where = {f"{m.removeprefix('riemannian_ref.')}": page for page in PAGES for m in _page_modules(page)}
    want = {}
    for sub, names in _published().items():
        for n in names:
            want[n if n in riemannian_ref.__all__ else f"{sub}.{n}"] = where.get(sub)
    got = [(page, path) for page, entries in _documented().items() for _, path in entries]
    problems = [f"{path} is documented {n} times" for path in sorted({p for _, p in got})
                if (n := sum(p == path for _, p in got)) > 1]
    for path, page in sorted(want.items()):
        pages = [pg for pg, p in got if p == path]
        if not pages:
            problems.append(f"riemannian_ref.{path} is published but documented on no page "
                            f"(add it to chapters/api/{page}.md)")
        elif page not in pages:
            problems.append(f"riemannian_ref.{path} is documented on {pages}, not on {page}.md")
    problems += [f"{page}.md documents riemannian_ref.{path}, which no subpackage's __all__ publishes"
                 for page, path in got if path not in want]
    for page, entries in _documented().items():
        for directive, path in entries:
            if "." in path and path in want:
                sub, name = path.split(".")
                obj = getattr(importlib.import_module(f"riemannian_ref.{sub}"), name)
                kind = "autoclass" if inspect.isclass(obj) else "autofunction" if callable(obj) else "autodata"
                if directive != kind:
                    problems.append(f"{page}.md: riemannian_ref.{path} needs .. {kind}::")
    assert not problems, "\n".join(problems)


def test_no_public_module_lists_what_its_subpackage_does_not_publish():
    """A module's __all__ is part of the surface too: it may not hold a name its subpackage keeps out."""
    problems = []
    for mod_name in MODULES:
        parts = mod_name.split(".")
        if len(parts) < 3 or parts[1] not in SUBPACKAGES:
            continue
        extra = set(importlib.import_module(mod_name).__all__) - set(importlib.import_module(
            f"riemannian_ref.{parts[1]}").__all__)
        if extra:
            problems.append(f"{mod_name}.__all__ lists {sorted(extra)}, which riemannian_ref.{parts[1]} does not")
    assert not problems, "\n".join(problems)


def test_the_parser_reads_directives_only_inside_eval_rst_blocks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# P\n\n.. autofunction:: riemannian_ref.outside\n\n"
                    "```{eval-rst}\n.. autofunction:: riemannian_ref.train\n"
                    ".. autoclass:: riemannian_ref.TrainConfig\n   :members:\n"
                    ".. automodule:: riemannian_ref.data\n```\n\n"
                    "````{eval-rst}\n.. autoclass:: riemannian_ref.TaskData\n"
                    ".. autofunction:: riemannian_ref.data.make_task\n````\n", encoding="utf-8")
    assert _directives(page) == [("autofunction", "train"), ("autoclass", "TrainConfig"),
                                 ("autoclass", "TaskData"), ("autofunction", "data.make_task")]


# ------------------------------------------------------------------ docstrings

def _public_modules() -> list[str]:
    mods = ["riemannian_ref"]
    for m in pkgutil.walk_packages(riemannian_ref.__path__, "riemannian_ref."):
        if not any(part.startswith("_") for part in m.name.split(".")):
            mods.append(m.name)
    return sorted(mods)


MODULES = _public_modules()


def test_every_subpackage_and_module_is_walked():
    for name in ("riemannian_ref.geometry.metric", "riemannian_ref.attention.functional",
                 "riemannian_ref.models.transformer", "riemannian_ref.analysis.collapse",
                 "riemannian_ref.optim.adam", "riemannian_ref.data", "riemannian_ref.training",
                 "riemannian_ref.plotting"):
        assert name in MODULES
    assert not any("._" in m for m in MODULES)


def _own_doc(obj) -> str:
    # A class without a docstring would inherit its base's (nn.Module's) from getdoc.
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc or "")


def _takes_arguments(obj) -> bool:
    if inspect.isclass(obj) and obj.__init__ is object.__init__:
        return False  # no constructor of its own: nothing to document
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return any(name not in ("self", "cls") for name in params)


def _problems(mod_name: str, mod) -> list[str]:
    problems = []
    for name in mod.__all__:
        obj = getattr(mod, name, None)
        if obj is None and not hasattr(mod, name):
            problems.append(f"{name}: in __all__ but not defined")
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue  # constants: documented with a `#:` comment where they are set
        doc = _own_doc(obj)
        if not doc:
            problems.append(f"{name}: no docstring")
            continue
        if _takes_arguments(obj) and not re.search(r"^Parameters\n-{3,}$", doc, re.M) \
                and not re.search(r":(func|class|meth):`[^`]+`[^.]*\b(arguments|parameters)\b", doc):
            problems.append(f"{name}: no numpydoc 'Parameters' section (or a :func: pointer "
                            "to the function that documents the arguments)")
    return problems


@pytest.mark.parametrize("module", MODULES)
def test_public_names_are_documented(module):
    mod = importlib.import_module(module)
    assert hasattr(mod, "__all__"), f"{module} has no __all__"
    assert _own_doc(mod), f"{module} has no module docstring"
    problems = _problems(module, mod)
    assert not problems, f"{module}:\n  " + "\n  ".join(problems)


def test_the_docstring_rule_catches_a_missing_parameters_section():
    mod = type(sys)("fake")

    def documented(x):
        """Do it.

        Parameters
        ----------
        x : int
        """

    def pointer(x):
        """As :func:`documented`; see it for the arguments."""

    def bare(x):
        """Do it, with x."""

    def nothing():
        pass

    mod.__all__ = ["documented", "pointer", "bare", "nothing"]
    for f in (documented, pointer, bare, nothing):
        setattr(mod, f.__name__, f)
    assert _problems("fake", mod) == [
        "bare: no numpydoc 'Parameters' section (or a :func: pointer to the function that documents the arguments)",
        "nothing: no docstring"]


# ------------------------------------------------------------------ dotted names in the text

DOTTED = re.compile(r"(?<![\w.])(?:riemannian_ref|rr)((?:\.[A-Za-z_]\w*)+)")
PLACEHOLDERS = {"NAME", "SUB", "SUBPACKAGE", "MODULE", "X", "Y"}  # riemannian_ref.SUB.NAME in prose


def _resolves(parts: list[str]) -> bool:
    """Whether riemannian_ref.<parts> names a module, or an attribute of the longest module prefix."""
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(["riemannian_ref", *parts[:i]]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return hasattr(riemannian_ref, parts[0])


def _texts():
    """(file, text) of the package's source, the scripts and the book (a notebook's cells, not its outputs)."""
    for pattern in ("riemannian_ref/**/*.py", "benchmarks/*.py", "experiments/*.py", "examples/*.py",
                    "chapters/*.md", "chapters/api/*.md", "README.md", "CONTRIBUTING.md"):
        for path in sorted(ROOT.glob(pattern)):
            yield path, path.read_text(encoding="utf-8")
    for path in sorted(ROOT.glob("chapters/*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        yield path, "\n".join("".join(cell["source"]) for cell in cells)


def test_dotted_names_in_docstrings_comments_and_the_book_resolve():
    """``riemannian_ref.x.y`` and ``rr.x.y`` wherever they are written name something that exists: no reference to
    a module from before a redesign, or to a helper a subpackage no longer publishes."""
    problems = []
    for path, text in _texts():
        for m in DOTTED.finditer(text):
            parts = m.group(1)[1:].split(".")
            if not PLACEHOLDERS & set(parts) and not _resolves(parts):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)}")
    assert not problems, "names that resolve to nothing:\n" + "\n".join(problems)


def test_the_dotted_name_rule_catches_a_stale_module():
    assert _resolves(["geometry", "scores", "riemannian_scores"]) and _resolves(["geometry", "transport"])
    assert not _resolves(["scores"]) and not _resolves(["manifolds"])
    assert not _resolves(["geometry", "rotate_pairs"])  # a helper reached through its module only


# ------------------------------------------------------------------ one version

def test_one_version_string():
    version = riemannian_ref.__version__
    assert isinstance(version, str) and re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", version), version
    installed = importlib.metadata.version("riemannian_ref")
    assert installed == version, (f"installed metadata says {installed}, riemannian_ref.__version__ says {version}: "
                                  "reinstall the package (pip install -e .)")
    m = re.search(r"^version:\s*['\"]?([^'\"\s]+)['\"]?\s*$", (ROOT / "CITATION.cff").read_text(encoding="utf-8"),
                  re.M)
    assert m, "CITATION.cff has no top-level version"
    assert m.group(1) == version, f"CITATION.cff says {m.group(1)}, riemannian_ref.__version__ says {version}"
    if sys.version_info >= (3, 11):  # the build reads the version from the package: no second copy
        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
        assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
        assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "riemannian_ref.__version__"}
