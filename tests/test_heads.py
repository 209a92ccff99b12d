"""RecallHead: one attention head of the package's attention module reading rr.pair_lookup.

Oracle: the head written out by hand from its own parameters (embeddings, the
frame of its one head, the value/output maps), with dot-product scores or the
distance score of G = lam I.
"""
import math

import pytest
import torch

import riemannian_ref as rr

F64 = torch.float64
K, V, N = 10, 7, 5


def _data(n=4, seed=0):
    return rr.pair_lookup(n, n_keys=K, n_values=V, n_pairs=N, generator=torch.Generator().manual_seed(seed))


def _by_hand(m, idx):
    """Logits of the last position from the head's parameters: the definition."""
    V1 = m.n_values + 1
    x = m.E_k(idx // V1) + m.E_v(idx % V1)  # (B, n, D)
    xq, xc = x[:, -1:], x[:, :-1]
    a = m.attn
    q = xq @ a.w_q[0]  # (B, 1, d)
    k = xc @ a.w_k[0]  # (B, N, d)
    v = a.v_proj(xc)  # (B, N, D): one head, v_head_dim = D
    d = q.shape[-1]
    if a.config.scores == "dot":
        S = q @ k.transpose(-1, -2) / math.sqrt(d)
    else:  # metric rank 0: -lam |q - k|^2 / (2 sqrt d)
        lam = a.metric.lam()[0]
        S = -0.5 * lam * ((q.unsqueeze(-2) - k.unsqueeze(-3)) ** 2).sum(-1) / math.sqrt(d)
    o = a.out_proj(S.softmax(-1) @ v)  # (B, 1, D)
    return m.out(o)[:, 0]


@pytest.mark.parametrize("scores, rank", [("dot", 2), ("metric", 0)])
def test_forward_equals_the_head_by_hand(scores, rank):
    torch.manual_seed(0)
    m = rr.RecallHead(K, V, 16, 4, scores=scores, attention=dict(rank=rank)).double()
    d = _data()
    logits = m(d.x)
    assert logits.shape == (4, N + 1, V)
    assert torch.equal(logits[:, :-1], torch.zeros(4, N, V, dtype=F64))  # only the answer is scored
    torch.testing.assert_close(logits[:, -1], _by_hand(m, d.x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scores, rank", [("dot", 2), ("metric", 0), ("metric", 2)])
def test_gradients_reach_every_parameter(scores, rank):
    torch.manual_seed(0)
    m = rr.RecallHead(K, V, 16, 4, scores=scores, attention=dict(rank=rank))
    d = _data(8)
    loss = torch.nn.functional.cross_entropy(m(d.x)[:, -1], d.y[:, -1])
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if name != "E_v.weight":  # the padding row ("no value") gets no gradient; the others do
            assert p.grad.abs().sum() > 0, name
    assert torch.equal(m.E_v.weight.grad[V], torch.zeros(16))


def test_per_key_metrics_change_the_scores():
    """scores="metric" with rank 2 is not the rank-0 head: per-key metrics enter the scores."""
    torch.manual_seed(0)
    m = rr.RecallHead(K, V, 16, 4, scores="metric", attention=dict(rank=2)).double()
    d = _data()
    ref = _by_hand(m, d.x)  # rank 0 formula with the same frames
    assert (m(d.x)[:, -1] - ref).abs().max() > 1e-3
    with torch.no_grad():
        m.attn.metric.proj.weight.zero_()  # U = 0: back to G = lam I
    torch.testing.assert_close(m(d.x)[:, -1], ref, rtol=1e-12, atol=1e-12)


def test_learns_pair_lookup_with_the_training_loop():
    torch.manual_seed(0)
    tr = rr.pair_lookup(512, n_keys=8, n_values=4, n_pairs=3, generator=torch.Generator().manual_seed(1))
    va = rr.pair_lookup(256, n_keys=8, n_values=4, n_pairs=3, generator=torch.Generator().manual_seed(2))
    m = rr.RecallHead(8, 4, 32, 8, scores="dot")
    res = rr.train(m, tr, va, rr.TrainConfig(lr=3e-2, steps=150, batch_size=None, eval_interval=150,
                                             schedule="constant", grad_clip=None))
    assert res.history["val_accuracy"][0] < 0.45  # chance is 1/4
    assert res.final["val_accuracy"] > 0.9


@pytest.mark.parametrize("call, match", [
    (lambda: rr.RecallHead(4, 4, 8, 2, scores="cosine"), "scores must be one of"),
    (lambda: rr.RecallHead(4, 4, 8, 0), "head_dim must be an int >= 1"),
    (lambda: rr.RecallHead(4, 4, 8, 2, attention=dict(rank=-1)), "attention: rank must be an int >= 0"),
    (lambda: rr.RecallHead(4, 4, 8, 2, attention=dict(d_model=4)), "attention.d_model is the head's width"),
    (lambda: rr.RecallHead(4, 4, 8, 2, scores="metric", attention=dict(scores="dot")),
     "attention.scores is set by RecallHead"),
    (lambda: rr.RecallHead(4, 4, 8, 2, attention=[2]), "attention must be an AttentionConfig or a mapping"),
    (lambda: rr.RecallHead(4, 4, 8, 2)(torch.tensor([[0]])), r"n_pairs \+ 1"),
    (lambda: rr.RecallHead(4, 4, 8, 2)(torch.tensor([[0, 20]])), r"ids in \[0, n_keys"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
