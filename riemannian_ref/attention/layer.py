r"""The package's one attention module: multi-head attention with metrics and a connection.

Every model in the package builds its attention from :class:`RiemannianAttention`
(the Fiber Bundle Transformer in every mode and preset, the rank-collapse
stacks, the recall head). For head :math:`h`, with per-head frames
:math:`W_Q^h, W_K^h \in \mathbb{R}^{D\times d}`,

.. math::
    q_i = W_Q^{h\top} x_i,\quad k_j = W_K^{h\top} y_j,\quad v_j = W_V^h y_j,
    \qquad o_i = \sum_j \mathrm{softmax}_j(s_{ij})\, P_{j\to i} v_j ,

(``y = x`` for self-attention) with scores :math:`s_{ij}` either the scaled
dot product (``scores="dot"``) or the Riemannian distance score
:math:`-\tfrac{1}{2\tau}(q_i - P k_j)^\top \bar G_{ij} (q_i - P k_j)`
(``scores="metric"``) whose metrics :math:`G = \lambda I + U U^\top` come from
one :class:`~riemannian_ref.geometry.metric.MetricNet` (per token, or one
shared metric per head), and :math:`P_{j\to i}` the transport of a connection
(:mod:`riemannian_ref.geometry.transport`; the identity by default).

The query/key maps are stored as frames of shape ``[h, D, d]`` so that a
Riemannian optimiser (:class:`~riemannian_ref.RiemannianAdam`, frames on
:class:`~riemannian_ref.Stiefel`) can keep
each head's frame orthonormal (:meth:`RiemannianAttention.qk_frames`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._checks import (F32_MAX, METRIC_SIDES, autocast_dtype, check_bool, check_choice, check_gains_rank, check_int,
                       check_number, check_tensor, shape_str)
from ..geometry.metric import LAM_MIN, METRIC_FORMS, MetricNet, SubspaceFactors, raw_from_lam
from ..geometry.scores import riemannian_scores
from ..geometry.transport import CONNECTIONS, rotary_frequencies
from .connections import connection_attention
from .functional import riemannian_attention

CONTENT_CONNECTIONS = ("content", "content_source", "cumulative")  # connections with learned per-token rates

__all__ = ["AttentionConfig", "RiemannianAttention"]

SCORES = ("metric", "dot")
METRICS = ("token", "shared", "position")
QK_INITS = ("normal", "orthonormal")


@dataclass(frozen=True)
class AttentionConfig:
    r"""Configuration of :class:`RiemannianAttention` (frozen; validated on construction).

    Parameters
    ----------
    d_model : int, default 64
        Width :math:`D` of the (query-side) token states and of the output.
    n_heads : int, default 4
        Number of heads :math:`h`.
    head_dim : int or None, default None
        Query/key dimension :math:`d` per head; None: ``d_model // n_heads``
        (then ``d_model`` must be divisible by ``n_heads``).
    v_head_dim : int or None, default None
        Value dimension per head; None: ``head_dim``.
    kv_dim : int or None, default None
        Width of the key/value states; None: ``d_model``.
    cross_attention : bool, default False
        Queries and keys come from different sequences (``forward(x, context)``):
        a query's metric then needs its own metric network.
    scores : {"metric", "dot"}, default "metric"
        Riemannian distance scores or scaled dot products.
    metric : {"token", "shared", "position"}, default "token"
        Per-token metrics computed from the states, one learned metric
        per head, or a metric field over positions (one learned metric per
        position and head, :math:`G_p`, whatever the token there; self-attention
        only) (``scores="metric"`` only).
    metric_bias : bool, default False
        ``metric="token"``: an affine metric network :math:`U_i = W x_i + b`
        (:class:`~riemannian_ref.geometry.metric.MetricNet` ``bias``).
    subspace : int or None, default None
        ``metric="token"``: per-token factors that share one learned subspace
        of dimension :math:`m` per head, :math:`U_i = B\,C_i`
        (:class:`~riemannian_ref.geometry.metric.MetricNet` ``subspace``),
        :math:`1 \le m \le` ``head_dim``; with the trivial connection
        attention then runs on SDPA as one dot product of width
        :math:`d + m(m+1)/2 + 1` (with another connection the factors are
        multiplied out and take that connection's path). Needs ``rank >= 1``.
    max_positions : int, default 1024
        ``metric="position"``: the number of positions the metric field covers
        (the longest sequence).
    metric_form : {"gains", "factor"}, default "gains"
        The metric parameterisation (:class:`~riemannian_ref.geometry.metric.MetricNet`
        ``form``): orthonormal directions with bounded per-token gains,
        :math:`G = \lambda(I + \sum_t \gamma_t u_t u_t^\top)`, or the unbounded
        factor :math:`G = \lambda I + U U^\top` of package versions up to 0.3.
    max_gain, gain_bias : float, default 4.0 and -2.0
        ``metric_form="gains"``: the largest gain and the gain logits' initial bias.
    metric_side : {"key", "query", "mean"}, default "key"
        Whose metric measures a pair.
    rank : int, default 2
        Metric rank :math:`r \ge 0`; 0 gives :math:`G = \lambda I`.
    strength : float, default 1.0
        Heterogeneity of the metrics at init (:class:`~riemannian_ref.geometry.metric.MetricNet`).
    lam_init, lam_min : float, default 1.0 and ``LAM_MIN``
        Initial :math:`\lambda` and its floor.
    learn_temperature : bool, default False
        A learned per-head factor on :math:`1/\tau` (1 at init), folded into the metric.
    connection : {"trivial", "flat", "content", "content_source", "cumulative"} or None, default None
        Transport of keys and values (self-attention only; None: ``"trivial"``,
        or the mode's default in :class:`~riemannian_ref.FiberBundleConfig`): none, rotary
        (flat), rates read from the content of both endpoints of an edge
        (inverse-consistent, curved), or of its source only, or the rates
        integrated along the sequence into per-token phases (flat,
        content-dependent, :math:`O(n d)` extra)
        (:mod:`~riemannian_ref.geometry.transport`).
    rotary_base : float, default 10000.0
        Base of the rotary rates :math:`\theta_m = \text{base}^{-2m/d}`.
    content_rate_std : float, default 0.5
        Content connections (also ``"cumulative"``): per-token rates :math:`\omega_j = 2\theta\,\mathrm{sigmoid}(W x_j)`
        with :math:`W` of init std ``content_rate_std / sqrt(D)`` (0: starts flat).
    transport_values : bool, default True
        Transport the values along the connection too. Rotary position
        embedding is exactly ``scores="dot"``, ``connection="flat"`` and
        ``transport_values=False``; with ``True`` the flat connection also
        rotates the values.
    causal : bool, default False
        Default of ``is_causal`` in :meth:`RiemannianAttention.forward`.
    bias : bool, default False
        Biases in the value and output projections.
    dropout : float, default 0.0
        Dropout on the attention weights in training mode, in ``[0, 1)``.
    init_std : float or None, default None
        Std of the query/key frames and the value projection at init; None:
        :math:`1/\sqrt{\text{fan-in}}` (unit-variance states give unit-variance
        queries, keys and values).
    out_init_std : float or None, default None
        Std of the output projection at init; None: :math:`1/\sqrt{h d_v}`.
    qk_init : {"normal", "orthonormal"}, default "normal"
        Gaussian frames, or frames with orthonormal columns (QR of a Gaussian).
    qk_gain : float, default 1.0
        Multiplies the query/key frames at init, so dot scores scale by ``qk_gain**2``.
    """

    d_model: int = 64                # D, width of the query-side states and of the output
    n_heads: int = 4                 # h
    head_dim: int | None = None      # d per head (None: d_model // n_heads)
    v_head_dim: int | None = None    # value dim per head (None: head_dim)
    kv_dim: int | None = None        # width of the key/value states (None: d_model)
    cross_attention: bool = False    # forward(x, context): queries and keys from different sequences
    scores: str = "metric"           # "metric" (Riemannian distance) or "dot" (scaled dot product)
    metric: str = "token"            # "token" (from the states), "shared" (one per head), "position" (per position)
    metric_bias: bool = False        # metric="token": affine metric network U_i = W x_i + b
    subspace: int | None = None      # metric="token": factors U_i = B C_i in one learned m-dim subspace per head
    max_positions: int = 1024        # metric="position": positions the metric field covers
    metric_side: str = "key"         # "key" | "query" | "mean": whose metric measures a pair
    metric_form: str = "gains"       # "gains" (bounded directions and gains) or "factor" (G = lam I + U U^T)
    max_gain: float = 4.0            # metric_form="gains": eigenvalues of G in [lam, lam (1 + max_gain)]
    gain_bias: float = -2.0          # metric_form="gains": initial bias of the gain logits
    rank: int = 2                    # r; 0 gives G = lam I
    strength: float = 1.0            # heterogeneity of the metrics at init
    lam_init: float = 1.0            # initial lambda
    lam_min: float = dataclasses.field(default=LAM_MIN, metadata={"absent": LAM_MIN})  # floor of lambda
    learn_temperature: bool = False  # learned per-head factor on 1/tau
    connection: str | None = None    # "trivial" | "flat" | "content" | "content_source" | "cumulative" (None: trivial)
    rotary_base: float = 10000.0     # rotary rates theta_m = base^(-2m/d)
    content_rate_std: float = 0.5    # init std of the content modulation of the rates (0: starts flat)
    transport_values: bool = True    # values transported along the connection too
    causal: bool = False             # default is_causal
    bias: bool = False               # biases in the value and output projections
    dropout: float = 0.0             # on the attention weights, training mode only
    init_std: float | None = None    # frames and value projection (None: 1/sqrt(fan_in))
    out_init_std: float | None = None  # output projection (None: 1/sqrt(h * v_head_dim))
    qk_init: str = "normal"          # "normal" or "orthonormal" frames
    qk_gain: float = 1.0             # multiplies the frames at init

    def __post_init__(self):
        check_int(self.d_model, "d_model")
        check_int(self.n_heads, "n_heads")
        for name in ("head_dim", "v_head_dim", "kv_dim"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}), "
                             "or give head_dim")
        check_choice(self.scores, "scores", SCORES)
        check_choice(self.metric, "metric", METRICS)
        check_choice(self.metric_side, "metric_side", METRIC_SIDES)
        check_choice(self.metric_form, "metric_form", METRIC_FORMS)
        check_number(self.max_gain, "max_gain", low=0.0, low_open=True, high=F32_MAX)
        check_number(self.gain_bias, "gain_bias", low=-F32_MAX, high=F32_MAX)
        if self.connection is not None:
            check_choice(self.connection, "connection", CONNECTIONS)
        check_choice(self.qk_init, "qk_init", QK_INITS)
        check_int(self.rank, "rank", 0)
        check_int(self.max_positions, "max_positions")
        if self.metric == "position" and self.cross_attention:
            raise ValueError("metric='position' indexes the metric by the position of a token in its own "
                             "sequence: it needs cross_attention=False")
        if self.metric_bias and self.metric != "token":
            raise ValueError(f"metric_bias=True needs metric='token' (metrics computed from the states), "
                             f"got metric={self.metric!r}")
        if self.subspace is not None:
            check_int(self.subspace, "subspace", 1, self.qk_dim)
            if self.scores != "metric" or self.metric != "token" or self.rank == 0:
                raise ValueError(f"subspace needs per-token metrics of rank >= 1 computed from the states "
                                 f"(scores='metric', metric='token', rank >= 1), got scores={self.scores!r}, "
                                 f"metric={self.metric!r}, rank={self.rank!r}")
        if self.scores == "metric":
            check_gains_rank(self.metric_form, self.rank, self.subspace or self.qk_dim, self.subspace is not None)
        check_number(self.strength, "strength", low=0.0)
        raw_from_lam(self.lam_init, self.lam_min)  # lam_init > lam_min > 0, finite
        check_number(self.rotary_base, "rotary_base", low=1.0, low_open=True)
        check_number(self.content_rate_std, "content_rate_std", low=0.0)
        check_number(self.dropout, "dropout", low=0.0, high=1.0, high_open=True)
        check_number(self.qk_gain, "qk_gain", low=0.0, low_open=True)
        for name in ("init_std", "out_init_std"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), name, low=0.0, low_open=True)
        if self.connection_resolved != "trivial":
            if self.cross_attention:
                raise ValueError(f"connection={self.connection!r} transports between positions of one "
                                 "sequence: it needs cross_attention=False")
            if self.qk_dim % 2:
                raise ValueError(f"connection={self.connection!r} rotates pairs of coordinates: head_dim must "
                                 f"be even, got {self.qk_dim}")
            if self.transport_values and self.v_dim != self.qk_dim:
                raise ValueError(f"transported values need v_head_dim == head_dim, got {self.v_dim} and "
                                 f"{self.qk_dim} (or transport_values=False)")
        if self.qk_init == "orthonormal" and self.qk_dim > min(self.d_model, self.kv_width):
            raise ValueError(f"orthonormal frames need head_dim <= d_model, got head_dim {self.qk_dim}")
        for name in ("cross_attention", "learn_temperature", "transport_values", "causal", "bias", "metric_bias"):
            check_bool(getattr(self, name), name)

    @property
    def qk_dim(self) -> int:
        """Query/key dimension :math:`d` per head."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def connection_resolved(self) -> str:
        """The connection in use: ``connection``, or ``"trivial"`` for None."""
        return self.connection if self.connection is not None else "trivial"

    @property
    def v_dim(self) -> int:
        """Value dimension per head."""
        return self.v_head_dim if self.v_head_dim is not None else self.qk_dim

    @property
    def kv_width(self) -> int:
        """Width of the key/value states."""
        return self.kv_dim if self.kv_dim is not None else self.d_model

    def replace(self, **changes) -> "AttentionConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


class RiemannianAttention(nn.Module):
    r"""Multi-head attention with dot-product or Riemannian scores and an optional connection.

    Parameters
    ----------
    config : AttentionConfig

    Notes
    -----
    ``forward`` returns ``(output, weights)`` like :class:`torch.nn.MultiheadAttention`;
    ``weights`` is None unless ``return_weights=True`` (which computes them
    densely). Masks follow one convention: ``True`` means *may attend*, for
    ``attn_mask`` (as SDPA) and for ``key_mask`` (one flag per key: ``True``
    for a real token, ``False`` for padding), which reaches the operator as a
    per-key vector, so memory stays :math:`O(n)`.
    """

    def __init__(self, config: AttentionConfig):
        super().__init__()
        if not isinstance(config, AttentionConfig):
            raise ValueError(f"config must be an AttentionConfig, got {type(config).__name__}")
        self.config = cfg = config
        D, Dkv, h, d, dv = cfg.d_model, cfg.kv_width, cfg.n_heads, cfg.qk_dim, cfg.v_dim
        self.w_q = nn.Parameter(torch.empty(h, D, d))    # h frames [D, d]
        self.w_k = nn.Parameter(torch.empty(h, Dkv, d))  # h frames [D_kv, d]
        self.v_proj = nn.Linear(Dkv, h * dv, bias=cfg.bias)
        self.out_proj = nn.Linear(h * dv, D, bias=cfg.bias)
        self.metric = self.metric_q = None
        if cfg.scores == "metric":
            kw = dict(lam_init=cfg.lam_init, lam_min=cfg.lam_min, strength=cfg.strength,
                      shared=cfg.metric == "shared", bias=cfg.metric_bias,
                      n_positions=cfg.max_positions if cfg.metric == "position" else None,
                      subspace=cfg.subspace, form=cfg.metric_form, max_gain=cfg.max_gain,
                      gain_bias=cfg.gain_bias)
            # One metric field: a token's metric is the same whether it queries or is queried.
            # In cross-attention the two sides are different states: one network per side used.
            if not cfg.cross_attention or cfg.metric_side in ("key", "mean"):
                self.metric = MetricNet(Dkv, h, d, cfg.rank, **kw)
            if cfg.cross_attention and cfg.metric_side in ("query", "mean"):
                self.metric_q = MetricNet(D, h, d, cfg.rank, **kw)
        self.log_temp = nn.Parameter(torch.zeros(h)) if cfg.learn_temperature else None
        self.rates = None
        if cfg.connection_resolved in CONTENT_CONNECTIONS:
            self.rates = nn.Linear(D, h * (d // 2), bias=False)  # omega_j = 2 theta sigmoid(W x_j)
        if cfg.connection_resolved != "trivial":
            self.register_buffer("theta", rotary_frequencies(d, cfg.rotary_base), persistent=False)
        else:
            self.theta = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise the projections as the config says (the metric networks initialise themselves)."""
        cfg = self.config
        for w, fan_in in ((self.w_q, cfg.d_model), (self.w_k, cfg.kv_width)):
            if cfg.qk_init == "orthonormal":
                Q, R = torch.linalg.qr(torch.randn_like(w))  # (h, D, d): orthonormal columns, Haar
                w.copy_(Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2))
            else:
                w.normal_(0.0, cfg.init_std if cfg.init_std is not None else fan_in ** -0.5)
            w.mul_(cfg.qk_gain)
        self.v_proj.weight.normal_(0.0, cfg.init_std if cfg.init_std is not None else cfg.kv_width ** -0.5)
        out_std = cfg.out_init_std if cfg.out_init_std is not None else (cfg.n_heads * cfg.v_dim) ** -0.5
        self.out_proj.weight.normal_(0.0, out_std)
        for lin in (self.v_proj, self.out_proj):
            if lin.bias is not None:
                lin.bias.zero_()
        if self.rates is not None:
            self.rates.weight.normal_(0.0, cfg.content_rate_std / math.sqrt(cfg.d_model))

    def qk_frames(self) -> list[nn.Parameter]:
        """The query and key frames ``[W_Q, W_K]``, each of shape [h, D, d] (a Stiefel param group)."""
        return [self.w_q, self.w_k]

    # ------------------------------------------------------------------ pieces
    def project(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values, each [B, h, n, d] (values [B, h, n_k, d_v]).

        Parameters
        ----------
        x : Tensor, shape [B, n_q, D]
            Query-side states (and key/value states for self-attention).
        context : Tensor, shape [B, n_k, D_kv], optional
            Key/value states for cross-attention.

        Returns
        -------
        (q, k, v) : tuple of Tensor
        """
        y = x if context is None else context
        B, n_k, _ = y.shape
        q = torch.einsum("bnD,hDd->bhnd", x, self.w_q)  # (B, h, n_q, d)
        k = torch.einsum("bnD,hDd->bhnd", y, self.w_k)  # (B, h, n_k, d)
        v = self.v_proj(y).view(B, n_k, self.config.n_heads, self.config.v_dim).transpose(1, 2)  # (B, h, n_k, dv)
        return q, k, v

    def geometry(self, x: Tensor, context: Tensor | None = None):
        """The metric and connection of every head: ``(lam, U_q, U_k, rates)``.

        Parameters
        ----------
        x : Tensor, shape [B, n_q, D]
        context : Tensor, shape [B, n_k, D_kv], optional

        Returns
        -------
        lam : Tensor, shape [h], or None for ``scores="dot"``
        U_q, U_k : Tensor, SubspaceFactors or None
            ``[B, h, n, d, r]`` per token or ``[1, h, d, r]`` shared (with
            ``subspace``: :class:`~riemannian_ref.geometry.metric.SubspaceFactors`),
            each None when ``metric_side`` does not use it. The learned
            temperature is folded in.
        rates : Tensor or None
            ``"flat"``: [d/2]; content connections (also ``"cumulative"``):
            the per-token rates [B, h, n, d/2] (how an edge combines them:
            :func:`~riemannian_ref.geometry.transport.edge_rule`); else None.
        """
        cfg = self.config
        rates = None
        if cfg.connection_resolved == "flat":
            rates = self.theta.to(x.dtype)
        elif cfg.connection_resolved in CONTENT_CONNECTIONS:
            B, n, _ = x.shape
            s = self.rates(x).view(B, n, cfg.n_heads, cfg.qk_dim // 2).transpose(1, 2)  # (B, h, n, d/2)
            rates = self.theta.to(x.dtype) * 2.0 * torch.sigmoid(s)
        if cfg.scores == "dot":
            return None, None, None, rates
        if context is None:  # self-attention: one metric per token, on both sides
            lam, U_k = self.metric(x)  # (h,), (B, h, n, d, r) or (1, h, d, r)
            U_q = U_k
        else:
            lam_k, U_k = self.metric(context) if self.metric is not None else (None, None)
            lam_q, U_q = self.metric_q(x) if self.metric_q is not None else (None, None)
            # "mean": (G_i + G_j) / 2 has isotropic part (lam_q + lam_k) / 2
            lam = lam_k if lam_q is None else lam_q if lam_k is None else 0.5 * (lam_k + lam_q)
        U_q = U_q if cfg.metric_side in ("query", "mean") else None
        U_k = U_k if cfg.metric_side in ("key", "mean") else None
        if self.log_temp is not None:
            t = self.log_temp.exp().to(x.dtype)  # (h,)
            lam = lam * t
            U_q = _scale_factor(U_q, t.sqrt())
            U_k = _scale_factor(U_k, t.sqrt())
        return lam, U_q, U_k, rates

    def scores(self, x: Tensor) -> Tensor:
        """Pre-softmax scores [B, h, n, n] of self-attention over the states ``x`` [B, n, D] (for analysis).

        No mask and no transport: the dot products, or the Riemannian scores of
        the heads' metrics.
        """
        q, k, _ = self.project(x)
        lam, U_q, U_k, _ = self.geometry(x)
        U_q, U_k = _dense_factor(U_q), _dense_factor(U_k)
        if lam is None:
            return q @ k.transpose(-1, -2) / math.sqrt(self.config.qk_dim)
        return riemannian_scores(q, k, U_q, U_k, lam=lam, metric_side=self.config.metric_side)

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, context: Tensor | None = None, *, attn_mask: Tensor | None = None,
                key_mask: Tensor | None = None, is_causal: bool | None = None, positions: Tensor | None = None,
                return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attend from the states ``x`` to themselves, or to ``context``.

        Parameters
        ----------
        x : Tensor, shape [B, n_q, D]
        context : Tensor, shape [B, n_k, D_kv], optional
            Key/value states (``cross_attention=True`` configs only).
        attn_mask : Tensor, optional
            Boolean (``True`` = may attend) or additive float mask,
            broadcastable to ``[B, h, n_q, n_k]``.
        key_mask : Tensor, shape [B, n_k], bool, optional
            ``True`` for keys that may be attended (real tokens), ``False``
            for padding.
        is_causal : bool, optional
            Causal mask; default ``config.causal``.
        positions : Tensor, shape [n] or [B, 1, n], optional
            Token positions of the connection (default ``0..n-1``).
        return_weights : bool
            Also return the attention weights [B, h, n_q, n_k] (dense).

        Returns
        -------
        out : Tensor, shape [B, n_q, D]
        weights : Tensor, shape [B, h, n_q, n_k], or None
        """
        cfg = self.config
        x = check_tensor(x, "x", min_dim=3)
        if x.dim() != 3 or x.shape[-1] != cfg.d_model:
            raise ValueError(f"x must have shape [B, n, {cfg.d_model}], got {shape_str(x)}")
        if context is not None:
            if not cfg.cross_attention:
                raise ValueError("context is given but the config has cross_attention=False")
            context = check_tensor(context, "context", min_dim=3)
            if context.dim() != 3 or context.shape[0] != x.shape[0] or context.shape[-1] != cfg.kv_width:
                raise ValueError(f"context must have shape [{x.shape[0]}, n_k, {cfg.kv_width}], "
                                 f"got {shape_str(context)}")
        elif cfg.cross_attention:
            raise ValueError("this module is configured for cross-attention: pass context")
        w = self.w_q
        mixed = autocast_dtype(x.device.type) is not None  # autocast casts per op: other dtypes are expected
        for name, t in (("x", x), ("context", context)):
            if t is not None and ((t.dtype != w.dtype and not mixed) or t.device != w.device):
                raise ValueError(f"{name} has dtype {t.dtype} on {t.device} but the module's parameters are "
                                 f"{w.dtype} on {w.device}; convert one of them (module.to(...))")
        if is_causal is not None:
            check_bool(is_causal, "is_causal")
        check_bool(return_weights, "return_weights")
        if positions is not None and not isinstance(positions, Tensor):
            raise ValueError(f"positions must be a tensor [n] or [B, 1, n] or None, got {type(positions).__name__}")
        is_causal = cfg.causal if is_causal is None else is_causal
        B, n_q, _ = x.shape
        n_k = n_q if context is None else context.shape[1]
        mask = _combine_masks(attn_mask, key_mask, B, n_k)
        q, k, v = self.project(x, context)
        lam, U_q, U_k, rates = self.geometry(x, context)
        p = cfg.dropout if self.training else 0.0
        if isinstance(U_k, SubspaceFactors) or isinstance(U_q, SubspaceFactors):
            if cfg.connection_resolved == "trivial" and not return_weights:  # one dot product: SDPA
                o = riemannian_attention(q, k, v, mask, p, is_causal, U_q=U_q, U_k=U_k, lam=lam,
                                         metric_side=cfg.metric_side)
                out = self.out_proj(o.transpose(1, 2).reshape(B, n_q, cfg.n_heads * cfg.v_dim))
                return out, None
            # a transport turns each token's subspace: the factors multiplied out (once where both sides share them)
            U_q, U_k = (_dense_factor(U_q),) * 2 if U_q is U_k else (_dense_factor(U_q), _dense_factor(U_k))
        res = connection_attention(
            q, k, v, mask, p, is_causal, None, U_q=U_q, U_k=U_k, lam=lam if lam is not None else 1.0,
            metric_side=cfg.metric_side, scores=cfg.scores, connection=cfg.connection_resolved, rates=rates,
            positions=positions, transport_values=cfg.transport_values, return_weights=return_weights)
        o, A = res if return_weights else (res, None)
        out = self.out_proj(o.transpose(1, 2).reshape(B, n_q, cfg.n_heads * cfg.v_dim))  # (B, n_q, D)
        return out, A


def _scale_factor(U, s: Tensor):
    """Multiply a per-head factor ([B, h, n, d, r], [1, h, d, r] or SubspaceFactors) by s [h]."""
    if U is None:
        return None
    if isinstance(U, SubspaceFactors):  # B (C s): the coefficients carry the scale
        return SubspaceFactors(U.basis, U.coef * s.view(-1, 1, 1, 1))
    return U * (s.view(-1, 1, 1, 1) if U.dim() == 5 else s.view(-1, 1, 1))


def _dense_factor(U):
    """Per-token factors as one tensor (SubspaceFactors multiplied out); anything else unchanged."""
    return U.dense() if isinstance(U, SubspaceFactors) else U


def _combine_masks(attn_mask: Tensor | None, key_mask: Tensor | None, B: int, n_k: int) -> Tensor | None:
    """``attn_mask`` and a per-key ``key_mask`` [B, n_k] as one mask; the key mask stays [B, 1, 1, n_k]."""
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            got = f"{attn_mask.dtype} tensor" if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
            raise ValueError(f"attn_mask must be a bool (True = may attend) or float (additive) tensor, got {got}")
        if attn_mask.dim() > 4 or (attn_mask.dim() and attn_mask.shape[-1] not in (n_k, 1)):
            raise ValueError(f"attn_mask must broadcast to [B, h, n_q, n_k] with n_k = {n_k}, got "
                             f"{shape_str(attn_mask)}")
    if key_mask is None:
        return attn_mask
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, n_k):
        got = f"{key_mask.dtype} {shape_str(key_mask)}" if isinstance(key_mask, Tensor) else type(key_mask).__name__
        raise ValueError(f"key_mask must be a bool tensor [B, n_k] = [{B}, {n_k}] (True = may attend), got {got}")
    keep = key_mask.view(B, 1, 1, n_k)  # (B, 1, 1, n_k): O(n) memory, broadcast by the operator
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))
