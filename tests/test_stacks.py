"""Attention stacks used by the rank-collapse experiments."""
import pytest
import torch

import riemannian_ref as rr

DT = torch.float64
VARIANTS = [
    dict(attention="euclidean"),
    dict(attention="shared", rank=2),
    dict(attention="hetero", metric_side="key", rank=2),
    dict(attention="hetero", metric_side="query", rank=1),
    dict(attention="hetero", metric_side="mean", rank=3),
    dict(attention="fiber", connection="trivial", rank=2),
    dict(attention="fiber", connection="flat", rank=2),
    dict(attention="fiber", connection="content", metric_side="mean", rank=2),
]
ARCHS = [dict(), dict(skip=True), dict(mlp=True), dict(skip=True, mlp=True, layer_norm=True)]


def make(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = rr.StackConfig(d_model=16, n_heads=2, depth=3, **kw)
    return rr.AttentionStack(cfg).double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_shapes_and_row_stochastic(gen, variant, arch):
    stack = make(**variant, **arch)
    X = torch.randn(2, 5, 16, generator=gen, dtype=DT)
    H, W = stack(X, return_weights=True)
    assert H.shape == (4, 2, 5, 16) and W.shape == (3, 2, 2, 5, 5)
    assert torch.equal(H[0], X)
    assert torch.all(W >= 0)
    assert torch.allclose(W.sum(-1), torch.ones((), dtype=DT))
    assert torch.equal(stack(X), H)  # same forward without weights


def test_euclidean_layer_is_sdpa(gen):
    stack = make(attention="euclidean")
    layer = stack.layers[0]
    X = torch.randn(2, 5, 16, generator=gen, dtype=DT)
    q, k, v = layer.qkv(X).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ref = layer.out(o.transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(layer(X)[0], ref)


def test_fiber_trivial_equals_hetero(gen):
    X = torch.randn(2, 6, 16, generator=gen, dtype=DT)
    a = make(attention="hetero", rank=2, metric_side="mean")(X)
    b = make(attention="fiber", connection="trivial", rank=2, metric_side="mean")(X)
    assert torch.allclose(a, b)


def test_strength_zero_metrics_agree(gen):
    """U = 0 at init: per-token metrics are lam I, whatever the side."""
    X = torch.randn(2, 6, 16, generator=gen, dtype=DT)
    outs = [make(attention="hetero", rank=2, strength=0.0, metric_side=s)(X) for s in ("key", "query", "mean")]
    assert torch.allclose(outs[0], outs[1]) and torch.allclose(outs[0], outs[2])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_identical_rows_are_a_fixed_point_unless_values_are_transported(gen, variant, arch):
    """Row-stochastic mixing of identical rows gives identical rows; a position-dependent transport does not."""
    x = torch.randn(2, 1, 16, generator=gen, dtype=DT)
    X = x.expand(2, 7, 16).contiguous()
    H = make(**variant, **arch)(X)
    r = rr.relative_residual(H[-1], "fro")
    if variant.get("connection") in ("flat", "content"):
        assert torch.all(r > 1e-3)
    else:
        assert torch.all(r < 1e-12)


def test_pure_stack_collapses_and_skip_stops_it(gen):
    X = torch.randn(4, 16, 16, generator=gen, dtype=DT)
    torch.manual_seed(0)
    pure = rr.AttentionStack(rr.StackConfig(d_model=16, n_heads=2, depth=8)).double()
    torch.manual_seed(0)
    skip = rr.AttentionStack(rr.StackConfig(d_model=16, n_heads=2, depth=8, skip=True, mlp=True,
                                            layer_norm=True)).double()
    assert rr.relative_residual(pure(X)[-1]).max() < 1e-8
    assert rr.relative_residual(skip(X)[-1]).min() > 1e-2


def test_qk_gain_scales_scores(gen):
    a = make(attention="euclidean").layers[0]
    b = make(attention="euclidean", qk_gain=2.0).layers[0]
    D = 16
    assert torch.allclose(b.qkv.weight[: 2 * D], 2 * a.qkv.weight[: 2 * D])
    assert torch.equal(b.qkv.weight[2 * D:], a.qkv.weight[2 * D:])


def test_path_products(gen):
    stack = make(attention="euclidean")
    X = torch.randn(2, 5, 16, generator=gen, dtype=DT)
    _, W = stack(X, return_weights=True)
    P = rr.attention_path_products(W)
    assert P.shape == (3, 2, 5, 5)
    assert torch.allclose(P[2], W[2, :, 0] @ W[1, :, 0] @ W[0, :, 0])
    assert torch.allclose(P.sum(-1), torch.ones((), dtype=DT))  # products of stochastic matrices
    heads = torch.tensor([1, 0, 1])
    P1 = rr.attention_path_products(W, heads)
    assert torch.allclose(P1[2], W[2, :, 1] @ W[1, :, 0] @ W[0, :, 1])
    with pytest.raises(ValueError, match="heads must lie in"):
        rr.attention_path_products(W, torch.tensor([0, 2, 0]))
    with pytest.raises(ValueError, match="heads must be a long tensor"):
        rr.attention_path_products(W, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="weights must have"):
        rr.attention_path_products(W[0])


def test_bad_config_and_input():
    with pytest.raises(ValueError, match="attention must be one of"):
        rr.StackConfig(attention="cosine")
    with pytest.raises(ValueError, match="divisible"):
        rr.StackConfig(d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="connection must be one of"):
        rr.StackConfig(connection="levi-civita")
    with pytest.raises(ValueError, match="rank >= 1"):
        rr.StackConfig(attention="shared", rank=0)
    with pytest.raises(ValueError, match="depth must be a positive int"):
        rr.StackConfig(depth=0)
    with pytest.raises(ValueError, match="qk_gain"):
        rr.StackConfig(qk_gain=0.0)
    stack = make()
    with pytest.raises(ValueError, match=r"x must have shape \[B, n, 16\]"):
        stack(torch.zeros(2, 5, 8, dtype=DT))


def test_histogram_task_and_training_reduces_loss():
    task = rr.HistogramTask(n=6, vocab=3)
    tok, y = task.sample(4, torch.Generator().manual_seed(0))
    for b in range(4):
        for i in range(6):
            assert y[b, i] == (tok[b] == tok[b, i]).sum() - 1
    torch.manual_seed(0)
    model = rr.StackClassifier(rr.StackConfig(d_model=16, n_heads=2, depth=2, skip=True, mlp=True,
                                              layer_norm=True), task.vocab, task.n)
    losses = rr.train_classifier(model, task, steps=30, batch=16, lr=1e-2, generator=torch.Generator().manual_seed(1))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
