"""Stiefel, fixed-rank and factored geometries in float64, with geoopt as the oracle."""
import pytest
import torch
from hypothesis import given, strategies as st

import riemannian_ref.optim as rr  # Stiefel, PartialIsometry, fixed-rank geometries

geoopt = pytest.importorskip("geoopt")

F64 = torch.float64
ST = rr.Stiefel()
SHAPES = [(5, 5), (6, 2), (3, 8, 3), (2, 4, 16, 4), (7, 1)]


def _frame(g, *shape):
    return ST.random(*shape, generator=g, dtype=F64)


@pytest.mark.parametrize("shape", SHAPES)
def test_random_points_are_on_the_manifold(gen, shape):
    x = _frame(gen, *shape)
    ok, why = ST.check_point(x)
    assert ok, why
    assert x.shape == shape


def test_check_point_reports_why(gen):
    x = _frame(gen, 6, 3)
    ok, why = ST.check_point(2 * x)
    assert not ok and "x^T x - I" in why
    ok, why = ST.check_point(torch.zeros(2, 5, dtype=F64))
    assert not ok and "n >= p" in why


@pytest.mark.parametrize("shape", SHAPES)
def test_projection_is_tangent_idempotent_and_orthogonal(gen, shape):
    x = _frame(gen, *shape)
    u = torch.randn(*shape, generator=gen, dtype=F64)
    xi = ST.proju(x, u)
    ok, why = ST.check_vector(x, xi)
    assert ok, why
    torch.testing.assert_close(ST.proju(x, xi), xi, atol=1e-13, rtol=0)
    # the residual u - xi = x sym(x^T u) is normal: orthogonal to every tangent vector
    eta = ST.proju(x, torch.randn(*shape, generator=gen, dtype=F64))
    assert ST.inner(x, u - xi, eta).abs().max() < 1e-12


@pytest.mark.parametrize("shape", SHAPES)
def test_agrees_with_geoopt_euclidean_stiefel(gen, shape):
    """Same metric and projection as geoopt.EuclideanStiefel; polar retraction = its projx(x + u)."""
    M = geoopt.EuclideanStiefel()
    x = _frame(gen, *shape)
    u = torch.randn(*shape, generator=gen, dtype=F64)
    torch.testing.assert_close(ST.proju(x, u), M.proju(x, u), atol=1e-13, rtol=0)
    torch.testing.assert_close(ST.egrad2rgrad(x, u), M.egrad2rgrad(x, u), atol=1e-13, rtol=0)
    z = torch.randn(*shape, generator=gen, dtype=F64)
    torch.testing.assert_close(ST.projx(z), M.projx(z), atol=1e-12, rtol=0)
    xi = ST.proju(x, u)
    torch.testing.assert_close(ST.retr(x, xi), M.projx(x + xi), atol=1e-12, rtol=0)
    torch.testing.assert_close(ST.inner(x, xi, xi), M.inner(x, xi, xi), atol=1e-12, rtol=1e-12)
    assert M.check_point_on_manifold(ST.retr(x, xi))


@pytest.mark.parametrize("shape", [(8, 3), (2, 6, 4)])
def test_polar_and_geoopt_qr_retractions_agree_to_second_order(gen, shape):
    """Both are retractions: R(x, t xi) = x + t xi + O(t^2), so they differ by O(t^2)."""
    M = geoopt.EuclideanStiefel()
    x = _frame(gen, *shape)
    xi = ST.proju(x, torch.randn(*shape, generator=gen, dtype=F64))
    errs = []
    for t in (1e-2, 1e-3):
        errs.append((ST.retr(x, t * xi) - M.retr(x, t * xi)).abs().max().item())
        assert (ST.retr(x, t * xi) - x - t * xi).abs().max() < 10 * t**2 * xi.abs().max() ** 2 + 1e-14
    assert errs[1] < errs[0] / 50  # quadratic decay (factor 100 ideal)


def test_projx_is_the_closest_frame(gen):
    z = torch.randn(7, 3, generator=gen, dtype=F64)
    p = ST.projx(z)
    d0 = (z - p).norm()
    for _ in range(200):
        q = _frame(gen, 7, 3)
        assert (z - q).norm() >= d0 - 1e-12


@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(0, 4))
def test_weight_decay_direction_is_normal(seed, p, extra):
    """proj_W(W) = W - W sym(W^T W) = 0 for every frame (claim e)."""
    g = torch.Generator().manual_seed(seed)
    x = ST.random(p + extra, p, generator=g, dtype=F64)
    assert ST.proju(x, x).abs().max() < 1e-14


def test_bad_input_raises():
    x = torch.eye(4, 2, dtype=F64)
    with pytest.raises(ValueError, match="u must have the shape"):
        ST.proju(x, torch.zeros(4, 3, dtype=F64))
    with pytest.raises(ValueError, match="n >= p"):
        ST.projx(torch.zeros(2, 4, dtype=F64))
    with pytest.raises(ValueError, match="shape"):
        ST.random(2, 5)


# ---------------------------------------------------------------- fixed rank
FR = rr.FixedRankEmbedded()


@pytest.mark.parametrize("batch,m,n,r", [((), 6, 5, 2), ((3,), 8, 8, 3), ((2, 2), 10, 4, 1)])
def test_fixed_rank_projection_matches_dense_formula(gen, batch, m, n, r):
    x = FR.random(*batch, m, n, r=r, generator=gen, dtype=F64)
    assert FR.check_point(x)[0]
    z = torch.randn(*batch, m, n, generator=gen, dtype=F64)
    PU = x.U @ x.U.transpose(-1, -2)
    PV = x.V @ x.V.transpose(-1, -2)
    dense = PU @ z + z @ PV - PU @ z @ PV  # P_U Z + Z P_V - P_U Z P_V
    t = FR.proju(x, z)
    xi = FR.tangent_to_dense(x, t)
    torch.testing.assert_close(xi, dense, atol=1e-12, rtol=0)
    # orthogonal parts; inner on the factors equals the Frobenius inner product
    assert (x.U.transpose(-1, -2) @ t.Up).abs().max() < 1e-12
    assert (x.V.transpose(-1, -2) @ t.Vp).abs().max() < 1e-12
    torch.testing.assert_close(FR.inner(x, t), xi.square().sum(dim=(-1, -2)), atol=1e-11, rtol=1e-12)
    torch.testing.assert_close(FR.tangent_to_dense(x, FR.proju(x, xi)), xi, atol=1e-12, rtol=0)


@pytest.mark.parametrize("batch,m,n,r", [((), 6, 5, 2), ((3,), 9, 7, 3)])
def test_fixed_rank_retraction_is_truncated_svd(gen, batch, m, n, r):
    x = FR.random(*batch, m, n, r=r, generator=gen, dtype=F64)
    t = FR.proju(x, 0.3 * torch.randn(*batch, m, n, generator=gen, dtype=F64))
    y = FR.retr(x, t)
    assert FR.check_point(y)[0]
    target = FR.to_dense(FR.from_dense(FR.to_dense(x) + FR.tangent_to_dense(x, t), r))
    torch.testing.assert_close(FR.to_dense(y), target, atol=1e-11, rtol=0)
    # first order: R(x, s xi) = x + s xi + O(s^2)
    s = 1e-4
    ys = FR.retr(x, rr.FixedRankTangent(*(s * c for c in t)))
    lin = FR.to_dense(x) + s * FR.tangent_to_dense(x, t)
    assert (FR.to_dense(ys) - lin).abs().max() < 1e-6


def test_fixed_rank_transport_is_projection(gen):
    x = FR.random(7, 6, r=2, generator=gen, dtype=F64)
    y = FR.retr(x, FR.proju(x, 0.2 * torch.randn(7, 6, generator=gen, dtype=F64)))
    t = FR.proju(x, torch.randn(7, 6, generator=gen, dtype=F64))
    got = FR.tangent_to_dense(y, FR.transp(x, y, t))
    want = FR.tangent_to_dense(y, FR.proju(y, FR.tangent_to_dense(x, t)))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_fixed_rank_from_factors(gen):
    A = torch.randn(2, 7, 3, generator=gen, dtype=F64)
    B = torch.randn(2, 5, 3, generator=gen, dtype=F64)
    x = FR.from_factors(A, B)
    torch.testing.assert_close(FR.to_dense(x), A @ B.transpose(-1, -2), atol=1e-12, rtol=0)
    assert FR.check_point(x)[0]


# ---------------------------------------------------------------- factored
FG = rr.FactoredLowRank()


def test_factored_balance_keeps_product_and_balances(gen):
    A = torch.randn(3, 8, 2, generator=gen, dtype=F64)
    B = 5 * torch.randn(3, 6, 2, generator=gen, dtype=F64)
    A2, B2 = FG.balance(A, B)
    torch.testing.assert_close(A2 @ B2.transpose(-1, -2), A @ B.transpose(-1, -2), atol=1e-12, rtol=0)
    torch.testing.assert_close(A2.transpose(-1, -2) @ A2, B2.transpose(-1, -2) @ B2, atol=1e-12, rtol=0)


def test_factored_gradient_is_riesz_representer_and_invariant(gen):
    """g_(A,B)(rgrad, eta) = <gA, etaA> + <gB, etaB> (the differential), and the
    induced direction on W is the same at every representative (A P, B P^-T)."""
    A = torch.randn(6, 2, generator=gen, dtype=F64)
    B = torch.randn(5, 2, generator=gen, dtype=F64)
    G = torch.randn(6, 5, generator=gen, dtype=F64)
    gA, gB = G @ B, G.T @ A
    FG0 = rr.FactoredLowRank(eps=0.0)  # no ridge: the identity is exact
    xi = FG0.egrad2rgrad(A, B, gA, gB)
    eta = (torch.randn(6, 2, generator=gen, dtype=F64), torch.randn(5, 2, generator=gen, dtype=F64))
    lhs = FG0.inner(A, B, xi, eta)
    rhs = (gA * eta[0]).sum() + (gB * eta[1]).sum()
    torch.testing.assert_close(lhs, rhs, atol=1e-12, rtol=1e-12)

    def dW(A, B):
        gA, gB = G @ B, G.T @ A
        xA, xB = FG0.egrad2rgrad(A, B, gA, gB)
        return xA @ B.T + A @ xB.T

    P = torch.randn(2, 2, generator=gen, dtype=F64) + 2 * torch.eye(2, dtype=F64)
    torch.testing.assert_close(dW(A, B), dW(A @ P, B @ torch.linalg.inv(P).T), atol=1e-10, rtol=0)


def test_factored_check_point():
    A = torch.zeros(4, 2, dtype=F64)
    A[0, 0] = 1
    ok, why = FG.check_point(A, torch.eye(3, 2, dtype=F64))
    assert not ok and "A is rank deficient" in why


# ---------------------------------------------------------------- partial isometry
def test_partial_isometry_is_product_of_stiefels(gen):
    PI = rr.PartialIsometry()
    U, V = PI.random(2, 7, 5, r=3, generator=gen, dtype=F64)
    assert PI.check_point(U, V)[0]
    W = PI.to_dense(U, V)
    s = torch.linalg.svdvals(W)
    torch.testing.assert_close(s[..., :3], torch.ones(2, 3, dtype=F64), atol=1e-12, rtol=0)
    G = torch.randn(2, 7, 5, generator=gen, dtype=F64)
    xU, xV = PI.egrad2rgrad(U, V, G @ V, G.transpose(-1, -2) @ U)
    U2, V2 = PI.retr(U, V, -0.1 * xU, -0.1 * xV)
    assert PI.check_point(U2, V2)[0]
