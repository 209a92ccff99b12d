"""Plotting helpers return artists with the right geometry; no display needed (Agg)."""
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import riemannian_ref.plotting as rr  # noqa: E402
from riemannian_ref import LowRankMetric  # noqa: E402

F64 = torch.float64


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_ellipse_params_of_rank_one_metric():
    lam, u = 0.5, torch.tensor([1.0, 1.0], dtype=F64)
    G = lam * torch.eye(2, dtype=F64) + torch.outer(u, u)
    w, h, a = rr.ellipse_params(G)
    # long axis orthogonal to u (eigenvalue lam), short axis along u (lam + |u|^2)
    assert math.isclose(float(w), 2 / math.sqrt(lam), rel_tol=1e-12)
    assert math.isclose(float(h), 2 / math.sqrt(lam + 2.0), rel_tol=1e-12)
    assert math.isclose(abs(math.cos(math.radians(float(a)) - math.pi / 4)), 0.0, abs_tol=1e-12)


def test_metric_ellipse_boundary_has_unit_length(ax):
    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 2, generator=g, dtype=F64)
    G = A @ A.T + 0.3 * torch.eye(2, dtype=F64)
    patch = rr.metric_ellipse(ax, (1.0, -2.0), G, scale=2.0)
    assert patch in ax.patches
    theta = torch.linspace(0, 2 * math.pi, 50, dtype=F64)
    circle = torch.stack([torch.cos(theta), torch.sin(theta)], -1).numpy()
    data_verts = patch.get_patch_transform().transform(circle)  # unit circle -> the ellipse, data coordinates
    verts = torch.as_tensor(data_verts, dtype=F64) - torch.tensor([1.0, -2.0], dtype=F64)
    lengths = torch.einsum("ni,ij,nj->n", verts, G, verts).sqrt()
    torch.testing.assert_close(lengths, torch.full_like(lengths, 2.0), rtol=1e-6, atol=1e-6)


def test_draw_metric_field_accepts_low_rank_and_returns_patches(ax):
    g = torch.Generator().manual_seed(1)
    M = LowRankMetric(torch.full((5,), 0.8, dtype=F64), torch.randn(5, 2, 1, generator=g, dtype=F64))
    pts = torch.randn(5, 2, generator=g, dtype=F64)
    patches = rr.draw_metric_field(ax, pts, M, scale=0.2, color=["C0", "C1", "C2", "C3", "C4"])
    assert len(patches) == 5 and all(p in ax.patches for p in patches)
    G = M.dense()
    for i, patch in enumerate(patches):  # each ellipse is its point's metric ball, in its colour
        w, h, a = rr.ellipse_params(G[i], 0.2)
        assert patch.center == pytest.approx(pts[i].tolist(), abs=1e-12)
        assert (patch.width, patch.height, patch.angle) == pytest.approx((float(w), float(h), float(a)), rel=1e-12)
        assert matplotlib.colors.same_color(patch.get_edgecolor(), f"C{i}")
    line = rr.draw_path(ax, pts, color="k")
    assert line in ax.lines
    assert line.get_xydata() == pytest.approx(pts.numpy(), abs=1e-12)
    fig = ax.figure
    fig.canvas.draw()  # renders without a display


def test_plotting_bad_inputs(ax):
    with pytest.raises(ValueError, match="G must be a 2 x 2"):
        rr.ellipse_params(torch.eye(3))
    with pytest.raises(ValueError, match="positive definite"):
        rr.ellipse_params(-torch.eye(2))
    with pytest.raises(ValueError, match="metrics"):
        rr.draw_metric_field(ax, torch.zeros(3, 2), torch.eye(2).expand(4, 2, 2))
    with pytest.raises(ValueError, match="color"):
        rr.draw_metric_field(ax, torch.zeros(3, 2), torch.eye(2).expand(3, 2, 2), color=["r", "g"])
