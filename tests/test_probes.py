"""The probes of ``riemannian_ref.analysis.probes``: the two-layer perceptron reads a nonlinear label
that no linear read-out can, sits at chance on random labels, is deterministic given its seed, and
refuses bad input by naming the argument."""
import pytest
import torch

import riemannian_ref.analysis as ra
from riemannian_ref.analysis import linear_probe_accuracy, mlp_probe_accuracy
from riemannian_ref.analysis.collapse import mlp_probe_accuracy as from_the_combined_module

DT = torch.float64


def _xor(n, seed, dtype=DT, noise_dims=4):
    """Label = parity of the signs of two coordinates, plus distractor coordinates and a large offset."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(n, 2 + noise_dims, generator=g, dtype=dtype) - 1
    y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()
    return 5.0 + 0.1 * x, y  # offset and scale: the probe standardises


def test_mlp_probe_reads_a_label_that_no_linear_probe_can():
    X, y = _xor(1500, 0)
    tr, te = slice(0, 1000), slice(1000, None)
    lin = linear_probe_accuracy(X[tr], y[tr], X[te], y[te])
    mlp = mlp_probe_accuracy(X[tr], y[tr], X[te], y[te])
    assert lin < 0.6, lin  # the parity of two signs is orthogonal to every linear function
    assert mlp > 0.9, mlp


def test_mlp_probe_is_at_chance_on_random_labels():
    g = torch.Generator().manual_seed(1)
    K, N = 4, 1000
    X = torch.randn(2 * N, 8, generator=g, dtype=DT)
    y = torch.randint(K, (2 * N,), generator=g)
    acc = mlp_probe_accuracy(X[:N], y[:N], X[N:], y[N:], steps=300)
    # chance is 1/4; four binomial standard deviations at N = 1000 are 0.055
    assert abs(acc - 1 / K) < 0.055, acc


def test_mlp_probe_is_deterministic_given_its_seed_and_leaves_the_global_rng_alone():
    X, y = _xor(400, 2)
    args = (X[:300], y[:300], X[300:], y[300:])
    state = torch.get_rng_state()
    a = mlp_probe_accuracy(*args, seed=3, steps=50)
    assert torch.equal(torch.get_rng_state(), state)
    assert mlp_probe_accuracy(*args, seed=3, steps=50) == a
    accs = {mlp_probe_accuracy(*args, seed=s, steps=5, hidden=4) for s in range(6)}
    assert len(accs) > 1  # the seed is used: tiny, barely trained probes differ between seeds


def test_mlp_probe_runs_in_float32_and_float64_and_under_no_grad():
    X, y = _xor(600, 4)
    tr, te = slice(0, 400), slice(400, None)
    a64 = mlp_probe_accuracy(X[tr], y[tr], X[te], y[te])
    a32 = mlp_probe_accuracy(X[tr].float(), y[tr], X[te].float(), y[te])
    with torch.no_grad():
        a16 = mlp_probe_accuracy(X[tr].half(), y[tr], X[te].half(), y[te])
    assert min(a64, a32, a16) > 0.85, (a64, a32, a16)
    assert ra.mlp_probe_accuracy is from_the_combined_module is mlp_probe_accuracy


def test_mlp_probe_handles_a_constant_feature():
    X, y = _xor(600, 5)
    X[:, -1] = 3.0  # zero variance on the training set: centred, not divided by zero
    assert mlp_probe_accuracy(X[:400], y[:400], X[400:], y[400:]) > 0.85


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=0), r"hidden must be an int >= 1, got 0"),
    (dict(hidden=2.0), r"hidden must be an int >= 1"),
    (dict(steps=0), r"steps must be an int >= 1, got 0"),
    (dict(steps=True), r"steps must be an int >= 1, got True"),
    (dict(seed=-1), r"seed must be an int >= 0"),
    (dict(seed=1.5), r"seed must be an int >= 0"),
    (dict(weight_decay=-1e-3), r"weight_decay must be a finite number >= 0"),
    (dict(weight_decay=float("inf")), r"weight_decay must be a finite number >= 0"),
    (dict(lr=0.0), r"lr must be a finite number > 0"),
])
def test_mlp_probe_refuses_bad_settings(kwargs, match):
    X, y = _xor(40, 6)
    with pytest.raises(ValueError, match=match):
        mlp_probe_accuracy(X[:30], y[:30], X[30:], y[30:], **kwargs)


def test_probes_refuse_bad_data_naming_the_argument():
    X, y = _xor(40, 7)
    for probe in (mlp_probe_accuracy, linear_probe_accuracy):
        with pytest.raises(ValueError, match=r"train_y must be a long tensor of shape \[30\]"):
            probe(X[:30], y[:30].double(), X[30:], y[30:])
        with pytest.raises(ValueError, match=r"test_y must be a long tensor of shape \[10\]"):
            probe(X[:30], y[:30], X[30:], y[31:])
        with pytest.raises(ValueError, match="test_x must have 6 features"):
            probe(X[:30], y[:30], X[30:, :3], y[30:])
        with pytest.raises(ValueError, match=r"train_x must have shape \[N, F\]"):
            probe(X[:30, None], y[:30], X[30:], y[30:])
        with pytest.raises(ValueError, match="train_x must be a floating-point tensor"):
            probe(X[:30].long(), y[:30], X[30:], y[30:])
        with pytest.raises(ValueError, match="test_y must hold labels >= 0"):
            probe(X[:30], y[:30], X[30:], y[30:] - 1)
        with pytest.raises(ValueError, match="train_x must have at least one row"):
            probe(X[:0], y[:0], X[30:], y[30:])
    bad = X.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="train_x must be finite"):
        mlp_probe_accuracy(bad[:30], y[:30], X[30:], y[30:])
