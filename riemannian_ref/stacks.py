r"""Attention stacks for rank-collapse experiments.

A depth-:math:`L` stack maps token states :math:`X_0 \in \mathbb{R}^{n\times D}`
through layers

.. math::
    X_{l+1} = \mathrm{MLP}\big(\mathrm{Attn}(X_l)\big) \quad\text{(or with skips and layer norm)},

and returns every :math:`X_l`, so one forward pass of a depth-32 stack gives the
rank-collapse profile of all depths 0..32 (the first :math:`l` layers of a
random stack *are* a random depth-:math:`l` stack).

The attention of a layer is one of

- ``"euclidean"``: scaled dot product :math:`\mathrm{softmax}(q_i^\top k_j/\sqrt d)`,
  as ``scaled_dot_product_attention``;
- ``"shared"``: Riemannian attention with one learned metric
  :math:`G = \lambda I + U U^\top` per head, the same for every token;
- ``"hetero"``: Riemannian attention with per-token metrics
  :math:`G_i = \lambda I + U_i U_i^\top` from a :class:`~riemannian_ref.MetricNet`
  (``metric_side`` key / query / mean, rank ``r``, heterogeneity ``strength``);
- ``"fiber"``: the same per-token metrics, with keys, key metrics and values
  parallel-transported to the query's fibre by a connection
  (:func:`~riemannian_ref.connection_attention`: ``"trivial"``, ``"flat"``
  (rotary), ``"content"`` with rates :math:`\omega_j = W_\theta x_j`).

Every attention matrix is row-stochastic, :math:`A_l \mathbf 1 = \mathbf 1`.
With a non-trivial connection the *output* is no longer :math:`A V`: the
values are rotated per (query, key) pair, :math:`o_i = \sum_j A_{ij} P_{j\to i} v_j`.

The module also holds the small toy task used to look at the profile after a
short training run (:class:`HistogramTask`, :class:`StackClassifier`,
:func:`train_classifier`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ._checks import check_tensor, shape_str
from .attention import riemannian_attention_reference
from .connections import CONNECTIONS, connection_attention
from .metrics import MetricNet
from .scores import METRIC_SIDES

__all__ = [
    "ATTENTIONS",
    "StackConfig",
    "AttentionLayer",
    "AttentionStack",
    "attention_path_products",
    "HistogramTask",
    "StackClassifier",
    "train_classifier",
]

ATTENTIONS = ("euclidean", "shared", "hetero", "fiber")


@dataclass(frozen=True)
class StackConfig:
    r"""A depth-``depth`` stack of (optionally) pure attention layers.

    Frozen and validated on construction (a bad value raises ``ValueError``
    naming the field); :meth:`with_` makes a changed copy.

    Parameters
    ----------
    d_model : int, default 64
        Width :math:`D` of the token states; must be divisible by ``n_heads``.
    n_heads : int, default 2
        Number of heads :math:`h`; the head dimension is :math:`d = D / h`
        (even for ``attention="fiber"``).
    depth : int, default 24
        Number of layers :math:`L`.
    attention : {"euclidean", "shared", "hetero", "fiber"}, default "euclidean"
        The attention of every layer (one of ``ATTENTIONS``; module docstring).
    metric_side : {"key", "query", "mean"}, default "key"
        Which token's metric measures a pair in ``"hetero"`` and ``"fiber"``
        attention (``"shared"`` has one metric per head, so the side does not
        matter).
    rank : int, default 4
        Rank :math:`r \ge 0` of the metrics of ``"shared"``, ``"hetero"``
        and ``"fiber"`` attention; ``"shared"`` needs :math:`r \ge 1`.
    strength : float, default 1.0
        Initial scale of :math:`U` (entries of variance ``strength**2 / r``,
        as in :class:`~riemannian_ref.MetricNet`); 0 gives
        :math:`G = \lambda I` at init.
    lam_init : float, default 1.0
        Initial isotropic part :math:`\lambda` of every metric; must exceed
        the floor ``1e-3``.
    skip : bool, default False
        Residual connections around the attention (and the MLP).
    mlp : bool, default False
        A two-layer ReLU MLP after each attention.
    layer_norm : bool, default False
        Pre-norm LayerNorm before the attention (and the MLP).
    mlp_ratio : int, default 4
        Hidden width of the MLP = ``mlp_ratio * d_model``.
    qk_gain : float, default 1.0
        Multiplies :math:`W_Q` and :math:`W_K` at init, so the scores scale
        by ``qk_gain**2``: sharper (> 1) or flatter (< 1) attention; > 0.
    connection : {"trivial", "flat", "content"}, default "trivial"
        The connection of ``"fiber"`` attention
        (:func:`~riemannian_ref.connection_attention`; ``"flat"`` uses the
        rotary rates with base 10000); ignored by the other attentions.
    rate_scale : float, default 0.1
        ``"content"`` connection: the rates are :math:`\omega_j = W_\theta x_j`
        with :math:`W_\theta` initialised with standard deviation
        ``rate_scale / sqrt(D)``, so rates of standard deviation about
        ``rate_scale`` for unit-variance token states.
    """

    d_model: int = 64  # D, width of the token states
    n_heads: int = 2  # h; head dimension d = D / h
    depth: int = 24  # L, number of layers
    attention: str = "euclidean"  # one of ATTENTIONS
    metric_side: str = "key"  # "key" | "query" | "mean" (hetero only)
    rank: int = 4  # r, metric rank (shared, hetero)
    strength: float = 1.0  # init scale of U (0: G = lam I at init)
    lam_init: float = 1.0  # initial isotropic part lam of every metric
    skip: bool = False  # residual connections around attention (and MLP)
    mlp: bool = False  # a two-layer ReLU MLP after each attention
    layer_norm: bool = False  # pre-norm LayerNorm before attention (and MLP)
    mlp_ratio: int = 4  # hidden width of the MLP = mlp_ratio * D
    qk_gain: float = 1.0  # multiplies W_Q and W_K at init: sharper (>1) or flatter (<1) attention
    connection: str = "trivial"  # "trivial" | "flat" | "content" (fiber only)
    rate_scale: float = 0.1  # std of the content connection's rates omega_j = W_theta x_j at init

    def __post_init__(self):
        for name in ("d_model", "n_heads", "depth", "mlp_ratio"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.metric_side not in METRIC_SIDES:
            raise ValueError(f"metric_side must be one of {METRIC_SIDES}, got {self.metric_side!r}")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {self.rank!r}")
        if self.attention == "shared" and self.rank == 0:
            raise ValueError("attention='shared' needs rank >= 1 (rank 0 is 'hetero' with strength 0)")
        if self.connection not in CONNECTIONS:
            raise ValueError(f"connection must be one of {CONNECTIONS}, got {self.connection!r}")
        if self.attention == "fiber" and self.head_dim % 2:
            raise ValueError(f"attention='fiber' rotates pairs: head_dim must be even, got {self.head_dim}")
        if not self.qk_gain > 0:
            raise ValueError(f"qk_gain must be > 0, got {self.qk_gain!r}")
        if not self.strength >= 0:
            raise ValueError(f"strength must be >= 0, got {self.strength!r}")
        if not self.lam_init > 1e-3:
            raise ValueError(f"lam_init must be > 1e-3 (the floor lam_min), got {self.lam_init!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def with_(self, **changes) -> "StackConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


class AttentionLayer(nn.Module):
    r"""One multi-head attention layer, :math:`X \mapsto \mathrm{concat}_h(A_h X W_V^h)\,W_O`.

    Projections are bias-free with entries :math:`\mathcal N(0, 1/D)`, so
    unit-variance token states give unit-variance queries, keys and values;
    ``qk_gain`` scales :math:`W_Q, W_K` (hence the scores by ``qk_gain**2``).

    Parameters
    ----------
    cfg : StackConfig
        Width, heads, the kind of attention and its metric and connection
        settings; the depth and the skip/MLP/norm fields are not used here.
    """

    def __init__(self, cfg: StackConfig):
        super().__init__()
        self.cfg = cfg
        D, h, d, r = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.rank
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        for lin in (self.qkv, self.out):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(D))
        with torch.no_grad():
            self.qkv.weight[: 2 * D].mul_(cfg.qk_gain)  # rows of W_Q and W_K
        self.metric = None
        self.U_shared = None
        self.rates = None
        if cfg.attention in ("hetero", "fiber"):
            self.metric = MetricNet(D, h, d, r, lam_init=cfg.lam_init, strength=cfg.strength)
        if cfg.attention == "fiber" and cfg.connection == "content":
            self.rates = nn.Linear(D, h * (d // 2), bias=False)  # omega_j = W_theta x_j
            nn.init.normal_(self.rates.weight, std=cfg.rate_scale / math.sqrt(D))
        elif cfg.attention == "shared":
            # Same scale as MetricNet's per-token factors: entries of variance strength^2 / r.
            self.U_shared = nn.Parameter(torch.randn(h, d, r) * (cfg.strength / math.sqrt(r)))
            self.rho = nn.Parameter(torch.full((h,), math.log(math.expm1(cfg.lam_init - 1e-3))))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Attention output and weights.

        Parameters
        ----------
        x : Tensor, shape [B, n, D]

        Returns
        -------
        y : Tensor, shape [B, n, D]
        A : Tensor, shape [B, h, n, n]
            Row-stochastic attention weights.
        """
        cfg = self.cfg
        B, n, D = x.shape
        h, d = cfg.n_heads, cfg.head_dim
        q, k, v = self.qkv(x).view(B, n, 3, h, d).permute(2, 0, 3, 1, 4)  # 3 x (B, h, n, d)
        if cfg.attention == "euclidean":
            S = q @ k.transpose(-1, -2) / math.sqrt(d)  # (B, h, n, n)
            A = torch.softmax(S, dim=-1)
            o = A @ v
        elif cfg.attention == "shared":
            lam = nn.functional.softplus(self.rho) + 1e-3  # (h,)
            U = self.U_shared.to(x.dtype).unsqueeze(0)  # (1, h, d, r) broadcasts against (B, h)
            o, A = riemannian_attention_reference(q, k, v, None, U, lam=lam.to(x.dtype),
                                                  metric_side="key", return_weights=True)
        else:
            lam, U = self.metric(x)  # (h,), (B, h, n, d, r)
            side = cfg.metric_side
            U_q = U if side in ("query", "mean") else None
            U_k = U if side in ("key", "mean") else None
            if cfg.attention == "hetero":
                o, A = riemannian_attention_reference(q, k, v, U_q, U_k, lam=lam, metric_side=side,
                                                      return_weights=True)
            else:
                theta = None
                if self.rates is not None:
                    theta = self.rates(x).view(B, n, h, d // 2).transpose(1, 2)  # (B, h, n, d/2)
                o, A = connection_attention(q, k, v, U_q, U_k, lam=lam, metric_side=side,
                                            connection=cfg.connection, theta=theta, return_weights=True)
        y = self.out(o.transpose(1, 2).reshape(B, n, D))  # (B, n, D)
        return y, A


class _MLP(nn.Module):
    def __init__(self, D: int, ratio: int):
        super().__init__()
        self.fc1 = nn.Linear(D, ratio * D)
        self.fc2 = nn.Linear(ratio * D, D)
        # He init for the ReLU layer, variance-preserving read-out, zero biases.
        nn.init.normal_(self.fc1.weight, std=math.sqrt(2.0 / D))
        nn.init.normal_(self.fc2.weight, std=1.0 / math.sqrt(ratio * D))
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class AttentionStack(nn.Module):
    r"""A depth-:math:`L` stack of attention layers (optionally with skips, MLPs, pre-norm).

    Per layer, with :math:`N` the LayerNorm (identity when ``layer_norm=False``):

    .. math::
        Y = \mathrm{Attn}(N(X)) + [\text{skip}]\,X,

        X' = \mathrm{MLP}(N(Y)) + [\text{skip}]\,Y \quad(\text{or } X' = Y \text{ without MLP}).

    With ``skip=mlp=layer_norm=False`` this is the pure self-attention network
    of Dong, Cordonnier and Loukas (2021). Parameters are drawn from the global
    torch RNG (seed it before construction).

    Parameters
    ----------
    cfg : StackConfig
        Depth, layer options and the attention of every layer.
    """

    def __init__(self, cfg: StackConfig):
        super().__init__()
        if not isinstance(cfg, StackConfig):
            raise ValueError(f"cfg must be a StackConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        D = cfg.d_model
        self.layers = nn.ModuleList(AttentionLayer(cfg) for _ in range(cfg.depth))
        self.mlps = nn.ModuleList(_MLP(D, cfg.mlp_ratio) for _ in range(cfg.depth)) if cfg.mlp else None
        if cfg.layer_norm:
            self.ln1 = nn.ModuleList(nn.LayerNorm(D) for _ in range(cfg.depth))
            self.ln2 = nn.ModuleList(nn.LayerNorm(D) for _ in range(cfg.depth)) if cfg.mlp else None

    def forward(self, x: Tensor, return_weights: bool = False):
        """Run the stack and return every hidden state.

        Parameters
        ----------
        x : Tensor, shape [B, n, D]
        return_weights : bool
            Also return every layer's attention weights.

        Returns
        -------
        hidden : Tensor, shape [L + 1, B, n, D]
            ``hidden[0] = x``, ``hidden[l]`` the output of layer ``l``.
        weights : Tensor, shape [L, B, h, n, n] (only if ``return_weights``)
        """
        cfg = self.cfg
        x = check_tensor(x, "x", min_dim=3)
        if x.dim() != 3 or x.shape[-1] != cfg.d_model:
            raise ValueError(f"x must have shape [B, n, {cfg.d_model}], got {shape_str(x)}")
        hidden, weights = [x], []
        for l, layer in enumerate(self.layers):
            a, A = layer(self.ln1[l](x) if cfg.layer_norm else x)
            x = x + a if cfg.skip else a
            if cfg.mlp:
                m = self.mlps[l](self.ln2[l](x) if cfg.layer_norm else x)
                x = x + m if cfg.skip else m
            hidden.append(x)
            weights.append(A)
        H = torch.stack(hidden)  # (L + 1, B, n, D)
        return (H, torch.stack(weights)) if return_weights else H


def attention_path_products(weights: Tensor, heads: Tensor | None = None) -> Tensor:
    r"""Products of attention matrices along a path of heads, :math:`P_l = A_l^{(h_l)} \cdots A_1^{(h_1)}`.

    In the path decomposition of Dong et al. the output of a pure attention
    stack is a sum over paths (one head per layer) of such products applied to
    the input; a product of row-stochastic matrices is row-stochastic, and it
    tends to a matrix with identical rows (rank one).

    Parameters
    ----------
    weights : Tensor, shape [L, B, h, n, n]
        Per-layer attention weights, as returned by :class:`AttentionStack`.
    heads : Tensor of int, shape [L] or [L, B], optional
        The head taken at each layer (per batch element if 2-D); default head 0.

    Returns
    -------
    Tensor, shape [L, B, n, n]
        ``out[l-1]`` is the product of the first ``l`` layers.
    """
    weights = check_tensor(weights, "weights", min_dim=5)
    if weights.dim() != 5 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must have shape [L, B, h, n, n], got {shape_str(weights)}")
    L, B, h, n, _ = weights.shape
    if heads is None:
        heads = torch.zeros(L, dtype=torch.long, device=weights.device)
    if not isinstance(heads, Tensor) or heads.dtype != torch.long or heads.shape not in ((L,), (L, B)):
        raise ValueError(f"heads must be a long tensor of shape [{L}] or [{L}, {B}], got "
                         f"{shape_str(heads) if isinstance(heads, Tensor) else type(heads).__name__}")
    if heads.numel() and (heads.min() < 0 or heads.max() >= h):
        raise ValueError(f"heads must lie in [0, {h}), got values in [{heads.min()}, {heads.max()}]")
    if heads.dim() == 1:
        heads = heads.unsqueeze(1).expand(L, B)  # (L, B)
    idx = heads.view(L, B, 1, 1, 1).expand(L, B, 1, n, n)
    A = weights.gather(2, idx).squeeze(2)  # (L, B, n, n)
    out, P = [], None
    for l in range(L):
        P = A[l] if P is None else A[l] @ P
        out.append(P)
    return torch.stack(out)  # (L, B, n, n)


# ---------------------------------------------------------------------- toy task
@dataclass(frozen=True)
class HistogramTask:
    """Counting: for every token, how many tokens of the sequence share its symbol.

    Needs every position to keep its own identity (a collapsed, identical-row
    representation cannot solve it), and needs attention to compare tokens.

    Parameters
    ----------
    n : int, default 16
        Sequence length; the targets take ``n`` values (a count from 1 to
        ``n``), so a classifier needs ``n_classes = n``.
    vocab : int, default 8
        Number of symbols, drawn uniformly and independently per position.
    """

    n: int = 16  # sequence length
    vocab: int = 8  # number of symbols

    def sample(self, batch: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Tokens and targets, both long tensors of shape [batch, n] (targets in 0..n-1 = count - 1)."""
        tok = torch.randint(self.vocab, (batch, self.n), generator=generator)  # (B, n)
        same = tok.unsqueeze(-1) == tok.unsqueeze(-2)  # (B, n, n)
        return tok, same.sum(-1) - 1


class StackClassifier(nn.Module):
    """Embedding, an :class:`AttentionStack`, a final LayerNorm and a per-token read-out.

    The embedding has entries :math:`N(0, 1)`, so the stack sees
    unit-variance token states. :meth:`forward` returns the logits and all
    hidden states of the stack, for rank-collapse measures after training.

    Parameters
    ----------
    cfg : StackConfig
        The attention stack.
    vocab : int
        Number of token ids.
    n_classes : int
        Number of output classes per token (``task.n`` for a
        :class:`HistogramTask`).
    """

    def __init__(self, cfg: StackConfig, vocab: int, n_classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.stack = AttentionStack(cfg)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, n_classes)

    def forward(self, tok: Tensor) -> tuple[Tensor, Tensor]:
        """Logits [B, n, n_classes] and hidden states [L + 1, B, n, D]."""
        H = self.stack(self.embed(tok))
        return self.head(self.norm(H[-1])), H


def train_classifier(model: StackClassifier, task: HistogramTask, *, steps: int = 200, batch: int = 64,
                     lr: float = 3e-3, generator: torch.Generator | None = None) -> list[float]:
    """A short Adam run on ``task``; returns the per-step training losses.

    Data are drawn on ``generator`` (CPU) and moved to the model's device.
    Every step draws a fresh batch; the loss is the token-averaged
    cross-entropy of the per-token classes.

    Parameters
    ----------
    model : StackClassifier
        Trained in place; its train/eval mode is left as it is.
    task : HistogramTask
        Source of the batches (:meth:`HistogramTask.sample`).
    steps : int
        Number of Adam steps (>= 0).
    batch : int
        Sequences per step.
    lr : float
        Adam learning rate.
    generator : torch.Generator, optional
        CPU generator for the data, for reproducible runs (the model's
        initialisation is not affected).

    Returns
    -------
    list of float
        The loss of each step, measured before its update; length ``steps``.
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    device = next(model.parameters()).device
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        tok, y = task.sample(batch, generator)
        logits, _ = model(tok.to(device))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
