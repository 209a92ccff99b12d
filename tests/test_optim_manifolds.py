"""The manifold interface and RiemannianAdam, in float64: one suite over every manifold (as geoopt's
test_manifold_basic), geoopt as the Stiefel oracle, the five certified claims of chapter 11, and the
optimiser's checks (one path for the constructor, add_param_group, load_state_dict and step)."""
import copy
import pickle

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import riemannian_ref as rr
from riemannian_ref.optim import (Euclidean, FixedRankEmbedded, FixedRankFactored, ManifoldParameter, RiemannianAdam,
                                  Stiefel, constrain_)

geoopt = pytest.importorskip("geoopt")

F64 = torch.float64
ST = Stiefel()

# ====================================================================== one suite over every manifold
CASES = {  # manifold, random's shape
    "euclidean": (Euclidean(), (3, 5, 4)),
    "stiefel": (Stiefel(), (3, 8, 3)),
    "stiefel_square": (Stiefel(), (5, 5)),
    "fixed_rank_embedded": (FixedRankEmbedded(), (2, 7, 5, 2)),
    "fixed_rank_factored": (FixedRankFactored(eps=0.0), (2, 6, 8, 3)),
}


@pytest.fixture(params=sorted(CASES))
def case(request, gen):
    M, shape = CASES[request.param]
    x = M.random(*shape, generator=gen, dtype=F64)
    if isinstance(x, tuple):  # random pairs are balanced (A^T A = B^T B); any full-rank pair is a point
        r = x[0].shape[-1]
        P = torch.randn(r, r, generator=gen, dtype=F64) + 3 * torch.eye(r, dtype=F64)
        x = (x[0] @ P, x[1] @ torch.linalg.inv(P).mT)
    return M, x


def _map(f, x):
    return tuple(f(t) for t in x) if isinstance(x, tuple) else f(x)


def _randn_like(x, gen):
    return _map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype), x)


def _value(M, x):
    """What the point means in its embedding: x, or W = A B^T for a factor pair."""
    return M.to_dense(x) if isinstance(x, tuple) else x


def _dvalue(M, x, u):
    """The change of _value along the tangent u."""
    if isinstance(M, FixedRankFactored):
        A, B = x
        uA, uB = u[..., :A.shape[-2], :], u[..., A.shape[-2]:, :]
        return uA @ B.mT + A @ uB.mT
    return u


def _tangent(M, x, gen):
    return M.proju(x, torch.randn(M.egrad2rgrad(x, _map(torch.zeros_like, x)).shape, generator=gen, dtype=F64))


def _loss(M, C):
    """A smooth function of the point's value (so invariant under a factor pair's change of basis)."""
    return lambda x: (C * _value(M, x)).sum() + 0.25 * _value(M, x).pow(4).sum()


def _egrad(f, x):
    leaf = _map(lambda t: t.detach().clone().requires_grad_(True), x)
    f(leaf).backward()
    return _map(lambda t: t.grad, leaf)


def test_random_and_projx_give_points(case, gen):
    M, x = case
    M.check_point(x)
    moved = _map(lambda t: t + 0.1 * torch.randn(t.shape, generator=gen, dtype=F64), x)
    y = M.projx(moved)
    M.check_point(y)
    torch.testing.assert_close(_value(M, M.projx(x)), _value(M, x), atol=1e-12, rtol=0)  # a point stays


def test_proju_is_tangent_idempotent_and_orthogonal(case, gen):
    M, x = case
    w = _tangent(M, x, gen) + torch.randn(_tangent(M, x, gen).shape, generator=gen, dtype=F64)
    u = M.proju(x, w)
    M.check_vector(x, u)
    torch.testing.assert_close(M.proju(x, u), u, atol=1e-12, rtol=0)
    eta = _tangent(M, x, gen)  # the residual is normal to every tangent vector (the embedded metric)
    if not isinstance(M, FixedRankFactored):
        assert ((w - u) * eta).sum().abs() < 1e-10


def test_egrad2rgrad_is_the_riemannian_gradient(case, gen):
    """inner(x, egrad2rgrad(x, grad f), u) = d/dt f(retr(x, t u)) at 0, for tangent u (central difference)."""
    M, x = case
    f = _loss(M, torch.randn(_value(M, x).shape, generator=gen, dtype=F64))
    rg = M.egrad2rgrad(x, _egrad(f, x))
    M.check_vector(x, rg)
    for _ in range(3):
        u = _tangent(M, x, gen)
        h = 1e-5
        fd = (f(M.retr(x, h * u)) - f(M.retr(x, -h * u))) / (2 * h)
        torch.testing.assert_close(M.inner(x, rg, u).sum(), fd, atol=1e-6, rtol=1e-6)


def test_retraction_is_first_order(case, gen):
    M, x = case
    zero = torch.zeros_like(_tangent(M, x, gen))
    torch.testing.assert_close(_value(M, M.retr(x, zero)), _value(M, x), atol=1e-12, rtol=0)
    u = _tangent(M, x, gen)
    M.check_point(M.retr(x, 0.5 * u))
    errs = []
    for t in (1e-3, 1e-4):  # value(retr(x, t u)) = value(x) + t dvalue(u) + O(t^2)
        lin = _value(M, x) + t * _dvalue(M, x, u)
        errs.append((_value(M, M.retr(x, t * u)) - lin).abs().max().item())
    assert errs[1] <= errs[0] / 30 and errs[1] < 1e-6  # exact (0) for Euclidean


def test_transport_lands_in_the_tangent_space_at_the_new_point(case, gen):
    M, x = case
    u, v = 0.3 * _tangent(M, x, gen), _tangent(M, x, gen)
    y = M.retr(x, u)
    M.check_vector(y, M.transp(x, y, v))
    y2, w = M.retr_transp(x, u, v)
    torch.testing.assert_close(_value(M, y2), _value(M, y), atol=1e-12, rtol=0)
    M.check_vector(y2, w)


def test_inner_is_a_metric_and_component_inner_adds_up_to_it(case, gen):
    M, x = case
    u, v = _tangent(M, x, gen), _tangent(M, x, gen)
    torch.testing.assert_close(M.inner(x, u, v), M.inner(x, v, u), atol=1e-12, rtol=0)
    assert (M.inner(x, u) > 0).all()
    c = M.component_inner(x, u)
    assert c.dim() == u.dim()  # broadcastable against u: Adam's second moment
    torch.testing.assert_close(c.sum(), M.inner(x, u).sum(), atol=1e-10, rtol=1e-12)


BAD_POINTS = {
    "euclidean": lambda x: torch.arange(3),
    "stiefel": lambda x: 2 * x,
    "stiefel_square": lambda x: x[..., :3, :],  # n < p
    "fixed_rank_embedded": lambda x: (x[0], torch.zeros_like(x[1])),
    "fixed_rank_factored": lambda x: (x[0][..., :2, :], x[1]),  # r > m
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_inputs_raise(gen, name):
    M, shape = CASES[name]
    x = M.random(*shape, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match=r"x|factor|A|n >= p"):
        M.check_point(BAD_POINTS[name](x))
    u = _tangent(M, x, gen)
    with pytest.raises(ValueError, match="u"):
        M.proju(x, u[..., :-1])
    with pytest.raises(ValueError, match="u"):
        M.retr(x, u[..., :-1])
    if name in ("stiefel", "fixed_rank_embedded"):  # a normal vector is not tangent
        normal = x if name == "stiefel" else (_value(M, x) - M.proju(x, _value(M, x)) + 1.0)
        with pytest.raises(ValueError, match="not tangent"):
            M.check_vector(x, normal)
    with pytest.raises(ValueError, match="shape"):
        M.random(*shape[:-2], 1, 3) if name != "euclidean" else M.random(-1)


# ====================================================================== Stiefel: geoopt as the oracle
@pytest.mark.parametrize("shape", [(5, 5), (6, 2), (3, 8, 3), (2, 4, 16, 4), (7, 1)])
def test_stiefel_agrees_with_geoopt_euclidean_stiefel(gen, shape):
    """Same metric and projection as geoopt.EuclideanStiefel; polar retraction = its projx(x + u)."""
    G = geoopt.EuclideanStiefel()
    x = ST.random(*shape, generator=gen, dtype=F64)
    u = torch.randn(*shape, generator=gen, dtype=F64)
    torch.testing.assert_close(ST.proju(x, u), G.proju(x, u), atol=1e-13, rtol=0)
    torch.testing.assert_close(ST.egrad2rgrad(x, u), G.egrad2rgrad(x, u), atol=1e-13, rtol=0)
    z = torch.randn(*shape, generator=gen, dtype=F64)
    torch.testing.assert_close(ST.projx(z), G.projx(z), atol=1e-12, rtol=0)
    xi = ST.proju(x, u)
    torch.testing.assert_close(ST.retr(x, xi), G.projx(x + xi), atol=1e-12, rtol=0)
    torch.testing.assert_close(ST.inner(x, xi, xi), G.inner(x, xi, xi), atol=1e-12, rtol=1e-12)
    assert G.check_point_on_manifold(ST.retr(x, xi))


def test_polar_and_geoopt_qr_retractions_agree_to_second_order(gen):
    G = geoopt.EuclideanStiefel()
    x = ST.random(2, 6, 4, generator=gen, dtype=F64)
    xi = ST.proju(x, torch.randn(2, 6, 4, generator=gen, dtype=F64))
    errs = [(ST.retr(x, t * xi) - G.retr(x, t * xi)).abs().max().item() for t in (1e-2, 1e-3)]
    assert errs[1] < errs[0] / 50  # quadratic decay (factor 100 ideal)


def test_projx_is_the_closest_frame(gen):
    z = torch.randn(7, 3, generator=gen, dtype=F64)
    d0 = (z - ST.projx(z)).norm()
    assert all((z - ST.random(7, 3, generator=gen, dtype=F64)).norm() >= d0 - 1e-12 for _ in range(200))


@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(0, 4))
def test_weight_decay_direction_is_normal(seed, p, extra):
    """proj_W(W) = W - W sym(W^T W) = 0 for every frame (claim e)."""
    x = ST.random(p + extra, p, generator=torch.Generator().manual_seed(seed), dtype=F64)
    assert ST.proju(x, x).abs().max() < 1e-14


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stiefel_check_point_tolerance_follows_the_dtype(dtype):
    # D19: Stiefel.random(...).bfloat16() has max |W^T W - I| = 3.9e-3 and was "not a point" at atol 1e-4
    for n, p in [(16, 4), (256, 64), (512, 512)]:
        ST.check_point(ST.random(n, p, generator=torch.Generator().manual_seed(n)).to(dtype))
    with pytest.raises(ValueError, match="atol"):
        ST.check_point((3 * torch.randn(16, 4)).to(dtype))
    with pytest.raises(ValueError, match="atol = 1.0e-04"):  # an explicit tolerance still rules
        ST.check_point(ST.random(16, 4).to(dtype), atol=1e-4)


# ====================================================================== fixed rank: dense formulas
FR, FG = FixedRankEmbedded(), FixedRankFactored(eps=0.0)


def test_fixed_rank_projection_retraction_and_gradient_match_dense_formulas(gen):
    x = FR.random(3, 9, 7, 3, generator=gen, dtype=F64)
    W = FR.to_dense(x)
    U, _, Vh = torch.linalg.svd(W)
    PU, PV = U[..., :3] @ U[..., :3].mT, Vh[..., :3, :].mT @ Vh[..., :3, :]
    Z = torch.randn(3, 9, 7, generator=gen, dtype=F64)
    dense = PU @ Z + Z @ PV - PU @ Z @ PV
    torch.testing.assert_close(FR.proju(x, Z), dense, atol=1e-12, rtol=0)
    # the gradient from the factor gradients (G B, G^T A) is the projection of G
    torch.testing.assert_close(FR.egrad2rgrad(x, (Z @ x[1], Z.mT @ x[0])), dense, atol=1e-11, rtol=0)
    # the retraction is the rank-r truncated SVD of W + xi, stored balanced
    y = FR.retr(x, 0.3 * dense)
    U2, s2, Vh2 = torch.linalg.svd(W + 0.3 * dense)
    trunc = (U2[..., :3] * s2[..., None, :3]) @ Vh2[..., :3, :]
    torch.testing.assert_close(FR.to_dense(y), trunc, atol=1e-11, rtol=0)
    torch.testing.assert_close(y[0].mT @ y[0], y[1].mT @ y[1], atol=1e-12, rtol=0)


def test_factored_balance_and_gauge_invariance(gen):
    A, B = torch.randn(3, 8, 2, generator=gen, dtype=F64), 5 * torch.randn(3, 6, 2, generator=gen, dtype=F64)
    A2, B2 = FG.projx((A, B))
    torch.testing.assert_close(A2 @ B2.mT, A @ B.mT, atol=1e-12, rtol=0)
    torch.testing.assert_close(A2.mT @ A2, B2.mT @ B2, atol=1e-12, rtol=0)
    G = torch.randn(3, 8, 6, generator=gen, dtype=F64)

    def dW(A, B):  # the change of W along the scaled gradient of <G, A B^T>
        xi = FG.egrad2rgrad((A, B), (G @ B, G.mT @ A))
        return xi[..., :8, :] @ B.mT + A @ xi[..., 8:, :].mT

    P = torch.randn(2, 2, generator=gen, dtype=F64) + 2 * torch.eye(2, dtype=F64)
    torch.testing.assert_close(dW(A, B), dW(A @ P, B @ torch.linalg.inv(P).mT), atol=1e-10, rtol=0)


# ====================================================================== ManifoldParameter, constrain_
def test_manifold_parameter_survives_deepcopy_pickle_to_and_state_dict(gen):
    W = ManifoldParameter(ST.random(2, 6, 3, generator=gen, dtype=F64), ST)
    for other in (copy.deepcopy(W), pickle.loads(pickle.dumps(W))):
        assert type(other) is ManifoldParameter and isinstance(other.manifold, Stiefel)
        assert torch.equal(other, W) and other.requires_grad
    m = nn.Module()
    m.W = W
    m.A, m.B = (nn.Parameter(t) for t in FR.random(5, 4, 2, generator=gen, dtype=F64))
    constrain_(FixedRankEmbedded(), m.A, m.B)
    m2 = copy.deepcopy(m)
    assert m2.A.manifold is m2.B.manifold and m2.A.manifold is not m.A.manifold  # the copy's pair is one pair
    m.float()
    assert type(m.W) is ManifoldParameter and m.W.dtype == torch.float32 and m.W is W
    sd = m2.state_dict()
    assert type(sd["W"]) is torch.Tensor
    m.double().load_state_dict(sd)
    assert type(m.W) is ManifoldParameter and torch.equal(m.W, m2.W)
    assert ManifoldParameter(torch.zeros(3)).manifold.name == "Euclidean"


def test_off_manifold_values_are_refused_and_nothing_is_tagged(gen):
    with pytest.raises(ValueError, match="orthonormal"):
        ManifoldParameter(torch.randn(6, 3, dtype=F64), ST)
    with pytest.raises(ValueError, match="manifold must be"):
        ManifoldParameter(torch.randn(6, 3, dtype=F64), "stiefel")
    good, bad = nn.Parameter(ST.random(6, 3, dtype=F64)), nn.Parameter(torch.randn(6, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"params\[1\]"):
        constrain_(ST, good, bad)
    assert type(good) is nn.Parameter  # all or nothing
    A, B = nn.Parameter(torch.randn(5, 2, dtype=F64)), nn.Parameter(torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match="factor B .*rank below r = 2"):
        constrain_(FixedRankFactored(), A, B)
    with pytest.raises(ValueError, match="one pair"):
        constrain_(FixedRankFactored(), A)


# ====================================================================== RiemannianAdam: the five claims
def _orth(g, n):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return q * torch.sign(torch.diagonal(r))


def _run(W0, grads, **kw):
    """RiemannianAdam on a frame copy of W0 with the given gradient sequence; return the iterates."""
    W = ManifoldParameter(W0.clone(), Stiefel())
    opt = RiemannianAdam([W], **kw)
    out = []
    for g in grads:
        W.grad = g.clone()
        opt.step()
        out.append(W.detach().clone())
    return out, opt


@pytest.mark.parametrize("shape", [(8, 3), (4, 6, 2), (5, 5)])
def test_claim_a_first_step_is_steepest_descent(gen, shape):
    """Among unit tangent directions d none decreases <g, d> more than the step's; the step is -xi/|xi| per frame."""
    W0 = ST.random(*shape, generator=gen, dtype=F64)
    g = torch.randn(*shape, generator=gen, dtype=F64)
    (W1,), _ = _run(W0, [g], lr=1e-3, eps=0.0)
    D = ST.proju(W0, W1 - W0)  # the tangent step, to first order
    xi = ST.proju(W0, g)
    unit = -xi / ST.norm(W0, xi)[..., None, None]
    torch.testing.assert_close(D / ST.norm(W0, D)[..., None, None], unit, atol=1e-6, rtol=0)
    best = (g * unit).sum(dim=(-1, -2))
    Wx = W0.expand(3000, *shape)
    dirs = ST.proju(Wx, torch.randn(3000, *shape, generator=gen, dtype=F64))
    vals = (g * (dirs / ST.norm(Wx, dirs)[..., None, None])).sum(dim=(-1, -2))
    assert (vals >= best - 1e-12).all()
    torch.testing.assert_close(best, -ST.norm(W0, xi), atol=1e-12, rtol=0)
    assert (vals.min(dim=0).values - best).max() < 0.8 * ST.norm(W0, xi).min()  # the search has teeth


def test_claim_a_holds_at_every_step_without_momentum(gen):
    grads = [torch.randn(6, 3, generator=gen, dtype=F64) for _ in range(5)]
    W = ManifoldParameter(ST.random(6, 3, generator=gen, dtype=F64), ST)
    opt = RiemannianAdam([W], lr=1e-4, betas=(0.0, 0.99), eps=0.0)
    for g in grads:
        prev = W.detach().clone()
        W.grad = g
        opt.step()
        D, xi = ST.proju(prev, W.detach() - prev), ST.proju(prev, g)
        assert (D * xi).sum() / (D.norm() * xi.norm()) < -1 + 1e-7


@pytest.mark.parametrize("c", [1e-6, 3e-2, 7.0, 1e5])
def test_claim_b_step_is_independent_of_gradient_scale(gen, c):
    W0 = ST.random(3, 7, 4, generator=gen, dtype=F64)
    grads = [torch.randn(3, 7, 4, generator=gen, dtype=F64) for _ in range(20)]
    a, _ = _run(W0, grads, lr=0.05, eps=0.0, trust_radius=0.04)
    b, _ = _run(W0, [c * g for g in grads], lr=0.05, eps=0.0, trust_radius=0.04)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-13, rtol=0)
    (a1,), _ = _run(W0, grads[:1], lr=0.01)  # with the default eps: approximate, of relative size eps/|xi|
    (b1,), _ = _run(W0, [1e3 * grads[0]], lr=0.01)
    assert 0 < (a1 - b1).abs().max() < 1e-9


def test_claim_c_stays_on_the_manifold_for_thousands_of_steps(gen):
    W0 = ST.random(2, 12, 4, generator=gen, dtype=F64)
    W = ManifoldParameter(W0.clone(), ST)
    opt = RiemannianAdam([W], lr=0.1, trust_radius=0.2)
    g = torch.Generator().manual_seed(7)
    eye, worst = torch.eye(4, dtype=F64), 0.0
    for _ in range(2000):
        W.grad = torch.randn(2, 12, 4, generator=g, dtype=F64)
        opt.step()
        worst = max(worst, (W.mT @ W - eye).abs().max().item())
    assert worst < 5e-14 and (W.detach() - W0).norm() > 1.0
    ST.check_vector(W.detach(), opt.state[W]["exp_avg"])  # the momentum is kept tangent


def test_claim_d_exact_orthogonal_equivariance(gen):
    W0 = ST.random(2, 9, 3, generator=gen, dtype=F64)
    Q = _orth(gen, 9)
    grads = [torch.randn(2, 9, 3, generator=gen, dtype=F64) for _ in range(50)]
    a, _ = _run(W0, grads, lr=0.05, trust_radius=0.03)
    b, _ = _run(Q @ W0, [Q @ g for g in grads], lr=0.05, trust_radius=0.03)
    for x, y in zip(a, b):
        torch.testing.assert_close(Q @ x, y, atol=1e-13, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("scale", [0.0, 1e-6, 1.0])
def test_claim_e_weight_decay_leaves_frames_bitwise_unchanged(dtype, scale):
    # D16: with decay added before projecting, gradients of size 1e-6 moved the frames by 7.8e-3 in 20 steps
    g = torch.Generator().manual_seed(3)
    grads = [scale * torch.randn(16, 4, generator=g, dtype=F64).to(dtype) for _ in range(40)]
    W0 = ST.random(16, 4, generator=torch.Generator().manual_seed(0), dtype=F64).to(dtype)
    a, _ = _run(W0, grads, lr=1e-2, eps=0.0, weight_decay=0.0)
    b, _ = _run(W0, grads, lr=1e-2, eps=0.0, weight_decay=1.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    moved = (a[-1] - W0).norm()
    assert moved > 0.03 if scale else moved < (1e-5 if dtype == torch.float32 else 1e-13)


def test_trust_radius_caps_the_step(gen):
    W0 = ST.random(5, 10, 3, generator=gen, dtype=F64)
    (W1,), _ = _run(W0, [torch.randn(5, 10, 3, generator=gen, dtype=F64)], lr=1.0, trust_radius=0.05)
    dist = (W1 - W0).square().sum(dim=(-1, -2)).sqrt()  # |polar(W + D) - W| <= |D| for tangent D
    assert (dist <= 0.05 + 1e-12).all() and (dist > 0.04).all()


# ====================================================================== RiemannianAdam: objectives, AdamW
def test_brockett_cost_on_stiefel_reaches_its_minimum(gen):
    """f(X) = tr(X^T S X N), N = diag(p..1): the minimum is sum_i N_i lambda_i (ascending eigenvalues)."""
    n, p = 8, 3
    Z = torch.randn(n, n, generator=gen, dtype=F64)
    S, N = Z @ Z.T / n, torch.diag(torch.arange(p, 0, -1, dtype=F64))
    target = (torch.linalg.eigvalsh(S)[:p] * torch.diag(N)).sum()
    X = ManifoldParameter(ST.random(n, p, generator=gen, dtype=F64), ST)
    opt = RiemannianAdam([X], lr=0.05)
    cost = lambda: torch.trace(X.T @ S @ X @ N)  # noqa: E731
    start = cost().item()
    for k in range(1500):
        for grp in opt.param_groups:
            grp["lr"] = 0.05 * (1 - k / 1500) + 1e-4
        opt.zero_grad()
        cost().backward()
        opt.step()
    assert start - target > 0.5 and cost().item() - target < 1e-3
    ST.check_point(X.detach())


@pytest.mark.parametrize("geometry", [FixedRankEmbedded, FixedRankFactored])
def test_low_rank_approximation_on_fixed_rank(gen, geometry):
    m, n, r = 10, 8, 2
    Y = torch.randn(m, r, generator=gen, dtype=F64) @ torch.randn(r, n, generator=gen, dtype=F64)
    A = nn.Parameter(0.3 * torch.randn(m, r, generator=gen, dtype=F64))
    B = nn.Parameter(0.3 * torch.randn(n, r, generator=gen, dtype=F64))
    constrain_(geometry(), A, B)
    opt = RiemannianAdam([A, B], lr=0.05, trust_radius=0.5)
    start = (A @ B.T - Y).square().sum().item()
    for k in range(400):
        for grp in opt.param_groups:
            grp["lr"] = 0.1 * (1 - k / 400) + 1e-3
        opt.zero_grad()
        (0.5 * (A @ B.T - Y).square().sum()).backward()
        opt.step()
    assert (A @ B.T - Y).square().sum().item() < 1e-3 * start
    assert not opt.state[B]  # a pair's state is kept at its first factor


def test_embedded_first_step_is_the_normalised_projected_gradient(gen):
    A0, B0 = torch.randn(2, 8, 3, generator=gen, dtype=F64), torch.randn(2, 6, 3, generator=gen, dtype=F64)
    G = torch.randn(2, 8, 6, generator=gen, dtype=F64)
    A, B = constrain_(FixedRankEmbedded(), nn.Parameter(A0.clone()), nn.Parameter(B0.clone()))
    opt = RiemannianAdam([A, B], lr=0.1, betas=(0.0, 0.9), eps=0.0)
    (G * (A @ B.mT)).sum().backward()
    opt.step()
    xi = FR.proju((A0, B0), G)
    want = FR.to_dense(FR.retr((A0, B0), -0.1 * xi / FR.norm((A0, B0), xi)[:, None, None]))
    torch.testing.assert_close(A.detach() @ B.detach().mT, want, atol=1e-12, rtol=0)


def test_factored_steps_do_not_depend_on_the_factorisation(gen):
    """The product after 5 steps is the same from (A, B) and (A P, B P^-T): GL(r) invariance, momentum included."""
    A0, B0 = torch.randn(7, 2, generator=gen, dtype=F64), torch.randn(5, 2, generator=gen, dtype=F64)
    G = torch.randn(7, 5, generator=gen, dtype=F64)
    P = torch.tensor([[2.0, 0.5], [0.0, 0.7]], dtype=F64)
    prods = []
    for a, b in ((A0, B0), (A0 @ P, B0 @ torch.linalg.inv(P).T)):
        A, B = constrain_(FixedRankFactored(), nn.Parameter(a.clone()), nn.Parameter(b.clone()))
        opt = RiemannianAdam([A, B], lr=0.05)
        for _ in range(5):
            opt.zero_grad()
            (G * (A @ B.T)).sum().backward()
            opt.step()
        prods.append((A @ B.T).detach())
    torch.testing.assert_close(prods[0], prods[1], atol=1e-9, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(F64, 1e-14), (torch.float32, 1e-6)])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_euclidean_parameters_match_torch_adamw(gen, dtype, atol, amsgrad):
    x0 = torch.randn(5, 4, generator=gen, dtype=F64).to(dtype)
    p1, p2 = nn.Parameter(x0.clone()), nn.Parameter(x0.clone())
    kw = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3, amsgrad=amsgrad)
    o1, o2 = RiemannianAdam([p1], **kw), torch.optim.AdamW([p2], **kw)
    for _ in range(10):
        g = torch.randn(5, 4, generator=gen, dtype=F64).to(dtype)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), atol=atol, rtol=0)
    assert (p1.detach() - x0).abs().max() > 0.05  # it moved


def test_a_zero_gradient_with_eps_0_takes_a_zero_step(gen):
    W = ManifoldParameter(ST.random(6, 3, generator=gen, dtype=F64), ST)
    opt = RiemannianAdam([W], lr=0.1, eps=0.0)
    W0 = W.detach().clone()
    W.grad = torch.zeros_like(W)
    opt.step()
    assert torch.allclose(W, W0, atol=1e-12) and torch.equal(opt.state[W]["exp_avg_sq"], torch.zeros(1, 1, dtype=F64))
    W.grad = torch.randn(W.shape, generator=gen, dtype=F64)
    opt.step()
    assert not torch.allclose(W, W0)
    ST.check_point(W.detach())


@pytest.mark.parametrize("mode", ["euclidean", "riemannian", "fiber_bundle"])
def test_the_models_orthonormal_frames_train_on_stiefel(mode):
    """FiberBundleConfig(attention=dict(qk_init="orthonormal")) + constrain_ + RiemannianAdam keeps W_Q, W_K on St(D, d)."""
    torch.manual_seed(0)
    cfg = rr.FiberBundleConfig.tiny(mode=mode, attention=dict(qk_init="orthonormal"))
    model = rr.FiberBundleTransformer(cfg).double()
    frames = model.qk_frame_parameters()
    with torch.no_grad():  # frames were orthonormalised in float32; re-project after .double()
        for W in frames:
            W.copy_(ST.projx(W))
    constrain_(Stiefel(), *frames)
    assert all(any(p is f for p in model.parameters()) for f in frames)  # the model holds the same objects
    opt = RiemannianAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in frames]
    idx = torch.randint(cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):
        out = model(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    eye = torch.eye(frames[0].shape[-1], dtype=F64)
    for W, W0 in zip(frames, before):
        assert (W.mT @ W - eye).abs().max() < 1e-12 and (W - W0).abs().max() > 1e-6
    assert losses[-1] < losses[0]


def test_state_dict_round_trip(gen):
    W0, b0 = ST.random(2, 6, 2, generator=gen, dtype=F64), torch.randn(6, generator=gen, dtype=F64)
    A0, B0 = FR.random(5, 4, 2, generator=gen, dtype=F64)
    grads = [[torch.randn(t.shape, generator=gen, dtype=F64) for t in (W0, b0, A0, B0)] for _ in range(10)]

    def make():
        ps = [ManifoldParameter(W0.clone(), ST), nn.Parameter(b0.clone())]
        ps += constrain_(FixedRankFactored(), nn.Parameter(A0.clone()), nn.Parameter(B0.clone()))
        opt = RiemannianAdam([{"params": ps[:1], "trust_radius": 0.1}, {"params": ps[1:2], "weight_decay": 0.1},
                              {"params": ps[2:], "amsgrad": True}], lr=0.02)
        return ps, opt

    ps, opt = make()
    for gs in grads[:5]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    ps2, opt2 = make()
    with torch.no_grad():
        for p, q in zip(ps2, ps):
            p.copy_(q)
    opt2.load_state_dict(sd)
    for gs in grads[5:]:
        for p, q, g in zip(ps, ps2, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, ps2))


# ====================================================================== checks: one path for every group
def _frame(*shape, seed=0, dtype=F64):
    return ManifoldParameter(ST.random(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype), ST)


def _randn(*shape, seed=0, dtype=F64):
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _pair(m=5, n=4, r=2, seed=1, geometry=FixedRankEmbedded):
    return list(constrain_(geometry(), _randn(m, r, seed=seed), _randn(n, r, seed=seed + 1)))


def _opt():
    return RiemannianAdam([{"params": [_frame(6, 3)] + _pair()}], lr=1e-2)


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict()), [[p.detach().clone() for p in g["params"]] for g in opt.param_groups]


def _assert_unchanged(opt, snap):
    sd, values = snap
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"] and now["state"].keys() == sd["state"].keys()
    assert len(opt.param_groups) == len(values)
    for g, vs in zip(opt.param_groups, values):
        assert all(torch.equal(p, v) for p, v in zip(g["params"], vs))


def _off(p):  # a frame moved off the manifold after it was tagged
    with torch.no_grad():
        p.mul_(3)
    return p


def _lonely_factor():
    return {"params": _pair()[:1]}


def _rank_one_pair():
    A, B = _pair()
    with torch.no_grad():
        A[:, 1] = A[:, 0]
    return {"params": [A, B]}


_BAD = [
    (lambda: {"params": [_off(_frame(6, 3))]}, r"param group 1: parameter 0 .*orthonormal frames"),
    (lambda: {"params": [_randn(3)], "lr": -0.5, "betas": (1.5, 0.9)}, r"param group 1: lr"),
    (lambda: {"params": [_randn(3)], "betas": (1.5, 0.9)}, r"param group 1: betas\[0\]"),
    (lambda: {"params": [_randn(3)], "betas": (0.9, 1.0)}, r"param group 1: betas\[1\]"),
    (lambda: {"params": [_randn(3)], "betas": 0.9}, r"param group 1: betas"),
    (lambda: {"params": [_randn(3)], "eps": -1e-8}, r"param group 1: eps"),
    (lambda: {"params": [_randn(3)], "weight_decay": float("nan")}, r"param group 1: weight_decay"),
    (lambda: {"params": [_randn(3)], "trust_radius": 0.0}, r"param group 1: trust_radius"),
    (lambda: {"params": [_randn(3)], "amsgrad": 1}, r"param group 1: amsgrad must be a bool"),
    (lambda: {"params": [_randn(6, 3)], "stiefel": True}, r"param group 1: the 'stiefel' group flag is gone"),
    (lambda: {"params": [_randn(6, 3)], "geometry": "embedded"}, r"param group 1: the 'geometry' group flag"),
    (lambda: {"params": [_randn(3)], "weight_decy": 0.1}, r"param group 1: unknown key 'weight_decy' \(did you"),
    (_lonely_factor, r"param group 1: pair \(parameters 0\) .*needs both factors"),
    (lambda: {"params": _pair() + _pair(r=3, seed=5)[:1]}, r"param group 1: pair \(parameters 2\)"),
    (_rank_one_pair, r"param group 1: pair \(parameters 0, 1\) .*factor A .*rank below r = 2"),
    (lambda: {"params": [ManifoldParameter(ST.random(16, 4).bfloat16(), ST)]},
     r"param group 1: .*bfloat16, expected float32 or float64: half"),
]


@pytest.mark.parametrize("case", range(len(_BAD)))
def test_add_param_group_runs_the_constructors_checks(case):
    # D4: add_param_group checked nothing; now it refuses what the constructor refuses, changing nothing
    make, match = _BAD[case]
    opt = _opt()
    snap = _snapshot(opt)
    group = make()
    with pytest.raises(ValueError, match=match):
        opt.add_param_group(group)
    _assert_unchanged(opt, snap)
    with pytest.raises(ValueError, match=match):  # the constructor refuses the same group, naming the same place
        RiemannianAdam([{"params": [_frame(6, 3, seed=3)]}, make()], lr=1e-2)


def test_tensors_in_two_places_and_split_pairs_are_refused():
    opt = _opt()
    p0 = opt.param_groups[0]["params"][0]
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 1: parameter 1 .*already in param group 0"):
        opt.add_param_group({"params": [_randn(3), p0]})
    x = _randn(3)
    with pytest.raises(ValueError, match=r"param group 1: parameters 0 and 1 are the same tensor"):
        opt.add_param_group({"params": [x, x]})
    A, B = _pair()
    with pytest.raises(ValueError, match=r"param group 1: pair .*needs both factors"):
        RiemannianAdam([{"params": [_randn(2)]}, {"params": [A]}, {"params": [B]}])
    _assert_unchanged(opt, snap)
    reused = FixedRankEmbedded()  # one instance for two pairs: four tensors, not a pair
    with pytest.raises(ValueError, match="holds 4 tensors"):
        RiemannianAdam([*constrain_(reused, _randn(5, 2), _randn(4, 2, seed=3)),
                        *constrain_(reused, _randn(5, 2, seed=4), _randn(4, 2, seed=5))])


def test_good_groups_added_later_step_as_the_constructors_would():
    opt = _opt()
    W, b = _frame(7, 2, seed=5), _randn(4, seed=6)
    opt.add_param_group({"params": W, "lr": 0.05, "trust_radius": 0.1})
    opt.add_param_group({"params": (q for q in [b]), "weight_decay": 0.1, "betas": [0.8, 0.9]})
    assert opt.param_groups[2]["betas"] == (0.8, 0.9) and opt.param_groups[1]["params"] == [W]
    twin = RiemannianAdam([{"params": [_frame(6, 3)] + _pair()},
                           {"params": [_frame(7, 2, seed=5)], "lr": 0.05, "trust_radius": 0.1},
                           {"params": [_randn(4, seed=6)], "weight_decay": 0.1, "betas": (0.8, 0.9)}], lr=1e-2)
    for _ in range(3):
        for o in (opt, twin):
            for grp in o.param_groups:
                for p in grp["params"]:
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64)
            o.step()
    for ga, gb in zip(opt.param_groups, twin.param_groups):
        assert all(torch.equal(p, q) for p, q in zip(ga["params"], gb["params"]))


def test_groups_edited_by_hand_and_points_moved_off_are_refused_before_any_change():
    opt = _opt()
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    snap = _snapshot(opt)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="RiemannianAdam.step: param group 0: lr"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    A = opt.param_groups[0]["params"][1]
    saved = A.detach().clone()
    with torch.no_grad():
        A[:, 1] = A[:, 0]  # the pair drifts to rank 1 between steps
    snap = (snap[0], [[saved if p is A else v for p, v in zip(opt.param_groups[0]["params"], snap[1][0])]])
    with pytest.raises(ValueError, match=r"step: param group 0: pair .*factor A .*rank below r = 2.*nothing was"):
        opt.step()
    with torch.no_grad():
        A.copy_(saved)
    _assert_unchanged(opt, snap)


def test_a_nan_gradient_raises_and_changes_nothing(gen):
    opt = _opt()
    params = opt.param_groups[0]["params"]
    twin = copy.deepcopy(opt)  # an optimiser deep-copies, its pair's manifold shared in the copy
    twin_params = twin.param_groups[0]["params"]
    assert twin_params[1].manifold is twin_params[2].manifold is not params[1].manifold

    def step_both(grads):
        for ps, o in ((params, opt), (twin_params, twin)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()

    step_both([torch.randn(p.shape, generator=gen, dtype=F64) for p in params])
    snap = _snapshot(opt)
    bad = [torch.randn(p.shape, generator=gen, dtype=F64) for p in params]
    bad[2].view(-1)[0] = float("nan")
    for p, g in zip(params, bad):
        p.grad = g
    with pytest.raises(FloatingPointError, match=r"gradient of parameter 2 of group 0 .* non-finite"):
        opt.step()
    _assert_unchanged(opt, snap)
    step_both([torch.randn(p.shape, generator=gen, dtype=F64) for p in params])
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))


def test_named_parameters_are_checked_too():
    model = nn.Linear(3, 2).double()
    opt = RiemannianAdam(model.named_parameters(), lr=1e-2)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    with pytest.raises(ValueError, match=r"param group 1: parameter 0 .*orthonormal frames"):
        opt.add_param_group({"params": [("W", _off(_frame(6, 3)))]})
    with pytest.raises(ValueError, match=r"param group 1: parameter 0 is already in param group 0"):
        opt.add_param_group({"params": [("w", model.weight)]})
    opt.add_param_group({"params": [("F", _frame(6, 3))], "name": "frames"})  # an unrelated key is a label
    assert opt.param_groups[1]["param_names"] == ["F"] and opt.param_groups[1]["name"] == "frames"


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_frame_tolerance_follows_the_dtype(dtype):
    # D19: a frame made in float32 and cast is a point in float32; in float64 it must be re-projected
    W32 = ST.random(64, 8, generator=torch.Generator().manual_seed(0))
    if dtype == torch.float32:
        RiemannianAdam([ManifoldParameter(W32, ST)])
    else:
        with pytest.raises(ValueError, match=r"max \|x\^T x - I\| = .* > atol = 1\.0e-10.*projx"):
            ManifoldParameter(W32.double(), ST)
        RiemannianAdam([ManifoldParameter(ST.projx(W32.double()), ST)])
    RiemannianAdam([nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])  # Euclidean: any float dtype


def _stepped():
    opt = _opt()
    opt.add_param_group({"params": [_randn(4, seed=9)]})
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd["param_groups"][0].update(lr=-1.0), r"load_state_dict: param group 0: lr"),
    (lambda sd: sd["param_groups"][1].update(betas=(0.9, 1.0)), r"load_state_dict: param group 1: betas\[1\]"),
    (lambda sd: sd["param_groups"][0].update(eps=float("inf")), r"param group 0: eps"),
    (lambda sd: sd["param_groups"][0].pop("trust_radius"), r"load_state_dict: param group 0 lacks trust_radius"),
    (lambda sd: sd["param_groups"][0].update(amsgrad=True),
     r"param group 0: state of parameter 0: max_exp_avg_sq is missing"),
    (lambda sd: sd["state"][0].update(exp_avg_sq=torch.zeros(6, 3)),
     r"param group 0: state of parameter 0: exp_avg_sq has shape \[6, 3\], expected \[1, 1\]"),
    (lambda sd: sd["state"][1].update(exp_avg=torch.zeros(5, 2)),
     r"param group 0: state of parameter 1: exp_avg has shape \[5, 2\], expected \[5, 4\]"),
    (lambda sd: sd["state"].update({2: copy.deepcopy(sd["state"][1])}),
     r"state of parameter 2: a factor pair's state is kept at its first factor"),
    (lambda sd: sd["state"][3].pop("exp_avg"), r"param group 1: state of parameter 0: .*exp_avg"),
    (lambda sd: sd["state"][3].update(step=-3), r"param group 1: state of parameter 0: step must be an int"),
    (lambda sd: sd["state"][0]["exp_avg"].fill_(float("nan")), r"param group 0: .*exp_avg has non-finite"),
])
def test_load_state_dict_runs_the_same_checks(edit, match):
    # D4: a state dict brings in groups and state; they pass the same checks, changing nothing if refused
    opt = _stepped()
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    _assert_unchanged(opt, snap)
    opt.load_state_dict(copy.deepcopy(snap[0]))  # an untouched one still loads


@pytest.mark.parametrize("kw,name", [(dict(lr=-1.0), "lr"), (dict(lr="fast"), "lr"), (dict(eps=None), "eps"),
                                     (dict(betas=0.9), "betas"), (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
                                     (dict(weight_decay=float("nan")), "weight_decay"),
                                     (dict(trust_radius=0.0), "trust_radius"), (dict(amsgrad="no"), "amsgrad")])
def test_hyper_parameters_refuse_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        RiemannianAdam([nn.Parameter(torch.zeros(3))], **kw)
