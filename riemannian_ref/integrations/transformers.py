r"""Riemannian attention as an attention backend of Hugging Face ``transformers`` (5.x).

Switch a model you already have (any model whose attention layers call
``transformers``' ``AttentionInterface``; Llama, Qwen2, Mistral and GPT-2 are tested) to
Riemannian attention in three lines, then train it as before::

    from riemannian_ref.integrations import transformers as rr_hf

    rr_hf.attach(model, rank=2)                   # a metric network in every attention layer
    model.set_attn_implementation("riemannian")   # transformers' own switch
    # ... your training loop, Trainer, generate(), save_pretrained() as usual

What it computes. :func:`attach` gives every attention layer a
:class:`HeadMetric`: for each head :math:`h` one
:class:`~riemannian_ref.geometry.metric.MetricNet` reading that head's key
states (``side="key"``) or query states (``side="query"``), so that the
metric is a field on the head space,

.. math::
    G^h(k) = \lambda_h I + U^h(k)\,U^h(k)^\top, \qquad U^h(k) = W^h \hat k \in \mathbb{R}^{d\times r},

with :math:`\hat k = k/\sqrt{|k|^2/d}` the RMS-normalised state and
:math:`\lambda_h` parameterised by the package's one rule
(:func:`~riemannian_ref.geometry.metric.lam_from_raw`). By default
(``form="gains"``) the columns of :math:`W^h \hat k` only set directions:
:math:`U^h(k)` is them orthonormalised, each times
:math:`\sqrt{\lambda_h \gamma_t(k)}` with a bounded gain
:math:`\gamma_t \in (0, g_{\max})`, so every eigenvalue of :math:`G^h(k)` lies
in :math:`[\lambda_h, \lambda_h(1+g_{\max})]`; ``form="factor"`` keeps
:math:`U^h(k) = W^h \hat k` unbounded (chapter 13 of the book compares them). The registered
function :func:`attention_forward` then calls
:func:`~riemannian_ref.attention.functional.riemannian_attention` with the
layer's own ``scaling`` :math:`1/\tau`: scores
:math:`s_{ij} = -\tfrac{1}{2\tau}(q_i-k_j)^\top G^h(k_j)(q_i-k_j)`, the masks
the model built (padding, causal, sliding window), grouped-query attention
(keys and values with fewer heads than queries) and attention dropout.

At init. With ``strength=0`` the factors are zero and the switched layer is
distance attention with :math:`G = \lambda I`: since
:math:`-\tfrac{\lambda}{2\tau}|q_i-k_j|^2 = \tfrac{\lambda}{\tau} q_i\cdot k_j
- \tfrac{\lambda}{2\tau}|k_j|^2 + (\text{a constant per row})`, that is SDPA
with scale :math:`\lambda/\tau` and the key-norm bias
:math:`-\tfrac{\lambda}{2\tau}|k_j|^2` (not the model's original attention:
switching a trained model changes its function by that bias). But
:math:`U = 0` is a stationary point: the score depends on :math:`W^h` only
through :math:`U U^\top`, so its gradient :math:`\propto U` vanishes there and a
zero-initialised metric never trains (in both forms). :func:`attach` therefore
starts the factors away from zero. In the factor form ``strength=0.01`` (the
default) is a relative change of about ``strength**2 = 1e-4`` in the scores,
which Adam's normalised steps leave within a few steps. In the bounded form
(the default) the directions are normalised, so ``strength`` only sets how
much the gains differ between keys; the gains start near
:math:`g_{\max}\,\mathrm{sigmoid}(b)` (0.48 for ``gain_bias=-2``) along
:math:`r` of the :math:`d` directions, an average relative change of about
:math:`0.48\,r/d` in the scores (6% at :math:`d = 16`, :math:`r = 2`). To
switch a trained model with a smaller first step, start the gains lower,
e.g. ``gain_bias=-8`` (gains about 0.001).

Saving. The metric networks are submodules of the attention layers, so
``save_pretrained`` writes them with the model and :func:`attach` records its
settings in ``model.config`` (key ``"riemannian_metric"``); :func:`from_pretrained`
builds the model with the metric networks in place, so that ``transformers``
loads them like any other weight.

Rotary models. In Llama, Qwen2, Mistral and the other rotary models the
layer hands the backend keys already rotated by their position,
:math:`k_j = R_j k^0_j` (:math:`R_j` the rotary rotation at position
:math:`p_j`, orthogonal, :math:`R_i^\top R_j = R_{p_j - p_i}`), and queries
:math:`q_i = R_i q^0_i`. A metric network reading :math:`k_j` would make the
metric depend on the absolute position. The backend therefore carries the
metric with the rotary frame: it computes the factor from the unrotated key
and rotates its columns with the key,

.. math::
    U^0_j = U(k^0_j) = U(R_j^\top k_j), \qquad U_j = R_j U^0_j ,

so that, since :math:`R_j` is orthogonal,

.. math::
    (q_i-k_j)^\top (\lambda I + U_j U_j^\top)(q_i-k_j)
    = \lambda\,|R_j^\top q_i - k^0_j|^2 + |U^{0\top}_j (R_j^\top q_i - k^0_j)|^2,
    \qquad R_j^\top q_i = R_j^\top R_i\, q^0_i ,

which depends on the positions only through :math:`R_j^\top R_i`, i.e.
:math:`p_i - p_j`: shifting every position changes nothing, as with SDPA,
and a left-padded prompt gives what it gives alone. (``side="query"`` is the
same with :math:`U_i = R_i U(R_i^\top q_i)`.) :math:`R_j` is the rotation the
model applied, read from the ``position_embeddings`` ``(cos, sin)`` that each
layer receives (normalised to :math:`\cos^2 + \sin^2 = 1`, so that a rotary
``attention_scaling`` does not scale the metric): :func:`attach` gives every
layer whose forward takes ``position_embeddings`` a forward pre-hook that
passes them to :func:`attention_forward` (as :class:`RotaryFrames`). With a
KV cache the cached keys were rotated in earlier calls, so the hook also
keeps, in the cache object, the frames of every token each layer has cached
(``cos`` and ``sin`` of shape ``[B, T, d]`` in float32 for ``T`` tokens: the
memory of one key/value head of a float32 cache), and follows the cache's own
count of tokens (appending, sliding windows, static caches, ``crop``,
``reset``). Models without rotary embeddings (GPT-2) get no hook and are
unchanged.

Generation. A key's metric depends on that key and its rotary frame only, so
with a KV cache the cached keys give the same metric as in a full forward, and
``generate`` with and without a cache (dynamic, static, sliding-window, beam
search) gives the same tokens (``tests/test_transformers_integration.py``).
Beam search reorders cache rows only among the beams of one prompt, which
share their positions, so the kept frames stay right. A cache whose batch
changed between calls while its rows had different positions (which rows were
kept is unknown), or that was filled before :func:`attach`, is refused with a
``ValueError``.

Masks and precision. A float (additive) mask is accepted as SDPA takes it;
entries at or below half of ``torch.finfo(mask.dtype).min`` (``transformers``'
convention for "masked", ``-inf`` included) are masked exactly, so a fully
masked row (a padded query in a 4-D mask) gives 0, as a boolean mask does,
and never NaN. With attention dropout, half-precision inputs (float16,
bfloat16) are computed in float32 and the result is returned in their dtype.

Limits. ``output_attentions=True`` returns ``None`` weights (as ``"sdpa"``
does); scores that other backends modify (``softcap``, attention sinks
``s_aux``, a ``position_bias``) and the paged cache of continuous batching
are refused with a ``ValueError``, and so are rotary embeddings that rotate
only part of the head (``cos`` narrower than ``head_dim``) or pair the
coordinates other than ``(l, l + d/2)`` (the ``rotate_half`` convention of
Llama, Qwen2 and Mistral).
"""
from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._checks import shape_str
from ..attention.functional import riemannian_attention
from ..geometry.metric import LAM_MIN, METRIC_FORMS, MetricNet, raw_from_lam

try:
    import transformers
except ImportError as exc:
    raise ImportError("riemannian_ref.integrations.transformers needs transformers 5.x: "
                      "pip install 'riemannian_ref[transformers]'") from exc

__all__ = ["NAME", "CONFIG_KEY", "FRAMES_KWARG", "HeadMetric", "RotaryFrames", "attach", "attention_forward",
           "from_pretrained", "register"]

#: The name under which :func:`register` puts the backend in ``transformers``' registries.
NAME = "riemannian"
#: The ``model.config`` attribute where :func:`attach` records its settings.
CONFIG_KEY = "riemannian_metric"
#: The attribute of an attention layer that holds its :class:`HeadMetric`.
METRIC_ATTR = "riemannian_metric"
SIDES = ("key", "query")
# Keyword arguments with which a model changes the scores in ways this backend does not implement
# (and the paged cache of continuous batching, which a backend must read itself).
UNSUPPORTED = ("softcap", "s_aux", "position_bias", "cache")
#: The keyword argument through which the pre-hook of a rotary layer hands :func:`attention_forward` its frames.
FRAMES_KWARG = "riemannian_frames"
# The attribute of a transformers Cache where the hooks keep, per layer, the frames of the cached tokens.
_CACHE_FRAMES_ATTR = "_riemannian_rotary_frames"
_HALF = (torch.float16, torch.bfloat16)


class RotaryFrames(NamedTuple):
    r"""The rotary rotations of one attention call, as ``(cos, sin)`` in the ``rotate_half`` layout.

    ``R x = x * cos + rotate_half(x) * sin`` rotates the coordinate pairs
    ``(l, l + d/2)``; the tensors are normalised (``cos^2 + sin^2 = 1``) and
    in float32 at least.

    Attributes
    ----------
    query_cos, query_sin : Tensor, shape [B or 1, n_q, d]
        The frames of the call's queries (its new tokens).
    key_cos, key_sin : Tensor, shape [B or 1, T, d]
        The frames of the ``T`` tokens the layer has seen, oldest first: the
        call's tokens without a cache, the cached and the new ones with one.
    cached : bool
        Whether the call used a KV cache (its keys may be fewer than ``T``, a
        sliding window, or more, a static cache's empty slots).
    """
    query_cos: Tensor
    query_sin: Tensor
    key_cos: Tensor
    key_sin: Tensor
    cached: bool

    def for_keys(self, n_k: int) -> tuple[Tensor, Tensor]:
        """The frames of ``n_k`` keys as a cache returns them: the latest tokens in order, then empty slots."""
        T = self.key_cos.shape[-2]
        if not self.cached and n_k != T:
            raise ValueError(f"without a KV cache the keys must be the call's {T} tokens, got {n_k} keys")
        start = max(0, T - n_k)  # a sliding window returns the latest tokens only
        cos, sin = self.key_cos[..., start:, :], self.key_sin[..., start:, :]
        empty = n_k - (T - start)  # a static cache's slots not written yet (masked): the identity
        if empty > 0:
            shape = (*cos.shape[:-2], empty, cos.shape[-1])
            cos = torch.cat([cos, cos.new_ones(shape)], -2)
            sin = torch.cat([sin, sin.new_zeros(shape)], -2)
        return cos, sin


def _rotate_half(x: Tensor, dim: int = -1) -> Tensor:
    """``[-x2, x1]`` along ``dim`` (the quarter turn of every pair ``(l, l + d/2)``)."""
    x1, x2 = x.chunk(2, dim)
    return torch.cat([-x2, x1], dim)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False, dim: int = -1) -> Tensor:
    """``R x`` (or ``R^T x``) along ``dim`` of ``x`` [B, h, n, d] (``dim=-1``) or factors [B, h, n, d, r]
    (``dim=-2``), with frames [B or 1, n, d]; computed in float32 at least, returned in ``x``'s dtype."""
    dt = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    shape = [cos.shape[0], 1, cos.shape[1], cos.shape[2]] + [1] * (x.dim() - 4)  # [B, 1, n, d(, 1)]
    c, s = cos.to(dt).view(shape), sin.to(dt).view(shape)
    xf = x.to(dt)
    out = xf * c - _rotate_half(xf, dim) * s if inverse else xf * c + _rotate_half(xf, dim) * s
    return out.to(x.dtype)


def _normalised(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotation of a (possibly scaled, ``attention_scaling``) rotary ``(cos, sin)``, in float32 at least."""
    dt = torch.promote_types(cos.dtype, torch.float32)
    c, s = cos.to(dt), sin.to(dt)
    r = torch.sqrt(c * c + s * s)
    return c / r, s / r


class HeadMetric(nn.Module):
    r"""Per-head metric fields of one attention layer: a :class:`~riemannian_ref.geometry.metric.MetricNet` per head.

    Head :math:`h` reads its own states :math:`x \in \mathbb{R}^d` (keys or
    queries), RMS-normalised (:math:`\hat x = x/\sqrt{|x|^2/d}`, so that the
    metric depends on the direction of :math:`x` and ``strength`` has the
    meaning it has in :class:`~riemannian_ref.geometry.metric.MetricNet`
    whatever the scale of the model's states), and gives
    :math:`U^h(x) = W^h \hat x \in \mathbb{R}^{d\times r}` and :math:`\lambda_h`.

    Parameters
    ----------
    n_heads : int
        Heads of the side it reads (key/value heads for ``side="key"``).
    head_dim : int
        Head dimension :math:`d`.
    rank : int
        Metric rank :math:`r \ge 0`.
    side : {"key", "query"}
        Whose states it reads, and so whose metric measures a pair.
    lam_init, lam_min, strength, form, max_gain, gain_bias
        As in :class:`~riemannian_ref.geometry.metric.MetricNet`.
    """

    def __init__(self, n_heads: int, head_dim: int, rank: int, *, side: str = "key", lam_init: float = 1.0,
                 lam_min: float = LAM_MIN, strength: float = 0.01, form: str = "gains", max_gain: float = 4.0,
                 gain_bias: float = -2.0):
        super().__init__()
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        for name, v, low in (("n_heads", n_heads, 1), ("head_dim", head_dim, 1), ("rank", rank, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                what = "a positive int" if low else "an int >= 0"
                raise ValueError(f"HeadMetric: {name} must be {what}, got {v!r}")
        self.side, self.n_heads, self.head_dim, self.rank = side, n_heads, head_dim, rank
        self.form = form
        self.heads = nn.ModuleList(MetricNet(head_dim, 1, head_dim, rank, lam_init=lam_init, lam_min=lam_min,
                                             strength=strength, form=form, max_gain=max_gain,
                                             gain_bias=gain_bias) for _ in range(n_heads))

    def extra_repr(self) -> str:
        return f"side={self.side!r}, n_heads={self.n_heads}, head_dim={self.head_dim}, rank={self.rank}"

    def forward(self, states: Tensor) -> tuple[Tensor, Tensor]:
        """Metric of every head and token.

        Parameters
        ----------
        states : Tensor, shape [B, h, n, d]
            The layer's key states (``side="key"``) or query states.

        Returns
        -------
        lam : Tensor, shape [h]
        U : Tensor, shape [B, h, n, d, r]
        """
        if not isinstance(states, Tensor) or states.dim() != 4 or states.shape[1] != self.n_heads \
                or states.shape[-1] != self.head_dim:
            got = shape_str(states) if isinstance(states, Tensor) else type(states).__name__
            raise ValueError(f"the {self.side} states must have shape [B, {self.n_heads}, n, {self.head_dim}], "
                             f"got {got}")
        # RMS-normalised, so that strength means what it means for MetricNet (unit-variance states)
        # whatever the scale of this model's keys: the metric is a field over directions.
        # (in float32 at least; a zero state, e.g. an empty cache slot, stays zero)
        x = states.to(torch.promote_types(states.dtype, torch.float32))
        x = (x * x.pow(2).mean(-1, keepdim=True).clamp_min(1e-12).rsqrt()).to(states.dtype)  # (B, h, n, d)
        parts = [net(x[:, i]) for i, net in enumerate(self.heads)]  # each (lam [1], U [B, 1, n, d, r])
        lam = torch.cat([p[0] for p in parts])  # (h,)
        U = torch.cat([p[1] for p in parts], dim=1)  # (B, h, n, d, r)
        return lam, U


_REGISTERED: set[str] = set()  # the names under which register() put the backend


def _call_argument(module: nn.Module, args: tuple, kwargs: dict, name: str):
    """The argument ``name`` of a call of ``module.forward``, by keyword or by position."""
    if name in kwargs:
        return kwargs[name]
    if not args:
        return None
    return inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get(name)


def _check_rotary_layout(module: nn.Module, cos: Tensor, sin: Tensor) -> None:
    """``cos``/``sin`` rotate the whole head in the ``rotate_half`` layout (checked once per layer: a host sync)."""
    d = module.head_dim
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[-1] != d:
        raise ValueError(f"the {NAME!r} attention backend needs rotary position_embeddings (cos, sin) of shape "
                         f"[B, n, head_dim={d}] (a rotation of the whole head), got cos {shape_str(cos)} and "
                         f"sin {shape_str(sin)} in {type(module).__name__}; partial rotary embeddings are not "
                         "supported")
    if module.__dict__.get("_riemannian_rotary_checked"):
        return
    m = d // 2
    if d % 2 or not (torch.equal(cos[..., :m], cos[..., m:]) and torch.equal(sin[..., :m], sin[..., m:])):
        raise ValueError(f"the {NAME!r} attention backend needs rotary position_embeddings in the rotate_half "
                         f"layout (coordinate l paired with l + head_dim/2, so cos[..., :{m}] == cos[..., {m}:]); "
                         f"{type(module).__name__} got another layout")
    module.__dict__["_riemannian_rotary_checked"] = True


def _cached_frames(cache, layer_idx, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The frames of every token of ``layer_idx`` in ``cache`` once this call's tokens are added (kept in the cache).

    The count of tokens the layer had seen comes from the cache itself
    (``get_seq_length``), so a ``crop`` drops the frames of the removed
    tokens and a ``reset`` (or a new cache) starts afresh.
    """
    store = cache.__dict__.setdefault(_CACHE_FRAMES_ATTR, {})
    seen = int(cache.get_seq_length(layer_idx))
    prev = store.get(layer_idx) if seen > 0 else None
    if seen > 0:
        kept = 0 if prev is None else prev[0].shape[-2]
        if kept < seen:
            raise ValueError(f"the KV cache holds {seen} tokens of layer {layer_idx} but the rotary frames of only "
                             f"{kept} were recorded: it was filled before attach() or by another model; the "
                             f"{NAME!r} backend needs the rotation of every cached key (start from an empty cache)")
        pc, ps = prev[0][..., :seen, :], prev[1][..., :seen, :]
        if pc.shape[0] != cos.shape[0]:
            if cos.shape[0] == 1:
                cos, sin = cos.expand(pc.shape[0], -1, -1), sin.expand(pc.shape[0], -1, -1)
            elif pc.shape[0] == 1:
                pc, ps = pc.expand(cos.shape[0], -1, -1), ps.expand(cos.shape[0], -1, -1)
            else:
                raise ValueError(f"the KV cache's batch changed from {pc.shape[0]} to {cos.shape[0]} rows between "
                                 f"calls (layer {layer_idx}); the {NAME!r} backend cannot tell which cached rows "
                                 "were kept: start from an empty cache")
        cos, sin = torch.cat([pc, cos], -2), torch.cat([ps, sin], -2)
    store[layer_idx] = (cos, sin)
    return cos, sin


def _rotary_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a rotary attention layer: hand :func:`attention_forward` the rotary frames.

    Reads the ``position_embeddings`` ``(cos, sin)`` of the call; with a KV
    cache (``past_key_values``) records them in the cache, so that the frames
    of the cached keys are known in later calls. The frames are passed (as
    :data:`FRAMES_KWARG`) only when the layer's implementation is this
    backend; the record is kept whatever the implementation.
    """
    pe = _call_argument(module, args, kwargs, "position_embeddings")
    if pe is None:
        return None
    active = getattr(module.config, "_attn_implementation", None) in _REGISTERED
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2 and all(isinstance(t, Tensor) for t in pe)):
        if not active:
            return None
        raise ValueError(f"the {NAME!r} attention backend needs position_embeddings = (cos, sin) in "
                         f"{type(module).__name__}, got {type(pe).__name__}")
    cos, sin = pe
    if active:
        _check_rotary_layout(module, cos, sin)
    elif cos.shape != sin.shape or cos.dim() != 3:
        return None
    cos, sin = _normalised(cos, sin)
    cache = _call_argument(module, args, kwargs, "past_key_values")
    if cache is not None:
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            raise ValueError(f"{type(module).__name__} has no layer_idx: the {NAME!r} backend needs it to keep the "
                             "rotary frames of the cached keys")
        key_cos, key_sin = _cached_frames(cache, layer_idx, cos, sin)
    else:
        key_cos, key_sin = cos, sin
    if not active:
        return None
    return args, {**kwargs, FRAMES_KWARG: RotaryFrames(cos, sin, key_cos, key_sin, cache is not None)}


def _takes_position_embeddings(layer: nn.Module) -> bool:
    try:
        return "position_embeddings" in inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):
        return False


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` and its mask rule with ``transformers`` under ``name``.

    The mask rule is SDPA's (a boolean mask, ``True`` = may attend, or none
    and ``is_causal``), which :func:`attention_forward` takes as it is.
    Registering twice is harmless. :func:`attach` and :func:`from_pretrained`
    call it.

    Parameters
    ----------
    name : str
        The implementation name to select with ``model.set_attn_implementation(name)``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    _REGISTERED.add(name)
    # Without a mask rule of its own, transformers passes a custom backend no mask at all.
    AttentionMaskInterface.register(name, sdpa_mask)


def _attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention layers of a transformers model: modules with ``head_dim``, ``scaling`` and ``config``."""
    return [(name, m) for name, m in model.named_modules()
            if all(hasattr(m, a) for a in ("head_dim", "scaling", "config")) and not isinstance(m, HeadMetric)]


def attach(model: nn.Module, rank: int = 2, *, side: str = "key", lam_init: float = 1.0, lam_min: float = LAM_MIN,
           strength: float = 0.01, form: str = "gains", max_gain: float = 4.0,
           gain_bias: float = -2.0) -> nn.Module:
    r"""Give every attention layer of a ``transformers`` model a :class:`HeadMetric`.

    Then select the backend with ``model.set_attn_implementation("riemannian")``.
    The metric networks are ordinary submodules (they train, move with
    ``.to()`` and are saved by ``save_pretrained``); the settings are recorded
    in ``model.config.riemannian_metric`` for :func:`from_pretrained`. A layer
    whose forward takes ``position_embeddings`` (a rotary model: Llama, Qwen2,
    Mistral, ...) also gets a forward pre-hook that hands the backend the
    rotary frames of its keys and queries (and records those of the cached
    keys in a KV cache), so that the metric is carried with the rotary frame
    and depends on relative positions only (see the module's notes).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Its attention layers are the modules with attributes ``head_dim``,
        ``scaling`` and ``config`` (the layers of every model that uses
        ``AttentionInterface``).
    rank : int
        Metric rank :math:`r \ge 0` (0: distance attention with a learned
        :math:`\lambda` per head).
    side : {"key", "query"}
        Whose states the metric networks read: the key's metric
        :math:`G(k_j)` or the query's :math:`G(q_i)` measures a pair.
    lam_init : float
        Initial :math:`\lambda` of every head (default 1).
    lam_min : float
        Floor of :math:`\lambda`.
    strength : float
        Size of the factors at init (:class:`~riemannian_ref.geometry.metric.MetricNet`):
        0 starts exactly at :math:`G = \lambda I` but leaves the factors
        without gradient (see the module's notes); with ``form="factor"``
        the default 0.01 starts within about ``1e-4`` of it; with
        ``"gains"`` it sets how much the gains differ between keys at init
        (``gain_bias`` sets where they start).
    form : {"gains", "factor"}
        The metric parameterisation (:class:`~riemannian_ref.geometry.metric.MetricNet`):
        orthonormal directions with bounded gains (default; the eigenvalues
        of every metric lie in :math:`[\lambda, \lambda(1 + g_{\max})]`), or the
        unbounded factor of package versions up to 0.3.
    max_gain, gain_bias : float
        ``form="gains"``: the largest gain :math:`g_{\max}` and the gain
        logits' initial bias.

    Returns
    -------
    The same ``model`` (changed in place).

    Notes
    -----
    Models built from one config object share it, and with it the recorded
    settings: build each model you attach to from a config of its own.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model must be a transformers model (an nn.Module with a config), got "
                         f"{type(model).__name__}")
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(f"attach found no attention layer in {type(model).__name__} (modules with attributes "
                         "head_dim, scaling and config, as transformers' attention layers have)")
    register()
    spec = dict(rank=rank, side=side, lam_init=lam_init, lam_min=lam_min, strength=strength, form=form,
                max_gain=max_gain, gain_bias=gain_bias)
    for _, layer in layers:
        if isinstance(getattr(layer, METRIC_ATTR, None), HeadMetric):
            raise ValueError(f"{type(layer).__name__} already has a Riemannian metric: attach once")
        h_q = layer.config.num_attention_heads
        h = h_q // getattr(layer, "num_key_value_groups", 1) if side == "key" else h_q
        ref = next(layer.parameters(), None)
        metric = HeadMetric(h, layer.head_dim, **spec)
        if ref is not None:
            metric.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
        setattr(layer, METRIC_ATTR, metric)
        if _takes_position_embeddings(layer):  # a rotary layer: the metric follows the rotary frame
            layer.register_forward_pre_hook(_rotary_pre_hook, with_kwargs=True)
    setattr(model.config, CONFIG_KEY, spec)
    return model


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    r"""The function ``transformers`` calls in every attention layer (registered by :func:`register`).

    Parameters
    ----------
    module : nn.Module
        The attention layer; it must carry a :class:`HeadMetric` (:func:`attach`).
    query : Tensor, shape [B, h, n_q, d]
    key, value : Tensor, shape [B, h_kv, n_k, d]
        ``h_kv`` divides ``h`` (grouped-query attention).
    attention_mask : Tensor or None
        As ``transformers`` builds it for SDPA: boolean ``[B, 1, n_q, n_k]``
        (``True`` = may attend; padding, causal and sliding-window patterns
        included), or ``None`` with the causal flag. A float (additive) mask
        is also accepted; its entries at or below ``finfo(mask.dtype).min / 2``
        are masked exactly (``-inf``), so a fully masked row gives 0.
    dropout : float
        Attention dropout (the layer passes 0 in evaluation). With dropout,
        float16/bfloat16 inputs are computed in float32 (outside autocast,
        returned in their dtype).
    scaling : float, optional
        :math:`1/\tau`, default :math:`1/\sqrt d`.
    is_causal : bool, optional
        Default: the layer's ``is_causal`` attribute (True if absent); used
        only when there is no mask and more than one query, as with SDPA.
    **kwargs
        ``riemannian_frames``: the :class:`RotaryFrames` of the call, which the
        pre-hook :func:`attach` gives rotary layers passes; then the metric
        network reads the unrotated states and its factors are rotated with
        them (see the module's notes). Without it the states are read as
        given. Ignored otherwise, except those that change the scores
        (``softcap``, ``s_aux``, ``position_bias``) and a paged ``cache``
        (continuous batching), which are refused.

    Returns
    -------
    out : Tensor, shape [B, n_q, h, d]
    weights : None
    """
    metric = getattr(module, METRIC_ATTR, None)
    if not isinstance(metric, HeadMetric):
        raise ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no Riemannian "
                         "metric: call riemannian_ref.integrations.transformers.attach(model) before selecting "
                         f"the {NAME!r} attention implementation")
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"the {NAME!r} attention backend does not implement {name} (the model passed "
                             f"{name}={kwargs[name]!r}); use another attn_implementation for this model")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"query and key must have shape [B, heads, n, d], got query {shape_str(query)}, "
                         f"key {shape_str(key)}")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # As the SDPA backend: the causal flag stands in for a mask only when the model built none
    # and there is more than one query (one new token attends to its whole cache).
    # (Top-left aligned, as SDPA's: with more keys than queries, e.g. an empty static cache at
    # prefill, the keys past n_q are never attended.)
    is_causal = bool(is_causal) and attention_mask is None and query.shape[-2] > 1
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = _additive_mask(attention_mask, query.dtype)
    lam, U = _metric(metric, query, key, kwargs.get(FRAMES_KWARG))  # (h_side,), (B, h_side, n, d, r)
    groups = query.shape[1] // key.shape[1]
    if metric.side == "key" and groups > 1:
        lam = lam.repeat_interleave(groups)  # one lambda per query head, as enable_gqa repeats U_k
    dtype = query.dtype
    if dropout > 0.0 and dtype in _HALF and not torch.is_autocast_enabled(query.device.type):
        # half precision with dropout: computed in float32, as the operator computes it without dropout (the
        # scores cancel terms of size |q|^2, which half precision leaves without a correct digit)
        query, key, value, U = (t.float() for t in (query, key, value, U))
        lam = lam.float()
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.float()
    factors = {"U_k": U} if metric.side == "key" else {"U_q": U}
    out = riemannian_attention(query, key, value, attention_mask, dropout, is_causal, scaling, lam=lam,
                               metric_side=metric.side, enable_gqa=groups > 1, **factors)  # (B, h, n_q, d)
    if out.dtype != dtype and not torch.is_autocast_enabled(query.device.type):
        out = out.to(dtype)
    return out.transpose(1, 2).contiguous(), None  # (B, n_q, h, d), as transformers' backends return


def _additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A float mask in ``dtype``, its "masked" entries (at most half of ``finfo(mask.dtype).min``) set to ``-inf``.

    So a fully masked row (transformers writes ``finfo.min``) gives 0, as a
    boolean mask, instead of overflowing to NaN.
    """
    if not mask.is_floating_point():
        raise ValueError(f"attention_mask must be boolean or floating point, got dtype {mask.dtype}")
    masked = mask <= torch.finfo(mask.dtype).min / 2
    return mask.to(dtype).masked_fill(masked, float("-inf"))


def _metric(metric: HeadMetric, query: Tensor, key: Tensor, frames) -> tuple[Tensor, Tensor]:
    """lambda and the factors of the side the metric reads, carried with the rotary frame when there is one."""
    states = key if metric.side == "key" else query
    if frames is None:
        return metric(states)
    if not isinstance(frames, RotaryFrames):
        raise ValueError(f"{FRAMES_KWARG} must be a RotaryFrames (passed by the hook attach() registers), got "
                         f"{type(frames).__name__}")
    n = states.shape[-2]
    cos, sin = frames.for_keys(n) if metric.side == "key" else (frames.query_cos, frames.query_sin)
    if cos.shape[-2:] != (n, states.shape[-1]) or cos.shape[0] not in (1, states.shape[0]):
        raise ValueError(f"the rotary frames of the {metric.side}s have shape {shape_str(cos)}, expected "
                         f"[{states.shape[0]}, {n}, {states.shape[-1]}] (or batch 1) for {metric.side} states "
                         f"{shape_str(states)}")
    lam, U0 = metric(_rotate(states, cos, sin, inverse=True))  # the factors of the unrotated states
    return lam, _rotate(U0, cos, sin, dim=-2)  # rotated with their states: U_j = R_j U(R_j^T k_j)


def _model_class(model_class, config):
    """A concrete model class: an Auto class resolved through its mapping for ``config``."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is not None:
        try:
            return mapping[type(config)]
        except KeyError:
            raise ValueError(f"{model_class.__name__} has no model for a {type(config).__name__}; pass the "
                             "model class itself as model_class") from None
    return model_class


def from_pretrained(path, model_class=None, **kwargs) -> nn.Module:
    """Load a model saved with ``save_pretrained`` after :func:`attach`, metric networks included.

    The model is built with its metric networks in place (as :func:`attach`
    recorded them in the saved config), so ``transformers`` loads every
    weight, and the ``"riemannian"`` implementation is selected.

    Parameters
    ----------
    path : str or os.PathLike
        What ``from_pretrained`` takes: a directory written by ``save_pretrained``
        (or a hub id).
    model_class : type, optional
        A ``transformers`` model class or Auto class; default
        ``AutoModelForCausalLM``.
    **kwargs
        Passed to ``model_class.from_pretrained`` (``dtype``, ``device_map``, ...).

    Returns
    -------
    transformers.PreTrainedModel
        (with ``output_loading_info=True``, the pair ``(model, loading_info)``).

    An entry saved before ``form``, ``max_gain`` and ``gain_bias`` existed
    (none of the three) describes the unbounded factor form and loads as
    ``form="factor"``.

    Raises
    ------
    ValueError
        Naming the config's path and the key, when the recorded entry is not
        exactly the settings :func:`attach` records (``rank``, ``side``,
        ``lam_init``, ``lam_min``, ``strength``) with values it accepts, or
        when the saved checkpoint lacks weights of the metric networks that
        entry describes (a ``side`` changed on a grouped-query model gives more
        heads). A changed ``rank`` is refused by ``transformers`` (a size
        mismatch). A ``side`` swapped on a model whose key and query heads
        are equally many cannot be told from the weights (same shapes): it
        loads, and the metric reads the other side's states.
    """
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    spec = getattr(config, CONFIG_KEY, None)
    if not isinstance(spec, dict):
        raise ValueError(f"the config at {path} has no {CONFIG_KEY!r} entry: it was not saved after attach(); "
                         "load it with transformers and call attach()")
    _check_spec(spec, path)
    cls = _model_class(model_class or transformers.AutoModelForCausalLM, config)

    def __init__(self, config, *args, **kw):
        cls.__init__(self, config, *args, **kw)
        attach(self, **getattr(config, CONFIG_KEY))

    # A subclass whose constructor attaches the metric networks: transformers then creates,
    # loads (and dispatches) them like the model's own weights.
    switched = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})
    register()
    kwargs.setdefault("attn_implementation", NAME)
    wants_info = kwargs.pop("output_loading_info", False)
    model, info = switched.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
    # metric weights the checkpoint lacks: the recorded spec does not describe the saved metric networks (a
    # side changed on a grouped-query model gives more heads); transformers would initialise them afresh
    missing = sorted(k for k in info.get("missing_keys", ()) if f"{METRIC_ATTR}." in k)
    if missing:
        raise ValueError(f"the {CONFIG_KEY!r} entry of the config at {path} ({spec}) does not match the saved "
                         f"metric networks: {len(missing)} of their weights are missing from the checkpoint, "
                         f"e.g. {missing[0]!r}; restore the entry that attach() recorded")
    return (model, info) if wants_info else model


#: The settings :func:`attach` records in ``model.config``, and what each must be.
_SPEC_FIELDS = ("rank", "side", "lam_init", "lam_min", "strength", "form", "max_gain", "gain_bias")
#: Settings added after the first release, with the values that reproduce models saved before them.
_SPEC_ADDED = {"form": "factor", "max_gain": 4.0, "gain_bias": -2.0}


def _check_spec(spec: dict, path) -> None:
    """The recorded ``riemannian_metric`` entry of a saved config: exactly :func:`attach`'s settings, valid.

    Raises ``ValueError`` naming the config's path and the key. A value read from
    JSON may be an int where attach took a float (``1`` for ``1.0``).
    """
    where = f"the {CONFIG_KEY!r} entry of the config at {path}"
    if not set(_SPEC_ADDED) & set(spec):  # saved before the metric forms existed: the unbounded factor form
        spec.update(_SPEC_ADDED)
    unknown = sorted(set(spec) - set(_SPEC_FIELDS), key=str)
    missing = [k for k in _SPEC_FIELDS if k not in spec]
    if unknown or missing:
        raise ValueError(f"{where} must have exactly the keys {list(_SPEC_FIELDS)} that attach() records; "
                         + (f"unknown: {unknown}" if unknown else "") + ("; " if unknown and missing else "")
                         + (f"missing: {missing}" if missing else ""))

    def number(key, ok, want):
        v = spec[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise ValueError(f"{where}: {key} must be {want}, got {v!r}")

    r = spec["rank"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"{where}: rank must be an int >= 0, got {r!r}")
    if spec["side"] not in SIDES:
        raise ValueError(f"{where}: side must be one of {SIDES}, got {spec['side']!r}")
    number("strength", lambda v: v >= 0, "a finite number >= 0")
    if spec["form"] not in METRIC_FORMS:
        raise ValueError(f"{where}: form must be one of {METRIC_FORMS}, got {spec['form']!r}")
    number("max_gain", lambda v: v > 0, "a finite number > 0")
    number("gain_bias", lambda v: True, "a finite number")
    try:  # lam_init and lam_min by the rule attach() applies
        raw_from_lam(spec["lam_init"], spec["lam_min"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
