r"""Riemannian attention as an attention backend of Hugging Face ``transformers`` (5.x).

Switch a model you already have (any model whose attention layers call
``transformers``' ``AttentionInterface``; Llama, Qwen2 and GPT-2 are tested) to
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
(:func:`~riemannian_ref.geometry.metric.lam_from_raw`). The registered
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
zero-initialised metric never trains. :func:`attach` therefore starts the
factors small, not zero: ``strength=0.01`` by default, a relative change of
about ``strength**2 = 1e-4`` in the scores, which Adam's normalised steps
leave within a few steps.

Saving. The metric networks are submodules of the attention layers, so
``save_pretrained`` writes them with the model and :func:`attach` records its
settings in ``model.config`` (key ``"riemannian_metric"``); :func:`from_pretrained`
builds the model with the metric networks in place, so that ``transformers``
loads them like any other weight.

Generation. A key's metric depends on that key only, so with a KV cache the
cached keys give the same metric as in a full forward, and ``generate`` with
and without a cache agree (``tests/test_transformers_integration.py``).

Limits. ``output_attentions=True`` returns ``None`` weights (as ``"sdpa"``
does); scores that other backends modify (``softcap``, attention sinks
``s_aux``, a ``position_bias``) and the paged cache of continuous batching
are refused with a ``ValueError``.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import shape_str
from ..attention.functional import riemannian_attention
from ..geometry.metric import LAM_MIN, MetricNet

try:
    import transformers
except ImportError as exc:
    raise ImportError("riemannian_ref.integrations.transformers needs transformers 5.x: "
                      "pip install 'riemannian_ref[transformers]'") from exc

__all__ = ["NAME", "CONFIG_KEY", "HeadMetric", "attach", "attention_forward", "from_pretrained", "register"]

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
    lam_init, lam_min, strength
        As in :class:`~riemannian_ref.geometry.metric.MetricNet`.
    """

    def __init__(self, n_heads: int, head_dim: int, rank: int, *, side: str = "key", lam_init: float = 1.0,
                 lam_min: float = LAM_MIN, strength: float = 0.01):
        super().__init__()
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
        self.side, self.n_heads, self.head_dim, self.rank = side, n_heads, head_dim, rank
        self.heads = nn.ModuleList(MetricNet(head_dim, 1, head_dim, rank, lam_init=lam_init, lam_min=lam_min,
                                             strength=strength) for _ in range(n_heads))

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
    # Without a mask rule of its own, transformers passes a custom backend no mask at all.
    AttentionMaskInterface.register(name, sdpa_mask)


def _attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention layers of a transformers model: modules with ``head_dim``, ``scaling`` and ``config``."""
    return [(name, m) for name, m in model.named_modules()
            if all(hasattr(m, a) for a in ("head_dim", "scaling", "config")) and not isinstance(m, HeadMetric)]


def attach(model: nn.Module, rank: int = 2, *, side: str = "key", lam_init: float = 1.0, lam_min: float = LAM_MIN,
           strength: float = 0.01) -> nn.Module:
    r"""Give every attention layer of a ``transformers`` model a :class:`HeadMetric`.

    Then select the backend with ``model.set_attn_implementation("riemannian")``.
    The metric networks are ordinary submodules (they train, move with
    ``.to()`` and are saved by ``save_pretrained``); the settings are recorded
    in ``model.config.riemannian_metric`` for :func:`from_pretrained`.

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
        without gradient (see the module's notes); the default 0.01 starts
        within about ``1e-4`` of it.

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
    spec = dict(rank=rank, side=side, lam_init=lam_init, lam_min=lam_min, strength=strength)
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
        is also accepted.
    dropout : float
        Attention dropout (the layer passes 0 in evaluation).
    scaling : float, optional
        :math:`1/\tau`, default :math:`1/\sqrt d`.
    is_causal : bool, optional
        Default: the layer's ``is_causal`` attribute (True if absent); used
        only when there is no mask and more than one query, as with SDPA.
    **kwargs
        Ignored, except those that change the scores (``softcap``, ``s_aux``,
        ``position_bias``) and a paged ``cache`` (continuous batching), which
        are refused.

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
        attention_mask = attention_mask.to(query.dtype)
    lam, U = metric(key if metric.side == "key" else query)  # (h_side,), (B, h_side, n, d, r)
    groups = query.shape[1] // key.shape[1]
    if metric.side == "key" and groups > 1:
        lam = lam.repeat_interleave(groups)  # one lambda per query head, as enable_gqa repeats U_k
    factors = {"U_k": U} if metric.side == "key" else {"U_q": U}
    out = riemannian_attention(query, key, value, attention_mask, dropout, is_causal, scaling, lam=lam,
                               metric_side=metric.side, enable_gqa=groups > 1, **factors)  # (B, h, n_q, d)
    return out.transpose(1, 2).contiguous(), None  # (B, n_q, h, d), as transformers' backends return


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
    """
    config = kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
    spec = getattr(config, CONFIG_KEY, None)
    if not isinstance(spec, dict):
        raise ValueError(f"the config at {path} has no {CONFIG_KEY!r} entry: it was not saved after attach(); "
                         "load it with transformers and call attach()")
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
    return switched.from_pretrained(path, config=config, **kwargs)
