"""LowRankMetric against dense torch.linalg, in float64, for many shapes."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

import riemannian_ref as rr

F64 = torch.float64


def _rand_metric(g, batch, d, r, diagonal=False):
    U = torch.randn(*batch, d, r, generator=g, dtype=F64)
    if diagonal:
        delta = torch.rand(*batch, d, generator=g, dtype=F64) + 0.1
        return rr.LowRankMetric(None, U, delta=delta)
    lam = torch.rand(tuple(batch), generator=g, dtype=F64) + 0.1
    return rr.LowRankMetric(lam, U)


shapes = st.tuples(
    st.lists(st.integers(1, 3), min_size=0, max_size=2),  # batch
    st.integers(1, 12),  # d
    st.integers(0, 5),  # r
    st.booleans(),  # diagonal form
    st.integers(0, 2**31 - 1),  # seed
)


@given(shapes)
def test_woodbury_solve_logdet_quad_against_dense(case):
    batch, d, r, diagonal, seed = case
    g = torch.Generator().manual_seed(seed)
    M = _rand_metric(g, batch, d, r, diagonal)
    G = M.dense()
    assert G.shape == (*batch, d, d)
    w = torch.randn(*batch, d, generator=g, dtype=F64)
    x_dense = torch.linalg.solve(G, w.unsqueeze(-1)).squeeze(-1)
    rel = (M.solve(w) - x_dense).norm() / x_dense.norm()
    assert rel < 1e-10
    sign, ld = torch.linalg.slogdet(G)
    assert (sign > 0).all()
    torch.testing.assert_close(M.logdet(), ld, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(M.quad(w), torch.einsum("...i,...ij,...j->...", w, G, w), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(M.matvec(w), (G @ w.unsqueeze(-1)).squeeze(-1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(M.inverse_dense(), torch.linalg.inv(G), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(M.inner(w, w), M.quad(w))


def test_solve_inverts_matvec(gen):
    M = _rand_metric(gen, (4, 3), 16, 4)
    w = torch.randn(4, 3, 16, generator=gen, dtype=F64)
    torch.testing.assert_close(M.matvec(M.solve(w)), w, rtol=1e-12, atol=1e-12)


def test_rank_zero_is_isotropic(gen):
    M = rr.LowRankMetric(2.5, torch.zeros(7, 0, dtype=F64))
    assert M.r == 0
    torch.testing.assert_close(M.dense(), 2.5 * torch.eye(7, dtype=F64))
    torch.testing.assert_close(M.logdet(), torch.tensor(7 * math.log(2.5), dtype=F64))


def test_average_is_mean_of_dense(gen):
    A = _rand_metric(gen, (5,), 6, 2)
    B = _rand_metric(gen, (5,), 6, 3)
    C = A.average(B)
    assert C.r == 5
    torch.testing.assert_close(C.dense(), (A.dense() + B.dense()) / 2)
    Ad = _rand_metric(gen, (5,), 6, 2, diagonal=True)
    torch.testing.assert_close(Ad.average(B).dense(), (Ad.dense() + B.dense()) / 2)


def test_broadcast_lam_per_head(gen):
    U = torch.randn(2, 4, 10, 8, 2, generator=gen, dtype=F64)  # [B, h, n, d, r]
    lam = torch.rand(4, 1, generator=gen, dtype=F64) + 0.5  # per head
    M = rr.LowRankMetric(lam, U)
    assert M.batch_shape == (2, 4, 10)
    assert M.logdet().shape == (2, 4, 10)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lam=0.0, U=torch.zeros(3, 1)), "lam must be finite and > 0"),
        (dict(lam=-1.0, U=torch.zeros(3, 1)), "lam must be finite and > 0"),
        (dict(lam=float("nan"), U=torch.zeros(3, 1)), "lam must be finite"),
        (dict(lam=None, U=torch.zeros(3, 1)), "lam must be given"),
        (dict(lam=1.0, U=torch.zeros(3)), "U must have at least 2 dimensions"),
        (dict(lam=1.0, U=torch.zeros(3, 1, dtype=torch.int64)), "floating-point"),
        (dict(lam=None, U=torch.zeros(3, 1), delta=torch.ones(4)), r"delta must have shape \[..., d\] with d = 3"),
        (dict(lam=None, U=torch.zeros(3, 1), delta=torch.tensor([1.0, 0.0, 1.0])), "delta must be finite and > 0"),
        (dict(lam=1.0, U=torch.zeros(3, 1), delta=torch.ones(3)), "not both"),
        (dict(lam=torch.ones(2), U=torch.zeros(3, 3, 1)), "do not broadcast"),
        (dict(lam=None, U=torch.zeros(3, 1), delta=torch.ones(3, dtype=torch.float64)), "dtype"),
    ],
)
def test_bad_metric_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rr.LowRankMetric(**kwargs)


def test_bad_vector_inputs():
    M = rr.LowRankMetric(1.0, torch.zeros(4, 3, 2))
    with pytest.raises(ValueError, match=r"v must have shape \[..., d\] with d = 3"):
        M.quad(torch.zeros(4, 5))
    with pytest.raises(ValueError, match="do not broadcast"):
        M.solve(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="dtype"):
        M.solve(torch.zeros(4, 3, dtype=torch.float64))


def test_metric_net_shapes_and_init_scale():
    torch.manual_seed(0)
    net = rr.MetricNet(d_model=64, n_heads=4, head_dim=16, rank=3, lam_init=1.0, form="factor")
    x = torch.randn(8, 50, 64)
    lam, U = net(x)
    assert lam.shape == (4,) and U.shape == (8, 4, 50, 16, 3)
    torch.testing.assert_close(lam, torch.ones(4), rtol=1e-5, atol=1e-5)
    v = torch.randn(8, 4, 50, 16)
    ratio = (rr.LowRankMetric(lam.view(4, 1), U).quad(v) / (v * v).sum(-1)).mean()
    # lam |v|^2 + |U^T v|^2 with E|U^T v|^2 = |v|^2 at strength 1: ratio about 2
    assert 1.7 < ratio.item() < 2.3
    dnet = rr.MetricNet(64, 4, 16, 2, diagonal=True)
    lam, U = dnet(x)  # always (lam, U); the diagonal comes from delta()
    assert U.shape == (8, 4, 50, 16, 2)
    delta = dnet.delta(x)
    assert delta.shape == (8, 4, 50, 16)
    # zero-initialised diagonal map: delta = lam softplus(0) / log 2 + lam_min = lam + lam_min
    torch.testing.assert_close(delta, (lam + dnet.lam_min).view(4, 1, 1).expand(8, 4, 50, 16))
    with pytest.raises(ValueError, match="diagonal=True"):
        net.delta(x)
    with pytest.raises(ValueError, match=r"x must have shape \[B, n, 64\]"):
        net(torch.randn(2, 5, 32))
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        rr.MetricNet(64, 4, 16, -1)


def test_metric_net_shared_and_rank_zero():
    """shared=True: one learned [h, d, r] factor per head; rank 0: U has r = 0 (G = lam I)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    shared = rr.MetricNet(8, 2, 4, 3, shared=True, form="factor")
    lam, U = shared(x)
    assert U.shape[-3:] == (2, 4, 3) and U.numel() == 2 * 4 * 3  # [h, d, r] (maybe with a leading 1)
    torch.testing.assert_close(U.reshape(2, 4, 3), shared.U.detach())  # the parameter, independent of x
    torch.testing.assert_close(shared(2 * x)[1], U)
    lam0, U0 = rr.MetricNet(8, 2, 4, 0, lam_init=2.0)(x)
    assert U0.shape == (2, 2, 5, 4, 0)
    torch.testing.assert_close(lam0, torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="diagonal=True needs per-token"):
        rr.MetricNet(8, 2, 4, 1, shared=True, diagonal=True)
