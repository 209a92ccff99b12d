r"""One attention head reading a value out of (key, value) pair tokens.

The model of the intrinsic-rank chapter: the smallest network in which the
query-key dimension is the object of study. Its attention is the package's
one module, :class:`~riemannian_ref.attention.layer.RiemannianAttention`.
"""
from __future__ import annotations

from torch import Tensor, nn

from collections.abc import Mapping

from .._checks import check_choice, check_int, check_tensor, shape_str
from ..attention.layer import AttentionConfig, RiemannianAttention
from .config import attention_fields, owned_attention

__all__ = ["RecallHead"]

_HEAD_OWNED = {"d_model": "the head's width: set RecallHead's d_model", "n_heads": "1 in a RecallHead",
               "head_dim": "the head's query-key dimension: set RecallHead's head_dim",
               "v_head_dim": "d_model in a RecallHead", "cross_attention": "True in a RecallHead (the query "
               "reads the pairs)", "scores": "set by RecallHead's scores"}


class RecallHead(nn.Module):
    r"""One attention head that answers :func:`~riemannian_ref.data.pair_lookup`.

    A pair token is embedded as :math:`x_t = E_k[\text{key}_t] + E_v[\text{value}_t]`,
    the query token as :math:`E_k[\text{query}]` (its "value" row is zero). The
    query attends to the pair tokens through one head whose query-key
    dimension is ``head_dim`` (the rank of :math:`W_Q W_K^\top`), with a dot
    product (``scores="dot"``) or a Riemannian distance with per-key metrics
    of rank ``attention["rank"]`` (``scores="metric"``; rank 0 is the
    plain distance head with :math:`G = \lambda I`, the control that separates
    the distance form from per-token metrics); the attended value (width
    ``d_model``) is decoded to logits over the value symbols.

    Parameters
    ----------
    n_keys, n_values : int
        Vocabulary sizes of the task.
    d_model : int
        Embedding width :math:`D`.
    head_dim : int
        Query-key dimension :math:`d`.
    scores : {"dot", "metric"}
        Dot-product or Riemannian scores.
    attention : AttentionConfig or mapping, optional
        The attention's options (e.g. ``dict(rank=0, metric_form="factor")``);
        the head sets its sizes, ``scores`` and ``cross_attention=True``.
    """

    def __init__(self, n_keys: int, n_values: int, d_model: int, head_dim: int, *, scores: str = "dot",
                 attention: AttentionConfig | Mapping | None = None):
        super().__init__()
        for name, val in (("n_keys", n_keys), ("n_values", n_values), ("d_model", d_model),
                          ("head_dim", head_dim)):
            check_int(val, name)
        check_choice(scores, "scores", ("dot", "metric"))
        owned = dict(d_model=d_model, n_heads=1, head_dim=head_dim, v_head_dim=d_model, cross_attention=True,
                     scores=scores)
        given = attention_fields({} if attention is None else attention, owned, _HEAD_OWNED)
        self.n_keys, self.n_values = n_keys, n_values
        self.E_k = nn.Embedding(n_keys, d_model)
        self.E_v = nn.Embedding(n_values + 1, d_model, padding_idx=n_values)  # the last row: "no value"
        self.attn = RiemannianAttention(owned_attention(given, owned))
        self.out = nn.Linear(d_model, n_values)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of the answer at the last position.

        Parameters
        ----------
        idx : LongTensor, shape [B, n_pairs + 1]
            Pair tokens then the query token, as made by :func:`~riemannian_ref.data.pair_lookup`.

        Returns
        -------
        Tensor, shape [B, n_pairs + 1, n_values]
            Only the last position carries logits; the others are zeros (they
            are not scored), so the model fits the ``[B, n, C]`` interface of
            :func:`~riemannian_ref.training.train`.
        """
        idx = check_tensor(idx, "idx", min_dim=2, floating=False)
        V1 = self.n_values + 1
        if idx.dim() != 2 or idx.shape[1] < 2:
            raise ValueError(f"idx must have shape [B, n_pairs + 1] with n_pairs >= 1, got {shape_str(idx)}")
        if int(idx.min()) < 0 or int(idx.max()) >= self.n_keys * V1:
            raise ValueError(f"idx must hold ids in [0, n_keys * (n_values + 1)) = [0, {self.n_keys * V1})")
        x = self.E_k(idx // V1) + self.E_v(idx % V1)  # (B, n, D)
        o, _ = self.attn(x[:, -1:], context=x[:, :-1])  # the query reads the pairs     (B, 1, D)
        logits = x.new_zeros(*idx.shape, self.n_values)
        logits[:, -1:] = self.out(o)
        return logits
