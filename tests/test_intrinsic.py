"""The linear-attention surrogate of chapter 12: exact risk, bounds, estimators."""
import pytest
import torch

import riemannian_ref.analysis as rr  # riemannian_ref.analysis.intrinsic (and energy_effective_rank)
from riemannian_ref.analysis import intrinsic  # population and best-rank risks, the statistic, FitConfig

F64 = torch.float64


@pytest.mark.parametrize("r_star", [0, 1, 3, 6])
@pytest.mark.parametrize("spectrum", ["flat", "decaying"])
def test_teacher_kernel_rank_and_spectrum(gen, r_star, spectrum):
    W = rr.teacher_kernel(6, r_star, spectrum=spectrum, scale=2.0, generator=gen)
    s = torch.linalg.svdvals(W)
    assert int((s > 1e-10).sum()) == r_star
    if r_star and spectrum == "flat":
        torch.testing.assert_close(s[:r_star], torch.full((r_star,), 2.0, dtype=F64))
        assert abs(float(rr.energy_effective_rank(W)) - r_star) < 1e-9


def test_linear_head_is_C_W_transpose_x(gen):
    Xq = torch.randn(3, 7, 4, generator=gen, dtype=F64)
    Xc = torch.randn(3, 10, 4, generator=gen, dtype=F64)
    W = torch.randn(4, 4, generator=gen, dtype=F64)
    C = Xc.transpose(-1, -2) @ Xc / 10
    expect = (C @ W.T @ Xq.transpose(-1, -2)).transpose(-1, -2)
    torch.testing.assert_close(rr.kernel_attention(Xq, Xc, W), expect)


def test_population_risk_formula_by_monte_carlo(gen):
    d, n = 4, 6
    W_star = rr.teacher_kernel(d, 2, generator=gen)
    W = torch.randn(d, d, generator=gen, dtype=F64) * 0.3
    Xq = torch.randn(40_000, 1, d, generator=gen, dtype=F64)
    Xc = torch.randn(40_000, n, d, generator=gen, dtype=F64)
    err = rr.kernel_attention(Xq, Xc, W) - rr.kernel_attention(Xq, Xc, W_star)
    mc = (err ** 2).sum(-1).mean()
    exact = intrinsic.population_risk(W, W_star, n)
    assert abs(float(mc / exact) - 1) < 0.03


def test_best_rank_risk_is_eckart_young(gen):
    W_star = rr.teacher_kernel(5, 3, spectrum="decaying", generator=gen)
    n = 20
    for r in range(6):
        U, s, Vh = torch.linalg.svd(W_star)
        W_r = (U[:, :r] * s[:r]) @ Vh[:r]
        torch.testing.assert_close(intrinsic.best_rank_risk(W_star, r, n), intrinsic.population_risk(W_r, W_star, n))
    assert float(intrinsic.best_rank_risk(W_star, 3, n)) < 1e-20


def test_kernel_statistic_is_exact_for_linear_heads(gen):
    W_star = rr.teacher_kernel(5, 2, generator=gen)
    Xq = torch.randn(16, 4, 5, generator=gen, dtype=F64)
    Xc = torch.randn(16, 12, 5, generator=gen, dtype=F64)
    M = intrinsic.kernel_statistic(Xq, Xc, rr.kernel_attention(Xq, Xc, W_star))
    torch.testing.assert_close(M, W_star, rtol=1e-9, atol=1e-9)


def test_fit_reaches_the_bound_and_recovers_rank(gen):
    d, n = 5, 16
    W_star = rr.teacher_kernel(d, 2, generator=gen)
    Xq = torch.randn(32, 8, d, generator=gen, dtype=F64)
    Xc = torch.randn(32, n, d, generator=gen, dtype=F64)
    Y = rr.kernel_attention(Xq, Xc, W_star)
    below = rr.fit_low_rank_kernel(Xq, Xc, Y, 1, intrinsic.FitConfig(steps=250), generator=gen)
    risk1 = float(intrinsic.population_risk(below["W"], W_star, n))
    bound1 = float(intrinsic.best_rank_risk(W_star, 1, n))
    assert risk1 >= bound1 * (1 - 1e-9)
    assert risk1 < 1.2 * bound1
    full = rr.fit_low_rank_kernel(Xq, Xc, Y, d, intrinsic.FitConfig(steps=250), generator=gen)
    assert float(intrinsic.population_risk(full["W"], W_star, n)) < 1e-3
    assert abs(full["erank"][-1] - 2) < 0.05
    assert len(full["steps"]) == len(full["loss"]) == len(full["erank"])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rr.teacher_kernel(4, 5), r"r_star must be an int in \[0, d\]"),
        (lambda: rr.teacher_kernel(4, 2, spectrum="odd"), "spectrum must be"),
        (lambda: rr.kernel_attention(torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), torch.zeros(3, 3)), r"W must have shape \[d, d\] = \[4, 4\]"),
        (lambda: rr.kernel_attention(torch.zeros(2, 3, 4), torch.zeros(2, 5, 3), torch.zeros(4, 4)), "must share batch dims and d"),
        (lambda: rr.kernel_attention(torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), torch.zeros(4, 4), attention="cos"), "attention must be one of"),
        (lambda: intrinsic.kernel_statistic(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)),
         "n >= d"),
        (lambda: intrinsic.best_rank_risk(torch.zeros(3, 3), -1, 5), "r must be an int >= 0"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()
