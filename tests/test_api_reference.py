"""The API reference documents exactly the curated names; every public name has its own docstring;
the package has one version.

(a) ``chapters/api/*.md`` (one page per subpackage, plus an index) document
    names with ``.. autofunction:: riemannian_ref.NAME`` and
    ``.. autoclass:: riemannian_ref.NAME`` inside ```{eval-rst} blocks; the
    set of those names is ``riemannian_ref.__all__``, each documented once,
    on the page of the subpackage that defines it.
(b) Every name in ``riemannian_ref.__all__`` and in the ``__all__`` of every
    public module carries its own docstring, and each callable that takes
    arguments documents them: a numpydoc ``Parameters`` section (types with
    shapes: ``q : Tensor, shape [..., n, d]``) or an explicit pointer to the
    function that does (``See :func:`other` for the arguments``). The Sphinx
    build with ``-W -n`` then checks that those docstrings parse.
(c) ``riemannian_ref.__version__`` is the installed distribution's version
    and the one in CITATION.cff, and setuptools reads it from there.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import riemannian_ref

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "chapters" / "api"
# One page per subpackage (and per module of the flat part), as the reference is laid out.
PAGES = {"geometry": "riemannian_ref.geometry", "attention": "riemannian_ref.attention",
         "models": "riemannian_ref.models", "analysis": "riemannian_ref.analysis",
         "optim": "riemannian_ref.optim", "data": "riemannian_ref.data",
         "training": ("riemannian_ref.training", "riemannian_ref.protocol")}
DIRECTIVE = re.compile(r"^\s*\.\. (autofunction|autoclass):: riemannian_ref\.(\w+)\s*$")
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
    return {p.stem: _directives(p) for p in sorted(API.glob("*.md"))}


def test_the_reference_has_one_page_per_subpackage():
    assert API.is_dir(), f"{API.relative_to(ROOT)} is missing: the API reference is one page per subpackage"
    pages = {p.stem for p in API.glob("*.md")}
    missing = sorted({"index", *PAGES} - pages)
    assert not missing, f"missing API pages: {[f'chapters/api/{m}.md' for m in missing]}"


def test_documented_names_are_exactly_the_curated_all():
    per_page = _documented()
    names = [name for entries in per_page.values() for _, name in entries]
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
            obj = getattr(riemannian_ref, name, None)
            want = "autoclass" if inspect.isclass(obj) else "autofunction"
            if directive != want:
                problems.append(f"{page}.md: {name} is a {'class' if want == 'autoclass' else 'function'}, "
                                f"use .. {want}::")
            modules = (PAGES[page],) if isinstance(PAGES.get(page), str) else PAGES.get(page, ())
            if page in PAGES and not any(name in importlib.import_module(m).__all__ for m in modules):
                problems.append(f"{page}.md documents {name}, which {' or '.join(modules)} does not export")
            if page not in PAGES:
                problems.append(f"{page}.md documents {name}: names belong on a subpackage's page")
    assert not problems, "\n".join(problems)


def test_the_parser_reads_directives_only_inside_eval_rst_blocks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# P\n\n.. autofunction:: riemannian_ref.outside\n\n"
                    "```{eval-rst}\n.. autofunction:: riemannian_ref.train\n"
                    ".. autoclass:: riemannian_ref.TrainConfig\n   :members:\n"
                    ".. automodule:: riemannian_ref.data\n```\n\n"
                    "````{eval-rst}\n.. autoclass:: riemannian_ref.TaskData\n````\n", encoding="utf-8")
    assert _directives(page) == [("autofunction", "train"), ("autoclass", "TrainConfig"),
                                 ("autoclass", "TaskData")]


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
