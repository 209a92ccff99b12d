"""Theorem 1: the explicit factorisation reproduces the scores, and its rank bounds are attained."""
import pytest
import torch

import riemannian_ref as rr

F64 = torch.float64


def _inputs(g, d, r, n, side, shared, batch=()):
    """Generic queries, keys and metric factors (per token, or one shared metric)."""
    q = torch.randn(*batch, n, d, generator=g, dtype=F64)
    k = torch.randn(*batch, n + 3, d, generator=g, dtype=F64)
    shape_q = (*batch, d, r) if shared else (*batch, n, d, r)
    shape_k = (*batch, d, r) if shared else (*batch, n + 3, d, r)
    U_q = torch.randn(*shape_q, generator=g, dtype=F64) if side in ("query", "mean") else None
    U_k = torch.randn(*shape_k, generator=g, dtype=F64) if side in ("key", "mean") else None
    return q, k, U_q, U_k


@pytest.mark.parametrize("side", ["key", "query", "mean"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("r", [0, 1, 3])
def test_factors_reproduce_scores(gen, side, shared, r):
    d, n = 4, 9
    q, k, U_q, U_k = _inputs(gen, d, r, n, side, shared, batch=(2, 3))
    lam = torch.rand(3, generator=gen, dtype=F64) + 0.2  # per head, broadcasts over [B, h]
    L, R = rr.non_gram_factors(q, k, U_q, U_k, lam=lam, metric_side=side, scale=0.7)
    S = rr.riemannian_scores(q, k, U_q, U_k, lam=lam, metric_side=side, scale=0.7)
    assert L.shape == (2, 3, n, L.shape[-1]) and R.shape == (2, 3, n + 3, L.shape[-1])
    assert L.shape[-1] == rr.score_rank_bound(d, side, shared=shared)
    torch.testing.assert_close(L @ R.transpose(-1, -2), S, rtol=1e-10, atol=1e-10)


def test_factors_mixed_mean_is_valid_concatenation(gen):
    d, n, r = 3, 6, 2
    q = torch.randn(n, d, generator=gen, dtype=F64)
    k = torch.randn(n, d, generator=gen, dtype=F64)
    U_q = torch.randn(d, r, generator=gen, dtype=F64)  # shared
    U_k = torch.randn(n, d, r, generator=gen, dtype=F64)  # per token
    L, R = rr.non_gram_factors(q, k, U_q, U_k, lam=0.5, metric_side="mean")
    assert L.shape[-1] == d * (d + 1) // 2 + 2 * d + 3
    S = rr.riemannian_scores(q, k, U_q, U_k, lam=0.5, metric_side="mean")
    torch.testing.assert_close(L @ R.T, S, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d,r", [(2, 1), (3, 1), (3, 2), (4, 1), (4, 4), (5, 2), (6, 3)])
@pytest.mark.parametrize("side", ["key", "query", "mean"])
@pytest.mark.parametrize("shared", [False, True])
def test_rank_bound_attained_for_generic_inputs(gen, d, r, side, shared):
    m = rr.score_rank_bound(d, side, shared=shared)
    n = m + 6  # enough tokens that the bound, not n, limits the rank
    q, k, U_q, U_k = _inputs(gen, d, r, n, side, shared)
    k = k[:n]
    if U_k is not None and not shared:
        U_k = U_k[:n]
    S = rr.riemannian_scores(q, k, U_q, U_k, lam=0.8, metric_side=side)
    assert rr.numerical_rank(S) == m
    # the gap is wide, so the count does not hinge on the tolerance
    sv = torch.linalg.svdvals(S)
    assert sv[m - 1] / sv[0] > 1e-8 and sv[m] / sv[0] < 1e-12


def test_few_tokens_give_full_rank(gen):
    # with n below the bound, per-token metrics give a full-rank score matrix
    d, n = 6, 12  # bound 28 > 12
    q, k, _, U_k = _inputs(gen, d, 2, n, "key", False)
    S = rr.riemannian_scores(q, k[:n], None, U_k[:n], lam=1.0, metric_side="key")
    assert rr.numerical_rank(S) == n


def test_score_rank_bound_values():
    assert rr.score_rank_bound(8, "key") == 45
    assert rr.score_rank_bound(8, "query") == 45
    assert rr.score_rank_bound(8, "mean") == 90
    for side in ("key", "query", "mean"):
        assert rr.score_rank_bound(8, side, shared=True) == 10
    assert rr.score_rank_bound(1, "key") == 3


@pytest.mark.parametrize("rank", [0, 1, 3, 7])
def test_numerical_rank_known(gen, rank):
    A = torch.randn(4, 12, rank, generator=gen, dtype=F64)
    B = torch.randn(4, rank, 9, generator=gen, dtype=F64)
    M = A @ B  # (4, 12, 9) of rank `rank`
    ranks = rr.numerical_rank(M)
    assert isinstance(ranks, torch.Tensor) and ranks.shape == (4,) and ranks.dtype == torch.long
    assert (ranks == rank).all()
    assert rr.numerical_rank(M[0]) == rank and isinstance(rr.numerical_rank(M[0]), int)
    assert (ranks == torch.linalg.matrix_rank(M)).all()


def test_numerical_rank_tolerance(gen):
    sv = torch.tensor([1.0, 1e-3, 1e-9], dtype=F64)
    Q1, _ = torch.linalg.qr(torch.randn(5, 3, generator=gen, dtype=F64))
    Q2, _ = torch.linalg.qr(torch.randn(4, 3, generator=gen, dtype=F64))
    M = Q1 @ torch.diag(sv) @ Q2.T
    assert rr.numerical_rank(M) == 3
    assert rr.numerical_rank(M, rtol=1e-6) == 2
    assert rr.numerical_rank(M, rtol=1e-1) == 1
    assert rr.numerical_rank(torch.zeros(3, 4, dtype=F64)) == 0
    assert rr.numerical_rank(torch.zeros(2, 0, 4, dtype=F64)).tolist() == [0, 0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="d must be a positive int"):
        rr.score_rank_bound(0)
    with pytest.raises(ValueError, match="d must be a positive int"):
        rr.score_rank_bound(2.0)
    with pytest.raises(ValueError, match="metric_side"):
        rr.score_rank_bound(3, "both")
    with pytest.raises(ValueError, match="shared"):
        rr.score_rank_bound(3, "key", shared=1)
    with pytest.raises(ValueError, match="S must have at least 2"):
        rr.numerical_rank(torch.ones(3))
    with pytest.raises(ValueError, match="S must be a floating-point"):
        rr.numerical_rank(torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="rtol"):
        rr.numerical_rank(torch.ones(3, 3), rtol=-1.0)
    q = torch.randn(5, 3, dtype=F64)
    with pytest.raises(ValueError, match="U_k must have shape"):
        rr.non_gram_factors(q, q, None, torch.randn(4, 3, 2, dtype=F64), metric_side="key")
    with pytest.raises(ValueError, match="lam"):
        rr.non_gram_factors(q, q, None, torch.randn(3, 2, dtype=F64), lam=-1.0, metric_side="key")


def test_no_factor_is_the_isotropic_metric(gen):
    """No U on a side the metric uses means G = lam I: a shared metric, rank <= d + 2."""
    q = torch.randn(9, 3, generator=gen, dtype=F64)
    k = torch.randn(11, 3, generator=gen, dtype=F64)
    for side in ("key", "query", "mean"):
        L, R = rr.non_gram_factors(q, k, None, None, lam=0.7, metric_side=side)
        S = rr.riemannian_scores(q, k, lam=0.7, metric_side=side)
        brute = -0.5 * 0.7 * ((q[:, None] - k[None]) ** 2).sum(-1) / 3 ** 0.5
        torch.testing.assert_close(S, brute, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(L @ R.T, brute, rtol=1e-12, atol=1e-12)
        assert rr.numerical_rank(S) <= rr.score_rank_bound(3, side, shared=True) == 5
