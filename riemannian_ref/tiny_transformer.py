"""A minimal Transformer with per-head query/key frames, and two tiny tasks.

Written for the optimiser chapter: the query and key maps of each layer are
stored as ``W_Q, W_K`` of shape ``[h, D, d]`` -- exactly the layout
:class:`~riemannian_ref.optim.StiefelAdam` treats as ``h`` frames on
:math:`\\mathrm{St}(D, d)` and :class:`~riemannian_ref.optim.LowRankAdam` as
``h`` factor pairs of the rank-``d`` bilinear form :math:`W_Q W_K^\\top`.
Pre-norm blocks, learned positions, standard scaled dot-product scores
(Vaswani et al. 2017). The tasks: modular addition ``a + b mod p`` (Power et
al. 2022) and a character-level corpus made of a standard-library module's
source text (no download).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .manifolds import Stiefel

__all__ = [
    "TinyTransformerConfig",
    "TinyTransformer",
    "modular_addition_data",
    "stdlib_char_corpus",
]


@dataclass
class TinyTransformerConfig:
    """Sizes of :class:`TinyTransformer`.

    Parameters
    ----------
    vocab : int
        Input and output vocabulary size.
    n_ctx : int
        Maximum sequence length (learned positions).
    d_model : int, default 64
        Residual width :math:`D`.
    n_heads : int, default 4
        Number of heads :math:`h`.
    head_dim : int, default 16
        Head dimension :math:`d`; query and key frames are :math:`D \\times d`.
    d_mlp : int, default 256
        Hidden width of the feed-forward block.
    n_layers : int, default 1
        Number of blocks.
    causal : bool, default True
        Causal mask (needed for language modelling).
    """

    vocab: int  # input and output vocabulary
    n_ctx: int  # maximum sequence length
    d_model: int = 64  # residual width D
    n_heads: int = 4  # h
    head_dim: int = 16  # d (query/key frames are D x d)
    d_mlp: int = 256  # hidden width of the feed-forward block
    n_layers: int = 1
    causal: bool = True  # causal mask (needed for language modelling)


class _Block(nn.Module):
    def __init__(self, cfg: TinyTransformerConfig):
        super().__init__()
        D, h, d = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.causal = cfg.causal
        self.ln1 = nn.LayerNorm(D)
        self.ln2 = nn.LayerNorm(D)
        self.W_Q = nn.Parameter(torch.empty(h, D, d))  # h frames [D, d]
        self.W_K = nn.Parameter(torch.empty(h, D, d))
        self.W_V = nn.Parameter(torch.empty(h, D, d))
        self.W_O = nn.Parameter(torch.empty(h, d, D))
        self.mlp = nn.Sequential(nn.Linear(D, cfg.d_mlp), nn.GELU(), nn.Linear(cfg.d_mlp, D))

    def attn(self, x: Tensor) -> Tensor:
        B, n, D = x.shape
        q = torch.einsum("bnD,hDd->bhnd", x, self.W_Q)  # (B, h, n, d)
        k = torch.einsum("bnD,hDd->bhnd", x, self.W_K)  # (B, h, n, d)
        v = torch.einsum("bnD,hDd->bhnd", x, self.W_V)  # (B, h, n, d)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, h, n, n)
        if self.causal:
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        o = s.softmax(dim=-1) @ v  # (B, h, n, d)
        return torch.einsum("bhnd,hdD->bnD", o, self.W_O)  # (B, n, D)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Pre-norm Transformer whose query/key maps are stacks of frames ``[h, D, d]``.

    Parameters
    ----------
    cfg : TinyTransformerConfig
    generator : torch.Generator, optional
        CPU generator for the initialisation (reproducible on any device).
        ``W_Q`` and ``W_K`` start as Haar-random orthonormal frames in every
        configuration, so constrained and unconstrained runs share their start.

    Notes
    -----
    ``forward(tokens [B, n]) -> logits [B, n, vocab]``.
    """

    def __init__(self, cfg: TinyTransformerConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab, D)
        self.pos = nn.Parameter(torch.empty(cfg.n_ctx, D))
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(D)
        self.unembed = nn.Linear(D, cfg.vocab, bias=False)
        self._init(generator)

    @torch.no_grad()
    def _init(self, g: torch.Generator | None) -> None:
        cfg, st = self.cfg, Stiefel()
        D, h, d = cfg.d_model, cfg.n_heads, cfg.head_dim

        def normal(*shape, std):
            return torch.randn(*shape, generator=g) * std

        self.embed.weight.copy_(normal(cfg.vocab, D, std=1.0))
        self.pos.copy_(normal(cfg.n_ctx, D, std=0.1))
        for blk in self.blocks:
            blk.W_Q.copy_(st.random(h, D, d, generator=g))
            blk.W_K.copy_(st.random(h, D, d, generator=g))
            blk.W_V.copy_(normal(h, D, d, std=D ** -0.5))
            blk.W_O.copy_(normal(h, d, D, std=(h * d) ** -0.5 / math.sqrt(2 * cfg.n_layers)))
            for lin in (blk.mlp[0], blk.mlp[2]):
                lin.weight.copy_(normal(*lin.weight.shape, std=lin.weight.shape[1] ** -0.5))
                lin.bias.zero_()
        self.unembed.weight.copy_(normal(cfg.vocab, D, std=D ** -0.5))

    def qk_frame_parameters(self) -> list[nn.Parameter]:
        """``[W_Q, W_K]`` of every layer (each ``[h, D, d]``), in layer order."""
        out: list[nn.Parameter] = []
        for blk in self.blocks:
            out += [blk.W_Q, blk.W_K]
        return out

    def forward(self, tokens: Tensor) -> Tensor:
        B, n = tokens.shape
        if n > self.cfg.n_ctx:
            raise ValueError(f"tokens has length {n} > n_ctx = {self.cfg.n_ctx}")
        x = self.embed(tokens) + self.pos[:n]  # (B, n, D)
        for blk in self.blocks:
            x = blk(x)
        return self.unembed(self.ln_f(x))  # (B, n, vocab)


def modular_addition_data(p: int, train_frac: float, generator: torch.Generator | None = None):
    """All pairs ``(a, b)`` as sequences ``[a, b, =]`` with label ``(a + b) mod p``, split at random.

    Parameters
    ----------
    p : int
        Modulus (the ``=`` token is ``p``, so the vocabulary has ``p + 1`` symbols).
    train_frac : float
        Fraction of the ``p**2`` pairs used for training, in (0, 1).
    generator : torch.Generator, optional

    Returns
    -------
    x_train : Tensor, shape [N_train, 3] (long)
    y_train : Tensor, shape [N_train]
    x_val : Tensor, shape [N_val, 3]
    y_val : Tensor, shape [N_val]
    """
    if p < 2:
        raise ValueError(f"p must be >= 2, got {p}")
    if not 0.0 < train_frac < 1.0:
        raise ValueError(f"train_frac must be in (0, 1), got {train_frac}")
    a = torch.arange(p).repeat_interleave(p)
    b = torch.arange(p).repeat(p)
    x = torch.stack([a, b, torch.full_like(a, p)], dim=1)  # (p^2, 3)
    y = (a + b) % p
    perm = torch.randperm(p * p, generator=generator)
    n_train = int(round(train_frac * p * p))
    tr, va = perm[:n_train], perm[n_train:]
    return x[tr], y[tr], x[va], y[va]


def stdlib_char_corpus(module_name: str = "argparse") -> tuple[Tensor, list[str]]:
    """The source text of a standard-library module as a character-token tensor.

    Parameters
    ----------
    module_name : str
        A pure-Python standard-library module (default ``"argparse"``).

    Returns
    -------
    tokens : Tensor, shape [N] (long)
    chars : list of str
        The vocabulary, sorted; ``chars[tokens[i]]`` is the ``i``-th character.
    """
    import importlib

    text = inspect.getsource(importlib.import_module(module_name))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars

