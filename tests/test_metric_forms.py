"""The bounded metric parameterisation (``MetricNet(form="gains")``, the default) against its definition.

G_j = lam (I + sum_t gamma_tj u_tj u_tj^T) with orthonormal u and gains in (0, max_gain): every eigenvalue of
every metric lies in [lam, lam (1 + max_gain)], in every layout (per token, affine, shared, per position,
subspace), for any input scale; the forward is differentiable (gradcheck in float64); half precision is
computed in float32; bad settings are refused naming the argument.
"""
import math

import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.geometry.metric import _orthonormal_columns

LAYOUTS = [dict(), dict(bias=True), dict(shared=True), dict(n_positions=12), dict(subspace=3)]


def _dense(U):
    U = U.dense() if isinstance(U, rr.SubspaceFactors) else U
    return U if U.dim() == 5 else U.unsqueeze(2)  # shared [1, h, d, r] -> [1, h, 1, d, r]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: ",".join(kw) or "token")
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_every_eigenvalue_lies_in_lam_to_lam_times_one_plus_max_gain(kw, scale):
    torch.manual_seed(0)
    net = rr.MetricNet(16, 3, 8, 2, max_gain=4.0, gain_bias=2.0, **kw).double()  # gains near max_gain
    with torch.no_grad():
        net.rho.copy_(torch.tensor([-1.0, 0.0, 2.0]))  # three different lam
        if net.gain_shared is not None:
            net.gain_shared.normal_(0, 3)
    lam, U = net(scale * torch.randn(4, 10, 16, dtype=torch.float64))
    U = _dense(U)
    ev = torch.linalg.eigvalsh(U @ U.mT) / lam.view(1, -1, 1, 1)  # spectrum of G / lam minus 1
    assert ev.min() > -1e-12 and ev.max() <= 4.0 + 1e-9
    assert ev.max() > 2.0  # the bound is approached, not vacuous
    if scale >= 1:  # orthogonal columns (the directions of nearly-zero raw factors: up to eps / |v|)
        gram = U.mT @ U
        norms = (gram[..., 0, 0] * gram[..., 1, 1]).sqrt()
        live = norms > 1e-100  # (gains that underflowed to subnormals say nothing about the directions)
        assert live.float().mean() > 0.25 and (gram[..., 0, 1].abs() <= 1e-9 * norms)[live].all()


def test_saturated_gains_keep_a_finite_gradient():
    torch.manual_seed(0)
    net = rr.MetricNet(16, 2, 8, 2)
    x = (1e4 * torch.randn(2, 5, 16)).requires_grad_()  # gain logits far beyond where sigmoid underflows
    lam, U = net(x)
    (U.sum() + lam.sum()).backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_the_factor_form_is_unbounded_and_the_gains_form_is_not():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    for form, bounded in (("factor", False), ("gains", True)):
        net = rr.MetricNet(16, 2, 8, 2, form=form)
        with torch.no_grad():
            net.proj.weight.mul_(100.0)  # a metric network that has grown in training
        lam, U = net(x)
        top = torch.linalg.eigvalsh(U.mT @ U)[..., -1] / lam.view(1, -1, 1)
        assert (top.max() <= 4.0 + 1e-5) == bounded, form


def test_gains_start_at_max_gain_sigmoid_bias_and_the_gradient_reaches_every_parameter():
    torch.manual_seed(0)
    net = rr.MetricNet(16, 2, 8, 2, strength=0.0 + 1e-12, max_gain=4.0, gain_bias=-4.0)
    g = net.gains(torch.randn(3, 5, 16))
    torch.testing.assert_close(g, torch.full_like(g, 4.0 * torch.sigmoid(torch.tensor(-4.0)).item()))
    net = rr.MetricNet(16, 2, 8, 2)
    lam, U = net(torch.randn(3, 5, 16))
    (U.pow(3).sum() + lam.sum()).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: ",".join(kw) or "token")
def test_gradcheck(kw):
    torch.manual_seed(0)
    net = rr.MetricNet(6, 2, 4, 2, **kw).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)

    def f(x):
        lam, U = net(x)
        return _dense(U), lam

    assert torch.autograd.gradcheck(f, (x,))


def test_orthonormalisation_is_smooth_at_zero_and_keeps_norms_below_one():
    V = torch.zeros(3, 4, 2, dtype=torch.float64, requires_grad=True)
    U = _orthonormal_columns(V)
    U.sum().backward()
    assert torch.equal(U, torch.zeros_like(U)) and torch.isfinite(V.grad).all()
    V = torch.randn(50, 6, 3, dtype=torch.float64)
    V[..., 2] = V[..., 0] + 1e-9 * V[..., 2]  # nearly dependent third column
    U = _orthonormal_columns(V)
    assert (U.norm(dim=-2) <= 1 + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_orthonormalised_in_float32(dtype):
    torch.manual_seed(0)
    net = rr.MetricNet(16, 2, 8, 2)
    x = torch.randn(2, 7, 16)
    lam32, U32 = net(x)
    lam, U = net.to(dtype)(x.to(dtype))
    assert U.dtype == dtype and lam.dtype == dtype
    err = (U.float() - U32).norm() / U32.norm()
    assert err < 8 * torch.finfo(dtype).eps, err


def test_under_autocast_the_metric_network_runs_in_float32():
    torch.manual_seed(0)
    net = rr.MetricNet(16, 2, 8, 2)
    x = torch.randn(2, 7, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lam, U = net(x)
    assert U.dtype == torch.float32
    torch.testing.assert_close(U, net(x)[1])


@pytest.mark.parametrize("kw, msg", [
    (dict(form="trace"), "form must be one of"), (dict(form=None), "form must be one of"),
    (dict(max_gain=0.0), "max_gain must be > 0"), (dict(max_gain=float("inf")), "max_gain must be a finite"),
    (dict(gain_bias=float("nan")), "gain_bias must be a finite"), (dict(max_gain=True), "max_gain must be a finite"),
])
def test_bad_settings_are_refused_naming_the_argument(kw, msg):
    with pytest.raises(ValueError, match=msg):
        rr.MetricNet(16, 2, 8, 2, **kw)


def test_the_gains_form_needs_as_many_dimensions_as_directions():
    """r orthonormal directions need r dimensions: past them Gram-Schmidt would orthonormalise rounding noise,
    and the extra directions turn with any change of the weights (a 1e-8 change moved U by 20%)."""
    with pytest.raises(ValueError, match=r"form='gains' needs rank <= head_dim = 8 .*got rank=9"):
        rr.MetricNet(16, 2, 8, 9)
    with pytest.raises(ValueError, match=r"form='gains' needs rank <= subspace = 2 .*got rank=3"):
        rr.MetricNet(16, 2, 8, 3, subspace=2)
    with pytest.raises(ValueError, match=r"needs rank <= subspace = 1"):
        rr.AttentionConfig(d_model=16, n_heads=2, rank=2, subspace=1)
    with pytest.raises(ValueError, match=r"attention: form='gains' needs rank <= subspace = 1"):
        rr.FiberBundleConfig.tiny(mode="riemannian", attention=dict(subspace=1))
    rr.MetricNet(16, 2, 8, 3, subspace=2, form="factor")  # a redundant factor is only redundant
    rr.AttentionConfig(d_model=16, n_heads=2, rank=9, scores="dot")  # no metric, no directions
    torch.manual_seed(0)
    net = rr.MetricNet(16, 2, 8, 2, subspace=2)  # at the limit the directions are well defined
    x = torch.randn(2, 5, 16)
    U = net(x)[1].dense()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1e-8 * torch.randn_like(p))
    assert float((net(x)[1].dense() - U).norm() / U.norm()) < 1e-5


@pytest.mark.parametrize("field, value, msg", [("metric_form", "gain", "metric_form"), ("max_gain", -1.0, "max_gain"),
                                               ("gain_bias", math.inf, "gain_bias")])
def test_the_configs_name_the_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        rr.AttentionConfig(**{field: value})
    with pytest.raises(ValueError, match=msg):
        rr.FiberBundleConfig.tiny(**{field: value})


def test_configs_pass_the_form_to_the_metric_network():
    for form in ("gains", "factor"):
        layer = rr.RiemannianAttention(rr.AttentionConfig(d_model=16, n_heads=2, metric_form=form, max_gain=2.0))
        assert layer.metric.form == form and layer.metric.max_gain == 2.0
        cfg = rr.FiberBundleConfig.tiny(mode="riemannian", attention=dict(metric_form=form))
        model = rr.FiberBundleTransformer(cfg)
        assert all(b.attn.metric.form == form for b in model.blocks)
