"""experiments/metric_parameterisation.py: the candidate metric forms and a smoke run of the script."""
import json
import math

import pytest
import torch

import riemannian_ref as rr
from _helpers import experiment_script

D_MODEL, H, D, R = 24, 3, 8, 2


def _script():
    return experiment_script("metric_parameterisation.py")


def _dense_metric(lam, U, iso):
    """G_j = (lam_h + iso_j) I + U_j U_j^T as a dense [B, h, n, d, d] float64 tensor."""
    lam_tok = lam.double().view(-1, 1) + (0 if iso is None else iso.double())  # (B, h, n)
    U = U.double()
    eye = torch.eye(U.shape[-2], dtype=torch.float64)
    return lam_tok[..., None, None] * eye + U @ U.transpose(-1, -2)


def _metric(name, **kw):
    m = _script()
    torch.manual_seed(0)
    cls = {"trace": m.TraceNormMetric, "gains": m.GainMetric, "aniso": m.AnisoMetric,
           "tanh": m.TanhBoundMetric}[name]
    return cls(D_MODEL, H, D, R, **kw)


def _x(gen, scale=1.0):
    return torch.randn(2, 5, D_MODEL, generator=gen) * scale


@pytest.mark.parametrize("name", ["trace", "gains", "aniso", "tanh"])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_candidate_metric_is_spd(name, scale, gen):
    metric = _metric(name)
    lam, U, iso = metric(_x(gen, scale))
    assert lam.shape == (H,) and U.shape == (2, H, 5, D, R)
    ev = torch.linalg.eigvalsh(_dense_metric(lam, U, iso))
    assert ev.min() > 0


def test_trace_form_fixes_trace_per_dim_at_tau(gen):
    metric = _metric("trace")
    with torch.no_grad():
        metric.rho.copy_(torch.tensor([-1.0, 0.5, 2.0]))
    for scale in (0.1, 1.0, 100.0):  # whatever the size of U, tr G / d == tau_h
        lam, U, iso = metric(_x(gen, scale))
        G = _dense_metric(lam, U, iso)
        tr = torch.diagonal(G, dim1=-2, dim2=-1).sum(-1) / D  # (B, h, n)
        torch.testing.assert_close(tr, metric.tau().double().view(-1, 1).expand_as(tr), rtol=1e-6, atol=0)


def test_trace_form_equals_its_formula(gen):
    """(A) as given to riemannian_attention is tau (I + U U^T) / (1 + |U|_F^2 / d) with U the raw factor."""
    m = _script()
    metric = _metric("trace")
    x = _x(gen)
    lam, U, iso = metric(x)
    U_raw = m._factors(metric.proj, x, H, D, R).double()
    tau = metric.tau().double().view(-1, 1, 1, 1)
    expect = tau * (torch.eye(D, dtype=torch.float64) + U_raw @ U_raw.transpose(-1, -2)) \
        / (1 + U_raw.pow(2).sum((-2, -1)) / D)[..., None, None]
    torch.testing.assert_close(_dense_metric(lam, U, iso), expect, rtol=1e-5, atol=1e-6)  # float32 metric


def test_iso_mask_gives_the_per_token_metric_scores(gen):
    """riemannian_attention with lam per head, U_k and the additive iso mask == dense scores of G_j."""
    m = _script()
    metric = _metric("trace")
    x = _x(gen)
    q = torch.randn(2, H, 5, D, generator=gen, dtype=torch.float64)
    k = torch.randn(2, H, 5, D, generator=gen, dtype=torch.float64)
    v = torch.randn(2, H, 5, D, generator=gen, dtype=torch.float64)
    lam, U, iso = (t.double() for t in metric(x))
    scale = 1 / math.sqrt(D)
    out = rr.riemannian_attention(q, k, v, m.iso_mask(q, k, iso, scale), is_causal=True, U_k=U, lam=lam)
    G = _dense_metric(lam, U, iso)  # (B, h, n_k, d, d)
    diff = q[..., :, None, :] - k[..., None, :, :]  # (B, h, n_q, n_k, d)
    s = -0.5 * scale * torch.einsum("bhijd,bhjde,bhije->bhij", diff, G, diff)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_gain_form_eigenvalues_lie_in_lam_to_lam_one_plus_gmax(gen):
    metric = _metric("gains", gmax=4.0)
    with torch.no_grad():
        metric.gain.bias.fill_(6.0)  # gains near gmax: the upper bound is the one at stake
    for scale in (1.0, 50.0):
        lam, U, iso = metric(_x(gen, scale))
        assert iso is None
        ev = torch.linalg.eigvalsh(_dense_metric(lam, U, iso))
        lam_h = lam.double().view(1, -1, 1, 1)
        assert (ev >= lam_h * (1 - 1e-9)).all() and (ev <= lam_h * (1 + 4.0) * (1 + 1e-6)).all()
        assert (ev[..., -1] > lam_h[..., 0] * 4.0).any()  # the gains do switch on


def test_gain_form_starts_nearly_isotropic(gen):
    metric = _metric("gains", gmax=4.0, gain_bias=-4.0)
    lam, U, _ = metric(_x(gen))
    low = U.pow(2).sum((-2, -1)) / (D * lam.view(-1, 1))
    assert low.max() < 0.1


def test_aniso_form_fixes_trace_and_bounds_eigenvalues(gen):
    metric = _metric("aniso", rho_max=0.9)
    with torch.no_grad():
        metric.b.copy_(torch.tensor([-4.0, 0.0, 5.0]))
        metric.rho_tau.copy_(torch.tensor([0.0, 1.0, -2.0]))
    lam, U, iso = metric(_x(gen, 10.0))
    G = _dense_metric(lam, U, iso)
    tau, rho = metric.tau().double(), metric.aniso().double()
    tr = torch.diagonal(G, dim1=-2, dim2=-1).sum(-1) / D
    torch.testing.assert_close(tr, tau.view(-1, 1).expand_as(tr))
    ev = torch.linalg.eigvalsh(G)
    lo = (tau * (1 - rho)).view(1, -1, 1, 1)
    hi = (tau * (1 - rho + rho * D)).view(1, -1, 1, 1)
    assert (ev >= lo * (1 - 1e-6)).all() and (ev <= hi * (1 + 1e-6)).all()


def test_tanh_form_bounds_the_low_rank_trace(gen):
    metric = _metric("tanh", c=1.0)
    lam, U, _ = metric(_x(gen, 100.0))
    assert (U.pow(2).sum((-2, -1)) / D <= 1.0 + 1e-5).all()


@pytest.mark.parametrize("name", ["trace", "gains", "aniso", "tanh"])
def test_candidate_gradients_are_finite_and_nonzero_at_init(name, gen):
    """Not at a saddle: the loss moves every metric parameter at init (U = 0 is a saddle of U U^T)."""
    metric = _metric(name)
    x = _x(gen)
    q = torch.randn(2, H, 5, D, generator=gen)
    k = torch.randn(2, H, 5, D, generator=gen)
    v = torch.randn(2, H, 5, D, generator=gen)
    lam, U, iso = metric(x)
    mask = None if iso is None else _script().iso_mask(q, k, iso, 1 / math.sqrt(D))
    out = rr.riemannian_attention(q, k, v, mask, is_causal=True, U_k=U, lam=lam)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    for pname, p in metric.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().max() > 0, pname


def test_script_smoke_run(tmp_path):
    m = _script()
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    m.main(["--steps", "2", "--log-every", "1", "--seeds", "0", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--block-size", "8", "--batch-size", "2", "--eval-batches", "1",
            "--final-batches", "1", "--probe-batch", "2", "--smoke-chars", "2000",
            "--out", str(out), "--md", str(md), "--quiet"])
    rec = json.loads(out.read_text())
    assert rec["complete"] and rec["exploratory"]
    for key in ("settings", "command", "machine", "data", "runs", "summary", "wall_s"):
        assert key in rec, key
    assert rec["machine"]["torch"] == torch.__version__ and "load_avg_1min_start" in rec["machine"]
    assert {r["arm"] for r in rec["runs"]} == set(m.ARMS)
    for r in rec["runs"]:
        assert r["seed"] == 0 and math.isfinite(r["final_val_loss"])
        assert [p["step"] for p in r["curve"]] == [0, 1, 2]
        for layer in r["curve"][-1]["layers"]:
            assert 0 <= layer["entropy"] <= math.log(8) + 1e-6
            if r["arm"] != "sdpa":
                assert layer["trace_per_dim"] > 0 and layer["aniso"] >= 0
    assert rec["summary"]["sdpa"]["pct_vs_sdpa"] == 0
    assert "| gains |" in md.read_text()
    # --resume keeps the finished runs and refuses other settings
    m.main(["--steps", "2", "--log-every", "1", "--seeds", "0", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--block-size", "8", "--batch-size", "2", "--eval-batches", "1",
            "--final-batches", "1", "--probe-batch", "2", "--smoke-chars", "2000", "--arms", "sdpa",
            "--out", str(out), "--resume", "--quiet"])
    assert json.loads(out.read_text())["runs"][0] == rec["runs"][0]
    with pytest.raises(ValueError, match="--resume"):
        m.main(["--steps", "3", "--seeds", "0", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                "--block-size", "8", "--batch-size", "2", "--smoke-chars", "2000", "--arms", "sdpa",
                "--out", str(out), "--resume", "--quiet"])
