"""What validation costs per call: it runs once per public call, and value checks do not sync a GPU.

Spies count the calls of the two validation functions,
``attention._validate.check_attention_inputs`` and
``_checks.check_score_inputs``, wherever the package holds a
reference to them (modules import them by name). The host-sync rules are
tested on CPU: the decision "reading this tensor's values waits for its
device" (``_checks.reading_syncs``) is made to answer yes for CPU tensors, and
a meta tensor (which has no values at all) takes the same branch for real.
"""
import sys

import pytest
import torch

import riemannian_ref as rr
from riemannian_ref import _checks
from riemannian_ref.attention import _validate, functional

F64 = torch.float64


@pytest.fixture
def counts(monkeypatch):
    """Replace both validation functions by counting wrappers in every module that holds them."""
    seen = {"check_attention_inputs": 0, "check_score_inputs": 0}
    for fn in (_validate.check_attention_inputs, _checks.check_score_inputs):
        def spy(*a, _fn=fn, **kw):
            seen[_fn.__name__] += 1
            return _fn(*a, **kw)

        holders = [m for name, m in list(sys.modules.items())
                   if name.startswith("riemannian_ref") and m is not None and fn in vars(m).values()]
        assert holders  # the spy would count nothing otherwise
        for m in holders:
            for attr, val in list(vars(m).items()):
                if val is fn:
                    monkeypatch.setattr(m, attr, spy)
    return seen


def once(counts, call):
    for key in counts:
        counts[key] = 0
    res = call()
    assert counts == {"check_attention_inputs": 1, "check_score_inputs": 1}, counts
    return res


@pytest.mark.parametrize("kw", [dict(), dict(connection="flat"), dict(connection="content"),
                                dict(metric_side="mean"), dict(scores="dot")], ids=str)
def test_a_module_forward_validates_once(gen, counts, kw):
    torch.manual_seed(0)
    m = rr.RiemannianAttention(rr.AttentionConfig(d_model=16, n_heads=2, causal=True, **kw))
    x = torch.randn(2, 9, 16, generator=gen)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[0, 6:] = False
    out, _ = once(counts, lambda: m(x, key_mask=key_mask))
    _, A = once(counts, lambda: m(x, key_mask=key_mask, return_weights=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ac, _ = once(counts, lambda: m(x, key_mask=key_mask))
    m16 = m.to(torch.bfloat16)
    half, _ = once(counts, lambda: m16(x.bfloat16(), key_mask=key_mask))
    m.float()
    assert A.shape == (2, 2, 9, 9) and ac.dtype == half.dtype == torch.bfloat16
    torch.testing.assert_close(ac.float(), out, rtol=0.05, atol=0.05)  # the same call in bfloat16


def test_the_operator_and_the_references_validate_once(gen, counts):
    """One validation for a whole call: the dense reference's scores and the 16 tiles of blockwise_attention use
    the validated arguments; the operator's dense branches (dropout, half precision, autocast) too."""
    q, k, v = (torch.randn(2, 2, 64, 8, generator=gen, dtype=F64) for _ in range(3))
    Uk = 0.3 * torch.randn(2, 2, 64, 8, 2, generator=gen, dtype=F64)
    lam = torch.tensor([0.7, 1.3], dtype=F64)
    ref = once(counts, lambda: rr.riemannian_attention_reference(q, k, v, is_causal=True, U_k=Uk, lam=lam))
    blk = once(counts, lambda: rr.blockwise_attention(q, k, v, is_causal=True, U_k=Uk, lam=lam,
                                                      block_sizes=(16, 16)))  # 4 x 4 tiles
    fast = once(counts, lambda: rr.riemannian_attention(q, k, v, None, 0.0, True, U_k=Uk, lam=lam))
    for out in (blk, fast):
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    once(counts, lambda: rr.riemannian_attention(q, k, v, None, 0.1, U_k=Uk, lam=lam))  # dropout: the dense path
    bf = [t.bfloat16() for t in (q, k, v, Uk, lam)]
    half = once(counts, lambda: rr.riemannian_attention(*bf[:3], None, 0.0, True, U_k=bf[3], lam=bf[4]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ac = once(counts, lambda: rr.riemannian_attention(*(t.float() for t in (q, k, v)), None, 0.0, True,
                                                          U_k=Uk.float(), lam=lam.float()))
    for out in (half, ac):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=0.02, atol=0.02)
    once(counts, lambda: rr.riemannian_attention(q, k[:, :1], v[:, :1], U_k=Uk[:, :1], enable_gqa=True))


# ------------------------------------------------------------------ no host sync off the CPU
@pytest.fixture
def device_like(monkeypatch):
    """CPU tensors treated as the tensors of a device whose values cost a sync to read (CUDA)."""
    monkeypatch.setattr(_checks, "reading_syncs", lambda t: True)
    monkeypatch.setattr(functional, "reading_syncs", lambda t: True)
    monkeypatch.delenv("RR_SYNC_CHECKS", raising=False)


@pytest.fixture
def no_bool(monkeypatch):
    """Reading a tensor's value as a Python bool fails the test (on CUDA it is a device-to-host sync)."""
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("bool(tensor): a host sync"))


def test_value_checks_read_values_eagerly_on_cpu_only():
    assert not _checks.reading_syncs(torch.zeros(1))
    assert _checks.reading_syncs(torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="lam must be finite and > 0 everywhere, got values such as"):
        _checks.as_positive(torch.tensor([1.0, -2.0]), "lam", torch.zeros(1))
    # a meta tensor has no values: bool() of it raises, so the check must not read it (and queues nothing)
    _checks.check_values(torch.zeros((), dtype=torch.bool, device="meta"), "never read")
    lam = _checks.as_positive(torch.tensor([1.0, 2.0], device="meta"), "lam", torch.zeros(1, device="meta"))
    assert lam.device.type == "meta"


def test_off_the_cpu_a_failed_check_is_asynchronous_and_still_loud(device_like, no_bool, monkeypatch):
    """torch._assert_async (on CPU it raises at once, on CUDA when the device gets there): a RuntimeError with the
    message; the detail, which would read the values, is not computed."""
    detail = lambda: pytest.fail("detail read the values")  # noqa: E731
    _checks.check_values(torch.tensor(True), "fine", detail)
    with pytest.raises(RuntimeError, match="lam must be finite and > 0 everywhere"):
        _checks.as_positive(torch.tensor([1.0, -2.0]), "lam", torch.zeros(1))
    q = torch.randn(1, 5, 4)
    with pytest.raises(RuntimeError, match="lam must be finite and > 0 everywhere"):
        rr.riemannian_attention(q, q, q, lam=torch.tensor(-1.0))
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(vocab_size=11))
    with pytest.raises(RuntimeError, match=r"idx must hold token ids in \[0, vocab_size\) = \[0, 11\)"):
        model(torch.tensor([[3, 11]]))


def test_rr_sync_checks_asks_for_the_eager_value_error(device_like, monkeypatch):
    monkeypatch.setenv("RR_SYNC_CHECKS", "1")
    with pytest.raises(ValueError, match=r"lam must be finite and > 0 everywhere, got values such as \[-2.0\]"):
        _checks.as_positive(torch.tensor([1.0, -2.0]), "lam", torch.zeros(1))
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(vocab_size=11))
    with pytest.raises(ValueError, match=r"got values in \[3, 11\]"):
        model(torch.tensor([[3, 11]]))


def test_a_python_lam_is_checked_on_the_host_and_never_copied(no_bool):
    like = torch.zeros(2, dtype=F64)
    t = _checks.as_positive(0.5, "lam", like)
    assert t.dtype == F64 and t.shape == () and float(t.item()) == 0.5
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="lam must be finite and > 0 everywhere, got"):
            _checks.as_positive(bad, "lam", like)


def test_the_all_zero_mask_shortcut_is_taken_on_cpu_only(gen, monkeypatch):
    """The row offsets of a float mask that is 0 wherever rows see keys are dropped on CPU (nothing to subtract);
    off the CPU they are kept (looking costs a sync) and subtracting them is exact: the same result."""
    q, k, v = (torch.randn(2, 2, 7, 4, generator=gen, dtype=F64) for _ in range(3))
    Uk = 0.3 * torch.randn(2, 2, 7, 4, 2, generator=gen, dtype=F64)
    pad = torch.zeros(2, 1, 1, 7, dtype=F64)
    pad[0, ..., 5:] = float("-inf")
    rows = []
    real = functional.blockwise_operator
    monkeypatch.setattr(functional, "blockwise_operator",
                        lambda *a, **kw: rows.append(kw["mask_rows"]) or real(*a, **kw))
    ref = rr.riemannian_attention_reference(q, k, v, pad, 0.0, True, U_k=Uk)
    cpu = rr.riemannian_attention(q, k, v, pad, 0.0, True, U_k=Uk)
    monkeypatch.setattr(functional, "reading_syncs", lambda t: True)
    dev = rr.riemannian_attention(q, k, v, pad, 0.0, True, U_k=Uk)
    assert rows[0] is None and rows[1] is not None and (rows[1] == 0).all()
    torch.testing.assert_close(cpu, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(dev, cpu)


def test_the_dropout_mask_is_made_relative_without_reading_it(gen, device_like, no_bool):
    mask = torch.zeros(2, 1, 5, 6, dtype=F64)
    mask[1, ..., 4:] = float("-inf")
    rel = functional._relative_mask(mask, True, 5, 6)
    assert rel is not mask and torch.equal(rel, mask)  # the all-zero offsets subtracted: exact
    shifted = functional._relative_mask(mask + 3.0, False, 5, 6)
    assert torch.equal(shifted, mask)  # each row relative to its largest visible entry
