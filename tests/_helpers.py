"""Helpers shared by several test files (imported by name: pytest puts tests/ on the path)."""
from __future__ import annotations

import importlib.util
import os
import sys

import dataclasses

import torch

import riemannian_ref as rr


class Boom:
    """Unpickling this calls ``_boom``: the payload of a crafted file, which a safe loader must never run."""

    calls = 0

    def __reduce__(self):
        return (_boom, ())


def _boom():
    Boom.calls += 1
    return {}


def payload_globals(path) -> list[str]:
    """The globals a torch file would import when unpickled, read without unpickling it.

    The positive control of the tests that crafted files are refused: the file a
    test wrote really carries ``_boom`` (so the safe loader's refusal is not
    vacuous), shown by ``torch.serialization.get_unsafe_globals_in_checkpoint``,
    which inspects the pickle's opcodes and runs nothing.
    """
    return torch.serialization.get_unsafe_globals_in_checkpoint(path)


_OWN_FIELDS = {f.name for f in dataclasses.fields(rr.FiberBundleConfig)} - {"attention"}


def nested(**kw) -> dict:
    """Keyword arguments of a FiberBundleConfig preset: the model's fields as they are, the rest (options of
    AttentionConfig, under its names) gathered into ``attention`` (variant tables list both in one dict)."""
    out = {k: v for k, v in kw.items() if k in _OWN_FIELDS}
    att = {k: v for k, v in kw.items() if k not in _OWN_FIELDS}
    return {**out, "attention": att} if att else out


def experiment_script(filename: str):
    """``experiments/<filename>`` as a module (loaded once per process)."""
    name = "rr_script_" + filename.removesuffix(".py")
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(__file__), "..", "experiments", filename)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules[name]


def train_script():
    """``experiments/train.py`` as a module (loaded once per process)."""
    return experiment_script("train.py")
