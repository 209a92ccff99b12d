r"""Budgets of a :class:`~riemannian_ref.models.transformer.FiberBundleTransformer`: parameters and FLOPs.

:func:`count_parameters` counts a model's (or a config's) parameters by
component, :func:`estimate_flops` its forward FLOPs by component, and
:func:`match_width` resizes a config to a parameter budget, so that modes can
be compared at matched size.
"""
from __future__ import annotations

import torch
from torch import nn

from .._checks import check_bool, check_int as _pos_int
from .config import FiberBundleConfig
from .transformer import FiberBundleTransformer

__all__ = ["count_parameters", "estimate_flops", "match_width"]

_COMPONENTS = ("embedding", "positions", "attention", "metric", "connection", "ffn", "ffn_metric",
               "norms", "head")


def _component(name: str) -> str:
    if name.startswith("tok_emb"):
        return "embedding"
    if name.startswith("pos_emb"):
        return "positions"
    if name.startswith("lm_head"):
        return "head"
    if ".attn.metric" in name or name.endswith(".attn.log_temp"):
        return "metric"
    if ".attn.rates." in name:
        return "connection"
    if ".attn." in name:
        return "attention"
    if ".ffn_metric." in name or name.endswith(".eta"):
        return "ffn_metric"
    if ".mlp." in name:
        return "ffn"
    return "norms"


def _check_config(config) -> None:
    if not isinstance(config, FiberBundleConfig):
        raise ValueError(f"config must be a FiberBundleConfig, got {type(config).__name__}")


def count_parameters(model_or_config) -> dict[str, int]:
    """Parameter counts by component, and ``"total"`` (tied weights counted once).

    Components: embedding, positions, attention (q/k frames, v, out), metric
    (attention metric nets), connection (content-rate maps), ffn, ffn_metric
    (metric of the preconditioned FFN and eta), norms, head (0 when tied).
    A config is instantiated on the CPU without consuming the caller's random
    numbers.

    Parameters
    ----------
    model_or_config : FiberBundleTransformer or FiberBundleConfig
        A model, or the config of one.

    Returns
    -------
    dict of str to int
        One count per component above, and ``"total"``.
    """
    if isinstance(model_or_config, FiberBundleConfig):
        with torch.random.fork_rng(devices=[]):  # counting leaves the caller's random stream alone
            model = FiberBundleTransformer(model_or_config)
    elif isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        raise ValueError(f"model_or_config must be a FiberBundleTransformer (or any nn.Module) or a "
                         f"FiberBundleConfig, got {type(model_or_config).__name__}")
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

    Parameters
    ----------
    config : FiberBundleConfig
        The config to resize; every field but ``d_model`` is kept.
    target : int
        The parameter count to match.
    exclude_embedding : bool
        Compare the count without the token embedding and the (untied) LM
        head, e.g. for a ``target`` counted the same way.
    widths : iterable of int, optional
        Candidate widths, in increasing order (default: the multiples of
        ``2 * n_heads`` described above). Widths the config rejects are
        skipped; the search stops at the first width whose count exceeds
        ``target``, since counts grow with the width.

    Returns
    -------
    FiberBundleConfig
        A validated copy of ``config`` with the best width (the smaller on a
        tie).

    Raises
    ------
    ValueError
        If no candidate width gives a valid config.
    """
    _check_config(config)
    _pos_int(target, "target")
    check_bool(exclude_embedding, "exclude_embedding")
    if widths is not None and not (isinstance(widths, (range, list, tuple))
                                   and all(isinstance(w, int) and not isinstance(w, bool) for w in widths)):
        raise ValueError(f"widths must be a range or sequence of ints, got {widths!r}")
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

    Parameters
    ----------
    config : FiberBundleConfig
    seq_len : int, optional
        Sequence length :math:`n` (default ``config.block_size``).

    Returns
    -------
    dict of str to float
        ``"projections"``, ``"scores"``, ``"softmax_mix"``, ``"metric"``,
        ``"connection"``, ``"ffn"``, ``"ffn_metric"``, ``"head"`` (0 for
        components the mode does not have) and ``"total"``.
    """
    _check_config(config)
    if seq_len is not None:
        _pos_int(seq_len, "seq_len")
    cfg = config
    n = cfg.block_size if seq_len is None else seq_len
    D, L, V, h, d = cfg.d_model, cfg.n_layers, cfg.out_dim or 0, cfg.n_heads, cfg.qk_dim
    hd = h * d
    r = cfg.metric_rank
    sides = 2 if cfg.metric_side == "mean" else 1
    out = dict.fromkeys(("projections", "scores", "softmax_mix", "metric", "connection", "ffn",
                         "ffn_metric", "head"), 0.0)
    conn = cfg.connection_resolved
    out["projections"] = L * 2 * n * (3 * D * hd + hd * D)  # q, k, v, out
    out["scores"] = L * 2 * n * n * hd  # q_i . k_j (+ norms, lower order)
    out["softmax_mix"] = L * (5 * n * n * h + 2 * n * n * hd)  # softmax + A V
    if cfg.mode != "euclidean":
        net = 0 if cfg.shared_metric else 2 * n * D * hd * r  # the metric network
        pair = 0 if cfg.shared_metric else sides * 2 * n * n * hd * r  # U^T (q - k) for every pair
        out["metric"] = L * (net + pair)
    if conn == "flat":
        out["connection"] = L * 3 * n * hd * (4 + r * sides)  # rotate q, k, v, output and U: O(n d r)
    if conn in ("content", "content_source"):
        rotations = 2 + (1 if cfg.metric_side in ("key", "mean") else 0)  # keys, values, (P^T on key side)
        out["connection"] = L * (2 * n * D * hd // 2 + n * n * hd + rotations * 3 * n * n * hd)
    if cfg.mlp:
        out["ffn"] = L * 2 * n * 2 * D * cfg.mlp_ratio * D
    if cfg.precondition_ffn_resolved:
        rf = cfg.ffn_metric_rank
        out["ffn_metric"] = L * (2 * n * D * D * rf + n * (4 * D * rf + 2 * D * rf * rf + rf ** 3))
    out["head"] = 2 * n * D * V
    out["total"] = sum(out.values())
    return out
