"""Connections: transport, transported attention against a dense per-pair reference, diagnostics."""
import pytest
import torch
from hypothesis import given, strategies as st

import riemannian_ref as rr
from riemannian_ref.analysis import bundle
from riemannian_ref.attention import connections
from riemannian_ref.geometry import transport as cx

SIDES = ("key", "query", "mean")
CONTENT = ("content", "content_source")
PER_TOKEN = CONTENT + ("cumulative",)  # connections that read per-token rates
DT = torch.float64


def _inputs(gen, B=2, h=3, n=7, d=6, r=2, shared=False):
    q = torch.randn(B, h, n, d, generator=gen, dtype=DT)
    k = torch.randn(B, h, n, d, generator=gen, dtype=DT)
    v = torch.randn(B, h, n, d, generator=gen, dtype=DT)
    shape = (B, h, d, r) if shared else (B, h, n, d, r)
    U_q = 0.5 * torch.randn(*shape, generator=gen, dtype=DT)
    U_k = 0.5 * torch.randn(*shape, generator=gen, dtype=DT)
    lam = 0.5 + torch.rand(h, generator=gen, dtype=DT)
    theta = 0.3 * torch.rand(B, h, n, d // 2, generator=gen, dtype=DT)
    return q, k, v, U_q, U_k, lam, theta


def _factors(side, U_q, U_k):
    return (U_q if side in ("query", "mean") else None, U_k if side in ("key", "mean") else None)


def _edge_rates(theta, rule):
    """omega_ij [..., i, j, d/2]: the source's rate, or the mean of both endpoints'."""
    src = theta.unsqueeze(-3).expand(*theta.shape[:-2], theta.shape[-2], *theta.shape[-2:])
    return src if rule == "source" else 0.5 * (src + theta.unsqueeze(-2))


def _dense_reference(q, k, v, U_q, U_k, lam, side, theta, pos, causal, rule="mean"):
    """Per-pair dense transport matrices [n, n, d, d]: the definition, for small n only."""
    n, d = q.shape[-2], q.shape[-1]
    phi = (pos[:, None] - pos[None, :])[..., None] * _edge_rates(theta, rule)  # (B, h, i, j, d/2)
    P = cx.block_rotation_matrix(phi)  # (B, h, i, j, d, d)
    eye = torch.eye(d, dtype=DT)
    lam4 = lam.view(-1, 1, 1)
    Gk = lam4[..., None] * eye + U_k @ U_k.transpose(-1, -2) if U_k is not None else None  # (B, h, j, d, d)
    Gq = lam4[..., None] * eye + U_q @ U_q.transpose(-1, -2) if U_q is not None else None
    kt = (P @ k.unsqueeze(-3).unsqueeze(-1)).squeeze(-1)  # (B, h, i, j, d)
    delta = q.unsqueeze(-2) - kt
    if side == "key":
        Gbar = P @ Gk.unsqueeze(-4) @ P.transpose(-1, -2)
    elif side == "query":
        Gbar = Gq.unsqueeze(-3).expand_as(P)
    else:
        Gbar = 0.5 * (P @ Gk.unsqueeze(-4) @ P.transpose(-1, -2) + Gq.unsqueeze(-3))
    dist2 = (delta.unsqueeze(-2) @ Gbar @ delta.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    S = -0.5 * dist2 / d ** 0.5
    if causal:
        S = S.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    A = S.softmax(-1)
    vt = (P @ v.unsqueeze(-3).unsqueeze(-1)).squeeze(-1)  # (B, h, i, j, d)
    return (A.unsqueeze(-1) * vt).sum(-2), A


# --------------------------------------------------------------------------- rotations
def test_rotate_pairs_matches_dense_and_is_orthogonal(gen):
    ang = torch.randn(5, 4, generator=gen, dtype=DT)
    x = torch.randn(5, 8, generator=gen, dtype=DT)
    R = cx.block_rotation_matrix(ang)
    torch.testing.assert_close(cx.rotate_pairs(x, ang), (R @ x.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(R.transpose(-1, -2) @ R, torch.eye(8, dtype=DT).expand(5, 8, 8))
    assert torch.equal(cx.rotate_pairs(x, torch.zeros_like(ang)), x)


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("connection", CONTENT)
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("causal", [False, True])
def test_content_matches_dense_per_pair_reference(gen, connection, side, causal):
    q, k, v, U_q, U_k, lam, theta = _inputs(gen)
    Uq, Uk = _factors(side, U_q, U_k)
    pos = torch.arange(q.shape[-2], dtype=DT) * 1.5 + 2.0
    out, A = rr.connection_attention(q, k, v, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, connection=connection,
                                     rates=theta, positions=pos, is_causal=causal, return_weights=True)
    ref_out, ref_A = _dense_reference(q, k, v, Uq, Uk, lam, side, theta, pos, causal, cx.edge_rule(connection))
    torch.testing.assert_close(A, ref_A)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("shared", [False, True])
def test_flat_equals_content_with_constant_rates(gen, side, shared):
    q, k, v, U_q, U_k, lam, _ = _inputs(gen, shared=shared)
    Uq, Uk = _factors(side, U_q, U_k)
    d, n = q.shape[-1], q.shape[-2]
    freqs = cx.rotary_frequencies(d, base=50.0, dtype=DT)
    flat = rr.connection_attention(q, k, v, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, connection="flat",
                                   rates=freqs, is_causal=True)
    content = rr.connection_attention(q, k, v, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, connection="content",
                                      rates=freqs.expand(n, d // 2), is_causal=True)
    torch.testing.assert_close(flat, content)


@pytest.mark.parametrize("side", SIDES)
def test_trivial_is_plain_riemannian_attention_and_zero_rates(gen, side):
    q, k, v, U_q, U_k, lam, theta = _inputs(gen)
    Uq, Uk = _factors(side, U_q, U_k)
    ref = rr.riemannian_attention_reference(q, k, v, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, is_causal=True)
    triv = rr.connection_attention(q, k, v, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, connection="trivial", is_causal=True)
    zero = rr.connection_attention(q, k, v, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, connection="content",
                                   rates=torch.zeros_like(theta), is_causal=True)
    torch.testing.assert_close(triv, ref)
    torch.testing.assert_close(zero, ref)


def test_flat_scores_are_rotary_dot_products(gen):
    """With lam = 1 and U = 0, flat scores are -|q_i - R_i R_j^T k_j|^2 / (2 sqrt d)."""
    q, k, v, _, _, _, _ = _inputs(gen)
    d, n = q.shape[-1], q.shape[-2]
    U0 = torch.zeros(*k.shape, 0, dtype=DT)
    _, A = rr.connection_attention(q, k, v, U_q=None, U_k=U0, lam=1.0, connection="flat", return_weights=True)
    ang = torch.arange(n, dtype=DT)[:, None] * cx.rotary_frequencies(d, dtype=DT)
    qr, kr = cx.rotate_pairs(q, -ang), cx.rotate_pairs(k, -ang)  # R^T q, R^T k
    S = (qr @ kr.transpose(-1, -2) - 0.5 * (kr * kr).sum(-1).unsqueeze(-2)) / d ** 0.5
    torch.testing.assert_close(A, S.softmax(-1))


@pytest.mark.parametrize("causal", [False, True])
def test_dot_scores_flat_without_value_transport_is_rope(gen, causal):
    """scores="dot", "flat", transport_values=False: SDPA on rotary-rotated queries and keys, plain values."""
    q, k, v, _, _, _, _ = _inputs(gen)
    d, n = q.shape[-1], q.shape[-2]
    ang = torch.arange(n, dtype=DT)[:, None] * cx.rotary_frequencies(d, dtype=DT)  # (n, d/2)
    # the package's frame convention rotates by R_i^T (RoPE with the rates' sign flipped)
    rope = torch.nn.functional.scaled_dot_product_attention(
        cx.rotate_pairs(q, -ang), cx.rotate_pairs(k, -ang), v, is_causal=causal)
    out = rr.connection_attention(q, k, v, None, 0.0, causal, scores="dot", connection="flat",
                                  transport_values=False)
    torch.testing.assert_close(out, rope, rtol=1e-12, atol=1e-12)
    # transporting the values too is a different function (rotated back to the query's fibre)
    moved = rr.connection_attention(q, k, v, is_causal=causal, scores="dot", connection="flat")
    assert (moved - rope).abs().max() > 1e-3
    with pytest.raises(ValueError, match="takes no metric factors"):
        rr.connection_attention(q, k, v, scores="dot", U_k=torch.zeros(*k.shape, 1, dtype=DT))


@pytest.mark.parametrize("connection", cx.CONNECTIONS)
@pytest.mark.parametrize("side", SIDES)
def test_causal_transport_leaks_no_future_token(gen, connection, side):
    q, k, v, U_q, U_k, lam, theta = _inputs(gen)
    Uq, Uk = _factors(side, U_q, U_k)
    th = theta if connection in PER_TOKEN else None
    t = 4  # perturb keys, values, factors and rates of tokens t.. ; outputs < t must not move
    kw = dict(lam=lam, metric_side=side, connection=connection, rates=th, is_causal=True)
    out = rr.connection_attention(q, k, v, U_q=Uq, U_k=Uk, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[..., t:, :] += 3.0
    v2[..., t:, :] -= 2.0
    Uk2 = None if Uk is None else Uk.clone()
    if Uk2 is not None:
        Uk2[..., t:, :, :] *= -4.0
    th2 = th
    if connection in PER_TOKEN:
        th2 = th.clone()
        th2[..., t:, :] += 1.0
    out2 = rr.connection_attention(q, k2, v2, U_q=Uq, U_k=Uk2, **{**kw, "rates": th2})
    torch.testing.assert_close(out2[..., :t, :], out[..., :t, :], rtol=0, atol=1e-12)
    assert (out2[..., t:, :] - out[..., t:, :]).abs().max() > 1e-3


def test_content_gradients_flow_to_rates(gen):
    q, k, v, _, U_k, lam, theta = _inputs(gen)
    theta = theta.clone().requires_grad_(True)
    out = rr.connection_attention(q, k, v, U_q=None, U_k=U_k, lam=lam, connection="content", rates=theta)
    out.square().sum().backward()
    assert theta.grad is not None and theta.grad.abs().sum() > 0


@pytest.mark.parametrize("n", [2, 7])
def test_content_connection_is_inverse_consistent_and_source_rule_is_not(gen, n):
    rates = torch.rand(2, n, 3, generator=gen, dtype=DT)
    pos = torch.randn(n, generator=gen, dtype=DT)
    mean = cx.transport_angles(rates, pos, "mean")  # (2, i, j, d/2)
    assert torch.equal(mean, -mean.transpose(-2, -3))  # P_{i->j} = P_{j->i}^{-1}, bit for bit
    src = cx.transport_angles(rates, pos, "source")
    loop = src + src.transpose(-2, -3)  # angle of P_{i->j} P_{j->i}
    off = ~torch.eye(n, dtype=torch.bool)
    assert (loop[:, off].abs() > 1e-9).all()
    torch.testing.assert_close(loop, (pos[None, :] - pos[:, None])[..., None] * (rates.unsqueeze(-2) - rates.unsqueeze(-3)))


def test_edge_rule_and_content_default():
    assert cx.edge_rule("content") == "mean" and cx.edge_rule("content_source") == "source"
    assert cx.edge_rule("flat") == cx.edge_rule("trivial") == "mean"
    assert rr.FiberBundleConfig.tiny(mode="fiber_bundle").connection_resolved == "content"
    with pytest.raises(ValueError, match="connection must be one of"):
        cx.edge_rule("levi-civita")
    with pytest.raises(ValueError, match="rule must be one of"):
        cx.transport_angles(torch.zeros(3, 2), torch.arange(3.0), "left")


# --------------------------------------------------------------------------- diagnostics
def _dense_P(rates, pos, to, frm, rule="source"):
    w = rates[..., frm, :] if rule == "source" else 0.5 * (rates[..., frm, :] + rates[..., to, :])
    return cx.block_rotation_matrix((pos[to] - pos[frm]) * w)


def test_holonomy_exactly_zero_for_trivial_and_flat(gen):
    n, d = 33, 16
    tri = bundle.sample_triangles(n, 200, generator=gen)
    like = torch.zeros((), dtype=torch.float32)
    for conn in ("trivial", "flat"):
        rates = cx.connection_rates(conn, n, d, like=like)
        hol = rr.holonomy_defect(rates, tri, reduce=False)
        assert torch.equal(hol, torch.zeros_like(hol)), conn


@pytest.mark.parametrize("rule", ["mean", "source"])
def test_holonomy_positive_for_content_and_matches_dense_loop(gen, rule):
    n, d = 9, 6
    rates = torch.rand(2, n, d // 2, generator=gen, dtype=DT)
    pos = torch.arange(n, dtype=DT)
    tri = bundle.sample_triangles(n, 20, generator=gen)
    hol = rr.holonomy_defect(rates, tri, reduce=False, rule=rule)  # (2, T)
    assert (hol > 1e-3).all()
    for t, (i, j, k) in enumerate(tri.tolist()):
        loop = _dense_P(rates, pos, i, k, rule) @ _dense_P(rates, pos, k, j, rule) @ _dense_P(rates, pos, j, i, rule)
        dense = (loop - torch.eye(d, dtype=DT)).flatten(-2).norm(dim=-1)
        torch.testing.assert_close(hol[:, t], dense)


def test_two_edge_loops_have_no_holonomy_only_with_the_mean_rule(gen):
    n, d = 8, 6
    rates = torch.rand(n, d // 2, generator=gen, dtype=DT)
    back = torch.tensor([[0, j, j] for j in range(1, n)])  # i -> j -> j -> i: there and back
    assert torch.equal(rr.holonomy_defect(rates, back, reduce=False), torch.zeros(n - 1, dtype=DT))
    assert (rr.holonomy_defect(rates, back, reduce=False, rule="source") > 1e-6).all()


@given(st.integers(0, 2**31 - 1), st.sampled_from(["mean", "source"]))
def test_holonomy_closed_form_identity(seed, rule):
    g = torch.Generator().manual_seed(seed)
    rates = 2 * torch.rand(5, 2, generator=g, dtype=DT) - 1
    pos = torch.randn(5, generator=g, dtype=DT)
    tri = bundle.sample_triangles(5, 4, generator=g)
    hol = rr.holonomy_defect(rates, tri, positions=pos, reduce=False, rule=rule)
    for t, (i, j, k) in enumerate(tri.tolist()):
        loop = _dense_P(rates, pos, i, k, rule) @ _dense_P(rates, pos, k, j, rule) @ _dense_P(rates, pos, j, i, rule)
        torch.testing.assert_close(hol[t], (loop - torch.eye(4, dtype=DT)).norm())
        if rule == "mean":  # per block, the loop angle is the signed area of the (rate, position) triangle
            x, y = rates[[i, j, k]], pos[[i, j, k]]  # (3, 2), (3,)
            area = 0.5 * (x[0] * (y[1] - y[2]) + x[1] * (y[2] - y[0]) + x[2] * (y[0] - y[1]))  # (2,)
            torch.testing.assert_close(hol[t], torch.sqrt(8 * torch.sin(area / 2).pow(2).sum()))


@pytest.mark.parametrize("rule", ["mean", "source"])
def test_transport_closure_zero_for_trivial_positive_for_flat_and_matches_definition(gen, rule):
    n, d = 10, 8
    x = torch.randn(3, n, d, generator=gen, dtype=DT)
    tri = bundle.sample_triangles(n, 30, generator=gen)
    zero = rr.transport_closure_defect(x, cx.connection_rates("trivial", n, d, like=x), tri, reduce=False)
    assert torch.equal(zero, torch.zeros_like(zero))
    # the flat rotary connection has no curvature but is far from the identity: this is not a torsion
    flat = rr.transport_closure_defect(x, cx.connection_rates("flat", n, d, like=x), tri, reduce=False)
    assert (flat > 1e-3).all()
    rates = torch.rand(3, n, d // 2, generator=gen, dtype=DT)
    clo = rr.transport_closure_defect(x, rates, tri, reduce=False, rule=rule)
    assert (clo > 1e-6).all()
    pos = torch.arange(n, dtype=DT)
    for t, (i, j, k) in enumerate(tri.tolist()):
        P = _dense_P(rates, pos, i, j, rule)
        e = (x[:, k] - x[:, i]) - (P @ (x[:, k] - x[:, j]).unsqueeze(-1)).squeeze(-1) - (x[:, j] - x[:, i])
        torch.testing.assert_close(clo[:, t], e.norm(dim=-1))


@pytest.mark.parametrize("rule", ["mean", "source"])
@pytest.mark.parametrize("per_token_lam", [False, True])
def test_metric_compatibility_matches_dense(gen, per_token_lam, rule):
    n, d, r = 8, 6, 3
    U = torch.randn(2, n, d, r, generator=gen, dtype=DT)
    lam = 0.5 + torch.rand(2, n, generator=gen, dtype=DT) if per_token_lam else 0.7
    rates = torch.rand(2, n, d // 2, generator=gen, dtype=DT)
    pairs = bundle.sample_pairs(n, 15, generator=gen)
    got = rr.metric_compatibility_defect(lam, U, rates, pairs, reduce=False, rule=rule)
    rel = rr.metric_compatibility_defect(lam, U, rates, pairs, reduce=False, rule=rule, relative=True)
    G = rr.LowRankMetric(lam if per_token_lam else lam, U).dense()  # (2, n, d, d)
    pos = torch.arange(n, dtype=DT)
    for t, (i, j) in enumerate(pairs.tolist()):
        P = _dense_P(rates, pos, i, j, rule)
        D = P.transpose(-1, -2) @ G[:, i] @ P - G[:, j]
        torch.testing.assert_close(got[:, t], D.flatten(-2).norm(dim=-1))
        torch.testing.assert_close(rel[:, t], D.flatten(-2).norm(dim=-1) / (G[:, i] - G[:, j]).flatten(-2).norm(dim=-1))
        # Hoffman-Wielandt: a rotation keeps the spectrum, so the defect is at least the spectral distance
        gap = (torch.linalg.eigvalsh(G[:, i]) - torch.linalg.eigvalsh(G[:, j])).norm(dim=-1)
        assert (got[:, t] >= gap * (1 - 1e-12)).all()
    # relative to P = I the trivial connection scores exactly 1
    triv = rr.metric_compatibility_defect(lam, U, torch.zeros_like(rates), pairs, relative=True)
    torch.testing.assert_close(triv, torch.ones(2, dtype=DT))


def test_compatible_transport_is_an_isometry_and_flat_with_identity_rotation(gen):
    d, r = 6, 2
    M = rr.LowRankMetric(0.3 + torch.rand(3, generator=gen, dtype=DT), torch.randn(3, d, r, generator=gen, dtype=DT))
    G = M.dense()  # (3, d, d): three fibres
    O = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=DT)).Q
    P = cx.compatible_transport(G[0], G[1], O)
    torch.testing.assert_close(P.transpose(-1, -2) @ G[0] @ P, G[1])
    assert (P.transpose(-1, -2) @ P - torch.eye(d, dtype=DT)).norm() > 1e-2  # not a rotation
    # with O = I the transports compose: the loop 0 -> 1 -> 2 -> 0 is the identity (a flat connection)
    T = lambda a, b: cx.compatible_transport(G[a], G[b])  # noqa: E731  P_{b -> a}
    torch.testing.assert_close(T(0, 2) @ T(2, 1) @ T(1, 0), torch.eye(d, dtype=DT))
    with pytest.raises(ValueError, match="positive definite"):
        cx.compatible_transport(-G[0], G[1])
    with pytest.raises(ValueError, match="G_j must have shape"):
        cx.compatible_transport(G[0], G[1, :4, :4])


def test_flat_is_compatible_with_a_rotary_covariant_metric(gen):
    """U_i = R_i U_0 is carried onto itself by P = R_i R_j^T: zero defect."""
    n, d, r = 12, 8, 2
    theta = cx.rotary_frequencies(d, base=20.0, dtype=DT)
    U0 = torch.randn(d, r, generator=gen, dtype=DT)
    ang = torch.arange(n, dtype=DT)[:, None] * theta
    U = cx.rotate_pairs(U0.T.expand(n, r, d), ang.unsqueeze(-2)).transpose(-1, -2)  # (n, d, r)
    pairs = bundle.sample_pairs(n, 40, generator=gen)
    rates = cx.connection_rates("flat", n, d, rates=theta, like=U)
    defect = rr.metric_compatibility_defect(1.0, U, rates, pairs)
    assert defect < 1e-10
    assert rr.metric_compatibility_defect(1.0, U, torch.zeros_like(rates), pairs) > 1e-2


# --------------------------------------------------------------------------- errors
def test_clear_errors(gen):
    q, k, v, _, U_k, lam, theta = _inputs(gen)
    with pytest.raises(ValueError, match="connection must be one of"):
        rr.connection_attention(q, k, v, U_q=None, U_k=U_k, connection="levi-civita")
    with pytest.raises(ValueError, match="needs rates"):
        rr.connection_attention(q, k, v, U_q=None, U_k=U_k, connection="content")
    with pytest.raises(ValueError, match="not used by the trivial"):
        rr.connection_attention(q, k, v, U_q=None, U_k=U_k, connection="trivial", rates=theta)
    with pytest.raises(ValueError, match="must be even"):
        rr.connection_attention(q[..., :5], k[..., :5], v[..., :5], U_q=None, U_k=U_k[..., :5, :], connection="flat")
    with pytest.raises(ValueError, match="head dimension d"):
        rr.connection_attention(q, k, v[..., :4], U_q=None, U_k=U_k, connection="content", rates=theta)
    with pytest.raises(ValueError, match=r"\[\.\.\., n, d/2\]"):
        rr.connection_attention(q, k, v, U_q=None, U_k=U_k, connection="content", rates=theta[..., :2])
    with pytest.raises(ValueError, match="positions"):
        rr.connection_attention(q, k, v, U_q=None, U_k=U_k, connection="flat", positions=torch.arange(3))
    with pytest.raises(ValueError, match="metric_side"):
        rr.connection_attention(q, k, v, U_q=None, U_k=U_k, metric_side="left")
    rates = torch.rand(7, 3, generator=gen, dtype=DT)
    with pytest.raises(ValueError, match=r"triangles must be a long tensor of shape \[T, 3\]"):
        rr.holonomy_defect(rates, torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="triangles must index tokens 0..6"):
        rr.holonomy_defect(rates, torch.tensor([[0, 1, 9]]))
    with pytest.raises(ValueError, match="rule must be one of"):
        rr.holonomy_defect(rates, torch.tensor([[0, 1, 2]]), rule="target")
    with pytest.raises(ValueError, match="relative must be a bool"):
        rr.metric_compatibility_defect(1.0, torch.zeros(7, 6, 1, dtype=DT), rates, torch.tensor([[0, 1]]),
                                       relative="yes")


def test_pairwise_rotation_gradients_match_finite_differences(gen):
    """The hand-written backward of the pairwise rotations (angles kept, rotations recomputed) against
    gradcheck, with the angles broadcast over a batch dimension the inputs have."""
    phi = torch.randn(3, 4, 4, 2, generator=gen, dtype=DT, requires_grad=True)  # (h, n_i, n_j, d/2)
    q, k, v = (torch.randn(2, 3, 4, 4, generator=gen, dtype=DT, requires_grad=True) for _ in range(3))
    f = connections._PairwiseRotation.apply
    assert torch.autograd.gradcheck(lambda *a: f(*a), (phi, q, k, v))
    assert torch.autograd.gradcheck(lambda p, x: f(p, x, None, None)[0], (phi, q))
    assert torch.autograd.gradcheck(lambda p, x: f(p, None, None, x)[2], (phi, v))


@pytest.mark.parametrize("connection", CONTENT)
@pytest.mark.parametrize("side", SIDES)
def test_content_gradients_match_the_dense_per_pair_reference(gen, connection, side):
    q, k, v, U_q, U_k, lam, theta = _inputs(gen, n=5)
    Uq, Uk = _factors(side, U_q, U_k)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, theta)]
    pos = torch.arange(5, dtype=DT) * 0.7
    grads = []
    for fn in ("ours", "dense"):
        for t in leaves:
            t.grad = None
        qq, kk, vv, th = leaves
        if fn == "ours":
            out = rr.connection_attention(qq, kk, vv, U_q=Uq, U_k=Uk, lam=lam, metric_side=side,
                                          connection=connection, rates=th, positions=pos, is_causal=True)
        else:
            out, _ = _dense_reference(qq, kk, vv, Uq, Uk, lam, side, th, pos, True, cx.edge_rule(connection))
        (out * torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out)).sum().backward()
        grads.append([t.grad.clone() for t in leaves])
    for ours, dense in zip(*grads):
        torch.testing.assert_close(ours, dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_content_connection_in_half_precision(gen, dtype):
    """Half-precision inputs (e.g. under autocast): the rotations run in float32, the result keeps the dtype."""
    q, k, v, _, U_k, lam, theta = (t.float() for t in _inputs(gen))
    ref = rr.connection_attention(q, k, v, U_k=U_k, lam=lam.float(), connection="content", rates=theta,
                                  is_causal=True)
    half = [t.to(dtype).requires_grad_(True) for t in (q, k, v, theta)]
    out = rr.connection_attention(half[0], half[1], half[2], U_k=U_k.to(dtype), lam=lam.to(dtype),
                                  connection="content", rates=half[3], is_causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype and torch.isfinite(t.grad).all() for t in half)
