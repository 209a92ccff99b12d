"""Rank-collapse diagnostics on matrices whose answer we know."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import riemannian_ref.analysis as rr  # residuals, ranks (riemannian_ref.analysis.collapse)
from riemannian_ref.analysis import measures  # residual_center, composite_residual_lower_bound

DT = torch.float64


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=DT)


def orthonormal(gen, n, k):
    Q, _ = torch.linalg.qr(randn(gen, n, k))
    return Q  # (n, k), orthonormal columns


# ------------------------------------------------------------------ composite norm
def test_composite_norm_by_hand():
    X = torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=DT)
    col = max(1 + 3, 2 + 0.5)  # 4
    row = max(1 + 2, 3 + 0.5)  # 3.5
    assert torch.allclose(rr.composite_norm(X), torch.tensor(math.sqrt(col * row), dtype=DT))


def test_composite_norm_of_ones_and_transpose(gen):
    n, D = 5, 3
    assert torch.allclose(rr.composite_norm(torch.ones(n, D, dtype=DT)), torch.tensor(math.sqrt(n * D), dtype=DT))
    X = randn(gen, 4, 6, 7)
    assert torch.allclose(rr.composite_norm(X), rr.composite_norm(X.transpose(-1, -2)))


# ------------------------------------------------------------------ residuals
CASES = [(norm, center) for norm in ("composite", "fro") for center in ("mean", "argmin")]


@pytest.mark.parametrize("norm,center", CASES)
def test_identical_rows_give_zero_residual(gen, norm, center):
    x = randn(gen, 3, 1, 8)
    X = x.expand(3, 6, 8).clone()  # every row equal: rank one
    r = rr.relative_residual(X, norm=norm, center=center)
    assert r.shape == (3,)
    assert torch.all(r.abs() < 1e-12)


@pytest.mark.parametrize("norm,center", CASES)
def test_zero_matrix_defined_as_zero(norm, center):
    r = rr.relative_residual(torch.zeros(2, 4, 3, dtype=DT), norm=norm, center=center)
    assert torch.equal(r, torch.zeros(2, dtype=DT))


@pytest.mark.parametrize("norm,center", CASES)
@pytest.mark.parametrize("c", [-3.0, 1e-3, 7.5])
def test_relative_residual_scale_invariant(gen, norm, center, c):
    X = randn(gen, 4, 10, 6)
    a = rr.relative_residual(X, norm=norm, center=center)
    b = rr.relative_residual(c * X, norm=norm, center=center)
    # the composite argmin is found by subgradient steps: equal up to the solver's accuracy
    assert torch.allclose(a, b, rtol=1e-6 if center == "mean" or norm == "fro" else 1e-3, atol=1e-9)
    assert torch.all(a > 0.1)  # Gaussian matrices are far from identical rows


@pytest.mark.parametrize("norm,center", CASES)
def test_residual_invariant_to_adding_a_common_row(gen, norm, center):
    """res(X + 1 y^T) = res(X): the residual does not see the shared row."""
    X = randn(gen, 3, 8, 5)
    y = randn(gen, 3, 1, 5)
    a = rr.residual(X, norm, center)
    b = rr.residual(X + 10 * y, norm, center)
    if center == "mean":
        assert torch.allclose(a, b, atol=1e-10)
    else:  # argmin is found numerically: compare the norms, not the points
        na = rr.composite_norm(a) if norm == "composite" else torch.linalg.matrix_norm(a)
        nb = rr.composite_norm(b) if norm == "composite" else torch.linalg.matrix_norm(b)
        assert torch.allclose(na, nb, rtol=0.05)


def test_frobenius_argmin_is_the_mean(gen):
    X = randn(gen, 5, 7, 3)
    assert torch.allclose(measures.residual_center(X, "fro", "argmin"), X.mean(-2))
    # and it is the minimiser: any perturbation of the centre increases the residual
    base = torch.linalg.matrix_norm(rr.residual(X, "fro", "argmin"))
    for _ in range(5):
        x = X.mean(-2) + 0.1 * randn(gen, 5, 3)
        assert torch.all(torch.linalg.matrix_norm(X - x.unsqueeze(-2)) > base)


@pytest.mark.parametrize("shape", [(6, 4), (12, 3), (5, 16)])
def test_composite_argmin_bracketed(gen, shape):
    """lower bound <= argmin value <= min(mean form, median form), bracket tight within 1.5."""
    X = randn(gen, 20, *shape)
    lo = measures.composite_residual_lower_bound(X)
    val = rr.composite_norm(rr.residual(X, "composite", "argmin"))
    mean_val = rr.composite_norm(rr.residual(X, "composite", "mean"))
    med_val = rr.composite_norm(X - X.median(-2, keepdim=True).values)
    assert torch.all(lo <= val + 1e-12)
    assert torch.all(val <= torch.minimum(mean_val, med_val) + 1e-12)
    assert torch.all(val / lo < 1.5)


def test_composite_argmin_beats_random_centres(gen):
    X = randn(gen, 8, 4)
    val = rr.composite_norm(rr.residual(X, "composite", "argmin"))
    for _ in range(200):
        x = X.mean(0) + 0.5 * randn(gen, 4)
        assert rr.composite_norm(X - x) >= val - 1e-9


def test_argmin_keeps_autograd_of_caller_clean(gen):
    X = randn(gen, 6, 3).requires_grad_(True)
    r = rr.relative_residual(X, "composite", "argmin")
    r.backward()  # gradient flows through X - 1 x^T with x treated as a constant
    assert X.grad is not None and torch.isfinite(X.grad).all()
    x = measures.residual_center(X.detach(), "composite", "argmin")  # the same centre, a constant
    Y = X.detach().clone().requires_grad_(True)
    (rr.composite_norm(Y - x) / rr.composite_norm(Y)).backward()
    torch.testing.assert_close(X.grad, Y.grad, rtol=1e-12, atol=1e-12)
    assert X.grad.abs().max() > 0


# ------------------------------------------------------------------ ranks
@pytest.mark.parametrize("n", [1, 3, 8])
def test_stable_and_effective_rank_of_orthogonal_matrix(gen, n):
    Q = orthonormal(gen, n, n)
    assert torch.allclose(rr.stable_rank(Q), torch.tensor(float(n), dtype=DT))
    assert torch.allclose(rr.energy_effective_rank(Q), torch.tensor(float(n), dtype=DT))


@pytest.mark.parametrize("k", [1, 2, 5])
def test_k_equal_singular_values(gen, k):
    n, D = 9, 7
    U = orthonormal(gen, n, k)
    V = orthonormal(gen, D, k)
    X = 3.0 * U @ V.T  # rank k, all singular values 3
    assert torch.allclose(rr.energy_effective_rank(X), torch.tensor(float(k), dtype=DT))
    assert torch.allclose(rr.stable_rank(X), torch.tensor(float(k), dtype=DT))


def test_unequal_spectrum_by_hand(gen):
    U = orthonormal(gen, 6, 2)
    V = orthonormal(gen, 4, 2)
    X = U @ torch.diag(torch.tensor([2.0, 1.0], dtype=DT)) @ V.T
    p = torch.tensor([4.0, 1.0], dtype=DT) / 5
    assert torch.allclose(rr.stable_rank(X), torch.tensor(5.0 / 4.0, dtype=DT))
    assert torch.allclose(rr.energy_effective_rank(X), torch.exp(-(p * p.log()).sum()))


@given(st.integers(1, 6), st.integers(1, 6), st.floats(0.01, 100.0), st.integers(0, 2**31 - 1))
def test_rank_measures_bounds_and_scale_invariance(n, D, c, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, D, generator=g, dtype=DT)
    rank = torch.linalg.matrix_rank(X).item()
    for f in (rr.stable_rank, rr.energy_effective_rank):
        v = f(X)
        assert 1 - 1e-9 <= v.item() <= rank + 1e-9
        assert torch.allclose(f(c * X), v, rtol=1e-9)
    assert rr.stable_rank(X) <= rr.energy_effective_rank(X) + 1e-9  # exp-entropy >= 1/max p


def test_ranks_of_zero_matrix():
    Z = torch.zeros(3, 4, 5, dtype=DT)
    assert torch.equal(rr.stable_rank(Z), torch.zeros(3, dtype=DT))
    assert torch.equal(rr.energy_effective_rank(Z), torch.zeros(3, dtype=DT))


@pytest.mark.parametrize("batch", [(), (2,), (3, 2)])
def test_batch_shapes(gen, batch):
    X = randn(gen, *batch, 5, 4)
    for f in (rr.composite_norm, rr.stable_rank, rr.energy_effective_rank, measures.composite_residual_lower_bound):
        assert f(X).shape == batch
    for norm, center in CASES:
        assert rr.relative_residual(X, norm, center).shape == batch
        assert rr.residual(X, norm, center).shape == X.shape
        assert measures.residual_center(X, norm, center).shape == (*batch, 4)
    # batched = looped
    flat = X.reshape(-1, 5, 4)
    loop = torch.stack([rr.relative_residual(x) for x in flat]).reshape(batch)
    assert torch.allclose(rr.relative_residual(X), loop)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("f", [rr.composite_norm, rr.relative_residual, rr.stable_rank,
                               rr.energy_effective_rank, rr.residual, measures.composite_residual_lower_bound])
def test_bad_inputs(f):
    with pytest.raises(ValueError, match="X must have at least 2 dimensions"):
        f(torch.ones(3, dtype=DT))
    with pytest.raises(ValueError, match="floating-point"):
        f(torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="torch.Tensor"):
        f([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"n, D >= 1"):
        f(torch.ones(0, 3, dtype=DT))


def test_bad_options(gen):
    X = randn(gen, 4, 3)
    with pytest.raises(ValueError, match="norm must be one of"):
        rr.relative_residual(X, norm="nuc")
    with pytest.raises(ValueError, match="center must be one of"):
        rr.relative_residual(X, center="median")
    with pytest.raises(ValueError, match="n_iter"):
        measures.residual_center(X, "composite", "argmin", n_iter=-1)
