"""RiemannianAttention, the package's one attention module, against SDPA and the functional operator."""
import math

import pytest
import torch
import torch.nn.functional as F

import riemannian_ref as rr
from riemannian_ref.attention import functional
from riemannian_ref.geometry.metric import raw_from_lam

F64 = torch.float64
SIDES = ["key", "query", "mean"]


def cfg(**kw):
    return rr.AttentionConfig(**{**dict(d_model=16, n_heads=2, rank=2), **kw})


def _lam_one(m):
    """lam = 1 exactly in float64 (the float32 init rounds)."""
    with torch.no_grad():
        m.metric.rho.fill_(raw_from_lam(1.0, m.config.lam_min))


def _heads_out(m, o):
    B, h, n, dv = o.shape
    return m.out_proj(o.transpose(1, 2).reshape(B, n, h * dv))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("metric", ["token", "shared"])
def test_cross_attention_matches_the_operator_and_returns_weights(side, metric):
    torch.manual_seed(0)
    m = rr.RiemannianAttention(cfg(metric_side=side, metric=metric, learn_temperature=True,
                                   cross_attention=True)).double()
    with torch.no_grad():
        m.log_temp.fill_(0.3)
    x = torch.randn(3, 10, 16, dtype=F64)
    y = torch.randn(3, 7, 16, dtype=F64)  # cross-attention, n_q != n_k
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[0, 4:] = False  # padding
    out, A = m(x, y, key_mask=keep)
    assert A is None and out.shape == (3, 10, 16)
    # by hand: project, take the metric, fold the temperature t into lam and U (G -> t G)
    q, k, v = m.project(x, y)
    lam, U_q, U_k, _ = m.geometry(x, y)
    t = math.exp(0.3)
    # one network per side used: the keys' for "key", the queries' for "query", both for "mean"
    assert (m.metric is None) == (side == "query") and (m.metric_q is None) == (side == "key")
    lam_raw = {"key": lambda: m.metric.lam(), "query": lambda: m.metric_q.lam(),
               "mean": lambda: 0.5 * (m.metric.lam() + m.metric_q.lam())}[side]()
    torch.testing.assert_close(lam, t * lam_raw)
    o = rr.riemannian_attention_reference(q, k, v, keep.view(3, 1, 1, 7), U_q=U_q, U_k=U_k, lam=lam,
                                          metric_side=side)
    torch.testing.assert_close(out, _heads_out(m, o), rtol=1e-12, atol=1e-12)
    out2, A2 = m(x, y, key_mask=keep, return_weights=True)
    torch.testing.assert_close(out, out2, rtol=1e-12, atol=1e-12)
    assert A2.shape == (3, 2, 10, 7)
    torch.testing.assert_close(A2.sum(-1), torch.ones(3, 2, 10, dtype=F64))
    assert (A2[0, :, :, 4:] == 0).all() and (A2[1:] > 0).all()
    out.sum().backward()
    for name, p in m.named_parameters():  # every parameter takes part (DDP needs no unused ones)
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_rank0_equals_sdpa_with_key_bias():
    torch.manual_seed(1)
    m = rr.RiemannianAttention(cfg(rank=0)).double()
    _lam_one(m)
    x = torch.randn(2, 9, 16, dtype=F64)
    out, _ = m(x, is_causal=True)
    q, k, v = m.project(x)
    d = 8
    bias = -(k * k).sum(-1).unsqueeze(-2) / (2 * math.sqrt(d))
    causal = torch.zeros(9, 9, dtype=F64).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    ref = _heads_out(m, F.scaled_dot_product_attention(q, k, v, attn_mask=bias + causal))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # the projections are the frames: q = x W_Q per head
    torch.testing.assert_close(q[:, 1], x @ m.w_q[1])


def test_dot_scores_equal_sdpa():
    torch.manual_seed(1)
    m = rr.RiemannianAttention(cfg(scores="dot", causal=True)).double()
    assert m.metric is None
    x = torch.randn(2, 9, 16, dtype=F64)
    q, k, v = m.project(x)
    torch.testing.assert_close(m(x)[0], _heads_out(m, F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    torch.testing.assert_close(m.scores(x), q @ k.transpose(-1, -2) / math.sqrt(8))


def test_shared_metric_equals_dot_product_form():
    torch.manual_seed(2)
    m = rr.RiemannianAttention(cfg(metric="shared", rank=3)).double()
    x = torch.randn(2, 9, 16, dtype=F64)
    out, _ = m(x)
    q, k, v = m.project(x)
    lam, _, U, _ = m.geometry(x)
    assert U.shape[-3:] == (2, 8, 3) and U.numel() == 2 * 8 * 3  # one [d, r] factor per head
    Gq, key_bias = rr.dot_product_form(q, k, U, lam=lam)
    o = F.scaled_dot_product_attention(Gq, k, v, attn_mask=key_bias, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, _heads_out(m, o), rtol=1e-10, atol=1e-10)


def test_cross_attention_metric_comes_from_each_side():
    torch.manual_seed(3)
    m = rr.RiemannianAttention(cfg(metric_side="mean", kv_dim=12, cross_attention=True))
    x, y = torch.randn(2, 5, 16), torch.randn(2, 8, 12)
    lam, U_q, U_k, _ = m.geometry(x, y)
    assert U_q.shape == (2, 2, 5, 8, 2) and U_k.shape == (2, 2, 8, 8, 2)
    torch.testing.assert_close(U_q, m.metric_q(x)[1])  # queries' metric from the queries' own network
    torch.testing.assert_close(U_k, m.metric(y)[1])
    torch.testing.assert_close(lam, 0.5 * (m.metric.lam() + m.metric_q.lam()))
    out, _ = m(x, y)
    assert out.shape == (2, 5, 16)
    with pytest.raises(ValueError, match=r"context must have shape \[2, n_k, 12\]"):
        m(x, torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match="pass context"):
        m(x)


@pytest.mark.parametrize("connection", ["content", "content_source"])
def test_content_connections_in_the_module(connection):
    """The module passes its connection through: the edge rule of each content connection, its own rates."""
    torch.manual_seed(0)
    m = rr.RiemannianAttention(cfg(connection=connection, causal=True)).double()
    x = torch.randn(2, 9, 16, dtype=F64)
    out, _ = m(x)
    q, k, v = m.project(x)
    lam, U_q, U_k, rates = m.geometry(x)
    o = rr.connection_attention(q, k, v, is_causal=True, U_q=U_q, U_k=U_k, lam=lam, connection=connection,
                                rates=rates)
    torch.testing.assert_close(out, _heads_out(m, o))
    # the same weights under the other rule give another function
    other = "content_source" if connection == "content" else "content"
    m2 = rr.RiemannianAttention(cfg(connection=other, causal=True)).double()
    m2.load_state_dict(m.state_dict())
    assert (m2(x)[0] - out).abs().max() > 1e-6
    # the default content connection is inverse-consistent on the module's own rates
    phi = rr.geometry.transport.transport_angles(rates, torch.arange(9, dtype=F64),
                                                    rr.geometry.transport.edge_rule(connection))
    antisym = (phi + phi.transpose(-2, -3)).abs().max()
    assert (antisym == 0) if connection == "content" else (antisym > 1e-6)


def test_errors():
    with pytest.raises(ValueError, match="divisible"):
        rr.RiemannianAttention(cfg(d_model=15))
    with pytest.raises(ValueError, match="config must be an AttentionConfig"):
        rr.RiemannianAttention(dict(d_model=16))
    with pytest.raises(ValueError, match="cross_attention=False"):
        cfg(connection="flat", cross_attention=True)
    m = rr.RiemannianAttention(cfg())
    with pytest.raises(ValueError, match=r"x must have shape \[B, n, 16\]"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="key_mask must be a bool tensor"):
        m(torch.randn(2, 5, 16), key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask must be a bool tensor"):
        m(torch.randn(2, 5, 16), key_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="context is given"):
        m(torch.randn(2, 5, 16), torch.randn(2, 5, 16))


# ------------------------------------------------------------------ key_mask: O(n), the same as a dense mask

def _spy(monkeypatch):
    """Record the mask argument of every call to the blockwise operator."""
    seen = []
    real = functional.blockwise_operator
    monkeypatch.setattr(functional, "blockwise_operator", lambda *a, **kw: seen.append(kw["mask"]) or real(*a, **kw))
    return seen


@pytest.mark.parametrize("connection", ["trivial", "flat"])
@pytest.mark.parametrize("with_attn_mask", [False, True])
def test_key_mask_reaches_the_operator_per_key_and_equals_a_dense_mask(monkeypatch, connection, with_attn_mask):
    torch.manual_seed(4)
    B, n, h = 3, 11, 2
    m = rr.RiemannianAttention(cfg(connection=connection, causal=True)).double()
    x = torch.randn(B, n, 16, dtype=F64)
    keep = torch.rand(B, n) > 0.3
    keep[:, 0] = True
    attn_mask = None
    if with_attn_mask:  # a bool [n, n] mask on top: combined without growing to [B, h, n, n] either
        attn_mask = torch.rand(n, n) > 0.2
        attn_mask[:, 0] = True
    seen = _spy(monkeypatch)
    out, _ = m(x, attn_mask=attn_mask, key_mask=keep)
    assert len(seen) == 1
    mask = seen[0]
    assert mask.dtype == torch.bool
    if with_attn_mask:
        assert mask.shape == (B, 1, n, n)  # the broadcast of [n, n] and [B, 1, 1, n]: no head dimension
    else:
        assert mask.shape == (B, 1, 1, n) and torch.equal(mask.view(B, n), keep)  # O(B n), not O(B h n^2)
    dense = keep.view(B, 1, 1, n).expand(B, h, n, n)
    if with_attn_mask:
        dense = dense & attn_mask
    seen.clear()
    ref, A = m(x, attn_mask=dense.contiguous(), return_weights=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert (A.masked_select(~dense) == 0).all() and (A > 0).any()
    # padding is never attended: changing a padded token's state moves no other real output
    pad = (~keep).nonzero()
    if len(pad):
        b, j = pad[-1].tolist()
        x2 = x.clone()
        x2[b, j] += 5.0
        out2, _ = m(x2, attn_mask=attn_mask, key_mask=keep)
        others = [i for i in range(n) if i != j]
        torch.testing.assert_close(out2[b, others], out[b, others], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scores", ["metric", "dot"])
def test_baseline_and_method_take_the_same_mask_path(monkeypatch, scores):
    """Padding + causal: the dot-product baseline hands SDPA the per-key mask [B, 1, 1, n] and is_causal, as the
    metric path hands its operator (it built a dense [B, 1, n, n] float mask for SDPA), with the same result as
    that dense mask; rows that see only padding give 0 on both."""
    from riemannian_ref.attention import connections

    if not connections._sdpa_takes_mask_and_causal(torch.device("cpu")):
        pytest.skip("this torch's SDPA does not apply attn_mask and is_causal together: the pair is combined")
    torch.manual_seed(6)
    B, n = 2, 9
    m = rr.RiemannianAttention(cfg(scores=scores, causal=True)).double()
    x = torch.randn(B, n, 16, dtype=F64)
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[0, :3] = False  # left padding: causal rows 0..2 of sequence 0 see no key
    seen = []
    if scores == "dot":
        sdpa = F.scaled_dot_product_attention
        monkeypatch.setattr(F, "scaled_dot_product_attention",
                            lambda *a, **kw: seen.append((kw["attn_mask"].shape, kw["is_causal"])) or sdpa(*a, **kw))
    else:
        real = functional.blockwise_operator
        monkeypatch.setattr(functional, "blockwise_operator",
                            lambda *a, **kw: seen.append((kw["mask"].shape, kw["causal"])) or real(*a, **kw))
    out, _ = m(x, key_mask=keep)
    assert seen == [((B, 1, 1, n), True)]
    dense = keep.view(B, 1, 1, n) & torch.ones(n, n, dtype=torch.bool).tril()
    ref, _ = m(x, attn_mask=dense, is_causal=False, return_weights=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0, :3], m.out_proj.bias.expand(3, 16) if m.out_proj.bias is not None
                               else torch.zeros(3, 16, dtype=F64))


def test_key_mask_with_a_float_attn_mask():
    torch.manual_seed(5)
    m = rr.RiemannianAttention(cfg()).double()
    x = torch.randn(2, 6, 16, dtype=F64)
    keep = torch.tensor([[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    bias = torch.randn(6, 6, dtype=F64)
    out, _ = m(x, attn_mask=bias, key_mask=keep)
    dense = bias.masked_fill(~keep.view(2, 1, 1, 6), float("-inf"))
    torch.testing.assert_close(out, m(x, attn_mask=dense)[0], rtol=1e-12, atol=1e-12)


def test_compiled_module_runs_and_matches():
    """torch.compile (dynamo; the operator is a custom op in the graph) gives the eager result and gradients.

    The "eager" backend keeps this test fast; what can break is dynamo tracing the module.
    """
    torch.manual_seed(4)
    m = rr.RiemannianAttention(cfg())
    x = torch.randn(2, 6, 16)
    cm = torch.compile(m, backend="eager", fullgraph=False)
    out, _ = cm(x, is_causal=True)
    ref, _ = m(x, is_causal=True)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    g = m.w_q.grad.clone()
    m.zero_grad()
    ref.sum().backward()
    torch.testing.assert_close(g, m.w_q.grad)
    assert g.abs().max() > 0


@pytest.mark.parametrize("scores, connection", [("metric", "trivial"), ("metric", "flat"), ("metric", "content"),
                                                ("dot", "trivial"), ("dot", "flat")])
def test_a_float32_mask_under_autocast(scores, connection):
    """Regression: under autocast a float32 attn_mask (and the module's float32 lam) next to the autocast
    queries was refused; now the module runs, returns the autocast dtype and stays within a few bfloat16
    epsilons of the float32 module."""
    torch.manual_seed(7)
    m = rr.RiemannianAttention(cfg(scores=scores, connection=connection, causal=True))
    x = torch.randn(2, 8, 16)
    bias = 0.5 * torch.randn(2, 1, 8, 8)
    ref, _ = m(x, attn_mask=bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = m(x, attn_mask=bias)
    assert out.dtype == torch.bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    assert (out.float() - ref).abs().max() <= 8 * eps * ref.abs().max()
