"""riemannian_scores against a brute-force definition, reductions and errors."""
import math

import pytest
import torch

import riemannian_ref as rr

F64 = torch.float64


def brute_scores(q, k, Uq, Uk, lam, side, scale):
    """Materialise every difference and every d x d metric: the definition."""
    d = q.shape[-1]
    eye = torch.eye(d, dtype=q.dtype)

    def G(U, per_token):
        M = U @ U.transpose(-1, -2) + lam * eye
        return M if per_token else M.unsqueeze(-3)

    D = q.unsqueeze(-2) - k.unsqueeze(-3)  # (..., nq, nk, d)
    if side == "key":
        Gb = G(Uk, Uk.dim() == k.dim() + 1).unsqueeze(-4)
    elif side == "query":
        Gb = G(Uq, Uq.dim() == q.dim() + 1).unsqueeze(-3)
    else:
        Gb = (G(Uq, Uq.dim() == q.dim() + 1).unsqueeze(-3) + G(Uk, Uk.dim() == k.dim() + 1).unsqueeze(-4)) / 2
    return -0.5 * scale * torch.einsum("...d,...de,...e->...", D, Gb, D)


@pytest.mark.parametrize("side", ["key", "query", "mean"])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("r", [0, 1, 3])
def test_scores_match_definition(gen, side, per_token, r):
    B, h, nq, nk, d = 2, 3, 5, 7, 4
    q = torch.randn(B, h, nq, d, generator=gen, dtype=F64)
    k = torch.randn(B, h, nk, d, generator=gen, dtype=F64)
    Uq = torch.randn(B, h, *((nq,) if per_token else ()), d, r, generator=gen, dtype=F64)
    Uk = torch.randn(B, h, *((nk,) if per_token else ()), d, r, generator=gen, dtype=F64)
    Uq_arg = Uq if side in ("query", "mean") else None
    Uk_arg = Uk if side in ("key", "mean") else None
    S = rr.riemannian_scores(q, k, Uq_arg, Uk_arg, lam=0.7, metric_side=side)
    assert S.shape == (B, h, nq, nk)
    torch.testing.assert_close(S, brute_scores(q, k, Uq, Uk, 0.7, side, 1 / math.sqrt(d)), rtol=1e-10, atol=1e-10)


def test_lam_per_head_broadcasts(gen):
    q = torch.randn(2, 3, 5, 4, generator=gen, dtype=F64)
    Uk = torch.randn(2, 3, 5, 4, 2, generator=gen, dtype=F64)
    lam = torch.tensor([0.5, 1.0, 2.0], dtype=F64)  # [h] against batch [B, h]
    S = rr.riemannian_scores(q, q, U_k=Uk, lam=lam)
    for head in range(3):
        torch.testing.assert_close(S[:, head], rr.riemannian_scores(q[:, head], q[:, head], U_k=Uk[:, head], lam=float(lam[head])))


def test_mean_is_symmetric_when_q_equals_k(gen):
    x = torch.randn(3, 9, 5, generator=gen, dtype=F64)
    U = torch.randn(3, 9, 5, 2, generator=gen, dtype=F64)
    S = rr.riemannian_scores(x, x, U, U, metric_side="mean")
    torch.testing.assert_close(S, S.transpose(-1, -2))
    # one-sided scores are not symmetric in general
    Sk = rr.riemannian_scores(x, x, U_k=U, metric_side="key")
    assert (Sk - Sk.transpose(-1, -2)).abs().max() > 1e-3
    # and "key" on (q, k) is "query" on (k, q), transposed
    torch.testing.assert_close(rr.riemannian_scores(x, x, U_q=U, metric_side="query"), Sk.transpose(-1, -2))


def test_shared_metric_is_dot_product_plus_key_bias(gen):
    q = torch.randn(2, 6, 8, generator=gen, dtype=F64)
    k = torch.randn(2, 9, 8, generator=gen, dtype=F64)
    U = torch.randn(2, 8, 3, generator=gen, dtype=F64)
    S = rr.riemannian_scores(q, k, U_k=U, lam=1.3)
    Gq, bias = rr.dot_product_form(q, k, U, lam=1.3)
    S_dot = Gq @ k.transpose(-1, -2) / math.sqrt(8) + bias
    # equal up to a per-row constant, hence the same softmax
    torch.testing.assert_close(torch.softmax(S, -1), torch.softmax(S_dot, -1), rtol=1e-12, atol=1e-12)
    row_shift = S - S_dot
    torch.testing.assert_close(row_shift, row_shift[..., :1].expand_as(row_shift))


def test_identity_metric_equals_sdpa_with_key_bias(gen):
    q = torch.randn(2, 3, 6, 8, generator=gen, dtype=F64)
    k = torch.randn(2, 3, 6, 8, generator=gen, dtype=F64)
    v = torch.randn(2, 3, 6, 5, generator=gen, dtype=F64)
    U0 = torch.zeros(2, 3, 6, 8, 0, dtype=F64)
    out = rr.riemannian_attention(q, k, v, U_k=U0, lam=1.0)
    bias = (-0.5 / math.sqrt(8)) * (k * k).sum(-1).unsqueeze(-2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("side", ["key", "query", "mean"])
def test_missing_factor_is_the_isotropic_metric(gen, side):
    """No factor on a side the metric uses means G = lam I there (rank 0), not an error."""
    q = torch.randn(2, 4, 3, generator=gen, dtype=F64)
    k = torch.randn(2, 5, 3, generator=gen, dtype=F64)
    U = torch.randn(2, 5, 3, 2, generator=gen, dtype=F64)
    S0 = rr.riemannian_scores(q, k, lam=0.7, metric_side=side)
    brute = -0.5 * 0.7 * ((q.unsqueeze(-2) - k.unsqueeze(-3)) ** 2).sum(-1) / math.sqrt(3)
    torch.testing.assert_close(S0, brute, rtol=1e-12, atol=1e-12)
    if side == "mean":  # only the key side has a factor: (lam I + G_k) / 2
        Sm = rr.riemannian_scores(q, k, U_k=U, lam=0.7, metric_side="mean")
        Uq0 = torch.zeros(2, 4, 3, 2, dtype=F64)
        torch.testing.assert_close(Sm, brute_scores(q, k, Uq0, U, 0.7, "mean", 1 / math.sqrt(3)))


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.zeros(4, 3), torch.zeros(5, 2)), dict(U_k=torch.zeros(5, 2, 1)), "share the head dimension"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(metric_side="left", U_k=torch.zeros(5, 3, 1)), "metric_side must be one of"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(U_k=torch.zeros(4, 3, 1)), r"U_k must have shape \[..., n, d, r\]"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(U_k=torch.zeros(1, 1, 5, 3, 1)), "U_k must have 3 dims"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(U_k=torch.zeros(5, 3, 1), U_q=torch.zeros(4, 3, 1)), "U_q is not used"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(U_k=torch.zeros(5, 3, 1), lam=0.0), "lam must be finite and > 0"),
        ((torch.zeros(4, 3), torch.zeros(5, 3, dtype=F64)), dict(U_k=torch.zeros(5, 3, 1)), "dtype"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(U_k=torch.zeros(5, 3, 1, dtype=F64)), "dtype"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(U_k=torch.zeros(5, 3, 1), scale=-1.0), "scale must be a finite positive"),
        ((torch.zeros(2, 4, 3), torch.zeros(3, 5, 3)), dict(U_k=torch.zeros(3, 5, 3, 1)), "do not broadcast"),
        ((torch.zeros(4, 3), torch.zeros(5, 3)), dict(metric_side="mean", U_q=torch.zeros(4, 3, 1), U_k=torch.zeros(5, 3, 2)), "same rank"),
        (([[0.0]], torch.zeros(5, 3)), dict(U_k=torch.zeros(5, 3, 1)), "q must be a torch.Tensor"),
    ],
)
def test_bad_score_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rr.riemannian_scores(*args, **kwargs)
