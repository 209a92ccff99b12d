"""The one-layer collapse bound and its escape routes (chapter 9), in float64.

Covers the metric options that the escape routes need (an affine metric
network, a metric field over positions) and the functions of
``riemannian_ref.analysis`` (measures, bound, probes) that certify the theorem: the token
radius, the bound's constant, the one-layer map, continuous collapse depths,
attention entropy and the linear probe.
"""
import math

import numpy as np
import pytest
import torch

import riemannian_ref as rr
from _helpers import nested
from riemannian_ref.analysis import (attention_entropy, collapse_bound, collapse_depth, collapse_map,
                                     linear_probe_accuracy, token_radius)

DT = torch.float64
METRIC = dict(mode="riemannian", rank=2, metric_form="factor")  # the form the bound is derived for
TOKEN_VARIANTS = {  # the theorem's hypothesis: metrics computed from the token states (model fields and options)
    "euclidean": dict(mode="euclidean"),
    "l2": dict(mode="riemannian", rank=0, strength=0.0),
    "shared": dict(METRIC, metric="shared"),
    "key": dict(METRIC, metric_side="key"),
    "query": dict(METRIC, metric_side="query"),
    "mean": dict(METRIC, metric_side="mean"),
    "bias": dict(METRIC, metric_bias=True),
    "temperature": dict(METRIC, metric_side="mean", learn_temperature=True),
}
POSITION_VARIANTS = {side: dict(METRIC, metric="position", metric_side=side) for side in ("key", "query", "mean")}


def _layer(seed=0, gain=1.0, **kw):
    torch.manual_seed(seed)
    cfg = rr.FiberBundleConfig.attention_stack(d_model=16, n_heads=2, n_layers=1, block_size=16,
                                               **nested(qk_gain=gain, **kw))
    attn = rr.FiberBundleTransformer(cfg).to(DT).blocks[0].attn
    if attn.log_temp is not None:
        with torch.no_grad():
            attn.log_temp.copy_(torch.tensor([0.3, -0.2]))  # a learned temperature away from 1
    return attn


def _inputs(seed=0, n=8, D=16):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(D, generator=g, dtype=DT), torch.randn(n, D, generator=g, dtype=DT)


# ----------------------------------------------------------------- metric options
def test_affine_metric_net_is_lipschitz_with_the_weight_and_nonzero_at_zero():
    torch.manual_seed(0)
    net = rr.MetricNet(8, 2, 4, 3, bias=True, form="factor").double()
    assert net.proj.bias is not None and net.proj.bias.abs().max() > 0  # a state-independent part at init
    x, y = torch.randn(2, 1, 5, 8, dtype=DT)
    _, Ux = net(x)
    _, Uy = net(y)
    _, U0 = net(torch.zeros(1, 5, 8, dtype=DT))
    assert U0.abs().max() > 0
    W = net.proj.weight.view(2, 12, 8)
    diff = torch.einsum("hkD,bnD->bhnk", W, x - y).reshape(Ux.shape)
    torch.testing.assert_close(Ux - Uy, diff)  # the bias cancels in differences
    for kw in (dict(shared=True), dict(n_positions=4)):
        with pytest.raises(ValueError, match="bias=True needs metrics computed from the states"):
            rr.MetricNet(8, 2, 4, 3, bias=True, **kw)


def test_position_metric_ignores_the_state_and_covers_n_positions():
    torch.manual_seed(0)
    net = rr.MetricNet(8, 2, 4, 3, n_positions=6, form="factor").double()
    x = torch.randn(3, 5, 8, dtype=DT)
    lam, U = net(x)
    assert U.shape == (1, 2, 5, 4, 3)
    torch.testing.assert_close(net(7 * x + 1)[1], U)
    torch.testing.assert_close(U[0, 1, 4], net.U_pos[4, 1].detach())
    with pytest.raises(ValueError, match="n = 7 tokens but the metric field covers n_positions = 6"):
        net(torch.randn(1, 7, 8, dtype=DT))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n_positions must be a positive int"):
            rr.MetricNet(8, 2, 4, 3, n_positions=bad)
    with pytest.raises(ValueError, match="excludes shared=True"):
        rr.MetricNet(8, 2, 4, 3, n_positions=4, shared=True)


def test_config_fields_reach_the_metric_network_and_bad_combinations_are_refused():
    cfg = rr.FiberBundleConfig.attention_stack(mode="riemannian", block_size=12, attention=dict(metric="position"))
    a = cfg.attention
    assert a.metric == "position" and a.max_positions == 12
    attn = rr.RiemannianAttention(a)
    assert attn.metric.U_pos.shape[0] == 12 and attn.metric.proj is None
    b = rr.FiberBundleConfig.attention_stack(mode="riemannian", attention=dict(metric_bias=True)).attention
    assert b.metric_bias and rr.RiemannianAttention(b).metric.proj.bias is not None
    with pytest.raises(ValueError, match="metric_bias=True needs metric='token'"):
        rr.AttentionConfig(d_model=16, metric="shared", metric_bias=True)
    with pytest.raises(ValueError, match="metric='position' .* needs cross_attention=False"):
        rr.AttentionConfig(d_model=16, metric="position", cross_attention=True)
    with pytest.raises(ValueError, match="max_positions must be an int >= 1"):
        rr.AttentionConfig(d_model=16, max_positions=0)
    with pytest.raises(ValueError, match="metric_bias must be a bool"):
        rr.FiberBundleConfig.attention_stack(attention=dict(metric_bias=1))


@pytest.mark.parametrize("kw", [dict(METRIC, metric_bias=True), POSITION_VARIANTS["key"],
                                POSITION_VARIANTS["query"], POSITION_VARIANTS["mean"]], ids=str)
def test_identical_rows_stay_identical_with_the_new_metrics(kw):
    """Neither a bias nor a metric per position breaks the fixed point: the values are not transported."""
    torch.manual_seed(0)
    stack = rr.FiberBundleTransformer(rr.FiberBundleConfig.attention_stack(
        d_model=16, n_heads=2, n_layers=4, block_size=16, **nested(**kw))).to(DT)
    x = torch.randn(2, 1, 16, dtype=DT)
    H = stack(embeds=x.expand(2, 7, 16).contiguous(), return_hidden=True).hidden
    assert rr.relative_residual(H[-1], "fro").max() < 1e-12
    X = torch.randn(2, 7, 16, dtype=DT)
    assert rr.relative_residual(stack(embeds=X, return_hidden=True).hidden[1], "fro").min() > 1e-3


# ----------------------------------------------------------------- the bound
def test_token_radius():
    X = torch.tensor([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0]], dtype=DT)
    torch.testing.assert_close(token_radius(X), torch.tensor(2.0, dtype=DT))  # mean (1, 1); (1, 3) is farthest
    assert token_radius(torch.ones(4, 3, dtype=DT)) == 0
    Y = torch.randn(5, 6, 4, dtype=DT)
    torch.testing.assert_close(token_radius(Y[:, torch.randperm(6)]), token_radius(Y))
    torch.testing.assert_close(token_radius(Y + 3.0), token_radius(Y))
    with pytest.raises(ValueError, match=r"X must have shape \[\.\.\., n, D\]"):
        token_radius(torch.zeros(0, 3, dtype=DT))


EPS = torch.logspace(-3.5, -1.5, 9, dtype=DT)  # above float64 rounding, below the higher orders


@pytest.mark.parametrize("gain", [1.0, 3.0])
@pytest.mark.parametrize("name", list(TOKEN_VARIANTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_cubic_bound_holds_and_the_exponent_is_three(name, gain, seed):
    attn = _layer(seed, gain, **TOKEN_VARIANTS[name])
    xbar, R = _inputs(seed)
    rho_in, rho_out = collapse_map(attn, xbar, R, EPS)
    torch.testing.assert_close(rho_in, EPS)
    for e, ri, ro in zip(EPS, rho_in, rho_out):
        p, C = collapse_bound(attn, xbar, float(e))
        assert p == 3 and ro <= C * ri ** 3
    slope = np.polyfit(np.log(rho_in.numpy()), np.log(rho_out.numpy()), 1)[0]
    assert abs(slope - 3) < 0.1


@pytest.mark.parametrize("side", list(POSITION_VARIANTS))
def test_position_metrics_give_a_quadratic_map_not_a_cubic_one(side):
    attn = _layer(0, 1.0, **POSITION_VARIANTS[side])
    xbar, R = _inputs(0)
    rho_in, rho_out = collapse_map(attn, xbar, R, EPS)
    for e, ri, ro in zip(EPS, rho_in, rho_out):
        p, C = collapse_bound(attn, xbar, float(e), n=8)
        assert p == 2 and ro <= C * ri ** 2
    slope = np.polyfit(np.log(rho_in.numpy()), np.log(rho_out.numpy()), 1)[0]
    assert abs(slope - 2) < 0.1
    cubic = rho_out / rho_in ** 3
    assert cubic[0] > 30 * cubic[-1]  # grows like 1 / eps: no C gives rho_out <= C rho_in^3 as eps -> 0
    with pytest.raises(ValueError, match="n must be an int in \\[1, 16\\] for metric='position'"):
        collapse_bound(attn, xbar, 0.1)


def test_the_bound_refuses_transports_and_bad_arguments():
    xbar, _ = _inputs(0)
    with pytest.raises(ValueError, match="connection='trivial' only"):
        collapse_bound(_layer(0, connection="flat", **METRIC), xbar, 0.1)
    attn = _layer(0, **METRIC)
    with pytest.raises(ValueError, match=r"center must have shape \[16\]"):
        collapse_bound(attn, torch.zeros(3, dtype=DT), 0.1)
    with pytest.raises(ValueError, match="radius must be a finite number >= 0"):
        collapse_bound(attn, xbar, -1.0)
    with pytest.raises(ValueError, match="attn must be a RiemannianAttention"):
        collapse_bound(torch.nn.Linear(2, 2), xbar, 0.1)
    with pytest.raises(ValueError, match="direction must have rows that are not all equal"):
        collapse_map(attn, xbar, torch.ones(8, 16, dtype=DT), EPS)


def test_value_transport_breaks_the_fixed_point_and_key_transport_gives_a_linear_map():
    xbar, R = _inputs(0)
    flat = _layer(0, connection="flat", **METRIC)
    _, out = collapse_map(flat, xbar, R, EPS)
    assert out.min() > 1e-2 and out.max() / out.min() < 1.1  # an intercept: rho_out does not vanish
    rope = _layer(0, 3.0, mode="euclidean", connection="flat", transport_values=False)
    rho_in, out = collapse_map(rope, xbar, R, EPS)
    slope = np.polyfit(np.log(rho_in.numpy()), np.log(out.numpy()), 1)[0]
    assert abs(slope - 1) < 0.05


# ----------------------------------------------------------------- depth, entropy, probe
def test_collapse_depth_interpolates_the_crossing():
    u = torch.tensor([[0.0, -2.0, -4.0, -8.0, -15.0], [0.0, -1.0, -1.0, -1.0, -1.0], [-7.0, -8.0, -9.0, -9, -9]])
    d = collapse_depth(u, -6.0)
    torch.testing.assert_close(d, torch.tensor([2.5, math.inf, 0.0], dtype=DT))
    torch.testing.assert_close(collapse_depth(np.array([0.0, -3.0, -9.0]), -6.0), torch.tensor(1.5, dtype=DT))
    with pytest.raises(ValueError, match="level must be a finite number"):
        collapse_depth(u, float("nan"))


def test_attention_entropy():
    n = 5
    H = attention_entropy(torch.full((2, n, n), 1.0 / n, dtype=DT))
    torch.testing.assert_close(H, torch.full((2, n), math.log(n), dtype=DT))
    torch.testing.assert_close(attention_entropy(torch.eye(n, dtype=DT)), torch.zeros(n, dtype=DT))


def test_linear_probe_reads_a_signal_above_its_precision_and_not_below():
    g = torch.Generator().manual_seed(0)
    K, N, F = 4, 400, 6
    y = torch.randint(K, (2 * N,), generator=g)
    means = torch.randn(K, F, generator=g, dtype=DT)
    offset = 10.0 * torch.randn(F, generator=g, dtype=DT)  # a large part common to every row

    def feats(scale):
        return offset + scale * (means[y] + 0.1 * torch.randn(2 * N, F, generator=g, dtype=DT))

    for scale, tol, expect in ((1.0, 1e-6, "perfect"), (1e-9, 1e-6, "chance"), (1e-9, 1e-13, "perfect")):
        X = feats(scale)
        acc = linear_probe_accuracy(X[:N], y[:N], X[N:], y[N:], rel_tol=tol)
        majority = torch.bincount(y[N:], minlength=K).max().item() / N
        assert acc > 0.95 if expect == "perfect" else acc <= majority + 0.05
    with pytest.raises(ValueError, match=r"train_y must be a long tensor of shape \[400\]"):
        linear_probe_accuracy(X[:N], y[:N].double(), X[N:], y[N:])
    with pytest.raises(ValueError, match="test_x must have 6 features"):
        linear_probe_accuracy(X[:N], y[:N], X[N:, :3], y[N:])


def test_the_bounded_gains_form_is_refused_not_bounded_wrongly():
    attn = _layer(**dict(METRIC, metric_form="gains"))
    with pytest.raises(ValueError, match="metric_form='gains'"):
        collapse_bound(attn, torch.zeros(16, dtype=DT), 0.1)


@pytest.mark.parametrize("kw", [dict(mode="euclidean"), METRIC])
def test_a_causal_layer_is_refused_its_map_is_linear(kw):
    """The bound assumes no mask: with the causal mask the one-layer map is linear (chapter 9, prop-causal)."""
    attn = _layer(**dict(kw, causal=True))
    with pytest.raises(ValueError, match="causal=True"):
        collapse_bound(attn, torch.zeros(16, dtype=DT), 0.1)
    xbar, R = torch.randn(16, dtype=DT), torch.randn(8, 16, dtype=DT)
    rho_in, rho_out = collapse_map(attn, xbar, R, torch.tensor([1e-4, 1e-5], dtype=DT))
    assert 0.9 < math.log10(rho_out[0] / rho_out[1]) < 1.1  # ten times smaller input, ten times smaller output


def test_a_nonlinear_metric_network_is_refused_with_the_reason():
    """The certificate needs x -> U(x) linear (its weight's norm is the Lipschitz constant)."""
    attn = _layer(**METRIC)
    net = next(m for m in attn.modules() if isinstance(getattr(m, "proj", None), torch.nn.Linear))
    lin = net.proj
    net.proj = torch.nn.Sequential(lin, torch.nn.Tanh())
    with pytest.raises(ValueError, match="one linear layer .* got Sequential"):
        collapse_bound(attn, torch.zeros(16, dtype=DT), 0.1)
