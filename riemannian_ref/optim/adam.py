"""Riemannian Adam variants for constrained attention weights.

* :class:`StiefelAdam` -- parameters in groups marked ``stiefel=True`` are
  stacks of frames on :math:`\\mathrm{St}(n, p)` (a tensor ``[..., n, p]``, one
  frame per leading index, e.g. ``W_Q`` of shape ``[h, D, d]``); every other
  group gets AdamW (Kingma and Ba 2015; Loshchilov and Hutter 2019).
* :class:`LowRankAdam` -- parameter *pairs* ``(A, B)`` read as the rank-``r``
  matrix :math:`W = A B^\\top` (per leading index), optimised on the embedded
  fixed-rank manifold (``geometry="embedded"``) or with the factored quotient
  geometry (``geometry="factored"``) of :mod:`riemannian_ref.manifolds`;
  unpaired groups get AdamW.

The Stiefel update for one frame ``W`` with Euclidean gradient ``g`` (step ``t``):

.. math::

    \\xi = g - W \\operatorname{sym}(W^\\top g), \\quad
    m \\leftarrow \\beta_1 m + (1 - \\beta_1) \\xi, \\quad
    v \\leftarrow \\beta_2 v + (1 - \\beta_2) |\\xi|_F^2,

    \\Delta = -\\eta \\frac{m / (1 - \\beta_1^t)}{\\sqrt{v / (1 - \\beta_2^t)} + \\epsilon},
    \\quad \\Delta \\leftarrow \\Delta \\min(1, \\rho / |\\Delta|_F),

    W \\leftarrow \\operatorname{polar}(W + \\Delta), \\quad m \\leftarrow \\mathrm{proj}_W(m).

``v`` is *one scalar per frame*, so the step is a tangent vector of Frobenius
length about ``lr`` whatever the gradient's scale, and ``m`` is tangent at the
current point after every step. Weight decay is applied in its Riemannian form
``proj_W(weight_decay * W)``, which is zero on the Stiefel manifold (kept in
the code so that the identity is exercised, not assumed).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._checks import check_number
from .low_rank import FactoredLowRank, FixedRankEmbedded, FixedRankPoint, FixedRankTangent
from .manifolds import Stiefel, sym

__all__ = ["StiefelAdam", "LowRankAdam"]


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   trust_radius: float | None) -> None:
    check_number(lr, "lr", low=0.0)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        check_number(b, f"betas[{i}]", low=0.0, high=1.0, high_open=True)
    check_number(eps, "eps", low=0.0)
    check_number(weight_decay, "weight_decay", low=0.0)
    if trust_radius is not None:
        check_number(trust_radius, "trust_radius", low=0.0, low_open=True)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, else 0: a zero second moment (``eps = 0`` and a zero gradient
    so far) means a zero first moment, and the step is zero, not 0/0."""
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def _adamw_(p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
    """One AdamW step in place (decoupled weight decay, bias-corrected moments)."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    t = state["step"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if wd:
        p.mul_(1.0 - lr * wd)
    m.mul_(b1).add_(grad, alpha=1.0 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    denom = (v / (1.0 - b2 ** t)).sqrt_().add_(eps)
    p.add_(_safe_div(m, denom), alpha=-lr / (1.0 - b1 ** t))


def _cap(step: Tensor, norm2: Tensor, radius: float | None) -> Tensor:
    """Scale each matrix of ``step`` [..., a, b] so its norm (sqrt of ``norm2`` [...]) is <= radius."""
    if radius is None:
        return step
    factor = (radius / norm2.clamp_min(0).sqrt().clamp_min(torch.finfo(step.dtype).tiny)).clamp(max=1.0)
    return step * factor[..., None, None]


class _AdamBase(Optimizer):
    """What both optimisers share: checked hyper-parameters, and ``step`` (the closure, then each group)."""

    def __init__(self, params: Iterable, lr, betas, eps, weight_decay, trust_radius, **flags):
        _check_hparams(lr, betas, eps, weight_decay, trust_radius)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_radius=trust_radius, **flags))
        for group in self.param_groups:
            _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["trust_radius"])

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step; returns the closure's loss if given.

        Every gradient (and, for :class:`LowRankAdam`, every factor pair) is
        checked before any parameter or state changes: a non-finite gradient
        or a rank-deficient pair raises and leaves the parameters and the
        optimiser's state exactly as they were.

        Raises
        ------
        FloatingPointError
            If a gradient has a NaN or infinite entry (naming the parameter's
            group, index and shape).
        ValueError
            For a sparse gradient, or (:class:`LowRankAdam`) a factor pair whose
            product has rank below ``r``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [(gi, i, p) for gi, group in enumerate(self.param_groups)
                 for i, p in enumerate(group["params"]) if p.grad is not None]
        for gi, i, p in grads:
            if p.grad.is_sparse:
                raise ValueError(f"{type(self).__name__} does not support sparse gradients (group {gi}, "
                                 f"parameter {i})")
        if grads and not bool(torch.stack([torch.isfinite(p.grad).all() for _, _, p in grads]).all()):
            gi, i, p = next(x for x in grads if not torch.isfinite(x[2].grad).all())
            n_bad = int((~torch.isfinite(p.grad)).sum())
            raise FloatingPointError(
                f"{type(self).__name__}.step: the gradient of parameter {i} of group {gi} (shape "
                f"{list(p.shape)}) has {n_bad} non-finite entries; no parameter and no state was changed "
                f"(skip this step, or find where the NaN/inf comes from)")
        for group in self.param_groups:
            self._precheck(group)
        for group in self.param_groups:
            self._group_step(group)
        return loss

    def _precheck(self, group: dict) -> None:
        """Raise before anything changes if this group cannot be stepped."""

    def _group_step(self, group: dict) -> None:
        raise NotImplementedError


class StiefelAdam(_AdamBase):
    """Riemannian Adam on Stiefel frames for marked groups, AdamW elsewhere.

    Parameters
    ----------
    params : iterable of Tensor or dict
        Parameters or param groups. A group with ``stiefel=True`` holds frames:
        each tensor of shape ``[..., n, p]`` (``n >= p``) must already have
        orthonormal columns (e.g. from :meth:`Stiefel.random` or
        :func:`~riemannian_ref.optim.manifolds.polar`).
    lr : float
        Step size. On frames it is the Frobenius length of a step when the
        gradient direction is steady (default 1e-3).
    betas : (float, float)
        Decay of the first and second moments (default (0.9, 0.999)).
    eps : float
        Added to the root of the second moment (default 1e-8). With
        ``eps = 0`` the frame update is exactly invariant to the gradient's
        scale; a frame whose gradients have all been zero then takes a zero
        step (not 0/0).
    weight_decay : float
        Decoupled weight decay (AdamW) on ordinary groups; on frames its
        Riemannian gradient :math:`\\mathrm{proj}_W(W) = 0`, so it has no effect
        there (default 0).
    trust_radius : float or None
        Cap on the Frobenius norm of each frame's step (default None: no cap).

    Notes
    -----
    State per frame tensor: ``step`` (int), ``exp_avg`` (tangent momentum,
    shape of the parameter), ``exp_avg_sq`` (shape ``[...]``: one scalar per
    frame). ``state_dict``/``load_state_dict`` are torch's.
    """

    # stateless geometry, on the class: torch's Optimizer pickles (and deep-copies) only its state and groups
    manifold = Stiefel()

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, trust_radius: float | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, trust_radius, stiefel=False)
        for group in self.param_groups:
            if group["stiefel"]:
                for p in group["params"]:
                    ok, why = self.manifold.check_point(p.detach(), atol=1e-4 if p.dtype != torch.float64 else 1e-8)
                    if not ok:
                        raise ValueError(
                            f"a parameter of shape {tuple(p.shape)} in a stiefel=True group is not a "
                            f"stack of orthonormal frames ({why}); initialise it with Stiefel.random or polar")

    def _group_step(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if group["stiefel"]:
                self._stiefel_step(p, p.grad, self.state[p], group)
            else:
                _adamw_(p, p.grad, self.state[p], group)

    def _stiefel_step(self, W: Tensor, g: Tensor, state: dict, group: dict) -> None:
        lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(W)
            state["exp_avg_sq"] = torch.zeros(W.shape[:-2], dtype=W.dtype, device=W.device)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if group["weight_decay"]:
            g = g + group["weight_decay"] * W  # its projection is W - W sym(W^T W) = 0 on St
        xi = g - W @ sym(W.transpose(-1, -2) @ g)  # tangent projection (..., n, p)
        m.mul_(b1).add_(xi, alpha=1.0 - b1)
        v.mul_(b2).add_(xi.square().sum(dim=(-1, -2)), alpha=1.0 - b2)  # one scalar per frame
        denom = (v / (1.0 - b2 ** t)).sqrt().add(eps)  # (...)
        step = -(lr / (1.0 - b1 ** t)) * _safe_div(m, denom[..., None, None])
        step = _cap(step, step.square().sum(dim=(-1, -2)), group["trust_radius"])
        W_new = self.manifold.retr(W, step)
        W.copy_(W_new)
        m.copy_(m - W @ sym(W.transpose(-1, -2) @ m))  # keep the momentum tangent at the new point


class LowRankAdam(_AdamBase):
    """Riemannian Adam on rank-``r`` matrices :math:`W = A B^\\top` given as factor pairs.

    Parameters
    ----------
    params : iterable of dict
        Param groups. A group with ``geometry`` in ``{"embedded", "factored"}``
        holds an even number of tensors ``[A_1, B_1, A_2, B_2, ...]`` with
        ``A_i`` of shape ``[..., m, r]`` and ``B_i`` of shape ``[..., n, r]``
        (each leading index one matrix, e.g. one head's ``W_Q, W_K``). Both
        factors must be finite and of full column rank (``W`` of rank exactly
        ``r``), at construction and at every step, else ``ValueError``; a zero
        factor, as LoRA's ``B = 0`` initialisation, is not a point of the
        manifold. Groups with ``geometry=None`` get AdamW.
    lr, betas, eps, weight_decay, trust_radius
        As in :class:`StiefelAdam`. Weight decay is applied to the factor
        pairs as a Euclidean decay of ``W`` projected onto the tangent space
        (it shrinks ``W``; unlike the Stiefel case it is not zero here).

    Notes
    -----
    ``embedded``: the Riemannian gradient is the tangent projection of the
    Euclidean gradient ``G`` of ``W``, computed from the factor gradients
    :math:`g_A = G B`, :math:`g_B = G^\\top A` (``G V = g_A B^+ V``), the step is
    retracted by truncated SVD, and the new point is stored balanced
    (:math:`A = U \\Sigma^{1/2}`, :math:`B = V \\Sigma^{1/2}`); the momentum is a
    tangent vector, stored as an ``m x n`` matrix (the SVD basis of the factors
    changes between steps) and transported by projection. ``factored``: the scaled gradient
    of the quotient metric, additive update of the factors, balancing, and the
    momentum carried along by the same change of basis. One scalar second
    moment per matrix (squared norm of the Riemannian gradient in its metric).
    """

    GEOMETRIES = ("embedded", "factored")
    # stateless geometries, on the class: torch's Optimizer pickles (and deep-copies) only its state and groups
    fixed_rank = FixedRankEmbedded()
    factored = FactoredLowRank(balance=True)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, trust_radius: float | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, trust_radius, geometry=None)
        for group in self.param_groups:
            geo = group["geometry"]
            if geo is None:
                continue
            if geo not in self.GEOMETRIES:
                raise ValueError(f"geometry must be one of {self.GEOMETRIES} or None, got {geo!r}")
            ps = group["params"]
            if len(ps) % 2:
                raise ValueError(f"a geometry={geo!r} group needs pairs [A, B, ...], got {len(ps)} tensors")
            for A, B in zip(ps[0::2], ps[1::2]):
                if A.dim() < 2 or B.dim() < 2 or A.shape[:-2] != B.shape[:-2] or A.shape[-1] != B.shape[-1]:
                    raise ValueError(f"pair A {tuple(A.shape)}, B {tuple(B.shape)} must be [..., m, r] and "
                                     "[..., n, r], agreeing in batch and rank")
            self._precheck(group)

    def _precheck(self, group: dict) -> None:
        """Every factor pair must be a point of the rank-r manifold: A and B finite, of full column rank."""
        if group["geometry"] is None:
            return
        ps = group["params"]
        for j, (A, B) in enumerate(zip(ps[0::2], ps[1::2])):
            for name, F in (("A", A), ("B", B)):
                Fd = F.detach()
                why = None
                if not bool(torch.isfinite(Fd).all()):
                    why = "has non-finite entries"
                elif Fd.shape[-1]:
                    s = torch.linalg.svdvals(Fd)  # (..., r), descending
                    tol = max(Fd.shape[-2:]) * torch.finfo(Fd.dtype).eps * s[..., 0]
                    if bool((s[..., -1] <= tol).any()):
                        why = (f"has rank below r = {Fd.shape[-1]} (smallest singular value "
                               f"{float(s[..., -1].min()):.3g})")
                if why is not None:
                    raise ValueError(
                        f"LowRankAdam: factor {name} of pair {j} (A {list(A.shape)}, B {list(B.shape)}) {why}, so "
                        "W = A B^T is not a point of the rank-r manifold; nothing was changed. A zero factor "
                        "(e.g. LoRA's B = 0 at init) is not allowed: initialise both factors with full column "
                        "rank (small random values)")

    def _group_step(self, group: dict) -> None:
        if group["geometry"] is None:
            for p in group["params"]:
                if p.grad is not None:
                    _adamw_(p, p.grad, self.state[p], group)
            return
        ps = group["params"]
        for A, B in zip(ps[0::2], ps[1::2]):
            if A.grad is None and B.grad is None:
                continue
            gA = A.grad if A.grad is not None else torch.zeros_like(A)
            gB = B.grad if B.grad is not None else torch.zeros_like(B)
            if group["weight_decay"]:
                # Euclidean decay of W: G += wd W, so gA += wd A B^T B, gB += wd B A^T A
                wd = group["weight_decay"]
                gA = gA + wd * A @ (B.transpose(-1, -2) @ B)
                gB = gB + wd * B @ (A.transpose(-1, -2) @ A)
            if group["geometry"] == "embedded":
                self._embedded_step(A, B, gA, gB, self.state[A], group)
            else:
                self._factored_step(A, B, gA, gB, self.state[A], group)

    @staticmethod
    def _moments(state: dict, xi: tuple[Tensor, ...], norm2: Tensor, group: dict):
        b1, b2 = group["betas"]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = [torch.zeros_like(x) for x in xi]
            state["exp_avg_sq"] = torch.zeros_like(norm2)
        state["step"] += 1
        t = state["step"]
        for m, x in zip(state["exp_avg"], xi):
            m.mul_(b1).add_(x, alpha=1.0 - b1)
        state["exp_avg_sq"].mul_(b2).add_(norm2, alpha=1.0 - b2)
        denom = (state["exp_avg_sq"] / (1.0 - b2 ** t)).sqrt().add(group["eps"])
        scale = -(group["lr"] / (1.0 - b1 ** t)) * _safe_div(torch.ones_like(denom), denom)  # (...)
        return [m * scale[..., None, None] for m in state["exp_avg"]]

    def _embedded_step(self, A, B, gA, gB, state, group):
        fr = self.fixed_rank
        Qa, Ra = torch.linalg.qr(A)
        Qb, Rb = torch.linalg.qr(B)
        Uc, s, Vch = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
        Vc = Vch.transpose(-1, -2)
        x = FixedRankPoint(Qa @ Uc, s, Qb @ Vc)
        # G V = gA B^+ V with B^+ V = Rb^{-1} Vc;  G^T U = gB Ra^{-1} Uc
        ZV = gA @ torch.linalg.solve_triangular(Rb, Vc, upper=True)
        ZtU = gB @ torch.linalg.solve_triangular(Ra, Uc, upper=True)
        xi = fr.proju_sketch(x, ZV, ZtU)
        # The momentum is kept as an ambient m x n matrix (tangent at the current point):
        # the factor triple (M, Up, Vp) depends on the SVD basis, which is recomputed
        # (up to signs and rotations) at every step, while the ambient matrix is not.
        steps = self._moments(state, (fr.tangent_to_dense(x, xi),), fr.inner(x, xi), group)
        step = fr.proju(x, steps[0])
        if group["trust_radius"] is not None:
            n2 = fr.inner(x, step)
            step = FixedRankTangent(*[_cap(c, n2, group["trust_radius"]) for c in step])
        y = fr.retr(x, step)
        rs = y.s.clamp_min(0).sqrt().unsqueeze(-2)
        A.copy_(y.U * rs)
        B.copy_(y.V * rs)
        m = state["exp_avg"][0]
        m.copy_(fr.tangent_to_dense(y, fr.proju(y, m)))  # transport by projection

    def _factored_step(self, A, B, gA, gB, state, group):
        fg = self.factored
        xi = fg.egrad2rgrad(A, B, gA, gB)
        steps = self._moments(state, xi, fg.inner(A, B, xi), group)
        if group["trust_radius"] is not None:
            n2 = fg.inner(A, B, tuple(steps))
            steps = [_cap(c, n2, group["trust_radius"]) for c in steps]
        A2, B2 = A + steps[0], B + steps[1]
        # balance, and carry the momentum by the same change of basis P (A_bal = A2 P, B_bal = B2 P^{-T})
        Qa, Ra = torch.linalg.qr(A2)
        Qb, Rb = torch.linalg.qr(B2)
        Uc, s, Vch = torch.linalg.svd(Ra @ Rb.transpose(-1, -2))
        rs = s.clamp_min(torch.finfo(s.dtype).tiny).sqrt().unsqueeze(-2)  # (..., 1, r)
        P = torch.linalg.solve_triangular(Ra, Uc * rs, upper=True)  # (..., r, r)
        Pit = torch.linalg.solve_triangular(Rb, Vch.transpose(-1, -2) * rs, upper=True)
        A.copy_((Qa @ Uc) * rs)
        B.copy_((Qb @ Vch.transpose(-1, -2)) * rs)
        mA, mB = state["exp_avg"]
        mA.copy_(mA @ P)
        mB.copy_(mB @ Pit)

