"""experiments/grokking_stiefel.py: frame movement, the rescaled Stiefel arm, and tuned rates on a grid's edge.

Tiny runs only: what is checked is what the script records and how it exits,
not what the arms learn.
"""
import json
import math

import pytest
import torch

import riemannian_ref as rr
from _helpers import experiment_script


@pytest.fixture(scope="module")
def script():
    return experiment_script("grokking_stiefel.py")


def _frames(h=3, D=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, D, d, generator=g, dtype=torch.float64))[0]


def test_frame_movement_distances(script):
    w0 = _frames()
    same = script.frame_movement([w0.clone()], [w0])
    assert same == {"relative": 0.0, "subspace": 0.0}
    # a frame scaled by 2: relative distance 1, the same column space
    scaled = script.frame_movement([2 * w0], [w0])
    assert scaled["relative"] == pytest.approx(1.0) and scaled["subspace"] < 1e-12
    # a rotation inside the column space moves the frame, not its subspace
    q = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    rotated = script.frame_movement([w0 @ q], [w0])
    assert rotated["relative"] > 0.1 and rotated["subspace"] < 1e-12
    # orthogonal column spaces: subspace distance 1
    e = torch.eye(12, dtype=torch.float64)
    a, b = e[:, :4].expand(3, 12, 4), e[:, 4:8].expand(3, 12, 4)
    assert script.frame_movement([b], [a])["subspace"] == pytest.approx(1.0)
    # averaged over the frame tensors (query and key)
    both = script.frame_movement([2 * w0, w0.clone()], [w0, w0])
    assert both["relative"] == pytest.approx(0.5)


def _model():
    torch.manual_seed(0)
    cfg = rr.FiberBundleConfig.grokking(20, block_size=4, d_model=16, n_heads=2, head_dim=4, mlp_ratio=2,
                                        n_classes=5)
    return rr.FiberBundleTransformer(cfg)


def test_stiefel_scaled_steps_sqrt_Dd_longer(script):
    """One step from the same gradient: the rescaled arm's frames move sqrt(D d) times farther."""
    moves = {}
    for arm in ("stiefel", "stiefel_scaled"):
        model = _model()
        frames = model.qk_frame_parameters()
        start = [f.detach().clone() for f in frames]
        opt = script.make_optimizer(arm, wd=1.0)(model, 1e-3)
        on_stiefel = [isinstance(g["params"][0], rr.ManifoldParameter) for g in opt.param_groups]
        assert on_stiefel == [True, False, False]
        assert all(isinstance(p.manifold, rr.Stiefel) for p in opt.param_groups[0]["params"])
        group = opt.param_groups[0]
        scale = math.sqrt(16 * 4) if arm == "stiefel_scaled" else 1.0
        assert group["lr"] == pytest.approx(1e-3 * scale) and group["trust_radius"] == pytest.approx(0.1 * scale)
        assert all(g["lr"] == 1e-3 for g in opt.param_groups[1:])
        for f in frames:
            f.grad = torch.randn(f.shape, generator=torch.Generator().manual_seed(2))
        opt.step()
        moves[arm] = torch.stack([(f.detach() - s).norm(dim=(-2, -1)) for f, s in zip(frames, start)])
    assert torch.allclose(moves["stiefel_scaled"], math.sqrt(16 * 4) * moves["stiefel"], rtol=1e-3)


def _run(script, tmp_path, lrs, *extra):
    out = tmp_path / "r.json"
    args = ["--task", "recall", "--n-keys", "4", "--n-values", "3", "--n-pairs", "2", "--n-train", "64",
            "--batch-size", "8", "--d-model", "16", "--n-heads", "2", "--head-dim", "4", "--d-mlp", "32",
            "--steps", "2", "--eval-every", "1", "--lrs", lrs, "--seeds", "0,1", "--arms", "adamw,frozen",
            "--device", "cpu", "--no-progress", "--out", str(out), *extra]
    return args, out


def test_edge_tuned_rate_is_recorded_and_fails_the_run(script, tmp_path, capsys):
    args, out = _run(script, tmp_path, "1e-3,1e-2")  # two rates: whichever wins is on an edge
    with pytest.raises(SystemExit) as exc:
        script.main(args)
    assert exc.value.code == script.EDGE_STATUS
    assert "WARNING" in capsys.readouterr().err
    res = json.loads(out.read_text())  # written all the same, with the flag
    assert sorted(res["at_edge_arms"]) == ["adamw", "frozen"]
    assert all(res["tuned"][a]["at_edge"] for a in ("adamw", "frozen"))
    for run in res["runs"]:
        fm = run["frame_movement"]
        assert set(fm) == {"relative", "subspace"}
        if run["mode"] == "frozen":
            assert fm == {"relative": 0.0, "subspace": 0.0}
        else:
            assert fm["relative"] > 0


def test_allow_edge_exits_normally(script, tmp_path):
    args, out = _run(script, tmp_path, "1e-3,1e-2", "--allow-edge")
    script.main(args)
    assert json.loads(out.read_text())["at_edge_arms"] == ["adamw", "frozen"]


def test_unknown_arm_is_refused(script, tmp_path):
    args, _ = _run(script, tmp_path, "1e-3")
    args[args.index("adamw,frozen")] = "adamw,sgd"
    with pytest.raises(SystemExit, match="unknown arm"):
        script.main(args)
