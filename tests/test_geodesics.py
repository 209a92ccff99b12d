"""Pair distance, segment length and shortest paths in float64: the inequalities and the exact cases."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

import riemannian_ref.geometry as rr  # pair_distance, segment_length, MetricField, path helpers
from riemannian_ref.geometry import fields  # path_length, straight_path, ...: reached through their module

F64 = torch.float64


def _metric(g, batch, d, r, diagonal=False, strength=1.0):
    U = strength * torch.randn(*batch, d, r, generator=g, dtype=F64)
    if diagonal:
        return rr.LowRankMetric(None, U, delta=torch.rand(*batch, d, generator=g, dtype=F64) + 0.1)
    return rr.LowRankMetric(torch.rand(tuple(batch), generator=g, dtype=F64) + 0.1, U)


def _closed_form_segment(a, b):
    """int_0^1 sqrt((1-t) a + t b) dt = 2/3 (b^1.5 - a^1.5) / (b - a), in a form stable for a ~ b."""
    return 2.0 / 3.0 * (a + (a * b).sqrt() + b) / (a.sqrt() + b.sqrt())


@pytest.mark.parametrize("side", ["mean", "query", "key"])
@pytest.mark.parametrize("dense", [False, True])
def test_pair_distance_matches_dense_formula(gen, side, dense):
    Mx, My = _metric(gen, (5,), 6, 2), _metric(gen, (5,), 6, 2)
    x, y = torch.randn(5, 6, generator=gen, dtype=F64), torch.randn(5, 6, generator=gen, dtype=F64)
    Gx, Gy = Mx.dense(), My.dense()
    Gbar = {"mean": (Gx + Gy) / 2, "query": Gx, "key": Gy}[side]
    delta = x - y
    want = torch.einsum("ni,nij,nj->n", delta, Gbar, delta).sqrt()
    got = rr.pair_distance(x, y, Gx if dense else Mx, Gy if dense else My, metric_side=side)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("diagonal", [False, True])
def test_segment_length_of_constant_metric_is_pair_distance(gen, diagonal):
    M = _metric(gen, (7,), 4, 3, diagonal)
    x, y = torch.randn(7, 4, generator=gen, dtype=F64), torch.randn(7, 4, generator=gen, dtype=F64)
    L = rr.segment_length(x, y, M, M)
    torch.testing.assert_close(rr.segment_length(x, y, M, M, method="quadrature", n_points=3), L,
                               rtol=1e-13, atol=1e-13)
    for side in ("mean", "query", "key"):
        torch.testing.assert_close(L, rr.pair_distance(x, y, M, M, side), rtol=1e-13, atol=1e-13)


def test_segment_length_matches_closed_form_and_is_symmetric(gen):
    Mx, My = _metric(gen, (20,), 3, 2, strength=2.0), _metric(gen, (20,), 3, 2)
    x, y = torch.randn(20, 3, generator=gen, dtype=F64), torch.randn(20, 3, generator=gen, dtype=F64)
    a, b = My.quad(x - y), Mx.quad(x - y)
    torch.testing.assert_close(rr.segment_length(x, y, Mx, My), _closed_form_segment(a, b), rtol=1e-13, atol=0)
    quad = rr.segment_length(x, y, Mx, My, method="quadrature", n_points=64)
    torch.testing.assert_close(quad, _closed_form_segment(a, b), rtol=1e-5, atol=0)
    assert rr.segment_length(x[0], x[0], Mx.dense()[0], My.dense()[0]) == 0
    torch.testing.assert_close(rr.segment_length(x, y, Mx, My), rr.segment_length(y, x, My, Mx),
                               rtol=1e-13, atol=1e-13)


cases = st.tuples(
    st.integers(1, 8),  # d
    st.integers(0, 4),  # r
    st.booleans(),  # diagonal form
    st.floats(0.0, 5.0),  # strength of U (heterogeneity)
    st.integers(0, 2**31 - 1),  # seed
)


@given(cases)
def test_jensen_bound_segment_below_mean_pair_distance(case):
    d, r, diagonal, strength, seed = case
    g = torch.Generator().manual_seed(seed)
    Mx, My = _metric(g, (16,), d, r, diagonal, strength), _metric(g, (16,), d, r, diagonal, strength)
    x, y = torch.randn(16, d, generator=g, dtype=F64), torch.randn(16, d, generator=g, dtype=F64)
    seg = rr.segment_length(x, y, Mx, My)
    mean = rr.pair_distance(x, y, Mx, My, "mean")
    assert (seg <= mean * (1 + 1e-12) + 1e-15).all()
    # and it lies between the smaller and the larger one-sided distance
    lo = torch.minimum(rr.pair_distance(x, y, Mx, My, "query"), rr.pair_distance(x, y, Mx, My, "key"))
    assert (seg >= lo * (1 - 1e-12)).all()


def _two_point_field(g, strength, m=2, r=2):
    M = _metric(g, (2,), m, r, strength=strength)
    x, y = torch.randn(m, generator=g, dtype=F64), torch.randn(m, generator=g, dtype=F64)
    field = rr.MetricField(torch.stack([y, x]), M, weights="segment")
    return field, x, y, M


def test_segment_field_reduces_to_linear_interpolation(gen):
    field, x, y, M = _two_point_field(gen, 1.5, m=3)
    t = torch.rand(9, generator=gen, dtype=F64)
    p = y + t[:, None] * (x - y)  # points on the segment from y (t=0) to x (t=1)
    want = (1 - t)[:, None, None] * M.dense()[0] + t[:, None, None] * M.dense()[1]
    torch.testing.assert_close(field.dense(p), want, rtol=1e-13, atol=1e-13)
    # and the polyline along the segment has the segment length, however it is spaced
    L_seg = rr.segment_length(x, y, rr.LowRankMetric(M.lam[1], M.U[1]), rr.LowRankMetric(M.lam[0], M.U[0]))
    for N in (2, 5, 33):
        torch.testing.assert_close(fields.path_length(fields.straight_path(y, x, N), field), L_seg, rtol=1e-7, atol=0)


@pytest.mark.parametrize("weights", ["gaussian", "inverse_distance", "segment"])
@pytest.mark.parametrize("diagonal", [False, True])
def test_field_at_is_the_dense_convex_combination(gen, weights, diagonal):
    K = 2 if weights == "segment" else 5
    M = _metric(gen, (K,), 2, 2, diagonal)
    field = rr.MetricField(torch.randn(K, 2, generator=gen, dtype=F64), M, weights=weights, bandwidth=0.7)
    p = 2 * torch.randn(4, 3, 2, generator=gen, dtype=F64)
    w = field.weights(p)
    assert w.shape == (4, 3, K) and (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 3, dtype=F64))
    G = field.dense(p)
    torch.testing.assert_close(field.at(p).dense(), G, rtol=1e-12, atol=1e-12)
    v = torch.randn(4, 3, 2, generator=gen, dtype=F64)
    torch.testing.assert_close(field.quad(p, v), torch.einsum("...i,...ij,...j->...", v, G, v),
                               rtol=1e-12, atol=1e-12)
    assert (torch.linalg.eigvalsh(G) > 0).all()


@pytest.mark.parametrize("seed,strength", [(0, 0.5), (1, 2.0), (2, 3.0)])
def test_shortest_path_not_longer_than_segment(seed, strength):
    g = torch.Generator().manual_seed(seed)
    field, x, y, M = _two_point_field(g, strength)
    seg = fields.path_length(fields.straight_path(x, y, 2), field)
    res = rr.shortest_path(x, y, field, n_points=24, steps=40)
    assert res.path.shape == (24, 2)
    torch.testing.assert_close(res.path[0], x, rtol=0, atol=0)
    torch.testing.assert_close(res.path[-1], y, rtol=0, atol=0)
    assert res.length <= seg * (1 + 1e-8)
    # Cauchy-Schwarz, and the minimiser of the energy runs at constant speed
    assert res.length ** 2 <= res.energy * (1 + 1e-12)
    assert res.energy <= res.length ** 2 * (1 + 1e-3)


def test_shortest_path_in_gaussian_field_not_longer_than_segment(gen):
    M = _metric(gen, (6,), 2, 2, strength=2.0)
    field = rr.MetricField(torch.randn(6, 2, generator=gen, dtype=F64), M, bandwidth=0.5)
    x, y = field.anchors[0], field.anchors[1]
    res = rr.shortest_path(x, y, field, n_points=17, steps=40)
    assert res.length <= fields.path_length(fields.straight_path(x, y, 64), field) * (1 + 1e-8)


@pytest.mark.parametrize("diagonal", [False, True])
def test_constant_metric_geodesic_is_the_straight_line(gen, diagonal):
    M1 = _metric(gen, (), 2, 2, diagonal, strength=2.0)
    # the same metric at both anchors: a constant field
    U = M1.U.expand(2, 2, 2)
    M = rr.LowRankMetric(None, U, delta=M1.delta.expand(2, 2)) if diagonal else rr.LowRankMetric(M1.lam.expand(2), U)
    x, y = torch.tensor([0.0, 0.0], dtype=F64), torch.tensor([1.0, 0.5], dtype=F64)
    field = rr.MetricField(torch.stack([x, y]), M, weights="segment")
    # start from a bent path so that the optimiser has work to do
    init = fields.straight_path(x, y, 17) + torch.sin(torch.linspace(0, math.pi, 17, dtype=F64))[:, None] * 0.3
    res = rr.shortest_path(x, y, field, n_points=17, steps=100, init=init)
    line = fields.straight_path(x, y, 17)
    torch.testing.assert_close(res.path, line, rtol=0, atol=1e-6)
    torch.testing.assert_close(res.length, rr.pair_distance(x, y, M1, M1), rtol=1e-10, atol=0)


def test_adam_also_shortens_and_is_deterministic(gen):
    field, x, y, _ = _two_point_field(gen, 2.0)
    kw = dict(n_points=12, steps=30, method="adam", lr=1e-2, coarse_to_fine=False)
    a, b = rr.shortest_path(x, y, field, **kw), rr.shortest_path(x, y, field, **kw)
    assert a.length <= fields.path_length(fields.straight_path(x, y, 2), field) * (1 + 1e-8)
    assert torch.equal(a.path, b.path)
    assert a.n_evals == 30


def test_constant_speed_respacing(gen):
    field, x, y, _ = _two_point_field(gen, 2.0)
    p = fields.constant_speed(fields.straight_path(x, y, 9), field, refine=64)
    pieces = torch.stack([fields.path_length(p[i:i + 2], field) for i in range(8)])
    assert (pieces.max() - pieces.min()) / pieces.mean() < 1e-3


def test_shortest_path_does_not_touch_graph_of_metrics(gen):
    U = torch.randn(2, 2, 1, generator=gen, dtype=F64, requires_grad=True)
    M = rr.LowRankMetric(torch.ones(2, dtype=F64), U * 2)  # a non-leaf with a graph
    x, y = torch.zeros(2, dtype=F64), torch.ones(2, dtype=F64)
    field = rr.MetricField(torch.stack([x, y]), M, weights="segment")
    res = rr.shortest_path(x, y, field, n_points=8, steps=20)
    assert U.grad is None and not res.path.requires_grad


# ------------------------------------------------------------- bad inputs
def test_bad_inputs_name_the_argument(gen):
    M = _metric(gen, (2,), 2, 1)
    M3 = _metric(gen, (), 3, 1)
    x, y = torch.zeros(2, dtype=F64), torch.ones(2, dtype=F64)
    with pytest.raises(ValueError, match="metric_side"):
        rr.pair_distance(x, y, M, M, metric_side="both")
    with pytest.raises(ValueError, match="metric_x"):
        rr.pair_distance(x, y, M3, M)
    with pytest.raises(ValueError, match="metric_y"):
        rr.pair_distance(x, y, M, torch.eye(3, dtype=F64))
    with pytest.raises(ValueError, match="metric_y batch"):
        rr.pair_distance(x, y, M, torch.eye(2, dtype=F64).expand(3, 2, 2))
    with pytest.raises(ValueError, match="x and y"):
        rr.pair_distance(x, torch.ones(3, dtype=F64), M, M)
    with pytest.raises(ValueError, match="y has dtype"):
        rr.segment_length(x, y.float(), M, M)
    with pytest.raises(ValueError, match="n_points"):
        rr.segment_length(x, y, M, M, method="quadrature", n_points=0)
    with pytest.raises(ValueError, match="method"):
        rr.segment_length(x, y, M, M, method="simpson")
    with pytest.raises(ValueError, match="anchors"):
        rr.MetricField(torch.zeros(2, dtype=F64), M)
    with pytest.raises(ValueError, match="metrics"):
        rr.MetricField(torch.zeros(3, 2, dtype=F64), M)
    with pytest.raises(ValueError, match="weights"):
        rr.MetricField(torch.zeros(2, 2, dtype=F64), M, weights="nearest")
    with pytest.raises(ValueError, match="segment"):
        rr.MetricField(torch.zeros(3, 2, dtype=F64), _metric(gen, (3,), 2, 1), weights="segment")
    with pytest.raises(ValueError, match="bandwidth"):
        rr.MetricField(torch.randn(2, 2, generator=gen, dtype=F64), M, bandwidth=0.0)
    field = rr.MetricField(torch.stack([x, y]), M, weights="segment")
    with pytest.raises(ValueError, match="points"):
        field.weights(torch.zeros(4, 3, dtype=F64))
    with pytest.raises(ValueError, match="path"):
        fields.path_length(torch.zeros(1, 2, dtype=F64), field)
    with pytest.raises(ValueError, match="field"):
        fields.path_energy(torch.zeros(4, 2, dtype=F64), "not a field")
    with pytest.raises(ValueError, match="n_points"):
        rr.shortest_path(x, y, field, n_points=2)
    with pytest.raises(ValueError, match="method"):
        rr.shortest_path(x, y, field, method="sgd")
    with pytest.raises(ValueError, match="init"):
        rr.shortest_path(x, y, field, n_points=8, init=torch.zeros(7, 2, dtype=F64))
    with pytest.raises(ValueError, match=r"x must have shape \[2\]"):
        rr.shortest_path(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64), field)
