"""Helpers shared by several test files (imported by name: pytest puts tests/ on the path)."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch


class Boom:
    """Unpickling this calls ``_boom``: the payload of a crafted file, which a safe loader must never run."""

    calls = 0

    def __reduce__(self):
        return (_boom, ())


def _boom():
    Boom.calls += 1
    return {}


def unsafe_load(path):
    """Load ``path`` with the unpickling loader the package never uses.

    The positive control of the tests that crafted files are refused: it shows
    that the file a test wrote really runs code when unpickled, so the safe
    loader's refusal is not vacuous. Only ever called on a file the test itself
    wrote, whose payload increments ``Boom.calls``.
    """
    with open(path, "rb") as f:
        return torch.load(f, weights_only=False)


def train_script():
    """``experiments/train.py`` as a module (loaded once per process)."""
    name = "rr_train_script"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(__file__), "..", "experiments", "train.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules[name]
