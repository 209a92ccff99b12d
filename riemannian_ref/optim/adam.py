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
current point after every step. Weight decay is not applied to frames: its
Riemannian gradient ``proj_W(weight_decay * W)`` is exactly zero on the Stiefel
manifold, and computing it would leave only round-off, which the per-frame
normalisation would scale up to a step of length ``lr`` whenever the gradient
is small.

Every param group is checked by one routine, whether it comes from the
constructor, from ``add_param_group`` or from ``load_state_dict``: the
hyper-parameter ranges, the group's flag (``stiefel`` or ``geometry``), frames
on the manifold, factor pairs of full rank ``r <= min(m, n)``, and no tensor in
two places. A refused group leaves the optimiser as it was.
"""
from __future__ import annotations

import difflib

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


_HALF = (torch.float16, torch.bfloat16)


def _check_float_dtype(p: Tensor, what: str) -> None:
    """Frames and factor pairs are stepped with SVDs and QRs, which torch runs in float32 and float64 only."""
    if p.dtype in _HALF:
        raise ValueError(
            f"{what} is {str(p.dtype).replace('torch.', '')}: half precision is not supported for frames and "
            "factor pairs (their SVD and QR steps need float32 or float64, and rounding to half precision "
            "loses most of a step of size lr); keep these parameters in float32 (run the forward under "
            "autocast)")
    if p.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{what} must be float32 or float64, got {p.dtype}")


class _AdamBase(Optimizer):
    """What both optimisers share: checked groups, and ``step`` (the closure, then each group).

    ``_FLAG`` is the group key that selects the geometry (``stiefel`` / ``geometry``) and ``_OTHER`` the
    other optimiser's key, refused so that a group meant for one is not silently given to the other.
    """

    _FLAG = ""
    _OTHER = ("", "")

    def __init__(self, params: Iterable, lr, betas, eps, weight_decay, trust_radius, **flags):
        _check_hparams(lr, betas, eps, weight_decay, trust_radius)
        # torch's Optimizer.__init__ calls self.add_param_group for every group: one checked path
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_radius=trust_radius, **flags))

    # -- checks ------------------------------------------------------------
    def _check_settings(self, group: dict) -> None:
        """Hyper-parameters and the geometry flag (cheap: also run before every step)."""
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["trust_radius"])
        other, owner = self._OTHER
        if other in group:
            raise ValueError(f"{other!r} is a {owner} group key; {type(self).__name__} groups use "
                             f"{self._FLAG!r}")

    def _check_params(self, group: dict) -> None:
        """The group's tensors are points of its geometry (run when a group is added or loaded)."""

    def _check_group(self, group: dict, gi: int, where: str = "") -> None:
        """Raise ``ValueError`` naming the group if it cannot be stepped; changes nothing."""
        try:
            self._check_keys(group)
            self._check_settings(group)
            self._check_params(group)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}{where}: param group {gi}: {exc}") from None

    def _check_keys(self, group: dict) -> None:
        """Refuse a key that looks like a misspelled setting (``"stifel"``); other extra keys are labels."""
        known = set(self.defaults) | {"params", "param_names", "peak_lr", "stiefel", "geometry"}
        for key in group:
            if isinstance(key, str) and key not in known:
                near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
                if near:
                    raise ValueError(f"unknown key {key!r} (did you mean {near[0]!r}? a misspelled setting "
                                     f"would be ignored)")

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after the same checks as the constructor's (which calls this for every group).

        The group's missing keys take the optimiser's defaults. Refused, with a ``ValueError`` naming the
        group's index and the argument, and leaving the optimiser unchanged: a hyper-parameter out of range,
        an unknown flag value, a tensor that is not a point of the group's geometry, and a tensor already
        in this or another group.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        gi = len(self.param_groups)
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set) or params is None:
            raise TypeError("params must be an ordered collection of Tensors (a list or tuple), not "
                            f"{type(params).__name__}")
        else:
            params = list(params)
        group["params"] = params
        tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]  # named parameters
        for i, p in enumerate(tensors):
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__}: param group {gi}: parameter {i} must be a Tensor, "
                                f"got {type(p).__name__}")
        seen: dict[int, int] = {}
        for i, p in enumerate(tensors):
            if id(p) in seen:
                raise ValueError(f"{type(self).__name__}: param group {gi}: parameters {seen[id(p)]} and {i} "
                                 "are the same tensor (it would be stepped twice)")
            seen[id(p)] = i
        for gj, other in enumerate(self.param_groups):
            for q in other["params"]:
                if id(q) in seen:
                    raise ValueError(f"{type(self).__name__}: param group {gi}: parameter {seen[id(q)]} is "
                                     f"already in param group {gj}; a tensor can be in one group only")
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        if isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        self._check_group({**group, "params": tensors}, gi)
        super().add_param_group(group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict`` after the checks of :meth:`add_param_group` on every loaded group.

        The loaded groups' hyper-parameters and flags replace the current ones (torch's rule), so each
        loaded group is checked with the current group's tensors, and each parameter's state against the
        shapes its geometry keeps; anything wrong raises a ``ValueError`` naming the group, and nothing
        is loaded.
        """
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(groups, (list, tuple)) or not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}.load_state_dict: state_dict must be a dict with "
                             "'state' (dict) and 'param_groups' (list)")
        if len(groups) == len(self.param_groups):  # else torch's own error says what differs
            for gi, (saved, cur) in enumerate(zip(groups, self.param_groups)):
                if not isinstance(saved, dict) or len(saved.get("params", ())) != len(cur["params"]):
                    continue
                # "differentiable": torch's __setstate__ (load_state_dict, deepcopy) adds it to defaults only
                missing = [k for k in self.defaults if k not in saved and k != "differentiable"]
                if missing:  # torch would load the group without them, and the next step would fail
                    raise ValueError(f"{type(self).__name__}.load_state_dict: param group {gi} lacks "
                                     f"{', '.join(missing)} (a state dict of another optimiser or version?)")
                merged = {**saved, "params": cur["params"]}
                if isinstance(merged["betas"], list):
                    merged["betas"] = tuple(merged["betas"])
                self._check_group(merged, gi, ".load_state_dict")
                try:
                    self._check_state(merged, [state.get(k) for k in saved["params"]])
                except ValueError as exc:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: param group {gi}: {exc}") from None
        super().load_state_dict(state_dict)

    def _check_state(self, group: dict, states: list) -> None:
        """Each parameter's loaded state has the keys and shapes this group's geometry keeps."""

    @staticmethod
    def _expect(st: dict, what: str, shapes: dict) -> None:
        if not isinstance(st, dict):
            raise ValueError(f"state of {what} must be a dict, got {type(st).__name__}")
        if not st:
            return
        for key in ("step", *shapes):
            if key not in st:
                raise ValueError(f"state of {what}: {key} is missing (expected keys step, "
                                 f"{', '.join(shapes)})")
        step = st["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"state of {what}: step must be an int >= 1 (the steps taken), got {step!r}")
        for key, want in shapes.items():
            val = st[key]
            if isinstance(want, list):  # a list of tensors, one shape (a tuple) each
                if not isinstance(val, (list, tuple)) or len(val) != len(want):
                    n = len(val) if isinstance(val, (list, tuple)) else type(val).__name__
                    raise ValueError(f"state of {what}: {key} holds {n} tensors, expected {len(want)}")
                pairs = [(f"{key}[{i}]", v, w) for i, (v, w) in enumerate(zip(val, want))]
            else:
                pairs = [(key, val, want)]
            for name, v, w in pairs:
                if not isinstance(v, Tensor) or list(v.shape) != list(w):
                    got = list(v.shape) if isinstance(v, Tensor) else type(v).__name__
                    raise ValueError(f"state of {what}: {name} has shape {got}, expected {list(w)}")
                if not bool(torch.isfinite(v).all()):
                    raise ValueError(f"state of {what}: {name} has non-finite entries")

    # -- stepping ----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step; returns the closure's loss if given.

        Every gradient, every group's settings (and, for :class:`LowRankAdam`,
        every factor pair) is checked before any parameter or state changes: a
        non-finite gradient, a hyper-parameter edited out of range or a
        rank-deficient pair raises and leaves the parameters and the
        optimiser's state exactly as they were.

        Raises
        ------
        FloatingPointError
            If a gradient has a NaN or infinite entry (naming the parameter's
            group, index and shape).
        ValueError
            For a sparse gradient, a group whose settings were edited out of
            range, or (:class:`LowRankAdam`) a factor pair whose product has
            rank below ``r``.
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
        for gi, group in enumerate(self.param_groups):
            try:
                self._check_settings(group)
                self._precheck(group)
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__}.step: param group {gi}: {exc}; nothing was "
                                 "changed") from None
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
        each tensor of shape ``[..., n, p]`` (``n >= p``), float32 or float64,
        must already have orthonormal columns (e.g. from
        :meth:`Stiefel.random` or :func:`~riemannian_ref.optim.manifolds.polar`),
        to ``max |W^T W - I| <= FRAME_ATOL[dtype]`` (1e-4 in float32, 1e-8 in
        float64). Half-precision frames are refused: keep the frames in
        float32 and run the forward under autocast.
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
        there: frames are not decayed, and a group's trajectory is bitwise the
        same for every ``weight_decay`` (default 0).
    trust_radius : float or None
        Cap on the Frobenius norm of each frame's step (default None: no cap).

    Notes
    -----
    State per frame tensor: ``step`` (int), ``exp_avg`` (tangent momentum,
    shape of the parameter), ``exp_avg_sq`` (shape ``[...]``: one scalar per
    frame). ``state_dict`` is torch's; ``load_state_dict`` and
    ``add_param_group`` check every group as the constructor does (ranges,
    the ``stiefel`` flag, frames, no tensor in two groups) and, for a state
    dict, each state's shapes, before anything changes; a refused group
    raises ``ValueError`` naming its index.
    """

    # stateless geometry, on the class: torch's Optimizer pickles (and deep-copies) only its state and groups
    manifold = Stiefel()
    _FLAG = "stiefel"
    _OTHER = ("geometry", "LowRankAdam")
    # tolerance on max |W^T W - I| of a frame a group may hold: about sqrt(eps) of the dtype, so that
    # round-off of a frame made in the same dtype passes and a frame of another dtype (or not orthonormal)
    # does not; the first step's polar retraction puts an accepted frame on the manifold to round-off
    FRAME_ATOL = {torch.float32: 1e-4, torch.float64: 1e-8}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, trust_radius: float | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, trust_radius, stiefel=False)

    def _check_settings(self, group: dict) -> None:
        super()._check_settings(group)
        if not isinstance(group["stiefel"], bool):
            raise ValueError(f"stiefel must be a bool, got {group['stiefel']!r}")

    def _check_params(self, group: dict) -> None:
        if not group["stiefel"]:
            return
        for i, p in enumerate(group["params"]):
            what = f"parameter {i} (shape {list(p.shape)}) of a stiefel=True group"
            if p.dim() < 2 or p.shape[-2] < p.shape[-1]:
                raise ValueError(f"{what} must be a stack of frames [..., n, p] with n >= p")
            _check_float_dtype(p, what)
            ok, why = self.manifold.check_point(p.detach(), atol=self.FRAME_ATOL[p.dtype])
            if not ok:
                hint = ""
                if p.dtype == torch.float64:
                    hint = " (a float32 frame cast to float64 is orthonormal only to about 1e-7: re-project it)"
                raise ValueError(f"{what} is not a stack of orthonormal frames ({why}){hint}; initialise it "
                                 "with Stiefel.random or polar")

    def _check_state(self, group: dict, states: list) -> None:
        for i, (p, st) in enumerate(zip(group["params"], states)):
            if st is None:
                continue
            sq = p.shape[:-2] if group["stiefel"] else p.shape
            self._expect(st, f"parameter {i}", {"exp_avg": tuple(p.shape), "exp_avg_sq": tuple(sq)})

    def _group_step(self, group: dict) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if group["stiefel"] is True:
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
        # no weight decay term: its Riemannian gradient proj_W(wd W) = wd (W - W sym(W^T W)) is exactly 0
        # on St, and its round-off, normalised per frame below, would move a frame whose gradient is small
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
        ``r``, so ``r <= min(m, n)``), float32 or float64, at construction,
        in ``add_param_group`` and ``load_state_dict`` and at every step, else
        ``ValueError`` naming the group, pair and factor; a zero factor, as
        LoRA's ``B = 0`` initialisation, is not a point of the manifold.
        ``geometry`` must be spelled exactly. Groups with ``geometry=None`` get
        AdamW.
    lr, betas, eps, weight_decay, trust_radius
        As in :class:`StiefelAdam`. Weight decay is applied to the factor
        pairs as a Euclidean decay of ``W`` projected onto the tangent space
        (it shrinks ``W``; unlike the Stiefel case it is not zero here). It is
        added to the gradient before the per-matrix normalisation (not
        decoupled): with a zero gradient ``W`` shrinks along itself by a step
        of length about ``lr`` whatever ``weight_decay > 0`` is, and its
        singular vectors do not turn.

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

    _FLAG = "geometry"
    _OTHER = ("stiefel", "StiefelAdam")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, trust_radius: float | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, trust_radius, geometry=None)

    def _check_settings(self, group: dict) -> None:
        super()._check_settings(group)
        geo = group["geometry"]
        if geo is not None and not (isinstance(geo, str) and geo in self.GEOMETRIES):
            raise ValueError(f"geometry must be one of {self.GEOMETRIES} or None, got {geo!r}")

    def _check_params(self, group: dict) -> None:
        geo = group["geometry"]
        if geo is None:
            return
        ps = group["params"]
        if len(ps) % 2:
            raise ValueError(f"a geometry={geo!r} group needs pairs [A, B, ...], got {len(ps)} tensors")
        for j, (A, B) in enumerate(zip(ps[0::2], ps[1::2])):
            if A.dim() < 2 or B.dim() < 2 or A.shape[:-2] != B.shape[:-2] or A.shape[-1] != B.shape[-1]:
                raise ValueError(f"pair {j}: A {list(A.shape)}, B {list(B.shape)} must be [..., m, r] and "
                                 "[..., n, r], agreeing in batch and rank")
            for name, F in (("A", A), ("B", B)):
                what = f"factor {name} of pair {j} ({name} {list(F.shape)})"
                _check_float_dtype(F, what)
                if F.shape[-1] > F.shape[-2]:
                    raise ValueError(
                        f"{what} has {F.shape[-1]} columns but only {F.shape[-2]} rows, so W = A B^T has rank "
                        f"at most {F.shape[-2]} < r = {F.shape[-1]}; a rank-r pair needs r <= min(m, n) = "
                        f"{min(A.shape[-2], B.shape[-2])}")
            if A.dtype != B.dtype or A.device != B.device:
                raise ValueError(f"pair {j}: A ({A.dtype}, {A.device}) and B ({B.dtype}, {B.device}) must "
                                 "share dtype and device")
        self._precheck(group)

    def _check_state(self, group: dict, states: list) -> None:
        ps = group["params"]
        if group["geometry"] is None:
            for i, (p, st) in enumerate(zip(ps, states)):
                if st is not None:
                    self._expect(st, f"parameter {i}", {"exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)})
            return
        for j in range(len(ps) // 2):
            A, B = ps[2 * j], ps[2 * j + 1]
            stA, stB = states[2 * j], states[2 * j + 1]
            if stB:
                raise ValueError(f"state of pair {j}: factor B holds state; a pair's state is kept with A")
            if stA is None:
                continue
            batch, m, n = tuple(A.shape[:-2]), A.shape[-2], B.shape[-2]
            avg = [(*batch, m, n)] if group["geometry"] == "embedded" else [tuple(A.shape), tuple(B.shape)]
            self._expect(stA, f"pair {j}", {"exp_avg": avg, "exp_avg_sq": batch})

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
                elif Fd.shape[-1] > Fd.shape[-2]:
                    why = f"has more columns (r = {Fd.shape[-1]}) than rows ({Fd.shape[-2]})"
                elif Fd.shape[-1]:
                    s = torch.linalg.svdvals(Fd)  # (..., r), descending
                    tol = max(Fd.shape[-2:]) * torch.finfo(Fd.dtype).eps * s[..., 0]
                    if bool((s[..., -1] <= tol).any()):
                        why = (f"has rank below r = {Fd.shape[-1]} (smallest singular value "
                               f"{float(s[..., -1].min()):.3g})")
                if why is not None:
                    raise ValueError(
                        f"factor {name} of pair {j} (A {list(A.shape)}, B {list(B.shape)}) {why}, so "
                        "W = A B^T is not a point of the rank-r manifold; nothing was changed. A zero factor "
                        "(e.g. LoRA's B = 0 at init) is not allowed: initialise both factors with full column "
                        "rank (small random values)")

    def _group_step(self, group: dict) -> None:
        geo = group["geometry"]
        if geo is None:
            for p in group["params"]:
                if p.grad is not None:
                    _adamw_(p, p.grad, self.state[p], group)
            return
        if geo not in self.GEOMETRIES:  # step() checked the settings first; never read another value as one
            raise ValueError(f"geometry must be one of {self.GEOMETRIES} or None, got {geo!r}")
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
            if geo == "embedded":
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

