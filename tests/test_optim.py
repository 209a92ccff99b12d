"""StiefelAdam's five claims and LowRankAdam, in float64."""
import copy

import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.optim import FixedRankEmbedded, FixedRankTangent

F64 = torch.float64
ST = rr.Stiefel()


def _orth(g, n):
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return q * torch.sign(torch.diagonal(r))


def _run(W0, grads, **kw):
    """Apply StiefelAdam to a copy of W0 with the given gradient sequence; return the iterates."""
    W = torch.nn.Parameter(W0.clone())
    opt = rr.StiefelAdam([{"params": [W], "stiefel": True}], **kw)
    out = []
    for g in grads:
        W.grad = g.clone()
        opt.step()
        out.append(W.detach().clone())
    return out, opt


@pytest.mark.parametrize("shape", [(8, 3), (4, 6, 2), (5, 5)])
def test_claim_a_first_step_is_steepest_descent(gen, shape):
    """Among unit tangent directions d, none decreases the linearised loss <g, d>
    more than the step's direction; the step is -xi/|xi| (per frame)."""
    W0 = ST.random(*shape, generator=gen, dtype=F64)
    g = torch.randn(*shape, generator=gen, dtype=F64)
    (W1,), _ = _run(W0, [g], lr=1e-3, eps=0.0)
    # tangent step recovered from the polar retraction: W1 = polar(W0 + D) with D tangent,
    # so D = proj_{W0}-part of the lift; to first order D = W1 - W0 (O(lr^2) error)
    D = ST.proju(W0, W1 - W0)
    xi = ST.proju(W0, g)
    unit = -xi / ST.norm(W0, xi)[..., None, None]
    torch.testing.assert_close(D / ST.norm(W0, D)[..., None, None], unit, atol=1e-6, rtol=0)
    # brute force over random unit tangent directions, per frame
    best = (g * unit).sum(dim=(-1, -2))  # (...)
    dirs = ST.proju(W0.expand(3000, *shape), torch.randn(3000, *shape, generator=gen, dtype=F64))
    dirs = dirs / ST.norm(W0.expand(3000, *shape), dirs)[..., None, None]
    vals = (g * dirs).sum(dim=(-1, -2))  # (3000, ...)
    assert (vals >= best - 1e-12).all()
    torch.testing.assert_close(best, -ST.norm(W0, xi), atol=1e-12, rtol=0)
    # the search does come close to the optimum, so the comparison has teeth
    assert (vals.min(dim=0).values - best).max() < 0.8 * ST.norm(W0, xi).min()


def test_claim_a_holds_at_every_step_without_momentum(gen):
    W0 = ST.random(6, 3, generator=gen, dtype=F64)
    grads = [torch.randn(6, 3, generator=gen, dtype=F64) for _ in range(5)]
    W = torch.nn.Parameter(W0.clone())
    opt = rr.StiefelAdam([{"params": [W], "stiefel": True}], lr=1e-4, betas=(0.0, 0.99), eps=0.0)
    for g in grads:
        Wprev = W.detach().clone()
        W.grad = g
        opt.step()
        D = ST.proju(Wprev, W.detach() - Wprev)
        xi = ST.proju(Wprev, g)
        cos = (D * xi).sum() / (D.norm() * xi.norm())
        assert cos < -1 + 1e-7


@pytest.mark.parametrize("c", [1e-6, 3e-2, 7.0, 1e5])
def test_claim_b_step_is_independent_of_gradient_scale(gen, c):
    W0 = ST.random(3, 7, 4, generator=gen, dtype=F64)
    grads = [torch.randn(3, 7, 4, generator=gen, dtype=F64) for _ in range(20)]
    a, _ = _run(W0, grads, lr=0.05, eps=0.0, trust_radius=0.04)
    b, _ = _run(W0, [c * g for g in grads], lr=0.05, eps=0.0, trust_radius=0.04)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-13, rtol=0)


def test_claim_b_with_default_eps_is_approximate_and_bounded(gen):
    W0 = ST.random(7, 4, generator=gen, dtype=F64)
    g = torch.randn(7, 4, generator=gen, dtype=F64)
    (a,), _ = _run(W0, [g], lr=0.01)
    (b,), _ = _run(W0, [1e3 * g], lr=0.01)
    # relative effect of eps is about eps / |xi| = 1e-8 / O(1)
    assert (a - b).abs().max() < 1e-9


def test_claim_c_stays_on_manifold_for_thousands_of_steps(gen):
    W0 = ST.random(2, 12, 4, generator=gen, dtype=F64)
    W = torch.nn.Parameter(W0.clone())
    opt = rr.StiefelAdam([{"params": [W], "stiefel": True}], lr=0.1, trust_radius=0.2)
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    eye = torch.eye(4, dtype=F64)
    for _ in range(2000):
        W.grad = torch.randn(2, 12, 4, generator=g, dtype=F64)
        opt.step()
        worst = max(worst, (W.transpose(-1, -2) @ W - eye).abs().max().item())
    assert worst < 5e-14
    assert (W.detach() - W0).norm() > 1.0  # it did move
    m = opt.state[W]["exp_avg"]
    assert ST.check_vector(W.detach(), m)[0]  # momentum kept tangent


def test_claim_d_exact_orthogonal_equivariance(gen):
    n, p = 9, 3
    W0 = ST.random(2, n, p, generator=gen, dtype=F64)
    Q = _orth(gen, n)
    grads = [torch.randn(2, n, p, generator=gen, dtype=F64) for _ in range(50)]
    a, _ = _run(W0, grads, lr=0.05, trust_radius=0.03)
    b, _ = _run(Q @ W0, [Q @ g for g in grads], lr=0.05, trust_radius=0.03)
    for x, y in zip(a, b):
        torch.testing.assert_close(Q @ x, y, atol=1e-13, rtol=0)


def test_claim_e_weight_decay_has_zero_riemannian_gradient(gen):
    W0 = ST.random(3, 8, 4, generator=gen, dtype=F64)
    assert ST.proju(W0, W0).abs().max() < 1e-15
    grads = [torch.randn(3, 8, 4, generator=gen, dtype=F64) for _ in range(30)]
    a, _ = _run(W0, grads, lr=0.05, weight_decay=0.0)
    b, _ = _run(W0, grads, lr=0.05, weight_decay=1.0)
    for x, y in zip(a, b):  # frames are not decayed at all: bitwise the same trajectory (D16)
        assert torch.equal(x, y)
    # whereas AdamW's decay does move an unconstrained matrix
    P = torch.nn.Parameter(W0.clone())
    opt = rr.StiefelAdam([P], lr=0.05, weight_decay=1.0)
    P.grad = torch.zeros_like(P)
    opt.step()
    assert (P.detach() - W0).abs().max() > 1e-3


def test_trust_radius_caps_the_step(gen):
    W0 = ST.random(5, 10, 3, generator=gen, dtype=F64)
    (W1,), _ = _run(W0, [torch.randn(5, 10, 3, generator=gen, dtype=F64)], lr=1.0, trust_radius=0.05)
    # |polar(W + D) - W| <= |D| for a tangent D (polar is a projection onto a set containing W)
    dist = (W1 - W0).square().sum(dim=(-1, -2)).sqrt()
    assert (dist <= 0.05 + 1e-12).all() and (dist > 0.04).all()


def test_plain_groups_match_torch_adamw(gen):
    x0 = torch.randn(5, 4, generator=gen, dtype=F64)
    p1, p2 = torch.nn.Parameter(x0.clone()), torch.nn.Parameter(x0.clone())
    o1 = rr.StiefelAdam([p1], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3)
    o2 = torch.optim.AdamW([p2], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3)
    for _ in range(10):
        g = torch.randn(5, 4, generator=gen, dtype=F64)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(p1.detach(), p2.detach(), atol=1e-14, rtol=0)


def test_state_dict_round_trip(gen):
    W0 = ST.random(2, 6, 2, generator=gen, dtype=F64)
    b0 = torch.randn(6, generator=gen, dtype=F64)
    grads = [(torch.randn(2, 6, 2, generator=gen, dtype=F64), torch.randn(6, generator=gen, dtype=F64)) for _ in range(10)]

    def make(W_init, b_init):
        W, b = torch.nn.Parameter(W_init.clone()), torch.nn.Parameter(b_init.clone())
        opt = rr.StiefelAdam([{"params": [W], "stiefel": True}, {"params": [b], "weight_decay": 0.1}],
                             lr=0.02, trust_radius=0.1)
        return W, b, opt

    W, b, opt = make(W0, b0)
    for gw, gb in grads[:5]:
        W.grad, b.grad = gw, gb
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    W2, b2, opt2 = make(W.detach(), b.detach())
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["stiefel"] and not opt2.param_groups[1]["stiefel"]
    for gw, gb in grads[5:]:
        W.grad, b.grad, W2.grad, b2.grad = gw, gb, gw.clone(), gb.clone()
        opt.step()
        opt2.step()
    torch.testing.assert_close(W2.detach(), W.detach(), atol=0, rtol=0)
    torch.testing.assert_close(b2.detach(), b.detach(), atol=0, rtol=0)


def test_bad_inputs_raise(gen):
    with pytest.raises(ValueError, match="not a stack of orthonormal frames"):
        rr.StiefelAdam([{"params": [torch.nn.Parameter(torch.randn(5, 2, dtype=F64))], "stiefel": True}])
    with pytest.raises(ValueError, match="trust_radius"):
        rr.StiefelAdam([torch.nn.Parameter(torch.zeros(3))], trust_radius=0.0)
    with pytest.raises(ValueError, match="betas"):
        rr.StiefelAdam([torch.nn.Parameter(torch.zeros(3))], betas=(1.0, 0.9))


# ---------------------------------------------------------------- LowRankAdam
FR = FixedRankEmbedded()


def test_embedded_step_uses_the_projected_gradient(gen):
    """With beta1 = 0 the first embedded step is the truncated-SVD retraction of
    -lr * xi / |xi| with xi = proj_X(G), G the Euclidean gradient of W."""
    A0 = torch.randn(2, 8, 3, generator=gen, dtype=F64)
    B0 = torch.randn(2, 6, 3, generator=gen, dtype=F64)
    G = torch.randn(2, 8, 6, generator=gen, dtype=F64)
    A, B = torch.nn.Parameter(A0.clone()), torch.nn.Parameter(B0.clone())
    opt = rr.LowRankAdam([{"params": [A, B], "geometry": "embedded"}], lr=0.1, betas=(0.0, 0.9), eps=0.0)
    (G * (A @ B.transpose(-1, -2))).sum().backward()
    opt.step()
    x = FR.from_factors(A0, B0)
    xi = FR.proju(x, G)
    nrm = FR.inner(x, xi).sqrt()
    want = FR.to_dense(FR.retr(x, FixedRankTangent(*(-0.1 * c / nrm[:, None, None] for c in xi))))
    got = A.detach() @ B.detach().transpose(-1, -2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # stored balanced
    torch.testing.assert_close(A.transpose(-1, -2) @ A, B.transpose(-1, -2) @ B, atol=1e-12, rtol=0)


@pytest.mark.parametrize("geometry", ["embedded", "factored"])
def test_low_rank_adam_fits_a_rank_r_target(gen, geometry):
    m, n, r = 10, 8, 2
    Y = torch.randn(m, r, generator=gen, dtype=F64) @ torch.randn(r, n, generator=gen, dtype=F64)
    A = torch.nn.Parameter(0.3 * torch.randn(m, r, generator=gen, dtype=F64))
    B = torch.nn.Parameter(0.3 * torch.randn(n, r, generator=gen, dtype=F64))
    opt = rr.LowRankAdam([{"params": [A, B], "geometry": geometry}], lr=0.05, trust_radius=0.5)
    start = (A @ B.T - Y).square().sum().item()
    for k in range(400):
        for group in opt.param_groups:
            group["lr"] = 0.1 * (1 - k / 400) + 1e-3
        opt.zero_grad()
        loss = 0.5 * (A @ B.T - Y).square().sum()
        loss.backward()
        opt.step()
    end = (A @ B.T - Y).square().sum().item()
    assert end < 1e-3 * start


def test_factored_step_keeps_momentum_consistent_under_balancing(gen):
    """The factored state round-trips and the product after a step is independent
    of the (A, B) representative it started from (GL(r) invariance)."""
    A0 = torch.randn(7, 2, generator=gen, dtype=F64)
    B0 = torch.randn(5, 2, generator=gen, dtype=F64)
    G = torch.randn(7, 5, generator=gen, dtype=F64)
    P = torch.tensor([[2.0, 0.5], [0.0, 0.7]], dtype=F64)
    prods = []
    for A_init, B_init in ((A0, B0), (A0 @ P, B0 @ torch.linalg.inv(P).T)):
        A, B = torch.nn.Parameter(A_init.clone()), torch.nn.Parameter(B_init.clone())
        opt = rr.LowRankAdam([{"params": [A, B], "geometry": "factored"}], lr=0.05)
        for _ in range(5):
            opt.zero_grad()
            (G * (A @ B.T)).sum().backward()
            opt.step()
        prods.append((A @ B.T).detach())
    torch.testing.assert_close(prods[0], prods[1], atol=1e-9, rtol=0)


def test_low_rank_adam_rejects_odd_groups():
    with pytest.raises(ValueError, match="pairs"):
        rr.LowRankAdam([{"params": [torch.nn.Parameter(torch.zeros(3, 2))], "geometry": "factored"}])
    with pytest.raises(ValueError, match="geometry"):
        rr.LowRankAdam([{"params": [torch.nn.Parameter(torch.zeros(3, 2))], "geometry": "nope"}])


@pytest.mark.parametrize("mode", ["euclidean", "riemannian", "fiber_bundle"])
def test_stiefel_adam_trains_the_fiber_bundle_models_constrained_frames(mode):
    """Issue 7's config flag: FiberBundleConfig(qk_init="orthonormal") + StiefelAdam keeps W_Q, W_K on St(D, d)."""
    torch.manual_seed(0)
    cfg = rr.FiberBundleConfig.tiny(mode=mode, attention=dict(qk_init="orthonormal"))
    model = rr.FiberBundleTransformer(cfg).double()
    frames = model.qk_frame_parameters()
    with torch.no_grad():  # frames were orthonormalised in float32; re-project after .double()
        for W in frames:
            W.copy_(rr.Stiefel().projx(W))
    frame_ids = {id(p) for p in frames}
    rest = [p for p in model.parameters() if id(p) not in frame_ids]
    opt = rr.StiefelAdam([{"params": frames, "stiefel": True}, {"params": rest}], lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in frames]
    idx = torch.randint(cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):
        out = model(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    eye = torch.eye(frames[0].shape[-1], dtype=torch.float64)
    for W, W0 in zip(frames, before):
        assert (W.transpose(-1, -2) @ W - eye).abs().max() < 1e-12  # still orthonormal frames
        assert (W - W0).abs().max() > 1e-6  # and they did move
    assert losses[-1] < losses[0]
