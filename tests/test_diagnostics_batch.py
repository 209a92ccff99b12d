"""``return_diagnostics`` over every legal metric/connection combination, per batch and for equal metrics (issue 28).

A batch of B sequences gives the per-example diagnostics averaged over the batch (each example's
diagnostics come from a B = 1 call on it), and configurations whose metrics are all equal
(``attention.rank=0``, or ``attention.strength=0`` at init) give finite diagnostics: the relative
metric-compatibility defect is 0 there (the defect is exactly 0, not 0/0).
"""
import itertools

import pytest
import torch

import riemannian_ref as rr
from _helpers import nested
from riemannian_ref.analysis.bundle import metric_compatibility_defect, sample_pairs

FC = rr.FiberBundleConfig

METRICS = ("token", "shared", "position")
CONNECTIONS = ("trivial", "flat", "content", "content_source", "cumulative")


def _legal():
    for mode, metric, conn in itertools.product(("riemannian", "fiber_bundle"), METRICS, CONNECTIONS):
        try:
            FC.tiny(mode=mode, attention=dict(connection=conn, metric=metric))
        except ValueError:
            continue
        yield mode, metric, conn


@pytest.mark.parametrize("mode, metric, conn", list(_legal()))
def test_diagnostics_of_a_batch_are_the_mean_of_the_per_example_ones(mode, metric, conn):
    # D7: the position metric's factors are [1, h, n, d, r]; a content connection's rates [B, h, n, d/2]
    torch.manual_seed(0)
    cfg = FC.tiny(mode=mode, n_layers=2, attention=dict(connection=conn, metric=metric))
    model = rr.FiberBundleTransformer(cfg).double()
    model.eval()
    idx = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    both = model(idx, return_diagnostics=True).diagnostics
    each = [model(idx[b:b + 1], return_diagnostics=True).diagnostics for b in range(2)]
    assert both.keys() == each[0].keys()
    if conn != "trivial" or metric != "shared":
        assert "metric_compatibility" in both
    for key in both:
        if key in ("lam", "metric_compatibility"):
            continue  # lam: per layer, not per example; the ratio of two means: checked through its parts
        want = (each[0][key] + each[1][key]) / 2
        torch.testing.assert_close(both[key], want, rtol=1e-10, atol=1e-12, msg=key)
    if "metric_compatibility" in both:
        assert torch.isfinite(both["metric_heterogeneity"]).all()


@pytest.mark.parametrize("kw", [dict(mode="riemannian", strength=0.0), dict(strength=0.0), dict(rank=0),
                                dict(mode="riemannian", rank=0), dict(rank=0, metric="position"),
                                dict(strength=0.0, metric="position")])
def test_equal_metrics_give_finite_diagnostics(kw):
    # D8: every metric lam I: the heterogeneity is 0 and so is the defect, exactly; the ratio is 0
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(FC.tiny(n_layers=2, **nested(**kw)))
    idx = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    diag = model(idx, return_diagnostics=True).diagnostics
    assert "metric_compatibility" in diag
    for key, val in diag.items():
        assert torch.isfinite(val).all(), (key, val)
    assert (diag["metric_heterogeneity"] == 0).all()
    assert (diag["metric_compatibility"] == 0).all()


def test_relative_compatibility_convention_for_equal_metrics():
    # D8: heterogeneity 0 -> 0 when the defect is 0 too (G = lam I), inf when the transport alone breaks it
    g = torch.Generator().manual_seed(0)
    n, d = 6, 4
    pairs = sample_pairs(n, 10, generator=g)
    rates = torch.rand(1, n, d // 2, generator=g, dtype=torch.float64)
    zero = torch.zeros(1, n, d, 2, dtype=torch.float64)
    for reduce in (True, False):
        out = metric_compatibility_defect(2.0, zero, rates, pairs, reduce=reduce, relative=True)
        assert (out == 0).all()
        assert (metric_compatibility_defect(2.0, zero, rates, pairs, reduce=reduce) == 0).all()
    shared = torch.randn(1, 1, d, 2, generator=g, dtype=torch.float64).expand(1, n, d, 2)
    out = metric_compatibility_defect(1.0, shared, rates, pairs, relative=True)
    assert torch.isinf(out).all()
