"""The operator's speed paths compute the same function as its plain paths.

The blockwise operator's loop has options that the ablation benchmark prices
(``LoopOptions``: fixed offset, row sum in the product, chunk size): every setting must
agree with the dense reference in float64, outputs and all gradients (the
float mask's included), with masks whose batch shape is broadcast in every
way a chunk of the flattened batch can meet it (shared, consecutive, gathered).
The fixed softmax offset must fall back to the online softmax exactly when a
row would underflow, and must not overflow when a later key beats the first
key block by a wide margin.
"""
import functools
import itertools

import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.attention import _blockwise as bw

F64 = torch.float64


@pytest.fixture(autouse=True)
def _blockwise_operator():
    """These tests are about the blockwise operator: calls without per-token factors would go to SDPA."""
    from riemannian_ref.attention import functional

    with functional._force_backend("blockwise"):
        yield


@pytest.fixture
def switches(monkeypatch):
    """Every public call below reaches the operator with these loop options (its ``options`` argument)."""
    from riemannian_ref.attention import functional

    def set_(fixed=True, rowsum=True, chunk=bw.DEFAULT_LOOP.chunk_tile):
        options = bw.LoopOptions(fixed_offset=fixed, rowsum_in_product=rowsum, chunk_tile=chunk)
        monkeypatch.setattr(functional, "blockwise_operator", functools.partial(bw.blockwise_operator, options=options))
    return set_


def _inputs(g, B=2, h=3, nq=9, nk=11, d=4, r=2, dtype=F64):
    q, k = torch.randn(B, h, nq, d, generator=g, dtype=dtype), torch.randn(B, h, nk, d, generator=g, dtype=dtype)
    v = torch.randn(B, h, nk, 3, generator=g, dtype=dtype)
    Uq = 0.6 * torch.randn(B, h, nq, d, r, generator=g, dtype=dtype)
    Uk = 0.6 * torch.randn(B, h, nk, d, r, generator=g, dtype=dtype)
    lam = torch.rand(h, 1, generator=g, dtype=dtype).squeeze(-1) + 0.5
    return q, k, v, Uq, Uk, lam


def _masks(g, B, h, nq, nk):
    """Masks whose batch dims broadcast differently: chunks of the flat batch get views or gathers."""
    keep_b = torch.rand(B, 1, nq, nk, generator=g) > 0.3
    keep_b[..., 0] = True
    keep_b[:, :, 2] = False  # a row that sees no key
    per_head = torch.rand(h, 1, nk, generator=g) > 0.2  # [h, 1, n_k]: chunks of size 2 mix heads
    per_head[..., 0] = True
    bias = torch.randn(1, h, nq, nk, generator=g, dtype=F64) * 0.5
    return {"bool [B,1,nq,nk]": keep_b, "bool [h,1,nk]": per_head, "float [1,h,nq,nk]": bias,
            "float [nq,nk] -inf": torch.zeros(nq, nk, dtype=F64).masked_fill(~keep_b[0, 0], float("-inf")),
            "key padding [B,1,1,nk]": keep_b[:, :, :1, :].clone().index_fill_(-1, torch.tensor([3]), False)}


@pytest.mark.parametrize("side", ["key", "query", "mean"])
@pytest.mark.parametrize("fixed,rowsum,chunk", [(True, True, 1), (True, False, 1), (False, True, 1),
                                                (True, True, 0), (False, False, 0)])
def test_every_switch_setting_equals_the_reference_with_gradients(switches, side, fixed, rowsum, chunk):
    g = torch.Generator().manual_seed(0)
    B, h, nq, nk = 2, 3, 9, 11
    switches(fixed, rowsum, chunk)  # chunk = 1: a chunk of (one or two) batch elements per tile
    for (name, mask), causal in itertools.product(_masks(g, B, h, nq, nk).items(), (False, True)):
        q, k, v, Uq, Uk, lam = _inputs(g, B, h, nq, nk)
        Uq = Uq if side != "key" else None
        Uk = Uk if side != "query" else None
        if mask.dtype != torch.bool:
            mask = mask.clone().requires_grad_(True)
        leaves = [t for t in (q, k, v, Uq, Uk, lam) if t is not None]
        for t in leaves:
            t.requires_grad_(True)
        kw = dict(U_q=Uq, U_k=Uk, lam=lam, metric_side=side, is_causal=causal)
        out = rr.riemannian_attention(q, k, v, mask, block_sizes=(4, 3), **kw)
        ref = rr.riemannian_attention_reference(q, k, v, mask, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=f"{name}, causal={causal}")
        w = torch.randn(out.shape, generator=g, dtype=F64)
        both = leaves + ([mask] if mask.requires_grad else [])
        ga = torch.autograd.grad((out * w).sum(), both)
        gr = torch.autograd.grad((ref * w).sum(), both)
        for a, b in zip(ga, gr):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=f"{name}, causal={causal}")


def test_batch_chunks_of_a_broadcast_mask_are_views_or_gathers():
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)  # key padding of B = 2 under h = 3 heads
    mc = bw._MaskChunks(mask, (2, 3), False)
    assert mc.ids == [0, 0, 0, 1, 1, 1]
    assert mc._where(0, 3) == slice(0, 1) and mc._where(2, 4) == slice(0, 2)  # shared / consecutive
    heads = torch.ones(3, 1, 5, dtype=torch.bool)  # [h, 1, n_k] under batch (2, 3)
    mc = bw._MaskChunks(heads, (2, 3), False)
    assert mc.ids == [0, 1, 2, 0, 1, 2]
    assert torch.equal(mc._where(2, 4), torch.tensor([2, 0]))  # gathered
    expanded = torch.ones(1, 5, dtype=torch.bool).expand(4, 3, 5)  # stride 0: read once, never copied
    assert bw._MaskChunks(expanded, (4,), False).flat.shape == (1, 3, 5)


def test_a_later_key_far_above_the_first_block_does_not_overflow(switches, monkeypatch):
    """Keys 0-7 lie ~95 nats (137 bits) below the bound, keys 8-11 are the queries themselves."""
    switches(True, True, 0)
    monkeypatch.setattr(bw, "_chunk_online", None)  # the fixed offset must handle this alone
    g = torch.Generator().manual_seed(1)
    d = 8
    q = torch.randn(1, 2, 4, d, generator=g)
    k = torch.cat([torch.randn(1, 2, 8, d, generator=g) + 9.0, q.flip(-2)], -2)  # (1, 2, 12, d)
    v = torch.randn(1, 2, 12, 3, generator=g)
    S = rr.riemannian_scores(q, k)
    assert S[..., :8].amax() < -89 and S[..., 8:].amax(-1).min() > -1e-5  # exp(-89) underflows float32
    out = rr.riemannian_attention(q, k, v, block_sizes=(4, 4))
    ref = rr.riemannian_attention_reference(q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("far", [False, True])
def test_the_online_fallback_runs_exactly_when_a_row_would_underflow(switches, monkeypatch, far):
    switches(True, True, 0)
    calls = []
    real = bw._chunk_online
    monkeypatch.setattr(bw, "_chunk_online", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 12, 8, generator=g) + (6.0 if far else 0.0)
    k = torch.randn(2, 2, 12, 8, generator=g) - (6.0 if far else 0.0)  # far: scores ~ -200 nats, all of them
    v = torch.randn(2, 2, 12, 5, generator=g)
    keep = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    keep[:, :, 3] = False  # a row that sees no key is not an underflow: no fallback for it
    out = rr.riemannian_attention(q, k, v, keep, block_sizes=(4, 4))
    torch.testing.assert_close(out, rr.riemannian_attention_reference(q, k, v, keep), rtol=1e-4, atol=1e-4)
    assert (out[:, :, 3] == 0).all()
    assert bool(calls) == far


def test_dead_rows_with_causal_and_key_padding():
    keep = torch.tensor([[False, False, True, True]])  # [1, 1, n_k]: keys 0, 1 are padding
    dead = bw._dead_rows(keep.view(1, 1, 4), True, 1, 4, 4)
    assert dead.tolist() == [[True, True, False, False]]  # causal rows 0, 1 see only padding
    assert bw._dead_rows(keep.view(1, 1, 4), False, 1, 4, 4).tolist() == [[False] * 4]


@pytest.mark.parametrize("side", ["key", "mean"])
def test_threads_over_chunks_equal_the_reference(switches, side):
    """Two worker threads over chunks of the batch: the same outputs and gradients; the caller's threads kept."""
    switches(True, True, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(3)
        q, k, v, Uq, Uk, lam = _inputs(g, B=3, h=2, nq=10, nk=9)
        Uq = Uq if side == "mean" else None
        leaves = [t.requires_grad_(True) for t in (q, k, v, Uk, lam)]
        keep = torch.rand(3, 1, 10, 9, generator=g) > 0.3
        kw = dict(U_q=Uq, U_k=Uk, lam=lam, metric_side=side, is_causal=True)
        out = rr.riemannian_attention(q, k, v, keep, block_sizes=(4, 3), **kw)
        assert bw._POOL_SIZE == 2 and torch.get_num_threads() == 2  # the pool ran; this thread keeps its 2
        ref = rr.riemannian_attention_reference(q, k, v, keep, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        w = torch.randn(out.shape, generator=g, dtype=F64)
        for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    finally:
        torch.set_num_threads(before)
