r"""Probes: how well a label can be read from features, such as deep token states.

Chapter 9 asks whether the residual that an escape route from rank collapse
keeps carries the input. A probe answers it operationally: it is trained on
one set of (feature, label) pairs and scored on another.

- :func:`linear_probe_accuracy`: a ridge-regularised linear read-out of
  whitened principal directions, at a stated relative precision (a signal
  below it carries nothing), solved in closed form in float64.
- :func:`mlp_probe_accuracy`: a two-layer perceptron (one hidden ReLU layer)
  trained full-batch by Adam on standardised features, deterministic given
  its seed; it reads nonlinear codes (for example a label that is the parity
  of two signs) that no linear probe can.

Both return the test accuracy as a float; chance is the frequency of the
most common test label, about :math:`1/K` for :math:`K` balanced classes.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._checks import check_tensor, shape_str

__all__ = ["linear_probe_accuracy", "mlp_probe_accuracy"]


def _check_probe_data(train_x, train_y, test_x, test_y) -> None:
    for name, x in (("train_x", train_x), ("test_x", test_x)):
        check_tensor(x, name, min_dim=2)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [N, F], got {shape_str(x)}")
    for name, y, x in (("train_y", train_y, train_x), ("test_y", test_y, test_x)):
        if not isinstance(y, Tensor) or y.dtype != torch.long or y.shape != x.shape[:1]:
            raise ValueError(f"{name} must be a long tensor of shape [{x.shape[0]}], got "
                             f"{shape_str(y) if isinstance(y, Tensor) else type(y).__name__}")
        if y.numel() and int(y.min()) < 0:
            raise ValueError(f"{name} must hold labels >= 0, got {int(y.min())}")
    if train_x.shape[0] == 0:
        raise ValueError("train_x must have at least one row (N >= 1), got shape [0, F]")
    if test_x.shape[1] != train_x.shape[1]:
        raise ValueError(f"test_x must have {train_x.shape[1]} features like train_x, got {shape_str(test_x)}")


@torch.no_grad()
def linear_probe_accuracy(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, *,
                          rel_tol: float = 1e-6, ridge: float = 1e-3) -> float:
    r"""Test accuracy of a linear read-out of labels from features, at a stated precision.

    The features are centred; only principal directions whose amplitude
    (singular value over :math:`\sqrt N`) exceeds ``rel_tol`` times the
    root-mean-square norm of the *uncentred* features are kept, whitened,
    and mapped to one-hot labels by ridge regression; the prediction is the
    arg max. So a signal smaller than ``rel_tol`` of the states themselves
    (for example a residual that has collapsed below float32 resolution)
    carries no information for this probe, however cleanly it would
    separate the classes in exact arithmetic.

    Parameters
    ----------
    train_x, test_x : Tensor, shape [N, F] and [N', F]
        Features (e.g. hidden states of a deep layer, one row per token).
    train_y, test_y : Tensor of int, shape [N] and [N']
        Labels in ``0..K-1``.
    rel_tol : float
        Relative amplitude below which a direction is discarded.
    ridge : float
        Ridge penalty on the whitened features (unit variance per direction).

    Returns
    -------
    float
        The fraction of ``test_y`` predicted correctly.
    """
    _check_probe_data(train_x, train_y, test_x, test_y)
    for name, v in (("rel_tol", rel_tol), ("ridge", ridge)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    X, Xt = train_x.double(), test_x.double()
    N = X.shape[0]
    mu = X.mean(0)
    scale = X.pow(2).sum(-1).mean().sqrt()  # rms norm of the uncentred features
    _, S, Vh = torch.linalg.svd(X - mu, full_matrices=False)
    keep = S / math.sqrt(N) > rel_tol * scale
    n_cls = int(max(train_y.max(), test_y.max())) + 1
    if not keep.any():
        Z, Zt = X.new_zeros(N, 0), X.new_zeros(Xt.shape[0], 0)
    else:
        P = Vh[keep].T / (S[keep] / math.sqrt(N))  # project and whiten      (F, k)
        Z, Zt = (X - mu) @ P, (Xt - mu) @ P
    Z1 = torch.cat([Z, torch.ones(N, 1, dtype=Z.dtype)], 1)  # with an intercept
    Y = torch.nn.functional.one_hot(train_y, n_cls).to(Z.dtype)
    reg = ridge * N * torch.eye(Z1.shape[1], dtype=Z.dtype)
    reg[-1, -1] = 0.0  # no penalty on the intercept
    B = torch.linalg.solve(Z1.T @ Z1 + reg, Z1.T @ Y)
    pred = (torch.cat([Zt, torch.ones(Zt.shape[0], 1, dtype=Z.dtype)], 1) @ B).argmax(-1)
    return float((pred == test_y).double().mean())


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def mlp_probe_accuracy(train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, *,
                       hidden: int = 64, steps: int = 500, seed: int = 0, weight_decay: float = 1e-4,
                       lr: float = 1e-2) -> float:
    r"""Test accuracy of a two-layer perceptron read-out of labels from features.

    The features are standardised with the training set's per-feature mean
    and standard deviation (a feature that is constant on the training set
    is only centred). The probe
    :math:`z \mapsto W_2\,\mathrm{relu}(W_1 z + b_1) + b_2` is initialised
    from ``seed`` (PyTorch's default uniform initialisation of linear layers,
    drawn from a private generator: the global random state is neither read
    nor changed), trained full-batch for ``steps`` steps of Adam on the
    cross-entropy plus :math:`\tfrac{\lambda}{2}(\|W_1\|_F^2 + \|W_2\|_F^2)`
    with :math:`\lambda` = ``weight_decay``, and scored by the arg max on
    the test set. It runs in float64 for float64 features and in float32
    otherwise (half precision is upcast), and with gradients enabled even
    inside :func:`torch.no_grad`. Given ``seed``, the result is a
    deterministic function of the inputs (on one machine and thread count).

    Unlike :func:`linear_probe_accuracy` it has no precision threshold:
    standardisation magnifies a small signal, so pass states at the precision
    you mean them (round-off noise is random and decodes at chance).

    Parameters
    ----------
    train_x, test_x : Tensor, shape [N, F] and [N', F]
        Finite floating-point features, one row per example.
    train_y, test_y : Tensor of int64, shape [N] and [N']
        Labels in ``0..K-1``.
    hidden : int
        Width of the hidden layer (at least 1).
    steps : int
        Full-batch Adam steps (at least 1).
    seed : int
        Seed of the initialisation (at least 0).
    weight_decay : float
        :math:`\lambda \ge 0`, the squared-norm penalty on both weight
        matrices (not on the biases).
    lr : float
        Adam's learning rate (> 0).

    Returns
    -------
    float
        The fraction of ``test_y`` predicted correctly.
    """
    _check_probe_data(train_x, train_y, test_x, test_y)
    for name, x in (("train_x", train_x), ("test_x", test_x)):
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} must be finite (it holds NaN or inf)")
    hidden = _check_int(hidden, "hidden", 1)
    steps = _check_int(steps, "steps", 1)
    seed = _check_int(seed, "seed", 0)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) \
            or not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    dt = torch.float64 if train_x.dtype == torch.float64 else torch.float32
    X, Xt = train_x.detach().to(dt), test_x.detach().to(device=train_x.device, dtype=dt)
    mu, sd = X.mean(0), X.std(0, correction=0)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    Z, Zt = (X - mu) / sd, (Xt - mu) / sd
    n_cls = max(int(train_y.max()), int(test_y.max()) if test_y.numel() else 0) + 1
    gen = torch.Generator(device=X.device).manual_seed(seed)

    def uniform(shape, fan_in):  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for both
        bound = 1.0 / math.sqrt(fan_in)
        u = torch.rand(shape, generator=gen, dtype=dt, device=X.device)
        return ((2 * u - 1) * bound).requires_grad_()

    F = Z.shape[1]
    W1, b1 = uniform((F, hidden), max(F, 1)), uniform((hidden,), max(F, 1))
    W2, b2 = uniform((hidden, n_cls), hidden), uniform((n_cls,), hidden)
    params = [W1, b1, W2, b2]
    y = train_y.to(X.device)
    with torch.enable_grad():
        opt = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            logits = torch.relu(Z @ W1 + b1) @ W2 + b2
            loss = torch.nn.functional.cross_entropy(logits, y)
            if weight_decay:
                loss = loss + weight_decay / 2 * (W1.pow(2).sum() + W2.pow(2).sum())
            loss.backward()
            opt.step()
    with torch.no_grad():
        pred = (torch.relu(Zt @ W1 + b1) @ W2 + b2).argmax(-1)
    return float((pred == test_y.to(pred.device)).double().mean())
