"""Certificates that no dot-product head realises a pattern, and a metric teacher that needs them."""
import math

import pytest
import torch

import riemannian_ref as rr
from _helpers import experiment_script
from riemannian_ref.geometry._realisability import (best_dot_head, dot_head_kl_lower_bound,
                                                    dot_head_logit_lower_bound, metric_teacher)

F64 = torch.float64


def _row_shifted_error(L, S):
    """min over c of ||L - S - c 1^T||_F: the error with each row's mean taken out."""
    E = L - S
    return float((E - E.mean(-1, keepdim=True)).norm())


def _dot_target(gen, n_q, n_k, d):
    Q = torch.randn(n_q, d, generator=gen, dtype=F64)
    K = torch.randn(n_k, d, generator=gen, dtype=F64)
    return torch.softmax(Q @ K.T, -1)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_dot_head_targets_have_zero_bound(gen, d):
    P = _dot_target(gen, 20, 24, d)
    cert = dot_head_logit_lower_bound(P, d)
    assert cert.bound <= cert.round_off
    assert cert.min_dot_dim == d
    assert dot_head_kl_lower_bound(P, d) == 0.0
    # one dimension less cannot do it (generic Q, K)
    assert dot_head_logit_lower_bound(P, d + 1).bound <= cert.round_off
    if d > 1:
        assert dot_head_logit_lower_bound(P, d - 1).bound > 1e3 * cert.round_off


@pytest.mark.parametrize("d,r", [(2, 1), (2, 2), (3, 2)])
def test_metric_teacher_needs_theorem1_dimension(gen, d, r):
    n = 32
    T = metric_teacher(n, d, r, gen)
    m = rr.score_rank_bound(d, "key")
    # the teacher is a metric head of dimension d: its weights are its own scores' softmax
    S = rr.riemannian_scores(T.q, T.k, None, T.U_k, lam=T.lam, scale=T.scale)
    torch.testing.assert_close(torch.softmax(S, -1), T.weights, rtol=0, atol=0)
    assert T.q.shape == (n, d) and T.U_k.shape == (n, d, r)
    cert = dot_head_logit_lower_bound(T.weights, d)
    assert cert.min_dot_dim == m  # Theorem 1's bound, attained
    for dd in range(d, m):  # positive up to m - 1, zero from m on
        assert dot_head_logit_lower_bound(T.weights, dd).bound > 1e6 * cert.round_off
    assert dot_head_logit_lower_bound(T.weights, m).bound <= cert.round_off
    assert dot_head_kl_lower_bound(T.weights, d) > 0
    # the teacher's row-centred scores have the requested root-mean-square
    Sc = T.scores - T.scores.mean(-1, keepdim=True)
    assert math.isclose(float(Sc.pow(2).mean().sqrt()), 1.0, rel_tol=1e-12)


@pytest.mark.parametrize("d", [1, 2, 4])
def test_truncated_svd_head_attains_the_bound(gen, d):
    T = metric_teacher(24, 2, 2, gen, spread=1.5)
    L = T.weights.log()
    Q, K, c = best_dot_head(T.weights, d)
    assert Q.shape == (24, d) and K.shape == (24, d) and c.shape == (24,)
    bound = dot_head_logit_lower_bound(T.weights, d).bound
    assert abs(float((L - Q @ K.T - c[:, None]).norm()) - bound) < 1e-10
    # the bound is a minimum: random heads and perturbed optimal heads do worse
    for _ in range(20):
        Qr = Q + 0.1 * torch.randn(Q.shape, generator=gen, dtype=F64)
        Kr = K + 0.1 * torch.randn(K.shape, generator=gen, dtype=F64)
        assert _row_shifted_error(L, Qr @ Kr.T) >= bound - 1e-10
        Qr, Kr = torch.randn(Q.shape, generator=gen, dtype=F64), torch.randn(K.shape, generator=gen, dtype=F64)
        assert _row_shifted_error(L, Qr @ Kr.T) >= bound - 1e-10


def test_bound_invariant_to_row_shifts_and_logits_form(gen):
    T = metric_teacher(16, 2, 1, gen)
    L = T.scores
    shifted = L + torch.randn(16, 1, generator=gen, dtype=F64) * 10
    a = dot_head_logit_lower_bound(T.weights, 2)
    b = dot_head_logit_lower_bound(L, 2, logits=True)
    c = dot_head_logit_lower_bound(shifted, 2, logits=True)
    assert abs(a.bound - b.bound) < 1e-10 and abs(b.bound - c.bound) < 1e-10
    torch.testing.assert_close(a.singular_values, c.singular_values, rtol=0, atol=1e-10)


def test_kl_bound_holds_for_trained_and_random_dot_heads(gen):
    """No dot head, fitted to the KL or random, goes below the certified KL bound."""
    d = 2
    T = metric_teacher(16, d, 2, gen, spread=0.7)
    P = T.weights
    kl_lb = dot_head_kl_lower_bound(P, d)
    assert kl_lb > 0

    def mean_kl(S):
        return float((P * (P.log() - torch.log_softmax(S, -1))).sum(-1).mean())

    Q, K, _ = best_dot_head(P, d)
    Q, K = Q.clone().requires_grad_(), K.clone().requires_grad_()
    opt = torch.optim.Adam([Q, K], lr=3e-2)
    for _ in range(300):
        opt.zero_grad()
        loss = (P * (P.log() - torch.log_softmax(Q @ K.T, -1))).sum(-1).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert mean_kl(Q @ K.T) >= kl_lb
        assert _row_shifted_error(P.log(), Q @ K.T) >= dot_head_logit_lower_bound(P, d).bound - 1e-10
        for _ in range(20):
            Qr, Kr = torch.randn(16, d, generator=gen, dtype=F64), torch.randn(16, d, generator=gen, dtype=F64)
            assert mean_kl(Qr @ Kr.T) >= kl_lb


def test_float32_input_is_computed_in_float64(gen):
    T = metric_teacher(16, 2, 1, gen)
    a = dot_head_logit_lower_bound(T.weights, 2)
    b = dot_head_logit_lower_bound(T.weights.float(), 2)
    assert b.singular_values.dtype == F64
    assert abs(a.bound - b.bound) < 1e-4 * a.bound


def test_bad_inputs(gen):
    P = _dot_target(gen, 5, 6, 2)
    with pytest.raises(ValueError, match="P must have positive entries"):
        dot_head_logit_lower_bound(torch.cat([P[:, :1] * 0, P[:, 1:]], 1), 2)
    with pytest.raises(ValueError, match="row-stochastic"):
        dot_head_logit_lower_bound(P * 2, 2)
    with pytest.raises(ValueError, match="P must be one"):
        dot_head_logit_lower_bound(P[None], 2)
    with pytest.raises(ValueError, match=r"n_k >= 2"):
        dot_head_logit_lower_bound(P[:, :1] / P[:, :1], 2)
    with pytest.raises(ValueError, match="logits must be finite"):
        dot_head_logit_lower_bound(torch.full((3, 3), float("nan"), dtype=F64), 2, logits=True)
    with pytest.raises(ValueError, match="P must be a torch.Tensor"):
        dot_head_logit_lower_bound(P.tolist(), 2)
    with pytest.raises(ValueError, match="floating-point"):
        dot_head_logit_lower_bound(torch.ones(3, 3, dtype=torch.long), 2, logits=True)
    with pytest.raises(ValueError, match="logits must be a bool"):
        dot_head_logit_lower_bound(P, 2, logits=1)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="d must be a positive int"):
            dot_head_logit_lower_bound(P, bad)
        with pytest.raises(ValueError, match="d must be a positive int"):
            dot_head_kl_lower_bound(P, bad)
        with pytest.raises(ValueError, match="d must be a positive int"):
            best_dot_head(P, bad)
    with pytest.raises(ValueError, match="n must be an int >= 2"):
        metric_teacher(1, 2, 1, gen)
    with pytest.raises(ValueError, match="r must be a positive int"):
        metric_teacher(8, 2, 0, gen)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        metric_teacher(8, 2, 1, 0)
    with pytest.raises(ValueError, match="spread must be a positive finite float"):
        metric_teacher(8, 2, 1, gen, spread=float("inf"))
    with pytest.raises(ValueError, match="lam must be a positive finite float"):
        metric_teacher(8, 2, 1, gen, lam=0.0)


def test_private_module_is_not_exported():
    import riemannian_ref.geometry as geo
    for name in ("dot_head_logit_lower_bound", "dot_head_kl_lower_bound", "best_dot_head", "metric_teacher"):
        assert name not in rr.__all__ and name not in geo.__all__


def test_experiment_script_smoke(tmp_path):
    """experiments/score_rank_task.py end to end at toy size: the file it writes and its checks."""
    import json

    mod = experiment_script("score_rank_task.py")
    out = tmp_path / "r.json"
    mod.main(["--ds", "2", "--n", "12", "--steps", "20", "--lrs", "1e-2", "--seeds", "0,1", "--out", str(out)])
    res = json.loads(out.read_text())
    by = res["by_d"]["2"]
    assert by["theorem1_rank"] == 6 and [r["min_dot_dim"] for r in by["runs"]] == [6, 6]
    assert set(by["summary"]) >= {"dot", "metric", "dot_matched", "dot_m", "logit_bound", "kl_bound"}
    assert [r["arms"]["dot_matched"]["dim"] for r in by["runs"]] == [4, 4]
    assert by["paired"]["dot_matched_minus_metric_kl"]["n"] == 2
    assert by["paired"]["dot_minus_metric_kl"]["n"] == 2
    assert res["command"].startswith("python experiments/score_rank_task.py") and res["wall_s"] > 0
    assert by["tuned_lr_at_edge"] == []  # one rate: no grid, so no edge
    mod.main(["--ds", "2", "--n", "8", "--steps", "5", "--lrs", "1e-3,1e-2", "--seeds", "0,1",
              "--arms", "dot,metric", "--out", str(out)])
    by = json.loads(out.read_text())["by_d"]["2"]
    assert by["tuned_lr_at_edge"] == ["dot", "metric"]  # two rates: every choice is an end
    with pytest.raises(ValueError, match="--arms"):
        mod.main(["--arms", "dot,attention", "--out", str(out)])


def test_experiment_script_pick_lr():
    """The tuned rate is the smallest whose KL ties the best (converged runs differ by round-off)."""
    pick = experiment_script("score_rank_task.py").pick_lr
    lrs = [1e-3, 1e-2, 1e-1]
    assert pick({"0.001": 0.5, "0.01": 0.2, "0.1": 0.3}, lrs) == 1e-2
    assert pick({"0.001": 0.5, "0.01": 0.2 * (1 + 1e-5), "0.1": 0.2}, lrs) == 1e-2  # relative tie
    assert pick({"0.001": 3e-11, "0.01": 1e-12, "0.1": -1e-17}, lrs) == 1e-3  # all at round-off
    assert pick({"0.001": 1e-6, "0.01": 1e-8, "0.1": 1e-12}, lrs) == 1e-1
