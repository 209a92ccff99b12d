r"""The configuration of the Fiber Bundle Transformer, with a preset for every model the book trains.

:class:`FiberBundleConfig` is a frozen, validated dataclass: a bad value raises
``ValueError`` naming the field, the expected range and the value given.
``mode`` chooses the attention scores and the defaults of the fibre-bundle
components (connection, preconditioned FFN, learned positions), each of which
is also a field of its own; ``skip``, ``mlp`` and ``layer_norm`` give the
block variants of Dong, Cordonnier and Loukas (2021). The model itself is
:class:`~riemannian_ref.models.transformer.FiberBundleTransformer`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..geometry.transport import CONNECTIONS
from .._checks import check_bool, check_choice as _choice, check_int as _pos_int, check_number as _number
from ..attention.layer import AttentionConfig
from ..geometry.metric import _F32_MAX, METRIC_FORMS, raw_from_lam
from ..geometry.scores import METRIC_SIDES

__all__ = ["MODES", "FiberBundleConfig"]

#: The accepted values of ``FiberBundleConfig.mode``.
MODES = ("euclidean", "riemannian", "fiber_bundle")
INITS = ("gpt2", "unit")
ACTIVATIONS = ("gelu", "relu")
_MAX_ELEMENTS = 2**63 - 1  # int64: the largest element count torch can describe
_SIZE_FIELDS = ("vocab_size", "n_classes", "block_size", "d_model", "n_heads", "head_dim", "n_layers",
                "mlp_ratio", "metric_rank", "ffn_metric_rank")


@dataclass(frozen=True)
class FiberBundleConfig:
    r"""Configuration of :class:`FiberBundleTransformer` (frozen; validated on construction).

    A bad value raises ``ValueError`` naming the field, the expected range and
    the value given. Sizes are bounded so that every weight's element count
    fits torch's 64-bit sizes: ``max(vocab_size, n_classes, block_size, W) * W
    * max(1, metric_rank, ffn_metric_rank) * (n_layers + 1) < 2**63`` with
    ``W = max(d_model * mlp_ratio, n_heads * head_dim)`` (a vocabulary of 256k,
    a width of 16k and a million positions are far below it). Presets:
    :meth:`tiny`, :meth:`small`, :meth:`attention_stack`, :meth:`grokking`.

    Parameters
    ----------
    vocab_size : int or None, default 64
        Number of token ids; None: no token embedding and no head (the model
        reads embeddings and returns hidden states).
    block_size : int, default 64
        Longest sequence: size of the learned position table and the context
        window of :meth:`FiberBundleTransformer.generate`.
    d_model : int, default 64
        Model width :math:`D`.
    n_heads : int, default 4
        Number of heads :math:`h`.
    head_dim : int or None, default None
        Head dimension :math:`d`; None: ``d_model // n_heads``.
    n_layers : int, default 2
        Number of blocks :math:`L`.
    mode : {"euclidean", "riemannian", "fiber_bundle"}, default "fiber_bundle"
        Dot-product or metric scores, and the defaults of ``connection``,
        ``precondition_ffn`` and ``learned_positions`` (module docstring).
    metric_side : {"key", "query", "mean"}, default "key"
        Whose metric measures a query-key pair (metric modes).
    metric_rank : int, default 2
        Rank :math:`r \ge 0` of every attention metric; 0 gives :math:`G = \lambda I`.
    metric_strength : float, default 1.0
        Heterogeneity of the metrics at init (0: :math:`U = 0` at init).
    shared_metric : bool, default False
        One learned metric per head and layer instead of per-token metrics.
    position_metric : bool, default False
        A metric field over positions: one learned metric per position, head
        and layer (``block_size`` positions), whatever the token there, instead
        of metrics computed from the states.
    metric_bias : bool, default False
        Per-token metrics from an affine network :math:`U_i = W x_i + b`
        (a bias drawn at init with the variance of a shared factor).
    metric_form : {"gains", "factor"}, default "gains"
        The metric parameterisation (:class:`~riemannian_ref.geometry.metric.MetricNet`
        ``form``): bounded directions and gains, or the unbounded factor of
        package versions up to 0.3.
    max_gain, gain_bias : float, default 4.0 and -2.0
        ``metric_form="gains"``: the largest gain and the gain logits' initial bias.
    metric_subspace : int or None, default None
        Per-token metrics whose factors share one learned subspace of
        dimension :math:`m` per head and layer, :math:`U_i = B\,C_i`
        (:class:`~riemannian_ref.geometry.metric.SubspaceFactors`): with the
        trivial connection attention is then one dot product of width
        :math:`d + m(m+1)/2 + 1` and runs on SDPA. :math:`1 \le m \le d`;
        needs a metric mode with per-token metrics (not ``shared_metric`` or
        ``position_metric``) and ``metric_rank >= 1``.
    lam_init : float, default 1.0
        Initial :math:`\lambda` of every metric, above the floor
        :data:`~riemannian_ref.geometry.metric.LAM_MIN`.
    learn_temperature : bool, default False
        A learned per-head factor on :math:`1/\tau`.
    connection : {"trivial", "flat", "content", "content_source", "cumulative"} or None, default None
        Transport of keys and values (:mod:`~riemannian_ref.geometry.transport`;
        ``"cumulative"`` is the flat content-dependent connection, :math:`O(n d)` extra);
        None: ``"content"`` (inverse-consistent) in ``"fiber_bundle"``
        mode, ``"trivial"`` otherwise.
    transport_values : bool, default True
        Transport the values along the connection too.
    rotary_base : float, default 10000.0
        Base of the rotary rates of the flat, content and cumulative connections.
    content_rate_std : float, default 0.5
        Init std of the content modulation of the rates (0: starts flat).
    precondition_ffn : bool or None, default None
        :math:`x + \eta G_x^{-1}\mathrm{FFN}(\mathrm{LN}(x))`; None: True in
        ``"fiber_bundle"`` mode, False otherwise.
    ffn_metric_rank : int, default 2
        Rank of the model-space metric :math:`G_x` of the preconditioned FFN.
    eta_init : float, default 1.0
        Initial step :math:`\eta` of the preconditioned FFN (learned per block).
    learned_positions : bool or None, default None
        Learned absolute position embeddings; None: unless the connection is
        not ``"trivial"`` (a connection carries position itself).
    skip : bool, default True
        Residual connections around the attention and the FFN.
    mlp : bool, default True
        A feed-forward network in every block.
    layer_norm : bool, default True
        Pre-norm LayerNorms in the blocks (the head always reads a
        LayerNorm of the last state).
    causal : bool, default True
        Causal self-attention (a language model); False: bidirectional.
    mlp_ratio : int, default 4
        FFN hidden width = ``mlp_ratio * d_model``.
    activation : {"gelu", "relu"}, default "gelu"
        FFN nonlinearity.
    bias : bool, default False
        Biases in the value/output projections, the FFN and the LayerNorms.
    dropout : float, default 0.0
        Dropout on embeddings, attention weights and residual branches.
    tie_weights : bool, default True
        The LM head shares the token embedding matrix.
    n_classes : int or None, default None
        Outputs per position; None: ``vocab_size`` (a language model).
    init : {"gpt2", "unit"}, default "gpt2"
        ``"gpt2"``: weights :math:`N(0, 0.02^2)`, residual output projections
        divided by :math:`\sqrt{2L}`. ``"unit"``: variance-preserving
        :math:`N(0, 1/\text{fan-in})` (He for a ReLU layer), token embeddings
        :math:`N(0, 1)`, positions :math:`N(0, 0.1^2)`; residual output
        projections divided by :math:`\sqrt{2L}` only when ``skip``.
    scale_residual : bool, default True
        Whether the division by :math:`\sqrt{2L}` above happens at all.
        False keeps every branch variance-preserving, as in the stacks of
        Dong et al. (:meth:`attention_stack`), where it decides how fast
        skip connections let the residual decay.
    qk_init : {"normal", "orthonormal"}, default "normal"
        Per-head query/key frames ``[h, D, d]`` Gaussian, or with orthonormal
        columns (for :class:`~riemannian_ref.optim.adam.StiefelAdam`).
    qk_gain : float, default 1.0
        Multiplies the query/key frames at init.
    """

    vocab_size: int | None = 64          # token ids (None: embeddings in, hidden states out)
    block_size: int = 64                 # longest sequence (context length)
    d_model: int = 64                    # model width D
    n_heads: int = 4                     # heads h
    head_dim: int | None = None          # d (None: D / h)
    n_layers: int = 2                    # blocks L
    mode: str = "fiber_bundle"           # "euclidean" | "riemannian" | "fiber_bundle"
    metric_side: str = "key"             # whose metric measures a pair: "key" | "query" | "mean"
    metric_rank: int = 2                 # r of each head metric G = lam I + U U^T (0: G = lam I)
    metric_strength: float = 1.0         # heterogeneity of the metrics at init
    shared_metric: bool = False          # one learned metric per head instead of per-token metrics
    position_metric: bool = False        # one learned metric per position instead of per-token metrics
    metric_bias: bool = False            # per-token metrics from an affine network U_i = W x_i + b
    metric_subspace: int | None = None   # per-token factors U_i = B C_i in one learned m-dim subspace per head
    metric_form: str = "gains"           # "gains" (bounded directions and gains) or "factor" (lam I + U U^T)
    max_gain: float = 4.0                # metric_form="gains": eigenvalues of G in [lam, lam (1 + max_gain)]
    gain_bias: float = -2.0              # metric_form="gains": initial bias of the gain logits
    lam_init: float = 1.0                # initial isotropic part lam of every metric
    learn_temperature: bool = False      # learned per-head factor on 1/tau
    connection: str | None = None        # None: "content" in fiber_bundle mode, else "trivial"
    transport_values: bool = True        # values transported along the connection too
    rotary_base: float = 10000.0         # rates theta_m = base^(-2m/d) of the flat and content connections
    content_rate_std: float = 0.5        # init std of the content modulation (0: starts flat)
    precondition_ffn: bool | None = None  # None: True in fiber_bundle mode
    ffn_metric_rank: int = 2             # rank of the model-space metric G_x of the preconditioned FFN
    eta_init: float = 1.0                # initial step size eta of the preconditioned FFN
    learned_positions: bool | None = None  # None: unless a flat/content connection carries position
    skip: bool = True                    # residual connections
    mlp: bool = True                     # a feed-forward network per block
    layer_norm: bool = True              # pre-norm LayerNorms
    causal: bool = True                  # causal self-attention
    mlp_ratio: int = 4                   # FFN hidden width = mlp_ratio * D
    activation: str = "gelu"             # "gelu" | "relu"
    bias: bool = False                   # biases in linear layers and LayerNorms
    dropout: float = 0.0                 # dropout on embeddings, attention weights and residual branches
    tie_weights: bool = True             # LM head shares the token embedding matrix
    n_classes: int | None = None         # outputs per position (None: vocab_size)
    init: str = "gpt2"                   # "gpt2" | "unit"
    scale_residual: bool = True          # residual branches' output projections / sqrt(2L) at init
    qk_init: str = "normal"              # "normal" | "orthonormal" per-head frames
    qk_gain: float = 1.0                 # multiplies the query/key frames at init

    def __post_init__(self):
        if self.vocab_size is not None:
            _pos_int(self.vocab_size, "vocab_size")
        for name in ("block_size", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            _pos_int(getattr(self, name), name)
        for name in ("metric_rank", "ffn_metric_rank"):
            _pos_int(getattr(self, name), name, 0)
        if self.head_dim is not None:
            _pos_int(self.head_dim, "head_dim")
        elif self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads (or give head_dim), got "
                             f"d_model={self.d_model}, n_heads={self.n_heads}")
        _choice(self.mode, "mode", MODES)
        _choice(self.metric_side, "metric_side", METRIC_SIDES)
        _choice(self.metric_form, "metric_form", METRIC_FORMS)
        _number(self.max_gain, "max_gain", low=0.0, low_open=True, high=_F32_MAX)
        _number(self.gain_bias, "gain_bias", low=-_F32_MAX, high=_F32_MAX)
        if self.connection is not None:
            _choice(self.connection, "connection", CONNECTIONS)
        _choice(self.init, "init", INITS)
        _choice(self.activation, "activation", ACTIVATIONS)
        for name in ("shared_metric", "position_metric", "metric_bias", "learn_temperature", "transport_values",
                     "skip", "mlp", "layer_norm", "causal", "bias", "tie_weights", "scale_residual"):
            check_bool(getattr(self, name), name)
        for name in ("precondition_ffn", "learned_positions"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        raw_from_lam(self.lam_init)
        if self.shared_metric and self.position_metric:
            raise ValueError("shared_metric and position_metric are exclusive: one metric per head, or one "
                             "per position")
        if self.metric_subspace is not None:
            _pos_int(self.metric_subspace, "metric_subspace", 1, self.qk_dim)
            if self.mode == "euclidean" or self.shared_metric or self.position_metric or self.metric_rank == 0:
                raise ValueError(f"metric_subspace needs per-token metrics of rank >= 1 (a metric mode, "
                                 f"shared_metric=False, position_metric=False, metric_rank >= 1), got "
                                 f"mode={self.mode!r}, shared_metric={self.shared_metric}, "
                                 f"position_metric={self.position_metric}, metric_rank={self.metric_rank}")
        _number(self.eta_init, "eta_init", low=-_F32_MAX, high=_F32_MAX)  # a float32 parameter
        # the fields handed to AttentionConfig under other names are checked here, under their own
        _number(self.metric_strength, "metric_strength", low=0.0)
        _number(self.rotary_base, "rotary_base", low=1.0, low_open=True)
        _number(self.content_rate_std, "content_rate_std", low=0.0)
        _number(self.dropout, "dropout", low=0.0, high=1.0, high_open=True)
        _number(self.qk_gain, "qk_gain", low=0.0, low_open=True)
        if self.n_classes is not None:
            _pos_int(self.n_classes, "n_classes")
            if self.tie_weights:
                raise ValueError("n_classes needs tie_weights=False (the head is not the embedding)")
        if self.vocab_size is None and self.n_classes is not None:
            raise ValueError("n_classes needs a vocab_size (the model reads token ids)")
        self._check_sizes()
        if self.precondition_ffn_resolved and not self.mlp:
            raise ValueError("precondition_ffn needs mlp=True (it preconditions the FFN update)")
        self.attention_config(0)  # validates the attention fields (raises naming the field)

    def _check_sizes(self) -> None:
        # A conservative bound on every weight's element count (rows x width x rank), times the layers:
        # the model's tensors must be describable by int64 sizes (torch's limit), checked before any
        # arithmetic of the model overflows. Real models are far below it (vocab 256k, width 64k, rank 64,
        # 1M positions, 1000 layers: about 2**57).
        width = max(self.d_model * self.mlp_ratio, self.n_heads * self.qk_dim)
        rows = max(self.vocab_size or 0, self.n_classes or 0, self.block_size, width)
        rank = max(1, self.metric_rank, self.ffn_metric_rank)
        if rows * width * rank * (self.n_layers + 1) > _MAX_ELEMENTS:
            sizes = {k: getattr(self, k) for k in _SIZE_FIELDS if getattr(self, k) is not None}
            worst = max(sizes, key=sizes.get)
            raise ValueError(f"{worst} = {sizes[worst]} is too large: this config's weights would exceed "
                             f"2**63 - 1 elements, the most torch can address (bound: max(vocab_size, n_classes, "
                             f"block_size, width) * width * max(1, metric_rank, ffn_metric_rank) * (n_layers + 1), "
                             f"width = max(d_model * mlp_ratio, n_heads * head_dim))")

    # ------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, **overrides) -> "FiberBundleConfig":
        """Two layers, width 32, two heads, metrics of rank 2: tests and live cells of the book.

        Parameters
        ----------
        **overrides
            Fields to change, e.g. ``mode="euclidean"``.
        """
        return cls(**{**dict(vocab_size=16, block_size=32, d_model=32, n_heads=2, n_layers=2), **overrides})

    @classmethod
    def small(cls, **overrides) -> "FiberBundleConfig":
        """Four layers, width 64, four heads, metrics of rank 4: the book's experiment scripts.

        Parameters
        ----------
        **overrides
            Any field of the config.
        """
        base = dict(vocab_size=64, block_size=128, d_model=64, n_heads=4, n_layers=4, metric_rank=4,
                    ffn_metric_rank=4)
        return cls(**{**base, **overrides})

    @classmethod
    def attention_stack(cls, **overrides) -> "FiberBundleConfig":
        """A pure self-attention network (Dong, Cordonnier and Loukas 2021): no skip, no FFN, no norm.

        Bidirectional, no positions, no token embedding (``vocab_size=None``:
        feed it embeddings), variance-preserving init, ReLU FFNs with biases
        where ``mlp=True`` is switched back on. ``skip``, ``mlp`` and
        ``layer_norm`` give Dong et al.'s variants.

        Parameters
        ----------
        **overrides
            Fields to change (e.g. ``n_layers=24``, ``mode="riemannian"``).
        """
        base = dict(vocab_size=None, block_size=1024, d_model=64, n_heads=2, n_layers=24, mode="euclidean",
                    metric_rank=4, skip=False, mlp=False, layer_norm=False, causal=False,
                    learned_positions=False, activation="relu", bias=True, tie_weights=False, init="unit",
                    scale_residual=False,
                    precondition_ffn=False)
        return cls(**{**base, **overrides})

    @classmethod
    def grokking(cls, vocab_size: int, **overrides) -> "FiberBundleConfig":
        """The optimiser chapter's model: one Euclidean layer with orthonormal query/key frames.

        Pre-norm, learned positions, GELU FFN, biases, an untied head,
        unit-variance init (as Power et al.'s grokking setting), three tokens
        of context (``a op b =`` without the operator token).

        Parameters
        ----------
        vocab_size : int
            Number of token ids.
        **overrides
            Fields to change.
        """
        base = dict(vocab_size=vocab_size, block_size=3, d_model=32, n_heads=4, n_layers=1, mode="euclidean",
                    bias=True, tie_weights=False, init="unit", qk_init="orthonormal")
        return cls(**{**base, **overrides})

    def replace(self, **changes) -> "FiberBundleConfig":
        """A copy with some fields changed (validated again).

        Parameters
        ----------
        **changes
            Fields to change.
        """
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ derived
    @property
    def qk_dim(self) -> int:
        """Head dimension :math:`d`."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def connection_resolved(self) -> str:
        """The connection in use (``connection`` or the mode's default)."""
        if self.connection is not None:
            return self.connection
        return "content" if self.mode == "fiber_bundle" else "trivial"

    @property
    def precondition_ffn_resolved(self) -> bool:
        """Whether the FFN update is preconditioned (``precondition_ffn`` or the mode's default)."""
        if self.precondition_ffn is not None:
            return self.precondition_ffn
        return self.mode == "fiber_bundle"

    @property
    def uses_learned_positions(self) -> bool:
        """Whether the model adds learned absolute positions (``learned_positions`` or the default)."""
        if self.learned_positions is not None:
            return self.learned_positions
        return self.connection_resolved == "trivial"

    @property
    def scales_residual(self) -> bool:
        r"""Whether residual-branch output projections are divided by :math:`\sqrt{2L}` at init."""
        return self.scale_residual and (self.init == "gpt2" or self.skip)

    @property
    def out_dim(self) -> int | None:
        """Outputs per position of the head (None: no head)."""
        return self.n_classes if self.n_classes is not None else self.vocab_size

    def attention_config(self, layer: int) -> AttentionConfig:
        """The :class:`~riemannian_ref.attention.layer.AttentionConfig` of every block's attention.

        Parameters
        ----------
        layer : int
            Block index (all blocks share one configuration today).

        Returns
        -------
        AttentionConfig
        """
        gpt2 = self.init == "gpt2"
        residual = 1.0 / math.sqrt(2 * self.n_layers) if self.scales_residual else 1.0
        return AttentionConfig(
            d_model=self.d_model, n_heads=self.n_heads, head_dim=self.head_dim,
            scores="dot" if self.mode == "euclidean" else "metric",
            metric="shared" if self.shared_metric else "position" if self.position_metric else "token",
            metric_side=self.metric_side, metric_bias=self.metric_bias, max_positions=self.block_size,
            subspace=self.metric_subspace, metric_form=self.metric_form, max_gain=self.max_gain,
            gain_bias=self.gain_bias,
            rank=self.metric_rank, strength=self.metric_strength, lam_init=self.lam_init,
            learn_temperature=self.learn_temperature, connection=self.connection_resolved,
            rotary_base=self.rotary_base, content_rate_std=self.content_rate_std,
            transport_values=self.transport_values, causal=self.causal, bias=self.bias, dropout=self.dropout,
            init_std=0.02 if gpt2 else None,
            out_init_std=(0.02 if gpt2 else (self.n_heads * self.qk_dim) ** -0.5) * residual,
            qk_init=self.qk_init, qk_gain=self.qk_gain)
