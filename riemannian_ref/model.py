r"""The Fiber Bundle Transformer: one configurable decoder-only language model.

Three *modes* on one :class:`FiberBundleConfig`, each changing one component:

- ``"euclidean"``: a standard pre-norm GPT block, scaled dot-product attention
  (``torch.nn.functional.scaled_dot_product_attention``) and a plain MLP. The
  baseline.
- ``"riemannian"``: the attention scores become metric distances,
  :math:`s_{ij} = -\tfrac{1}{2\tau}(q_i - k_j)^\top \bar G_{ij} (q_i - k_j)`
  with per-token, per-head metrics :math:`G_i = \lambda I + U_i U_i^\top` from a
  :class:`~riemannian_ref.MetricNet`, through
  :func:`riemannian_ref.riemannian_attention`. Everything else as ``"euclidean"``.
- ``"fiber_bundle"``: Riemannian attention whose keys, key metrics and values
  are parallel-transported to the query's fibre by a connection
  (:func:`riemannian_ref.connection_attention`), and a metric-preconditioned
  feed-forward step :math:`x \leftarrow x + \eta\,G_x^{-1}\mathrm{FFN}(\mathrm{LN}(x))`
  with the token's model-space metric :math:`G_x = \lambda I_D + U_x U_x^\top`
  (Woodbury, :math:`O(D r)`), :math:`\eta` learned per layer.

Positions: ``"euclidean"`` and ``"riemannian"`` add learned absolute position
embeddings (their attention is otherwise blind to order). ``"fiber_bundle"``
with the ``"flat"`` or ``"content"`` connection takes position from the
connection alone (no learned positions); with ``"trivial"`` it adds learned
positions. ``FiberBundleConfig.learned_positions`` overrides this.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_tensor, shape_str
from .attention import riemannian_attention, riemannian_attention_reference
from .connections import (CONNECTIONS, connection_attention, connection_rates, holonomy_defect,
                          metric_compatibility_defect, rotary_frequencies, sample_pairs, sample_triangles,
                          torsion_defect)
from .metrics import LowRankMetric, MetricNet
from .scores import METRIC_SIDES, riemannian_scores

__all__ = [
    "MODES",
    "FiberBundleConfig",
    "FiberBundleTransformer",
    "FiberBundleOutput",
    "count_parameters",
    "estimate_flops",
    "match_width",
]

MODES = ("euclidean", "riemannian", "fiber_bundle")


@dataclass
class FiberBundleConfig:
    """Configuration of :class:`FiberBundleTransformer` (defaults: a small book-sized model)."""

    vocab_size: int = 64            # number of token ids
    block_size: int = 64            # longest sequence (context length)
    d_model: int = 64               # model width D
    n_heads: int = 4                # heads h; head dimension d = D / h
    n_layers: int = 2               # residual blocks L
    mode: str = "fiber_bundle"      # "euclidean" | "riemannian" | "fiber_bundle"
    metric_side: str = "key"        # which metric measures a pair: "key" | "query" | "mean"
    metric_rank: int = 2            # rank r of each head metric G = lam I + U U^T (0: G = lam I)
    metric_strength: float = 1.0    # MetricNet init scale: heterogeneity of the metrics at init
    lam_init: float = 1.0           # initial isotropic part lam of every metric
    connection: str = "content"     # fiber_bundle only: "trivial" | "flat" | "content"
    rotary_base: float = 10000.0    # rates theta_m = base^(-2m/d) of the flat connection
    content_rate_std: float = 0.5   # init std of the content modulation of the rates (0: starts flat)
    precondition_ffn: bool = True   # fiber_bundle only: x + eta G_x^{-1} FFN(LN(x)) instead of x + FFN(LN(x))
    ffn_metric_rank: int = 2        # rank of the model-space metric G_x of the preconditioned FFN
    eta_init: float = 1.0           # initial step size eta of the preconditioned FFN
    mlp_ratio: int = 4              # FFN hidden width = mlp_ratio * D
    dropout: float = 0.0            # dropout on embeddings, attention weights and residual branches
    bias: bool = False              # biases in linear layers and LayerNorms
    tie_weights: bool = True        # LM head shares the token embedding matrix
    learned_positions: bool | None = None  # None: automatic by mode and connection (module docstring)
    stiefel_qk: bool = False        # init per-head query/key frames [h, D, d] with orthonormal columns

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------ presets
    @classmethod
    def tiny(cls, **overrides) -> "FiberBundleConfig":
        """Two layers, width 32, two heads: tests and live cells of the book."""
        base = dict(vocab_size=16, block_size=32, d_model=32, n_heads=2, n_layers=2, metric_rank=2,
                    ffn_metric_rank=2)
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides) -> "FiberBundleConfig":
        """Four layers, width 64, four heads: the book's experiment scripts."""
        base = dict(vocab_size=64, block_size=128, d_model=64, n_heads=4, n_layers=4, metric_rank=4,
                    ffn_metric_rank=4)
        return cls(**{**base, **overrides})

    def replace(self, **changes) -> "FiberBundleConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def uses_connection(self) -> bool:
        """True when attention transports between fibres (fiber_bundle with flat/content)."""
        return self.mode == "fiber_bundle" and self.connection != "trivial"

    @property
    def uses_learned_positions(self) -> bool:
        if self.learned_positions is not None:
            return self.learned_positions
        return not self.uses_connection

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field on any inconsistency."""
        for name in ("vocab_size", "block_size", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        for name in ("metric_rank", "ffn_metric_rank"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{name} must be an int >= 0, got {val!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.metric_side not in METRIC_SIDES:
            raise ValueError(f"metric_side must be one of {METRIC_SIDES}, got {self.metric_side!r}")
        if self.connection not in CONNECTIONS:
            raise ValueError(f"connection must be one of {CONNECTIONS}, got {self.connection!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model must be divisible by n_heads, got d_model={self.d_model}, "
                             f"n_heads={self.n_heads}")
        if self.uses_connection and self.head_dim % 2:
            raise ValueError(f"connection={self.connection!r} rotates pairs of coordinates: the head dimension "
                             f"d_model / n_heads must be even, got {self.d_model} / {self.n_heads} = {self.head_dim}")
        if not self.lam_init > 1e-3:
            raise ValueError(f"lam_init must be > 1e-3 (the metric floor), got {self.lam_init}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.rotary_base > 1:
            raise ValueError(f"rotary_base must be > 1, got {self.rotary_base}")
        if self.content_rate_std < 0 or self.metric_strength < 0:
            raise ValueError("content_rate_std and metric_strength must be >= 0")


class FiberBundleOutput(NamedTuple):
    """What :meth:`FiberBundleTransformer.forward` returns when more than logits is requested."""

    logits: Tensor                  # [B, n, vocab]
    loss: Tensor | None             # scalar cross-entropy, when targets are given
    hidden: Tensor | None           # [L + 1, B, n, D]: embeddings, then the output of every block
    diagnostics: dict | None        # per-layer tensors, see FiberBundleTransformer.forward


def _normal_(weight: Tensor, std: float = 0.02) -> None:
    nn.init.normal_(weight, mean=0.0, std=std)


class Attention(nn.Module):
    """Multi-head attention of one block, in the block's mode."""

    def __init__(self, cfg: FiberBundleConfig):
        super().__init__()
        self.cfg = cfg
        D, h, d = cfg.d_model, cfg.n_heads, cfg.head_dim
        # Per-head frames: query/key projections as [h, D, d] (one D x d frame per head).
        self.w_q = nn.Parameter(torch.empty(h, D, d))
        self.w_k = nn.Parameter(torch.empty(h, D, d))
        self.v_proj = nn.Linear(D, D, bias=cfg.bias)
        self.out_proj = nn.Linear(D, D, bias=cfg.bias)
        self._init_frames()
        _normal_(self.v_proj.weight)
        _normal_(self.out_proj.weight, 0.02 / math.sqrt(2 * cfg.n_layers))
        for lin in (self.v_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.metric = None
        if cfg.mode != "euclidean":
            self.metric = MetricNet(D, h, d, cfg.metric_rank, lam_init=cfg.lam_init,
                                    strength=cfg.metric_strength)
        self.rates = None
        if cfg.mode == "fiber_bundle" and cfg.connection == "content":
            # omega_j = theta * 2 sigmoid(W x_j): positive rates, equal to the flat ones when W x_j = 0.
            self.rates = nn.Linear(D, h * (d // 2), bias=False)
            _normal_(self.rates.weight, cfg.content_rate_std / math.sqrt(D))
        if cfg.mode == "fiber_bundle" and cfg.connection in ("flat", "content"):
            self.register_buffer("theta", rotary_frequencies(d, cfg.rotary_base), persistent=False)
        else:
            self.theta = None

    def _init_frames(self) -> None:
        if self.w_q.is_meta:
            return
        if self.cfg.stiefel_qk:
            for w in (self.w_q, self.w_k):
                with torch.no_grad():
                    Q, R = torch.linalg.qr(torch.randn_like(w))  # (h, D, d) orthonormal columns
                    w.copy_(Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2))
        else:
            _normal_(self.w_q)
            _normal_(self.w_k)

    # ------------------------------------------------------------ pieces
    def project(self, x: Tensor):
        """Queries, keys, values of normalised states x [B, n, D]: each [B, h, n, d]."""
        B, n, _ = x.shape
        h, d = self.cfg.n_heads, self.cfg.head_dim
        q = torch.einsum("bnD,hDd->bhnd", x, self.w_q)  # (B, h, n, d)
        k = torch.einsum("bnD,hDd->bhnd", x, self.w_k)  # (B, h, n, d)
        v = self.v_proj(x).view(B, n, h, d).transpose(1, 2)  # (B, h, n, d)
        return q, k, v

    def geometry(self, x: Tensor):
        """Metric factors and connection rates of normalised states x [B, n, D].

        Returns ``lam [h]``, ``U_q``/``U_k`` ([B, h, n, d, r] or None, as
        ``metric_side`` needs) and ``theta`` (None, [d/2], or [B, h, n, d/2]).
        """
        cfg = self.cfg
        if self.metric is None:
            return None, None, None, None
        lam, U = self.metric(x)  # (h,), (B, h, n, d, r)
        U_q = U if cfg.metric_side in ("query", "mean") else None
        U_k = U if cfg.metric_side in ("key", "mean") else None
        theta = None
        if self.rates is not None:
            B, n, _ = x.shape
            s = self.rates(x).view(B, n, cfg.n_heads, cfg.head_dim // 2).transpose(1, 2)  # (B, h, n, d/2)
            theta = self.theta * 2.0 * torch.sigmoid(s)
        elif self.theta is not None:
            theta = self.theta
        return lam, U_q, U_k, theta

    def scores(self, x: Tensor) -> Tensor:
        """Pre-softmax scores without mask, [B, h, n, n] (analysis only; trivial/no connection).

        ``"euclidean"``: :math:`q_i\\cdot k_j/\\sqrt d`; otherwise the Riemannian scores.
        """
        q, k, _ = self.project(x)
        if self.metric is None:
            return q @ k.transpose(-1, -2) / math.sqrt(self.cfg.head_dim)
        lam, U_q, U_k, _ = self.geometry(x)
        return riemannian_scores(q, k, U_q, U_k, lam=lam, metric_side=self.cfg.metric_side)

    def forward(self, x: Tensor, diag: dict | None = None) -> Tensor:
        cfg = self.cfg
        B, n, D = x.shape
        q, k, v = self.project(x)
        p = cfg.dropout if self.training else 0.0
        if cfg.mode == "euclidean":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            lam, U_q, U_k, theta = self.geometry(x)
            if cfg.mode == "riemannian":
                y = riemannian_attention(q, k, v, U_q, U_k, lam=lam, metric_side=cfg.metric_side,
                                         is_causal=True, dropout_p=p)
            else:
                y = connection_attention(q, k, v, U_q, U_k, lam=lam, metric_side=cfg.metric_side,
                                         connection=cfg.connection, theta=theta, is_causal=True, dropout_p=p)
            if diag is not None:
                self._diagnostics(diag, k, lam, U_q if U_k is None else U_k, theta)
        y = y.transpose(1, 2).reshape(B, n, D)  # (B, n, D)
        return self.out_proj(y)

    @torch.no_grad()
    def _diagnostics(self, diag: dict, k: Tensor, lam: Tensor, U: Tensor, theta: Tensor | None) -> None:
        cfg = self.cfg
        B, h, n, d = k.shape
        conn = cfg.connection if cfg.mode == "fiber_bundle" else "trivial"
        if conn == "content":
            rates = theta  # (B, h, n, d/2)
        else:
            rates = connection_rates(conn, n, d, theta=theta, like=k) if d % 2 == 0 else None
        diag["lam"].append(lam.detach())
        if rates is None or n < 3:
            return
        g = torch.Generator().manual_seed(0)  # the same triangles every call: comparable numbers
        tri = sample_triangles(n, diag["n_samples"], generator=g, device=k.device)
        pairs = sample_pairs(n, diag["n_samples"], generator=g, device=k.device)
        diag["holonomy"].append(holonomy_defect(rates, tri).expand(B, h).mean(0))  # (h,)
        diag["torsion"].append(torsion_defect(k, rates, tri).mean(0))  # (h,)
        diag["metric_compatibility"].append(
            metric_compatibility_defect(lam.view(h, 1), U, rates, pairs).mean(0))  # (h,)


class MLP(nn.Module):
    def __init__(self, cfg: FiberBundleConfig):
        super().__init__()
        D, H = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(D, H, bias=cfg.bias)
        self.proj = nn.Linear(H, D, bias=cfg.bias)
        _normal_(self.fc.weight)
        _normal_(self.proj.weight, 0.02 / math.sqrt(2 * cfg.n_layers))
        for lin in (self.fc, self.proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    r"""Pre-norm residual block: :math:`x + \mathrm{Attn}(\mathrm{LN}(x))`, then the (preconditioned) FFN."""

    def __init__(self, cfg: FiberBundleConfig):
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.ffn = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.ffn_metric = None
        if cfg.mode == "fiber_bundle" and cfg.precondition_ffn:
            # G_x = lam I_D + U_x U_x^T on the model space: a one-"head" metric net of dimension D.
            self.ffn_metric = MetricNet(cfg.d_model, 1, cfg.d_model, cfg.ffn_metric_rank,
                                        lam_init=cfg.lam_init, strength=cfg.metric_strength)
            self.eta = nn.Parameter(torch.tensor(float(cfg.eta_init)))

    def forward(self, x: Tensor, diag: dict | None = None) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x), diag))
        z = self.ln2(x)
        f = self.ffn(z)  # a covector on the model space                      (B, n, D)
        if self.ffn_metric is not None:
            lam, U = self.ffn_metric(z)  # (1,), (B, 1, n, D, r)
            f = LowRankMetric(lam, U.squeeze(1)).solve(f)  # G_x^{-1} f, Woodbury  (B, n, D)
            f = self.eta * f
        return x + f


class FiberBundleTransformer(nn.Module):
    """Decoder-only language model in one of three modes (see the module docstring).

    Parameters
    ----------
    config : FiberBundleConfig
    """

    def __init__(self, config: FiberBundleConfig):
        super().__init__()
        if not isinstance(config, FiberBundleConfig):
            raise ValueError(f"config must be a FiberBundleConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        D = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, D)
        _normal_(self.tok_emb.weight)
        self.pos_emb = None
        if config.uses_learned_positions:
            self.pos_emb = nn.Embedding(config.block_size, D)
            _normal_(self.pos_emb.weight)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(D, bias=config.bias)
        self.lm_head = nn.Linear(D, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        else:
            _normal_(self.lm_head.weight)

    def qk_frame_parameters(self) -> list[nn.Parameter]:
        """The per-head query/key frames, each of shape [h, D, d] (a Stiefel optimiser's param group)."""
        return [p for blk in self.blocks for p in (blk.attn.w_q, blk.attn.w_k)]

    def forward(self, idx: Tensor, targets: Tensor | None = None, return_hidden: bool = False,
                return_diagnostics: bool = False, diagnostic_samples: int = 64):
        """Logits of the next token at every position.

        Parameters
        ----------
        idx : LongTensor, shape [B, n]
            Token ids, ``n <= block_size``.
        targets : LongTensor, shape [B, n], optional
            Next-token ids; ``-1`` entries are ignored by the loss.
        return_hidden : bool
            Also return the residual stream before the first block and after
            every block, shape [L + 1, B, n, D] (for rank-collapse measures).
        return_diagnostics : bool
            Also return a dict of per-layer tensors (computed without gradient):
            ``"lam"`` [L, h] (absent in ``"euclidean"`` mode); in the other
            modes ``"holonomy"``, ``"torsion"`` (on the keys),
            ``"metric_compatibility"`` (of the attention metric), each [L, h],
            averaged over the batch and ``diagnostic_samples`` fixed random
            triangles/pairs (the non-fibre ``"riemannian"`` mode counts as the
            trivial connection); ``"relative_residual"`` [L + 1]:
            :math:`\\|X - \\mathbf 1 \\bar x^\\top\\|_F / \\|X\\|_F` of the stream.
        diagnostic_samples : int
            Number of sampled triangles and pairs.

        Returns
        -------
        Tensor [B, n, vocab] when only logits are asked for, else a
        :class:`FiberBundleOutput` ``(logits, loss, hidden, diagnostics)``
        with ``None`` for what was not requested.
        """
        cfg = self.config
        idx = check_tensor(idx, "idx", min_dim=2, floating=False)
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an integer tensor of shape [B, n], got {shape_str(idx)} {idx.dtype}")
        B, n = idx.shape
        if n > cfg.block_size:
            raise ValueError(f"sequence length {n} exceeds block_size = {cfg.block_size}")
        x = self.tok_emb(idx)  # (B, n, D)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(n, device=idx.device))
        x = self.drop(x)
        diag = None
        if return_diagnostics and cfg.mode != "euclidean":
            diag = {"lam": [], "holonomy": [], "torsion": [], "metric_compatibility": [],
                    "n_samples": diagnostic_samples}
        hidden = [x]
        for blk in self.blocks:
            x = blk(x, diag)
            hidden.append(x)
        logits = self.lm_head(self.ln_f(x))  # (B, n, vocab)
        loss = None
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {shape_str(idx)}, got {shape_str(targets)}")
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        if targets is None and not return_hidden and not return_diagnostics:
            return logits
        H = torch.stack(hidden)  # (L + 1, B, n, D)
        out_diag = None
        if return_diagnostics:
            out_diag = {}
            if diag is not None:
                for key in ("lam", "holonomy", "torsion", "metric_compatibility"):
                    if diag[key]:
                        out_diag[key] = torch.stack(diag[key])  # (L, h)
            with torch.no_grad():
                Hd = H.detach()
                res = Hd - Hd.mean(-2, keepdim=True)
                out_diag["relative_residual"] = (res.flatten(-2).norm(dim=-1)
                                                 / Hd.flatten(-2).norm(dim=-1)).mean(-1)  # (L + 1,)
        return FiberBundleOutput(logits, loss, H if return_hidden else None, out_diag)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample ``max_new_tokens`` continuations autoregressively, shape [B, n + max_new_tokens].

        ``temperature = 0`` takes the argmax (greedy). The context is cropped to
        the last ``block_size`` tokens.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size:]
            logits = self(ctx)[:, -1, :]  # (B, vocab)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = logits.softmax(-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


# --------------------------------------------------------------------------- budgets
_COMPONENTS = ("embedding", "positions", "attention", "metric", "connection", "ffn", "ffn_metric",
               "norms", "head")


def _component(name: str) -> str:
    if name.startswith("tok_emb"):
        return "embedding"
    if name.startswith("pos_emb"):
        return "positions"
    if name.startswith("lm_head"):
        return "head"
    if ".attn.metric." in name:
        return "metric"
    if ".attn.rates." in name:
        return "connection"
    if ".attn." in name:
        return "attention"
    if ".ffn_metric." in name or name.endswith(".eta"):
        return "ffn_metric"
    if ".ffn." in name:
        return "ffn"
    return "norms"


def count_parameters(model_or_config) -> dict[str, int]:
    """Parameter counts by component, and ``"total"`` (tied weights counted once).

    Components: embedding, positions, attention (q/k frames, v, out), metric
    (attention metric nets), connection (content-rate maps), ffn, ffn_metric
    (metric of the preconditioned FFN and eta), norms, head (0 when tied).
    A config is instantiated on the CPU (book-sized models: milliseconds; the
    ``meta`` device was slower here).
    """
    if isinstance(model_or_config, FiberBundleConfig):
        with torch.random.fork_rng(devices=[]):  # counting leaves the caller's random stream alone
            model = FiberBundleTransformer(model_or_config)
    elif isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        raise ValueError(f"expected a FiberBundleTransformer or FiberBundleConfig, got {type(model_or_config).__name__}")
    counts = dict.fromkeys(_COMPONENTS, 0)
    for name, p in model.named_parameters():  # shared parameters appear once
        counts[_component(name)] += p.numel()
    counts["total"] = sum(counts.values())
    return counts


def match_width(config: FiberBundleConfig, target: int, *, exclude_embedding: bool = False,
                widths: range | None = None) -> FiberBundleConfig:
    """The config with ``d_model`` changed so its parameter count is closest to ``target``.

    Candidate widths are multiples of ``2 * n_heads`` (even head dimensions)
    up to four times the current width. Use it to compare modes at matched
    size: ``match_width(cfg_fb, count_parameters(cfg_eucl)["total"])``.
    """
    step = 2 * config.n_heads
    if widths is None:
        widths = range(step, 4 * config.d_model + step, step)
    best, best_gap = None, None
    for D in widths:
        try:
            cand = config.replace(d_model=D)
        except ValueError:
            continue
        c = count_parameters(cand)
        total = c["total"] - (c["embedding"] + c["head"] if exclude_embedding else 0)
        gap = abs(total - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = cand, gap
        if total > target:  # counts grow with the width: nothing further can be closer
            break
    if best is None:
        raise ValueError(f"no valid width in {widths} for this config")
    return best


def estimate_flops(config: FiberBundleConfig, seq_len: int | None = None) -> dict[str, float]:
    """Forward FLOPs of one sequence, by component (multiply-add = 2 FLOPs).

    Matmuls are counted exactly; elementwise work (softmax, rotations, the
    content transport) at one FLOP per scalar operation, an estimate. The
    pairwise low-rank products cost ``2 n^2 D r`` per one-sided metric
    (``"mean"``: twice). Returns per-component FLOPs and ``"total"``.
    """
    cfg = config
    n = cfg.block_size if seq_len is None else seq_len
    D, L, V, h, d = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.n_heads, cfg.head_dim
    r = cfg.metric_rank
    sides = 2 if cfg.metric_side == "mean" else 1
    out = dict.fromkeys(("projections", "scores", "softmax_mix", "metric", "connection", "ffn",
                         "ffn_metric", "head"), 0.0)
    out["projections"] = L * 2 * n * 4 * D * D  # q, k, v, out
    out["scores"] = L * 2 * n * n * D  # q_i . k_j (+ norms, lower order)
    out["softmax_mix"] = L * (5 * n * n * h + 2 * n * n * D)  # softmax + A V
    if cfg.mode != "euclidean":
        out["metric"] = L * (2 * n * D * h * d * r + sides * 2 * n * n * D * r)  # metric net + U^T (q - k)
    if cfg.mode == "fiber_bundle" and cfg.connection == "flat":
        out["connection"] = L * 3 * n * D * (4 + r * sides)  # rotate q, k, v, output and U: O(n D r)
    if cfg.mode == "fiber_bundle" and cfg.connection == "content":
        rotations = 2 + (1 if cfg.metric_side in ("key", "mean") else 0)  # keys, values, (P^T on key side)
        out["connection"] = L * (2 * n * D * D // 2 + n * n * D + rotations * 3 * n * n * D)
    out["ffn"] = L * 2 * n * 2 * D * cfg.mlp_ratio * D
    if cfg.mode == "fiber_bundle" and cfg.precondition_ffn:
        rf = cfg.ffn_metric_rank
        out["ffn_metric"] = L * (2 * n * D * D * rf + n * (4 * D * rf + 2 * D * rf * rf + rf ** 3))
    out["head"] = 2 * n * D * V
    out["total"] = sum(out.values())
    return out
