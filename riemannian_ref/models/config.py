r"""The configuration of the Fiber Bundle Transformer, with a preset for every model the book trains.

:class:`FiberBundleConfig` is a frozen, validated dataclass: a bad value raises
``ValueError`` naming the field, the expected range and the value given. It
holds the model's own fields and one
:class:`~riemannian_ref.attention.layer.AttentionConfig`, ``attention``, with
every option of the attention. ``mode`` chooses the attention scores and the
defaults of the fibre-bundle components (connection, preconditioned FFN,
learned positions), each of which is also a field of its own; ``skip``,
``mlp`` and ``layer_norm`` give the block variants of Dong, Cordonnier and
Loukas (2021). The model itself is
:class:`~riemannian_ref.models.transformer.FiberBundleTransformer`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .._checks import F32_MAX, check_bool, check_choice, check_int, check_number
from ..attention.layer import AttentionConfig


__all__ = ["MODES", "FiberBundleConfig"]

#: The accepted values of ``FiberBundleConfig.mode``.
MODES = ("euclidean", "riemannian", "fiber_bundle")
INITS = ("gpt2", "unit")
ACTIVATIONS = ("gelu", "relu")
_MAX_ELEMENTS = 2**63 - 1  # int64: the largest element count torch can describe
_SIZE_FIELDS = ("vocab_size", "n_classes", "block_size", "d_model", "n_heads", "head_dim", "n_layers",
                "mlp_ratio", "ffn_metric_rank")
#: The AttentionConfig fields the model sets from its own, with where to set them instead.
_MODEL_OWNED = {
    "d_model": "the model's width: set FiberBundleConfig.d_model",
    "n_heads": "the model's number of heads: set FiberBundleConfig.n_heads",
    "head_dim": "the model's head dimension: set FiberBundleConfig.head_dim",
    "max_positions": "the model's context: set FiberBundleConfig.block_size",
    "scores": "set by the mode: set FiberBundleConfig.mode",
    "causal": "the model's: set FiberBundleConfig.causal",
    "bias": "the model's: set FiberBundleConfig.bias",
    "dropout": "the model's: set FiberBundleConfig.dropout",
    "init_std": "set by the init scheme: set FiberBundleConfig.init",
    "out_init_std": "set by the init scheme: set FiberBundleConfig.init and scale_residual",
    "v_head_dim": "not an option of the model (its values have head_dim)",
    "kv_dim": "not an option of the model (self-attention over its own states)",
    "cross_attention": "not an option of the model (self-attention)",
}
_ATTENTION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionConfig)}
#: The attention options: the AttentionConfig fields a FiberBundleConfig takes in ``attention``.
ATTENTION_OPTIONS = tuple(k for k in _ATTENTION_DEFAULTS if k not in _MODEL_OWNED)
#: The flat fields of FiberBundleConfig up to model-file format 3 that moved into ``attention``, with their
#: names there (``shared_metric=True`` and ``position_metric=True`` became ``metric="shared"``/``"position"``).
MOVED_FIELDS = {
    "metric_rank": "rank", "metric_strength": "strength", "metric_subspace": "subspace",
    "shared_metric": "metric", "position_metric": "metric",
    **{k: k for k in ("metric_side", "metric_bias", "metric_form", "max_gain", "gain_bias", "lam_init",
                      "learn_temperature", "connection", "transport_values", "rotary_base", "content_rate_std",
                      "qk_init", "qk_gain")},
}


def _moved_options(flat: Mapping) -> dict:
    """The attention options that old flat fields (keys of :data:`MOVED_FIELDS`) give, under their new names."""
    out = {}
    for old, v in flat.items():
        new = MOVED_FIELDS[old]
        if new != "metric":
            out[new] = v
        elif v is True:  # shared_metric / position_metric
            if "metric" in out:
                raise ValueError("shared_metric and position_metric are exclusive: one metric per head, or one "
                                 "per position")
            out["metric"] = old.split("_")[0]
        elif v is not False:
            raise ValueError(f"{old} must be a bool, got {v!r}")
    return out


def attention_fields(att, owned: Mapping, where: Mapping[str, str]) -> dict:
    """The fields an ``attention`` argument gives (an AttentionConfig or a mapping of its fields), checked.

    ``owned``: the fields its owner sets; one given with a value other than
    its default and the owner's raises ``ValueError`` saying ``where[field]``.
    """
    if isinstance(att, AttentionConfig):
        given = {k: getattr(att, k) for k in _ATTENTION_DEFAULTS}
    elif isinstance(att, Mapping):
        given = dict(att)
        unknown = sorted(set(given) - set(_ATTENTION_DEFAULTS), key=str)
        if unknown:
            moved = "".join(f"; {k} is now {MOVED_FIELDS[k]}" for k in unknown if k in MOVED_FIELDS)
            raise ValueError(f"attention has unknown fields {unknown} (fields of AttentionConfig expected{moved})")
    else:
        raise ValueError(f"attention must be an AttentionConfig or a mapping of its fields, got {type(att).__name__}")
    for k, v in owned.items():
        if k in given and given[k] != _ATTENTION_DEFAULTS[k] and given[k] != v:
            raise ValueError(f"attention.{k} is {where[k]} (got {given[k]!r})")
    return given


def owned_attention(given: Mapping, owned: Mapping) -> AttentionConfig:
    """The AttentionConfig of the ``given`` options and the ``owned`` fields (errors prefixed ``attention:``)."""
    try:
        return AttentionConfig(**{**given, **owned})
    except ValueError as exc:
        raise ValueError(f"attention: {exc}") from None


def nest_flat(flat: Mapping) -> dict:
    """The fields of a flat config (model files of format <= 3) nested: the moved ones as ``attention``."""
    own = {k: v for k, v in flat.items() if k not in MOVED_FIELDS}
    return {**own, "attention": _moved_options({k: v for k, v in flat.items() if k in MOVED_FIELDS})}


def _refuse_moved(changes: Mapping) -> None:
    """Old flat names in a preset's or replace's arguments: say where they moved."""
    for old in changes:
        if old in MOVED_FIELDS:
            new = _moved_options({old: changes[old]}) or {"metric": "token"}
            use = ", ".join(f"{k}={v!r}" for k, v in new.items())
            raise ValueError(f"{old} moved to attention: use attention=dict({use})")


@dataclass(frozen=True)
class FiberBundleConfig:
    r"""Configuration of :class:`FiberBundleTransformer` (frozen; validated on construction).

    A bad value raises ``ValueError`` naming the field, the expected range and
    the value given. Sizes are bounded so that every weight's element count
    fits torch's 64-bit sizes: ``max(vocab_size, n_classes, block_size, W) * W
    * max(1, rank, ffn_metric_rank) * (n_layers + 1) < 2**63`` with
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
        Dot-product or metric scores, and the defaults of the connection,
        ``precondition_ffn`` and ``learned_positions`` (module docstring).
    attention : AttentionConfig or mapping, default {}
        Every option of the attention of every block: the fields of
        :class:`~riemannian_ref.AttentionConfig` (``rank``,
        ``metric``, ``metric_side``, ``connection``, ...); a mapping gives
        some and leaves the others at their defaults. Stored as the
        AttentionConfig every block gets: the fields the model owns
        (``d_model``, ``n_heads``, ``head_dim``, ``max_positions`` =
        ``block_size``, ``causal``, ``bias``, ``dropout``, ``scores`` from the
        mode, ``init_std`` and ``out_init_std`` from ``init``) come from the
        model (given with another value: ``ValueError``), and ``connection``
        None becomes ``"content"`` in ``"fiber_bundle"`` mode, ``"trivial"``
        otherwise. ``lam_init`` and ``strength`` also initialise the
        preconditioned FFN's metric.
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
    """

    vocab_size: int | None = 64          # token ids (None: embeddings in, hidden states out)
    block_size: int = 64                 # longest sequence (context length)
    d_model: int = 64                    # model width D
    n_heads: int = 4                     # heads h
    head_dim: int | None = None          # d (None: D / h)
    n_layers: int = 2                    # blocks L
    mode: str = "fiber_bundle"           # "euclidean" | "riemannian" | "fiber_bundle"
    attention: AttentionConfig | Mapping = field(default_factory=dict)  # every attention option
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

    def __post_init__(self):
        if self.vocab_size is not None:
            check_int(self.vocab_size, "vocab_size")
        for name in ("block_size", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            check_int(getattr(self, name), name)
        check_int(self.ffn_metric_rank, "ffn_metric_rank", 0)
        if self.head_dim is not None:
            check_int(self.head_dim, "head_dim")
        elif self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads (or give head_dim), got "
                             f"d_model={self.d_model}, n_heads={self.n_heads}")
        check_choice(self.mode, "mode", MODES)
        check_choice(self.init, "init", INITS)
        check_choice(self.activation, "activation", ACTIVATIONS)
        for name in ("skip", "mlp", "layer_norm", "causal", "bias", "tie_weights", "scale_residual"):
            check_bool(getattr(self, name), name)
        for name in ("precondition_ffn", "learned_positions"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        check_number(self.eta_init, "eta_init", low=-F32_MAX, high=F32_MAX)  # a float32 parameter
        check_number(self.dropout, "dropout", low=0.0, high=1.0, high_open=True)
        if self.n_classes is not None:
            check_int(self.n_classes, "n_classes")
            if self.tie_weights:
                raise ValueError("n_classes needs tie_weights=False (the head is not the embedding)")
        if self.vocab_size is None and self.n_classes is not None:
            raise ValueError("n_classes needs a vocab_size (the model reads token ids)")
        object.__setattr__(self, "attention", self._attention_config())
        self._check_sizes()
        if self.precondition_ffn_resolved and not self.mlp:
            raise ValueError("precondition_ffn needs mlp=True (it preconditions the FFN update)")

    def _attention_config(self) -> AttentionConfig:
        """``attention`` as the AttentionConfig of every block (model-owned fields filled and checked)."""
        gpt2 = self.init == "gpt2"
        residual = 1.0 / math.sqrt(2 * self.n_layers) if self.scales_residual else 1.0
        owned = dict(d_model=self.d_model, n_heads=self.n_heads, head_dim=self.head_dim, v_head_dim=None,
                     kv_dim=None, cross_attention=False, max_positions=self.block_size,
                     scores="dot" if self.mode == "euclidean" else "metric", causal=self.causal, bias=self.bias,
                     dropout=self.dropout, init_std=0.02 if gpt2 else None,
                     out_init_std=(0.02 if gpt2 else (self.n_heads * self.qk_dim) ** -0.5) * residual)
        given = attention_fields(self.attention, owned, _MODEL_OWNED)
        # a connection left to the mode stays so through replace(mode=...): remembered, not a field
        object.__setattr__(self, "_mode_connection", given.get("connection") is None)
        if given.get("connection") is None:
            given["connection"] = "content" if self.mode == "fiber_bundle" else "trivial"
        return owned_attention(given, owned)

    def _check_sizes(self) -> None:
        # A conservative bound on every weight's element count (rows x width x rank), times the layers:
        # the model's tensors must be describable by int64 sizes (torch's limit), checked before any
        # arithmetic of the model overflows. Real models are far below it (vocab 256k, width 64k, rank 64,
        # 1M positions, 1000 layers: about 2**57).
        width = max(self.d_model * self.mlp_ratio, self.n_heads * self.qk_dim)
        rows = max(self.vocab_size or 0, self.n_classes or 0, self.block_size, width)
        rank = max(1, self.attention.rank, self.ffn_metric_rank)
        if rows * width * rank * (self.n_layers + 1) > _MAX_ELEMENTS:
            sizes = {k: getattr(self, k) for k in _SIZE_FIELDS if getattr(self, k) is not None}
            sizes["attention.rank"] = self.attention.rank
            worst = max(sizes, key=sizes.get)
            raise ValueError(f"{worst} = {sizes[worst]} is too large: this config's weights would exceed "
                             f"2**63 - 1 elements, the most torch can address (bound: max(vocab_size, n_classes, "
                             f"block_size, width) * width * max(1, attention.rank, ffn_metric_rank) * "
                             f"(n_layers + 1), width = max(d_model * mlp_ratio, n_heads * head_dim))")

    # ------------------------------------------------------------ presets
    @classmethod
    def _merged(cls, base: dict, changes: dict) -> "FiberBundleConfig":
        """``cls(**base)`` with ``changes`` applied, an ``attention`` mapping merged into the base's."""
        _refuse_moved(changes)
        att = changes.get("attention")
        if isinstance(att, Mapping):
            changes = {**changes, "attention": {**base.get("attention", {}), **att}}
        return cls(**{**base, **changes})

    @classmethod
    def tiny(cls, **overrides) -> "FiberBundleConfig":
        """Two layers, width 32, two heads, metrics of rank 2: tests and live cells of the book.

        Parameters
        ----------
        **overrides
            Fields to change, e.g. ``mode="euclidean"``; ``attention=dict(...)`` is merged into the preset's.
        """
        return cls._merged(dict(vocab_size=16, block_size=32, d_model=32, n_heads=2, n_layers=2), overrides)

    @classmethod
    def small(cls, **overrides) -> "FiberBundleConfig":
        """Four layers, width 64, four heads, metrics of rank 4: the book's experiment scripts.

        Parameters
        ----------
        **overrides
            Fields to change; ``attention=dict(...)`` is merged into the preset's (rank 4).
        """
        base = dict(vocab_size=64, block_size=128, d_model=64, n_heads=4, n_layers=4, attention=dict(rank=4),
                    ffn_metric_rank=4)
        return cls._merged(base, overrides)

    @classmethod
    def attention_stack(cls, **overrides) -> "FiberBundleConfig":
        """A pure self-attention network (Dong, Cordonnier and Loukas 2021): no skip, no FFN, no norm.

        Bidirectional, no positions, no token embedding (``vocab_size=None``:
        feed it embeddings), variance-preserving init, ReLU FFNs with biases
        where ``mlp=True`` is switched back on, metrics of rank 4. ``skip``,
        ``mlp`` and ``layer_norm`` give Dong et al.'s variants.

        Parameters
        ----------
        **overrides
            Fields to change (e.g. ``n_layers=24``, ``mode="riemannian"``);
            ``attention=dict(...)`` is merged into the preset's.
        """
        base = dict(vocab_size=None, block_size=1024, d_model=64, n_heads=2, n_layers=24, mode="euclidean",
                    attention=dict(rank=4), skip=False, mlp=False, layer_norm=False, causal=False,
                    learned_positions=False, activation="relu", bias=True, tie_weights=False, init="unit",
                    scale_residual=False,
                    precondition_ffn=False)
        return cls._merged(base, overrides)

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
            Fields to change; ``attention=dict(...)`` is merged into the preset's.
        """
        base = dict(vocab_size=vocab_size, block_size=3, d_model=32, n_heads=4, n_layers=1, mode="euclidean",
                    bias=True, tie_weights=False, init="unit", attention=dict(qk_init="orthonormal"))
        return cls._merged(base, overrides)

    def replace(self, **changes) -> "FiberBundleConfig":
        """A copy with some fields changed (validated again).

        Parameters
        ----------
        **changes
            Fields to change; ``attention=dict(...)`` is merged into the
            current attention options, whose model-owned fields follow the
            new model.
        """
        return self._merged(self.to_dict(), changes)

    def to_dict(self) -> dict:
        """The config as plain values: every field, ``attention`` as a dict of its options.

        The model-owned fields of the attention are left out, and a connection
        left to the mode is None, so ``FiberBundleConfig(**cfg.to_dict()) == cfg``
        holds and keeps following the mode.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        att = {k: getattr(self.attention, k) for k in ATTENTION_OPTIONS}
        if self._mode_connection:
            att["connection"] = None
        return {**out, "attention": att}

    # ------------------------------------------------------------ derived
    @property
    def qk_dim(self) -> int:
        """Head dimension :math:`d`."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def connection_resolved(self) -> str:
        """The connection in use (``attention.connection``, or the mode's default where it was None)."""
        return self.attention.connection

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
