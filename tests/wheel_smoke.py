"""Smoke test of an installed wheel, run by `python3 dev.py test` in a fresh virtual environment.

`dev.py` builds the wheel and sdist (`python -m build`, the wheel from the sdist), installs the
wheel with the transformers extra into a new virtual environment outside the checkout, and runs
this file there with `python -I` from a temporary directory, so that nothing of the checkout is
importable: a module, data file or `py.typed` missing from the wheel, or a dependency missing
from its metadata, fails here. (Not collected by pytest: it is not named test_*.)
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import pkgutil
import sys
import tempfile
from pathlib import Path

import torch

import riemannian_ref as rr

checks = []


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise SystemExit(f"wheel smoke test failed: {name} {detail}")
    checks.append(name)


# installed, not found in a checkout
where = Path(rr.__file__).resolve()
check("installed in this environment", Path(sys.prefix).resolve() in where.parents, f"({where})")
check("version in the metadata", importlib.metadata.version("riemannian_ref") == rr.__version__)
requires = importlib.metadata.requires("riemannian_ref") or []
check("the transformers extra is declared", any("transformers" in r and "extra" in r for r in requires),
      f"({requires})")
check("py.typed is shipped", importlib.resources.files("riemannian_ref").joinpath("py.typed").is_file())
check("the content kernel's C source is shipped",
      importlib.resources.files("riemannian_ref").joinpath("attention/_content_kernel.c").is_file())

# every module imports (the transformers integration too: the extra is installed)
modules = [m.name for m in pkgutil.walk_packages(rr.__path__, "riemannian_ref.")]
for name in modules:
    importlib.import_module(name)
check("every module imports", "riemannian_ref.integrations.transformers" in modules, f"({len(modules)} modules)")
check("the public names resolve", all(hasattr(rr, n) for n in rr.__all__))

# a forward and a backward through the function, the module and the model
g = torch.Generator().manual_seed(0)
q, k, v = torch.randn(3, 2, 4, 16, 8, generator=g).unbind(0)
U = (0.3 * torch.randn(2, 4, 16, 8, 2, generator=g)).requires_grad_()
out = rr.riemannian_attention(q, k, v, is_causal=True, U_k=U, lam=1.0)
out.sum().backward()
check("riemannian_attention forward and backward", out.shape == (2, 4, 16, 8) and U.grad.abs().sum() > 0)
attn = rr.RiemannianAttention(rr.AttentionConfig(d_model=32, n_heads=4, rank=2, causal=True))
y, _ = attn(torch.randn(2, 16, 32, generator=g))
check("RiemannianAttention forward", y.shape == (2, 16, 32))
model = rr.FiberBundleTransformer(rr.FiberBundleConfig.small(mode="riemannian"))
idx = torch.randint(64, (2, 33), generator=g)
loss = model(idx[:, :-1], targets=idx[:, 1:]).loss
loss.backward()
check("FiberBundleTransformer loss and backward", bool(torch.isfinite(loss)))
fb = rr.FiberBundleTransformer(rr.FiberBundleConfig.small(mode="fiber_bundle"))
fb(idx[:, :-1], targets=idx[:, 1:]).loss.backward()
from riemannian_ref.attention import _content_cpu  # noqa: E402

check("the content kernel builds from the installed source", _content_cpu.available(),
      f"({_content_cpu.unavailable_reason()})")
train, _, info = rr.char_lm(block_size=32)
check("char_lm reads its text", len(train) > 0 and info["n_chars"] > 10_000)

# the transformers backend on a small model built from a config
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from riemannian_ref.integrations import transformers as rr_hf  # noqa: E402

torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
rr_hf.attach(llama, rank=2)
llama.set_attn_implementation("riemannian")
ids = torch.randint(50, (2, 12), generator=g)
llama(ids, labels=ids).loss.backward()
with tempfile.TemporaryDirectory() as tmp:
    llama.save_pretrained(tmp)
    loaded = rr_hf.from_pretrained(tmp).eval()
    same = torch.equal(llama.eval()(ids).logits, loaded(ids).logits)
check("transformers backend: train step, save and load", same)

print(f"wheel smoke test: {len(checks)} passed ({len(modules)} modules imported from {where.parent})")
