"""The API reference covers the whole package.

``chapters/api_reference.md`` documents the package one module per section
(``.. automodule::``); a module left out there silently drops out of the
book's reference, so this test lists the package's modules and checks each
has its section. It also checks that every public name (``__all__``) of
every module carries its own docstring, and that each public callable
documents its arguments: a numpydoc ``Parameters`` section (types with
shapes: ``q : Tensor, shape [..., n, d]``) or an explicit pointer to the
function that does (``See :func:`other` for the arguments``).
The Sphinx build with ``-W -n`` then checks that those docstrings parse.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import riemannian_ref

PAGE = Path(__file__).resolve().parents[1] / "chapters" / "api_reference.md"
MODULES = sorted(m.name for m in pkgutil.iter_modules(riemannian_ref.__path__)
                 if not m.name.startswith("_"))


def _documented_modules() -> set[str]:
    text = PAGE.read_text(encoding="utf-8")
    return set(re.findall(r"^\.\. automodule:: riemannian_ref\.(\w+)\s*$", text, re.M))


def test_every_module_has_a_section():
    documented = _documented_modules()
    missing = sorted(set(MODULES) - documented)
    stale = sorted(documented - set(MODULES))
    assert not missing, (f"modules without a section in {PAGE.name}: {missing}; add for each "
                         "a heading and an eval-rst block with `.. automodule:: riemannian_ref.NAME`")
    assert not stale, f"{PAGE.name} documents modules that do not exist: {stale}"


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


@pytest.mark.parametrize("module", MODULES)
def test_public_names_are_documented(module):
    mod = importlib.import_module(f"riemannian_ref.{module}")
    assert hasattr(mod, "__all__"), f"riemannian_ref.{module} has no __all__"
    assert _own_doc(mod), f"riemannian_ref.{module} has no module docstring"
    problems = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue  # constants: documented with a `#:` comment where they are set
        doc = _own_doc(obj)
        if not doc:
            problems.append(f"{name}: no docstring")
            continue
        if inspect.isclass(obj) and not _takes_arguments(obj):
            continue
        if _takes_arguments(obj) and not re.search(r"^Parameters\n-{3,}$", doc, re.M) \
                and not re.search(r":(func|class|meth):`[^`]+`[^.]*\b(arguments|parameters)\b", doc):
            problems.append(f"{name}: no numpydoc 'Parameters' section (or a :func: pointer "
                            "to the function that documents the arguments)")
    assert not problems, f"riemannian_ref.{module}:\n  " + "\n  ".join(problems)
