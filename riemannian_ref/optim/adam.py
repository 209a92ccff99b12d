"""One Riemannian Adam for parameters on any manifold (geoopt's ``RiemannianAdam`` pattern).

Each parameter is a point of its manifold: a :class:`~riemannian_ref.optim.manifold.ManifoldParameter`
carries it, an untagged tensor is :class:`~riemannian_ref.optim.manifold.Euclidean`. For a
point ``x`` with Euclidean gradient ``g`` at step ``t``:

.. math::

    \\xi = \\mathrm{egrad2rgrad}(x, g), \\quad
    m \\leftarrow \\beta_1 m + (1 - \\beta_1) \\xi, \\quad
    v \\leftarrow \\beta_2 v + (1 - \\beta_2) \\langle \\xi, \\xi \\rangle_{\\mathrm{component}},

    \\Delta = -\\eta \\frac{m / (1 - \\beta_1^t)}{\\sqrt{v / (1 - \\beta_2^t)} + \\epsilon},
    \\quad (x, m) \\leftarrow \\mathrm{retr\\_transp}(x, \\Delta, m).

On the Euclidean space ``v`` is per entry and this is AdamW (Kingma and Ba
2015; Loshchilov and Hutter 2019). On Stiefel frames and fixed-rank matrices
``v`` is one scalar per matrix (Becigneul and Ganea 2019), so a step is a
tangent vector of metric length about ``lr`` whatever the gradient's scale,
and the momentum is tangent at the current point after every step.

Weight decay is AdamW's decoupled decay, applied to Euclidean parameters only.
Manifold parameters are not decayed: on the Stiefel manifold its Riemannian
gradient :math:`\\mathrm{proj}_W(W)` is exactly zero (computing it would leave
round-off, which the per-matrix normalisation would scale up to a step of
length ``lr`` when the gradient is small); on fixed-rank matrices a decay of
``W`` is a modelling choice, added to the loss if wanted.
"""
from __future__ import annotations

import difflib
from typing import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._checks import check_number
from .manifold import Euclidean, Manifold

__all__ = ["RiemannianAdam"]

_EUCLIDEAN = Euclidean()
_HALF = (torch.float16, torch.bfloat16)


def _check_hparams(lr, betas, eps, weight_decay, amsgrad, trust_radius) -> None:
    check_number(lr, "lr", low=0.0)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    for i, b in enumerate(betas):
        check_number(b, f"betas[{i}]", low=0.0, high=1.0, high_open=True)
    check_number(eps, "eps", low=0.0)
    check_number(weight_decay, "weight_decay", low=0.0)
    if not isinstance(amsgrad, bool):
        raise ValueError(f"amsgrad must be a bool, got {amsgrad!r}")
    if trust_radius is not None:
        check_number(trust_radius, "trust_radius", low=0.0, low_open=True)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, else 0: a zero second moment (``eps = 0`` and only zero gradients so
    far) goes with a zero first moment, and the step is zero, not 0/0."""
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def _manifold_of(p: Tensor) -> Manifold:
    """The manifold a tensor carries (:class:`Euclidean` when untagged)."""
    m = getattr(p, "manifold", None)
    return m if isinstance(m, Manifold) else _EUCLIDEAN


def _units(params: list) -> list[tuple[Manifold, list[int]]]:
    """The points of a group: ``(manifold, indices)``, one index per tensor, a factor pair at its first factor."""
    units, pairs = [], {}
    for i, p in enumerate(params):
        M = _manifold_of(p)
        if M.n_tensors == 1:
            units.append((M, [i]))
        elif id(M) in pairs:
            pairs[id(M)].append(i)
        else:
            pairs[id(M)] = [i]
            units.append((M, pairs[id(M)]))
    return units


class RiemannianAdam(Optimizer):
    """Adam on every parameter's manifold: AdamW for plain tensors, Riemannian Adam for manifold parameters.

    Parameters
    ----------
    params : iterable of Tensor or dict
        Parameters or param groups, as for ``torch.optim.AdamW``; the
        geometry comes from each parameter (a :class:`ManifoldParameter`, or
        one tagged by :func:`~riemannian_ref.optim.constrain_`). Both factors
        of a factor pair must be in one group. Manifold parameters must be
        float32 or float64 points of their manifold, checked when a group is
        added or loaded and before every step.
    lr : float
        Step size; on a manifold, the metric length of a step when the
        gradient direction is steady (default 1e-3).
    betas : (float, float)
        Decay of the first and second moments (default (0.9, 0.999)).
    eps : float
        Added to the root of the second moment (default 1e-8). With
        ``eps = 0`` a manifold step is exactly invariant to the gradient's
        scale, and a point whose gradients were all zero does not move.
    weight_decay : float
        Decoupled weight decay of Euclidean parameters (AdamW's); manifold
        parameters are not decayed (default 0).
    amsgrad : bool
        Use the running maximum of the second moment (default False).
    trust_radius : float or None
        Cap on the metric norm of each matrix's step on a manifold; Euclidean
        parameters are not capped (default None: no cap).

    Notes
    -----
    State per point, kept at its (first) tensor: ``step`` (int), ``exp_avg``
    (a tangent vector), ``exp_avg_sq`` (per entry for Euclidean parameters,
    shape ``[..., 1, 1]`` on matrix manifolds), and ``max_exp_avg_sq`` with
    ``amsgrad``. ``add_param_group`` and ``load_state_dict`` check every group
    as the constructor does (ranges, points, pairs, a tensor in one group only,
    state shapes) and raise ``ValueError`` naming the group before anything
    changes.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 trust_radius: float | None = None):
        _check_hparams(lr, betas, eps, weight_decay, amsgrad, trust_radius)
        # torch's Optimizer.__init__ calls self.add_param_group for every group: one checked path
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, trust_radius=trust_radius))

    # -- checks ------------------------------------------------------------
    def _check_group(self, group: dict, gi: int, where: str = "", others: list | None = None) -> None:
        """Raise ``ValueError`` naming the group if it cannot be stepped; changes nothing."""
        try:
            self._check_keys(group)
            _check_hparams(*(group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "trust_radius")))
            self._check_points(group, others or [])
        except ValueError as exc:
            raise ValueError(f"RiemannianAdam{where}: param group {gi}: {exc}") from None

    def _check_keys(self, group: dict) -> None:
        """Refuse the old geometry flags and a key that looks like a misspelled setting; other keys are labels."""
        for old in ("stiefel", "geometry"):
            if old in group:
                raise ValueError(f"the {old!r} group flag is gone: put the parameters on their manifold with "
                                 "rr.optim.constrain_(manifold, *params) or ManifoldParameter")
        known = set(self.defaults) | {"params", "param_names", "peak_lr"}
        for key in group:
            if isinstance(key, str) and key not in known:
                near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
                if near:
                    raise ValueError(f"unknown key {key!r} (did you mean {near[0]!r}? a misspelled setting "
                                     f"would be ignored)")

    @staticmethod
    def _check_points(group: dict, others: list) -> None:
        """Every manifold point: its dtype, on its manifold, a factor pair complete and in this group only."""
        ps = group["params"]
        for M, idx in _units(ps):
            if isinstance(M, Euclidean):
                continue
            what = (f"parameter {idx[0]} (shape {list(ps[idx[0]].shape)})" if M.n_tensors == 1 else
                    f"pair (parameters {', '.join(map(str, idx))}) on {M.name}")
            if len(idx) != M.n_tensors:
                raise ValueError(f"{what} needs both factors (A, B) in this group, with a manifold instance of "
                                 f"their own (constrain_(manifold, A, B)); it holds {len(idx)} tensors")
            if M.n_tensors > 1 and any(_manifold_of(q) is M for q in others):
                raise ValueError(f"{what}: a factor of this pair is in another param group")
            for i in idx:
                if M.dtypes is not None and ps[i].dtype not in M.dtypes:
                    hint = (": half precision is not supported on a manifold (its SVD and QR steps need float32 "
                            "or float64, and rounding loses most of a step of size lr); keep these parameters in "
                            "float32 (run the forward under autocast)" if ps[i].dtype in _HALF else "")
                    raise ValueError(f"{what} is {str(ps[i].dtype).replace('torch.', '')}, expected float32 or "
                                     f"float64{hint}")
            x = ps[idx[0]].detach() if M.n_tensors == 1 else tuple(ps[i].detach() for i in idx)
            try:
                M.check_point(x)
            except ValueError as exc:
                raise ValueError(f"{what}: {exc}; nothing was changed") from None

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after the constructor's checks (which calls this for every group).

        The group's missing keys take the optimiser's defaults. Refused with a
        ``ValueError`` naming the group's index, leaving the optimiser unchanged:
        a hyper-parameter out of range, a manifold parameter off its manifold, an
        incomplete factor pair, and a tensor already in this or another group.
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
                raise TypeError(f"RiemannianAdam: param group {gi}: parameter {i} must be a Tensor, "
                                f"got {type(p).__name__}")
        seen: dict[int, int] = {}
        for i, p in enumerate(tensors):
            if id(p) in seen:
                raise ValueError(f"RiemannianAdam: param group {gi}: parameters {seen[id(p)]} and {i} are the "
                                 "same tensor (it would be stepped twice)")
            seen[id(p)] = i
        for gj, other in enumerate(self.param_groups):
            for q in other["params"]:
                if id(q) in seen:
                    raise ValueError(f"RiemannianAdam: param group {gi}: parameter {seen[id(q)]} is already in "
                                     f"param group {gj}; a tensor can be in one group only")
        for key, default in self.defaults.items():
            group.setdefault(key, default)
        if isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        others = [q for g in self.param_groups for q in g["params"]]
        self._check_group({**group, "params": tensors}, gi, others=others)
        super().add_param_group(group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict`` after the checks of :meth:`add_param_group` on every loaded group.

        The loaded groups' hyper-parameters replace the current ones (torch's
        rule), so each is checked with the current group's tensors, and each
        point's state against the shapes its manifold gives; anything wrong
        raises a ``ValueError`` naming the group, and nothing is loaded.
        """
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        state = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(groups, (list, tuple)) or not isinstance(state, dict):
            raise ValueError("RiemannianAdam.load_state_dict: state_dict must be a dict with 'state' (dict) and "
                             "'param_groups' (list)")
        if len(groups) == len(self.param_groups):  # else torch's own error says what differs
            for gi, (saved, cur) in enumerate(zip(groups, self.param_groups)):
                if not isinstance(saved, dict) or len(saved.get("params", ())) != len(cur["params"]):
                    continue
                # "differentiable": torch's __setstate__ (load_state_dict, deepcopy) adds it to defaults only
                missing = [k for k in self.defaults if k not in saved and k != "differentiable"]
                if missing:  # torch would load the group without them, and the next step would fail
                    raise ValueError(f"RiemannianAdam.load_state_dict: param group {gi} lacks "
                                     f"{', '.join(missing)} (a state dict of another optimiser or version?)")
                merged = {**saved, "params": cur["params"]}
                if isinstance(merged["betas"], list):
                    merged["betas"] = tuple(merged["betas"])
                self._check_group(merged, gi, ".load_state_dict")
                try:
                    self._check_state(merged, [state.get(k) for k in saved["params"]])
                except ValueError as exc:
                    raise ValueError(f"RiemannianAdam.load_state_dict: param group {gi}: {exc}") from None
        super().load_state_dict(state_dict)

    @staticmethod
    @torch.no_grad()
    def _check_state(group: dict, states: list) -> None:
        """Each point's loaded state has the keys and shapes its manifold gives (at its first tensor)."""
        ps = group["params"]
        for M, idx in _units(ps):
            for i in idx[1:]:
                if states[i]:
                    raise ValueError(f"state of parameter {i}: a factor pair's state is kept at its first factor")
            st = states[idx[0]]
            if st is None:
                continue
            x = ps[idx[0]].detach() if M.n_tensors == 1 else tuple(ps[i].detach() for i in idx)
            xi = M.egrad2rgrad(x, torch.zeros_like(x) if M.n_tensors == 1 else tuple(map(torch.zeros_like, x)))
            sq = tuple(M.component_inner(x, xi).shape)
            shapes = {"exp_avg": tuple(xi.shape), "exp_avg_sq": sq}
            if group["amsgrad"]:
                shapes["max_exp_avg_sq"] = sq
            _expect(st, f"parameter {idx[0]}", shapes)

    # -- stepping ----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step; returns the closure's loss if given.

        Every gradient, every group's settings and every manifold point are
        checked before any parameter or state changes.

        Raises
        ------
        FloatingPointError
            If a gradient has a NaN or infinite entry (naming the parameter's
            group, index and shape).
        ValueError
            For a sparse gradient, a group whose settings were edited out of
            range, or a manifold parameter off its manifold (a factor pair of
            rank below ``r``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [(gi, i, p) for gi, group in enumerate(self.param_groups)
                 for i, p in enumerate(group["params"]) if p.grad is not None]
        for gi, i, p in grads:
            if p.grad.is_sparse:
                raise ValueError(f"RiemannianAdam does not support sparse gradients (group {gi}, parameter {i})")
        if grads and not bool(torch.stack([torch.isfinite(p.grad).all() for _, _, p in grads]).all()):
            gi, i, p = next(x for x in grads if not torch.isfinite(x[2].grad).all())
            n_bad = int((~torch.isfinite(p.grad)).sum())
            raise FloatingPointError(
                f"RiemannianAdam.step: the gradient of parameter {i} of group {gi} (shape {list(p.shape)}) has "
                f"{n_bad} non-finite entries; no parameter and no state was changed (skip this step, or find "
                "where the NaN/inf comes from)")
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, gi, ".step")
        for group in self.param_groups:
            for M, idx in _units(group["params"]):
                self._step_point(M, [group["params"][i] for i in idx], group)
        return loss

    def _step_point(self, M: Manifold, ps: list, group: dict) -> None:
        if all(p.grad is None for p in ps):
            return
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in ps]
        lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
        euclidean = isinstance(M, Euclidean)
        x, g = (ps[0], grads[0]) if M.n_tensors == 1 else (tuple(ps), tuple(grads))
        if euclidean and group["weight_decay"]:
            ps[0].mul_(1.0 - lr * group["weight_decay"])
        xi = M.egrad2rgrad(x, g)
        state = self.state[ps[0]]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(xi)
            state["exp_avg_sq"] = torch.zeros_like(M.component_inner(x, xi))
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(xi, alpha=1.0 - b1)
        if euclidean:  # component_inner is xi * xi: fused, as AdamW's
            v.mul_(b2).addcmul_(xi, xi, value=1.0 - b2)
        else:
            v.mul_(b2).add_(M.component_inner(x, xi), alpha=1.0 - b2)
        if group["amsgrad"]:
            if "max_exp_avg_sq" not in state:  # amsgrad switched on after the first step
                state["max_exp_avg_sq"] = v.clone()
            v = torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
        denom = (v / (1.0 - b2 ** t)).sqrt().add(eps)
        if euclidean:  # retr(x, u) = x + u and transport is the identity: one fused update, as AdamW's
            ps[0].add_(_safe_div(m, denom), alpha=-lr / (1.0 - b1 ** t))
            return
        step = -(lr / (1.0 - b1 ** t)) * _safe_div(m, denom)
        radius = group["trust_radius"]
        if radius is not None:
            norm = M.component_inner(x, step).clamp_min(0).sqrt().clamp_min(torch.finfo(step.dtype).tiny)
            step = step * (radius / norm).clamp(max=1.0)
        y, m_new = M.retr_transp(x, step, m)
        for p, new in zip(ps, (y,) if M.n_tensors == 1 else y):
            p.copy_(new)
        m.copy_(m_new)


def _expect(st, what: str, shapes: dict) -> None:
    """A loaded state: a dict with ``step`` (int >= 1) and finite tensors of the given shapes (or empty)."""
    if not isinstance(st, dict):
        raise ValueError(f"state of {what} must be a dict, got {type(st).__name__}")
    if not st:
        return
    for key in ("step", *shapes):
        if key not in st:
            raise ValueError(f"state of {what}: {key} is missing (expected keys step, {', '.join(shapes)})")
    step = st["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"state of {what}: step must be an int >= 1 (the steps taken), got {step!r}")
    for key, want in shapes.items():
        v = st[key]
        if not isinstance(v, Tensor) or tuple(v.shape) != tuple(want):
            got = list(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"state of {what}: {key} has shape {got}, expected {list(want)}")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"state of {what}: {key} has non-finite entries")
