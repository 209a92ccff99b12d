r"""The Fiber Bundle Transformer: the package's one Transformer, with presets for every model the book trains.

One :class:`FiberBundleConfig` describes the model; its ``mode`` chooses the
attention scores and the defaults of the fibre-bundle components, each of
which is also a field of its own:

- ``"euclidean"``: scaled dot-product attention (SDPA), a plain feed-forward
  network, learned absolute positions. The baseline.
- ``"riemannian"``: the scores become metric distances,
  :math:`s_{ij} = -\tfrac{1}{2\tau}(q_i - k_j)^\top \bar G_{ij} (q_i - k_j)`,
  with per-token, per-head metrics :math:`G_i = \lambda I + U_i U_i^\top`.
  Everything else as ``"euclidean"``.
- ``"fiber_bundle"``: Riemannian scores, and by default a ``"content"``
  connection that transports keys, key metrics and values to the query's
  fibre (positions then come from the connection, not from a learned table),
  and the metric-preconditioned feed-forward step
  :math:`x \leftarrow x + \eta\,G_x^{-1}\mathrm{FFN}(\mathrm{LN}(x))` with
  :math:`G_x = \lambda I_D + U_x U_x^\top` (Woodbury, :math:`O(D r)`): a
  learned, input-dependent damping of the feed-forward update, strongest
  along the :math:`r` directions of :math:`U_x` (reading it as a Riemannian
  steepest-descent step is an interpretation: the FFN output is not the
  differential of a function).

Switching ``mode`` from ``"riemannian"`` to ``"fiber_bundle"`` changes three
things at once (the connection, the positions and the feed-forward step).
``attention.connection``, ``precondition_ffn`` and ``learned_positions`` are
options of their own that override each default, so each component can be switched
alone, and an effect of the mode is only attributed by that ablation.

The block is pre-norm and residual by default; ``skip``, ``mlp`` and
``layer_norm`` switch those parts off, which gives the pure self-attention
networks of Dong, Cordonnier and Loukas (2021) and their variants
(:meth:`FiberBundleConfig.attention_stack`). With ``vocab_size=None`` the model
reads embeddings (``forward(embeds=...)``) and has no head.

Every attention is a :class:`~riemannian_ref.attention.layer.RiemannianAttention`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_bool, check_int, check_number, check_tensor, shape_str
from .._checks import autocast_dtype, check_values
from .._io import atomic_write
from ..attention.layer import AttentionConfig, RiemannianAttention
from ..geometry.metric import LowRankMetric, MetricNet, SubspaceFactors
from .config import ATTENTION_OPTIONS, MOVED_FIELDS, FiberBundleConfig, nest_flat

__all__ = ["FiberBundleTransformer"]


class FiberBundleOutput(NamedTuple):
    """What :meth:`FiberBundleTransformer.forward` returns.

    Parameters
    ----------
    logits : Tensor, shape [B, n, out_dim], or None
        Next-token logits (or class logits) at every position; None for a
        model without a head.
    loss : Tensor, shape [], or None
        Mean cross-entropy over the positions whose target is not ``-1``;
        None when no targets were given.
    hidden : Tensor, shape [L + 1, B, n, D], or None
        The residual stream: the embeddings, then the output of every block
        (``return_hidden``).
    weights : Tensor, shape [L, B, h, n, n], or None
        Every block's attention weights (``return_weights``).
    diagnostics : dict or None
        Per-layer tensors (``return_diagnostics``; see :meth:`FiberBundleTransformer.forward`).
    """

    logits: Tensor | None
    loss: Tensor | None
    hidden: Tensor | None
    weights: Tensor | None
    diagnostics: dict | None


class MLP(nn.Module):
    """The feed-forward network of a block, ``Linear -> activation -> Linear``, sized by ``config``
    (``d_model``, ``mlp_ratio``, ``activation``, ``bias``, ``dropout``, ``init``)."""

    def __init__(self, config: FiberBundleConfig):
        super().__init__()
        D, H = config.d_model, config.mlp_ratio * config.d_model
        self.fc = nn.Linear(D, H, bias=config.bias)
        self.proj = nn.Linear(H, D, bias=config.bias)
        self.act = nn.GELU() if config.activation == "gelu" else nn.ReLU()
        self.drop = nn.Dropout(config.dropout)
        with torch.no_grad():
            gpt2 = config.init == "gpt2"
            residual = 1.0 / math.sqrt(2 * config.n_layers) if config.scales_residual else 1.0
            he = 2.0 if config.activation == "relu" else 1.0
            self.fc.weight.normal_(0.0, 0.02 if gpt2 else math.sqrt(he / D))
            self.proj.weight.normal_(0.0, (0.02 if gpt2 else H ** -0.5) * residual)
            for lin in (self.fc, self.proj):
                if lin.bias is not None:
                    lin.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [B, n, D] to [B, n, D]."""
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    r"""One block: :math:`y = x + \mathrm{Attn}(N(x))`, then :math:`y + \mathrm{FFN}(N(y))` (each part optional).

    Without ``skip`` the sums lose their first term; without ``layer_norm``
    :math:`N` is the identity; without ``mlp`` the second step is skipped;
    with the preconditioned FFN the update is :math:`\eta\,G_y^{-1}\mathrm{FFN}(N(y))`.

    Parameters
    ----------
    config : FiberBundleConfig
    layer : int
        Index of the block.
    """

    def __init__(self, config: FiberBundleConfig, layer: int = 0):
        super().__init__()
        self.config = config
        D = config.d_model
        self.ln1 = nn.LayerNorm(D, bias=config.bias) if config.layer_norm else nn.Identity()
        self.attn = RiemannianAttention(config.attention)
        self.drop = nn.Dropout(config.dropout)
        self.ln2 = self.mlp = self.ffn_metric = self.eta = None
        if config.mlp:
            self.ln2 = nn.LayerNorm(D, bias=config.bias) if config.layer_norm else nn.Identity()
            self.mlp = MLP(config)
        if config.precondition_ffn_resolved:
            # G_x = lam I_D + U_x U_x^T on the model space: a one-"head" metric net of dimension D
            # the preconditioner keeps the unbounded factor form (metric_form is about attention's metrics)
            self.ffn_metric = MetricNet(D, 1, D, config.ffn_metric_rank, lam_init=config.attention.lam_init,
                                        strength=config.attention.strength, form="factor")
            self.eta = nn.Parameter(torch.tensor([float(config.eta_init)]))  # (1,): FSDP2 shards no 0-d parameter

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # files and checkpoints written while eta was 0-d load as they were (load_state_dict passes a copy)
        key = prefix + "eta"
        if self.eta is not None and isinstance(state_dict.get(key), Tensor) and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor, *, key_mask: Tensor | None = None,
                return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """``x`` [B, n, D] to the block's output [B, n, D] and (optionally) its attention weights."""
        a, A = self.attn(self.ln1(x), key_mask=key_mask, return_weights=return_weights)
        a = self.drop(a)
        x = x + a if self.config.skip else a
        if self.mlp is not None:
            z = self.ln2(x)
            f = self.mlp(z)  # the feed-forward update                     (B, n, D)
            if self.ffn_metric is not None:
                lam, U = self.ffn_metric(z)  # (1,), (B, 1, n, D, r)
                if autocast_dtype(z.device.type) is None:
                    f = self.eta * LowRankMetric(lam, U.squeeze(1)).solve(f)  # eta G_x^{-1} f: damped along U_x
                else:  # autocast (mixed dtypes): a linear solve, computed and returned in float32 as autocast does
                    with torch.autocast(z.device.type, enabled=False):
                        f = self.eta * LowRankMetric(lam.float(), U.squeeze(1).float()).solve(f.float())
            x = x + f if self.config.skip else f
        return x, A


class FiberBundleTransformer(nn.Module):
    """The package's Transformer (module docstring): a language model, a classifier or a bare stack.

    Parameters
    ----------
    config : FiberBundleConfig
        The model; its presets cover every model the book trains.
    """

    def __init__(self, config: FiberBundleConfig):
        super().__init__()
        if not isinstance(config, FiberBundleConfig):
            raise ValueError(f"config must be a FiberBundleConfig, got {type(config).__name__}")
        self.config = config
        D, gpt2 = config.d_model, config.init == "gpt2"
        self.tok_emb = self.pos_emb = self.ln_f = self.lm_head = None
        if config.vocab_size is not None:
            self.tok_emb = nn.Embedding(config.vocab_size, D)
            nn.init.normal_(self.tok_emb.weight, std=0.02 if gpt2 else 1.0)
        if config.uses_learned_positions:
            self.pos_emb = nn.Embedding(config.block_size, D)
            nn.init.normal_(self.pos_emb.weight, std=0.02 if gpt2 else 0.1)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        if config.out_dim is not None:
            self.ln_f = nn.LayerNorm(D, bias=config.bias)  # before the head, whatever the blocks do
            self.lm_head = nn.Linear(D, config.out_dim, bias=False)
            if config.tie_weights:
                self.lm_head.weight = self.tok_emb.weight
            else:
                nn.init.normal_(self.lm_head.weight, std=0.02 if gpt2 else D ** -0.5)

    def qk_frame_parameters(self) -> list[nn.Parameter]:
        """The per-head query/key frames of every block, each [h, D, d] (a Stiefel optimiser's group)."""
        return [p for blk in self.blocks for p in blk.attn.qk_frames()]

    def _embed(self, idx: Tensor | None, embeds: Tensor | None) -> Tensor:
        cfg = self.config
        if (idx is None) == (embeds is None):
            raise ValueError("give exactly one of idx (token ids) and embeds (states [B, n, D])")
        if idx is not None:
            if self.tok_emb is None:
                raise ValueError("this model has no token embedding (vocab_size=None): pass embeds=")
            idx = check_tensor(idx, "idx", min_dim=2, floating=False)
            if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"idx must be an integer tensor of shape [B, n], got {idx.dtype} {shape_str(idx)}")
            if idx.numel():
                check_values(((idx >= 0) & (idx < cfg.vocab_size)).all(),
                             f"idx must hold token ids in [0, vocab_size) = [0, {cfg.vocab_size})",
                             lambda: f", got values in [{int(idx.min())}, {int(idx.max())}]")
            x = self.tok_emb(idx)  # (B, n, D)
        else:
            x = check_tensor(embeds, "embeds", min_dim=3)
            if x.dim() != 3 or x.shape[-1] != cfg.d_model:
                raise ValueError(f"embeds must have shape [B, n, {cfg.d_model}], got {shape_str(x)}")
        n = x.shape[1]
        if n > cfg.block_size:
            raise ValueError(f"sequence length {n} exceeds block_size = {cfg.block_size}")
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(n, device=x.device))
        return self.drop(x)

    def forward(self, idx: Tensor | None = None, targets: Tensor | None = None, *, embeds: Tensor | None = None,
                key_mask: Tensor | None = None, return_hidden: bool = False, return_weights: bool = False,
                return_diagnostics: bool = False, diagnostic_samples: int = 64) -> FiberBundleOutput:
        """Run the model.

        Parameters
        ----------
        idx : LongTensor, shape [B, n], optional
            Token ids (models with a ``vocab_size``).
        targets : LongTensor, shape [B, n], optional
            Target ids; ``-1`` entries are ignored by the loss.
        embeds : Tensor, shape [B, n, D], optional
            Input states instead of ``idx`` (positions are still added if the
            model has them).
        key_mask : Tensor, shape [B, n], bool, optional
            ``True`` for real tokens, ``False`` for padding (never attended).
        return_hidden : bool
            Also return the residual stream [L + 1, B, n, D].
        return_weights : bool
            Also return every block's attention weights [L, B, h, n, n]
            (computed densely).
        return_diagnostics : bool
            Also return per-layer tensors, computed without gradient:
            ``"relative_residual"`` [L + 1] (:math:`\\|X - \\mathbf 1 \\bar x^\\top\\|_F / \\|X\\|_F`
            of the stream, averaged over the batch) and, in metric modes,
            ``"lam"``, ``"holonomy"``, ``"transport_closure"`` (on the keys),
            ``"metric_compatibility"`` (relative to the heterogeneity: 1 is
            no better than no transport; where every metric of a head is the
            same, 0 when the transport preserves it, as for
            :math:`G = \\lambda I` with ``attention.rank=0`` or factors at 0, and
            ``inf`` when it does not) and ``"metric_heterogeneity"``
            (:math:`\\|G_i - G_j\\|_F`), each [L, h], averaged over the batch
            and ``diagnostic_samples`` fixed random triangles/pairs
            (:mod:`riemannian_ref.analysis.bundle`).
        diagnostic_samples : int
            Number of sampled triangles and pairs.

        Returns
        -------
        FiberBundleOutput
            ``(logits, loss, hidden, weights, diagnostics)``, None for what was not asked.
        """
        for name, flag in (("return_hidden", return_hidden), ("return_weights", return_weights),
                           ("return_diagnostics", return_diagnostics)):
            check_bool(flag, name)
        check_int(diagnostic_samples, "diagnostic_samples")
        x = self._embed(idx, embeds)
        hidden, weights = [x], []
        try:
            for blk in self.blocks:
                x, A = blk(x, key_mask=key_mask, return_weights=return_weights)
                hidden.append(x)
                weights.append(A)
        except torch.linalg.LinAlgError as exc:  # a Cholesky of a metric: positive definite unless not finite
            raise self._solve_error(hidden[0]) from exc
        logits = loss = None
        if self.lm_head is not None:
            logits = self.lm_head(self.ln_f(x))  # (B, n, out_dim)
            if targets is not None:
                self._check_targets(targets, logits.shape[:2])
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        elif targets is not None:
            raise ValueError("targets given, but this model has no head (vocab_size=None)")
        H = torch.stack(hidden) if (return_hidden or return_diagnostics) else None  # (L + 1, B, n, D)
        diag = self._diagnostics(H, diagnostic_samples) if return_diagnostics else None
        return FiberBundleOutput(logits, loss, H if return_hidden else None,
                                 torch.stack(weights) if return_weights else None, diag)

    @torch.no_grad()
    def _solve_error(self, x: Tensor) -> FloatingPointError:
        """Why a metric's Cholesky failed: the non-finite parameters, else the input ``x`` (embedded).

        Checked only after the failure, so the forward pass has no extra host sync.
        """
        where = "a metric's Cholesky factorisation failed in the forward pass"
        bad = [k for k, p in self.named_parameters() if not bool(p.isfinite().all())]
        if bad:
            return FloatingPointError(f"{where}: parameters not finite: {', '.join(bad)}")
        if not bool(x.isfinite().all()):
            return FloatingPointError(f"{where}: the input (embeds) is not finite")
        return FloatingPointError(f"{where}, with finite parameters and input: the activations overflowed")

    def _check_targets(self, targets, shape) -> None:
        K = self.config.out_dim
        if not isinstance(targets, Tensor) or targets.dtype != torch.int64 or targets.shape != shape:
            got = f"{targets.dtype} {shape_str(targets)}" if isinstance(targets, Tensor) else type(targets).__name__
            raise ValueError(f"targets must have shape {shape_str(shape)} and dtype int64, got {got}")
        if targets.numel() and (int(targets.min()) < -1 or int(targets.max()) >= K):
            raise ValueError(f"targets must hold ids in [0, {K}) or -1 (ignored), got values in "
                             f"[{int(targets.min())}, {int(targets.max())}]")

    @torch.no_grad()
    def _diagnostics(self, H: Tensor, n_samples: int) -> dict:
        from ..analysis.bundle import (relative_defect, holonomy_defect, metric_compatibility_defect, sample_pairs,
                                       sample_triangles, transport_closure_defect)
        from ..geometry.transport import connection_rates, edge_rule

        Hd = H.detach()
        res = Hd - Hd.mean(-2, keepdim=True)
        out = {"relative_residual": (res.flatten(-2).norm(dim=-1) / Hd.flatten(-2).norm(dim=-1)).mean(-1)}
        if self.config.mode == "euclidean":
            return out
        lams, hol, clo, comp, het = [], [], [], [], []
        for layer, blk in enumerate(self.blocks):
            z = blk.ln1(Hd[layer])
            _, k, _ = blk.attn.project(z)
            lam, U_q, U_k, rates = blk.attn.geometry(z)
            lams.append(lam)
            B, h, n, d = k.shape
            conn = blk.attn.config.connection_resolved
            if d % 2 or n < 3 or U_q is None and U_k is None:
                continue
            rule = edge_rule(conn)
            if conn in ("trivial", "flat"):
                rates = connection_rates(conn, n, d, rates=rates, like=k)
            g = torch.Generator().manual_seed(0)  # the same triangles every call: comparable numbers
            tri = sample_triangles(n, n_samples, generator=g, device=k.device)
            pairs = sample_pairs(n, n_samples, generator=g, device=k.device)
            U = U_k if U_k is not None else U_q
            if isinstance(U, SubspaceFactors):  # per-token factors in a shared subspace: multiplied out
                U = U.dense()
            if U.dim() == 4:  # shared [1, h, d, r]: the same metric for every token
                U = U.unsqueeze(2).expand(B, h, n, *U.shape[-2:])
            elif U.shape[0] != B:  # a position metric [1, h, n, d, r]: the same for every sequence
                U = U.expand(B, *U.shape[1:])
            hol.append(holonomy_defect(rates, tri, rule=rule).expand(B, h).mean(0))  # (h,)
            clo.append(transport_closure_defect(k, rates, tri, rule=rule).mean(0))  # (h,)
            defect = metric_compatibility_defect(lam.view(h, 1), U, rates, pairs, rule=rule)  # (B, h)
            hetero = metric_compatibility_defect(lam.view(h, 1), U, torch.zeros_like(rates), pairs)
            comp.append(relative_defect(defect.mean(0), hetero.mean(0)))  # (h,); equal metrics: 0, not 0/0
            het.append(hetero.mean(0))  # (h,)
        out["lam"] = torch.stack(lams)  # (L, h)
        if hol:
            out.update(holonomy=torch.stack(hol), transport_closure=torch.stack(clo),
                       metric_compatibility=torch.stack(comp), metric_heterogeneity=torch.stack(het))
        return out

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Sample continuations autoregressively, shape [B, n + max_new_tokens].

        Parameters
        ----------
        idx : LongTensor, shape [B, n]
            The prompt.
        max_new_tokens : int
            Number of tokens to add, ``>= 0``.
        temperature : float
            ``0`` takes the argmax (greedy); otherwise logits are divided by it.
        top_k : int, optional
            Sample among the ``top_k`` most likely tokens (``>= 1``).
        generator : torch.Generator, optional
            CPU generator for the draws.

        Returns
        -------
        LongTensor, shape [B, n + max_new_tokens]
            The context is cropped to the last ``block_size`` tokens at every step.
        """
        if self.lm_head is None or self.config.n_classes is not None:
            raise ValueError("generate needs a language model (vocab_size set, n_classes None)")
        if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.shape[1] == 0:
            got = shape_str(idx) if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"idx must be a prompt of token ids [B, n] with n >= 1, got {got}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        check_int(max_new_tokens, "max_new_tokens", 0)
        check_number(temperature, "temperature", low=0.0)
        if top_k is not None:
            check_int(top_k, "top_k")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:]).logits[:, -1, :]  # (B, vocab)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    # ------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Save the config and the weights in one file that :meth:`load` reads back safely.

        The write is atomic: the file goes to a temporary file in the same
        directory, is flushed to disk and then renamed over ``path``, so a
        crash or kill at any moment leaves either the previous file or the new
        one, complete (at worst a stray ``.<name>.<random>.tmp`` file next to
        it). The file records the format version and every field of the
        config, so :meth:`load` rebuilds the same model without relying on
        defaults. Non-finite weights are written as they are (a diverged
        model can be inspected), but :meth:`load` refuses them.

        Parameters
        ----------
        path : str or path-like
            File to write (``torch.save`` format holding only plain values and
            tensors, so it loads with ``weights_only=True``); missing parent
            directories are created.

        Raises
        ------
        ValueError
            Naming ``path``, before anything is written, if it is not a str or
            path-like, is a directory, or its directory cannot take a new file.
        """
        blob = {"format": _FORMAT, "config": self.config.to_dict(), "state_dict": self.state_dict()}
        atomic_write(path, lambda tmp: torch.save(blob, tmp), "path")

    @classmethod
    def load(cls, path: str | os.PathLike, *, config: FiberBundleConfig | None = None,
             map_location=None) -> "FiberBundleTransformer":
        """Rebuild a model saved by :meth:`save`, strictly (no code from the file runs).

        The file is read with ``torch.load(weights_only=True)``: only tensors
        and plain values are unpickled, and nothing stored in it is called.
        Its config must name every field of :class:`FiberBundleConfig` and,
        in ``attention``, every attention option, and no other, so no field
        silently takes a default. Files of formats 1 to 3 (written before
        the attention options were nested) hold a flat config, the attention options as fields of
        their own (``metric_rank``, ``shared_metric``, ...): they are nested
        by one table (``MOVED_FIELDS`` in ``riemannian_ref.models.config``).
        Files of formats 1 and 2 may lack the fields added since, and only
        those; they get the values that reproduce the model of then (format
        1: ``position_metric=False``, ``metric_bias=False``,
        ``scale_residual=True``, ``metric_subspace=None``; both:
        ``metric_form="factor"``, the unbounded metrics). A format-1 file of
        a model with the content connection that lacks ``scale_residual`` is
        refused unless ``config`` names the connection's rule: version 0.2.0
        used the rule now called ``"content_source"``. The weights must match
        that config exactly (names and shapes) and be finite. Each parameter
        and buffer comes back in the dtype it was saved in.

        A file of version 0.2.0 with the content connection loads as the model
        it was (and :meth:`save` then writes the current format) with::

            saved = nest_flat(torch.load(path, weights_only=True)["config"])
            # its rule and its metrics
            saved["attention"].update(connection="content_source",
                                      metric_form="factor")
            cfg = FiberBundleConfig(**saved)
            model = FiberBundleTransformer.load(path, config=cfg)

        (``nest_flat`` from ``riemannian_ref.models.config``).

        Parameters
        ----------
        path : str or path-like
            A file written by :meth:`save`.
        config : FiberBundleConfig, optional
            The config the caller expects; a file with another config is
            refused, naming the fields that differ. Fields the file lacks are
            taken from it: the way to load a damaged or hand-edited file whose
            config misses fields, or a format-1 file whose content-connection
            rule is not recorded (then :meth:`save` it again).
        map_location : optional
            As in :func:`torch.load`.

        Returns
        -------
        FiberBundleTransformer

        Raises
        ------
        ValueError
            Naming the file, if it is unreadable or not a saved model, has an
            unknown format version, its config is not a dict of fields, lacks
            fields (and no ``config`` supplies them), has unknown fields, is
            not valid, or differs from ``config``, or if its weights are not a
            dict of tensors, do not match the config, or are not finite (the
            parameters are named).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a str or path-like naming a file written by save, got "
                             f"{type(path).__name__}")
        if config is not None and not isinstance(config, FiberBundleConfig):
            raise ValueError(f"config must be a FiberBundleConfig or None, got {type(config).__name__}")
        name = os.fspath(path)
        try:
            blob = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:  # a damaged, foreign or unsafe file
            raise ValueError(f"{name}: not a readable riemannian_ref model file ({exc})") from None
        version = _format_version(blob)
        if version is None:
            raise ValueError(f"{name}: not a riemannian_ref model file (format {_FORMAT!r} expected)")
        if version not in _READABLE_VERSIONS:
            raise ValueError(f"{name}: a riemannian_ref model file of format version {version}; this version of "
                             f"the package reads versions {list(_READABLE_VERSIONS)} (a newer package wrote it?)")
        saved_cfg = _saved_config(name, blob.get("config"), version, config)
        if config is not None and config != saved_cfg:
            mine, theirs = _leaves(saved_cfg), _leaves(config)
            diff = [f"{k}: file {mine[k]!r}, expected {theirs[k]!r}" for k in sorted(mine) if mine[k] != theirs[k]]
            raise ValueError(f"{name}: saved with another config ({'; '.join(diff)})")
        state = blob.get("state_dict")
        if not isinstance(state, dict):
            raise ValueError(f"{name}: the saved state_dict is a {type(state).__name__}, not a dict of tensors")
        for k, v in state.items():
            if not isinstance(k, str) or not isinstance(v, Tensor):
                raise ValueError(f"{name}: the saved state_dict must map names to tensors, but entry {k!r} is "
                                 f"a {type(v).__name__}" + ("" if isinstance(k, str) else " under a non-str key"))
        bad = [k for k, v in state.items()
               if (v.is_floating_point() or v.is_complex()) and not bool(v.isfinite().all())]
        if bad:
            raise ValueError(f"{name}: the saved weights are not finite in {', '.join(bad)} (a diverged model; "
                             f"torch.load(path, weights_only=True) reads the file for inspection)")
        model = cls(saved_cfg)
        own = dict(model.named_buffers())
        own.update(model.named_parameters())
        for k, t in own.items():  # the file's floating dtypes (a float64 model stays float64)
            s = state.get(k)
            if isinstance(s, Tensor) and s.is_floating_point() and t.is_floating_point() and s.dtype != t.dtype:
                t.data = t.data.to(s.dtype)
        try:
            model.load_state_dict(state)
        except Exception as exc:  # missing/extra keys, shapes, or anything else torch refuses
            raise ValueError(f"{name}: the weights do not match the saved config ({exc})") from None
        return model


def _format_version(blob) -> int | None:
    """The format version of a loaded file (None: not a model file)."""
    fmt = blob.get("format") if isinstance(blob, dict) else None
    if not isinstance(fmt, str) or not fmt.startswith(_FORMAT_PREFIX):
        return None
    tail = fmt[len(_FORMAT_PREFIX):]
    return int(tail) if tail.isascii() and tail.isdigit() else None


def _saved_config(name: str, saved, version: int, expected: FiberBundleConfig | None) -> FiberBundleConfig:
    """The config a file records, checked field by field (format migrations applied)."""
    _check_fields_dict(name, saved, "the saved config")
    if version < 4:  # flat: the attention options as fields of their own
        values = _complete(name, saved, _FLAT_FIELDS, _CONFIG_MIGRATIONS[version],
                           None if expected is None else _flat(expected), version)
        if version == 1 and "scale_residual" not in saved and _resolved_connection(values) == "content":
            # The rule of connection="content" changed while format 1 was written: version 0.2.0 took the rates
            # from the source token (today's "content_source"); later versions from both endpoints. Files that
            # record scale_residual came after the change; without it, the file does not say which rule it used.
            if expected is None or expected.connection_resolved not in ("content", "content_source"):
                raise ValueError(
                    f"{name}: a format-1 file with the content connection that does not say which rule it used "
                    f"(version 0.2.0 took the rates from the source token, today's connection='content_source'; "
                    f"later development versions used today's 'content'); load it with config= giving the "
                    f"connection it was trained with, e.g. config=FiberBundleConfig(..., attention=dict("
                    f"connection='content_source')) for a file of 0.2.0 (FiberBundleTransformer.load shows how), "
                    f"and save it again")
            values["connection"] = _flat(expected)["connection"]
        values = nest_flat(values)
        values["attention"] = {"metric": "token", **values["attention"]}  # "token" unless a flag said otherwise
    else:
        values = _complete(name, saved, _CONFIG_FIELDS, {}, None if expected is None else expected.to_dict(),
                           version)
        _check_fields_dict(name, values["attention"], "the saved config's attention")
    want = None if expected is None else expected.to_dict()
    values["attention"] = _complete(name, values["attention"], frozenset(ATTENTION_OPTIONS), _absent_options(),
                                    None if want is None else want["attention"], version, "attention.")
    try:
        return FiberBundleConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: the saved config is not valid: {exc}") from None


def _absent_options() -> dict:
    """The attention options a saved file may lack, with the value that rebuilds its model.

    An :class:`AttentionConfig` field declares it as ``metadata={"absent": value}``
    (its behaviour before it existed): so adding an option needs no new file format.
    A file lacking an option without one is refused.
    """
    return {f.name: f.metadata["absent"] for f in dataclasses.fields(AttentionConfig)
            if "absent" in f.metadata and f.name in ATTENTION_OPTIONS}


def _check_fields_dict(name: str, saved, what: str) -> None:
    if not isinstance(saved, dict) or not all(isinstance(k, str) for k in saved):
        got = type(saved).__name__ if not isinstance(saved, dict) else "dict with non-str keys"
        raise ValueError(f"{name}: {what} is a {got}, not a dict of FiberBundleConfig fields")


def _complete(name: str, saved: dict, known: frozenset, added: dict, expected: dict | None, version: int,
              prefix: str = "") -> dict:
    """``saved``'s fields, refusing unknown ones; those missing from ``added`` (fields added since ``version``,
    with their values of then) or else from ``expected``."""
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ValueError(f"{name}: the saved config has unknown fields {[prefix + k for k in unknown]} (not "
                         f"fields of FiberBundleConfig of format version {version})")
    migrated = {k: v for k, v in added.items() if k not in saved}
    missing = sorted(known - set(saved) - set(migrated))
    if missing and expected is None:
        raise ValueError(f"{name}: the saved config lacks the fields {[prefix + k for k in missing]} (format "
                         f"version {version}); if you know the values the model was built with, load it with "
                         f"config=FiberBundleConfig(...) giving them, and save it again")
    return {**migrated, **{k: expected[k] for k in missing}, **saved}


def _flat(cfg: FiberBundleConfig) -> dict:
    """A config as the flat fields of format <= 3 (the inverse of ``nest_flat``)."""
    values = cfg.to_dict()
    att = values.pop("attention")
    values.update({old: att[new] for old, new in MOVED_FIELDS.items() if new != "metric"})
    return {**values, "shared_metric": att["metric"] == "shared", "position_metric": att["metric"] == "position"}


def _leaves(cfg: FiberBundleConfig) -> dict:
    """Every field of a config, the attention's as ``attention.<option>`` (the connection resolved)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "attention"}
    return {**values, **{f"attention.{k}": getattr(cfg.attention, k) for k in ATTENTION_OPTIONS}}


def _resolved_connection(values: dict):
    """The connection a flat saved config's values resolve to (as FiberBundleConfig.connection_resolved)."""
    if values.get("connection") is not None:
        return values["connection"]
    return "content" if values.get("mode") == "fiber_bundle" else "trivial"


#: The format of the files :meth:`FiberBundleTransformer.save` writes ("<prefix><version>"). Versions 2
#: to 4 record every config field; version 3 added the metric parameterisation (``metric_form``,
#: ``max_gain``, ``gain_bias``), and files of versions 1 and 2 hold the unbounded factor form; version 4
#: nests the attention options in ``attention`` (versions 1 to 3: flat, :data:`MOVED_FIELDS`).
_FORMAT_PREFIX = "riemannian_ref.FiberBundleTransformer/"
_FORMAT_VERSION = 4
_FORMAT = f"{_FORMAT_PREFIX}{_FORMAT_VERSION}"
#: For each older format version, the (flat) config fields added since, with the values that reproduce the
#: models of then (each field's behaviour before it existed). A file of that version may lack exactly
#: these (it was written before some of them existed); any other missing field is refused.
_FACTOR_FORM = {"metric_form": "factor", "max_gain": 4.0, "gain_bias": -2.0}  # metrics before version 3
_CONFIG_MIGRATIONS: dict[int, dict[str, object]] = {
    1: {"position_metric": False,  # per-token metrics (metric fields over positions did not exist)
        "metric_bias": False,      # linear metric networks
        "scale_residual": True,    # residual projections / sqrt(2L) at init with gpt2 init or skip
        "metric_subspace": None,   # unconstrained per-token factors
        **_FACTOR_FORM},
    2: dict(_FACTOR_FORM),
    3: {},
}
_READABLE_VERSIONS = tuple(sorted({*_CONFIG_MIGRATIONS, _FORMAT_VERSION}))
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(FiberBundleConfig))
_FLAT_FIELDS = (_CONFIG_FIELDS - {"attention"}) | frozenset(MOVED_FIELDS)  # the configs of formats 1 to 3
