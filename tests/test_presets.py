"""The presets of the one Transformer: tiny, small, attention_stack (the rank-collapse stacks), grokking.

Every preset in every mode builds and takes a training step through rr.train
(the full-batch loss falls); the attention stacks keep the properties the
rank-collapse chapters rely on (row-stochastic mixing, identical rows as a
fixed point, collapse without skips); the grokking preset has orthonormal
frames and is causal. The config holds one AttentionConfig: presets and
``replace`` merge attention options, the model sets the attention's sizes, and
every option of AttentionConfig reaches every block unchanged.
"""
import dataclasses

import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.attention import layer as attention_layer
from riemannian_ref.geometry.metric import METRIC_FORMS
from riemannian_ref._checks import METRIC_SIDES
from riemannian_ref.geometry.transport import CONNECTIONS
from riemannian_ref.models import MODES
from riemannian_ref.models import config as config_module

DT = torch.float64
FBC = rr.FiberBundleConfig


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ one step through rr.train

def _preset_case(preset, mode):
    """A config of the preset in this mode and a small task it can read."""
    if preset == "tiny":
        return FBC.tiny(mode=mode), rr.associative_recall(16, vocab_size=16, n_pairs=3, seq_len=12, generator=_g(0))
    if preset == "small":
        return FBC.small(mode=mode), rr.associative_recall(8, vocab_size=64, n_pairs=4, seq_len=16, generator=_g(0))
    if preset == "attention_stack":  # a per-token classifier on the counting task
        data = rr.counting(16, seq_len=8, vocab_size=4, generator=_g(0))
        return FBC.attention_stack(mode=mode, vocab_size=4, n_classes=8, n_layers=4, d_model=16,
                                   skip=True, mlp=True, layer_norm=True), data
    train, _ = rr.modular_arithmetic(7, generator=_g(0))
    return FBC.grokking(8, mode=mode), train


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", ["tiny", "small", "attention_stack", "grokking"])
def test_every_preset_builds_and_takes_a_training_step(preset, mode):
    cfg, data = _preset_case(preset, mode)
    assert cfg.mode == mode
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # full batch and the training set as validation set: the logged loss is the training loss
    res = rr.train(model, data, data, rr.TrainConfig(lr=1e-3, steps=1, batch_size=None, eval_interval=1))
    assert res.steps_done == 1 and res.history["step"] == [0, 1]
    assert res.n_params == rr.count_parameters(model)["total"] == rr.count_parameters(cfg)["total"]
    l0, l1 = res.history["val_loss"]
    assert torch.isfinite(torch.tensor([l0, l1])).all() and l1 < l0  # one descent step
    moved = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any(".attn.w_q" in k for k in moved) and any("lm_head" in k for k in moved)
    assert rr.evaluate(model, data)["loss"] == pytest.approx(l1, rel=1e-6)


@pytest.mark.parametrize("scores, rank", [("dot", 2), ("metric", 0), ("metric", 2)])
def test_recall_head_takes_a_training_step_on_pair_lookup(scores, rank):
    data = rr.pair_lookup(32, n_keys=10, n_values=5, n_pairs=4, generator=_g(0))
    torch.manual_seed(0)
    head = rr.RecallHead(10, 5, 16, 4, scores=scores, attention=dict(rank=rank))
    before = head.attn.w_q.detach().clone()
    res = rr.train(head, data, data, rr.TrainConfig(lr=1e-3, steps=1, batch_size=None, eval_interval=1))
    l0, l1 = res.history["val_loss"]
    assert l1 < l0 and not torch.equal(head.attn.w_q, before)


def test_preset_fields():
    t = FBC.tiny()
    assert (t.vocab_size, t.block_size, t.d_model, t.n_heads, t.n_layers, t.mode) == (16, 32, 32, 2, 2,
                                                                                       "fiber_bundle")
    s = FBC.small()
    assert (s.vocab_size, s.block_size, s.d_model, s.n_heads, s.n_layers, s.attention.rank) == (64, 128, 64, 4, 4, 4)
    a = FBC.attention_stack()
    assert a.vocab_size is None and a.out_dim is None and (a.skip, a.mlp, a.layer_norm, a.causal) == (False,) * 4
    assert a.mode == "euclidean" and not a.uses_learned_positions and not a.precondition_ffn_resolved
    gk = FBC.grokking(98)
    assert (gk.vocab_size, gk.block_size, gk.n_layers, gk.mode, gk.attention.qk_init, gk.tie_weights) == (
        98, 3, 1, "euclidean", "orthonormal", False)
    assert FBC.tiny(d_model=48).d_model == 48 and FBC.grokking(5, n_heads=2).n_heads == 2  # overrides
    assert t.replace(mode="euclidean") == FBC.tiny(mode="euclidean")
    with pytest.raises(Exception):  # frozen
        t.mode = "euclidean"


# ------------------------------------------------------------------ one nested attention config

def test_attention_options_merge_into_the_preset_and_follow_the_model():
    s = FBC.small(attention=dict(metric_side="mean"))
    assert (s.attention.rank, s.attention.metric_side) == (4, "mean")  # merged into the preset's rank 4
    r = s.replace(attention=dict(metric="shared"))
    assert (r.attention.rank, r.attention.metric_side, r.attention.metric) == (4, "mean", "shared")
    w = s.replace(d_model=128, n_heads=8, block_size=64, causal=False, init="unit", mode="euclidean")
    a = w.attention  # the model's fields re-derived, the options kept
    assert (a.d_model, a.n_heads, a.max_positions, a.causal, a.scores, a.init_std) == (128, 8, 64, False, "dot", None)
    assert (a.rank, a.metric_side) == (4, "mean") and FBC(**w.to_dict()) == w
    whole = FBC.small(attention=rr.AttentionConfig(rank=1))  # an AttentionConfig: every option at once
    assert whole.attention.rank == 1 and whole.attention.max_positions == 128
    # a connection left to the mode follows the mode through replace; one that is given stays
    fb = FBC.tiny()
    assert fb.attention.connection == "content" and fb.replace(mode="euclidean").connection_resolved == "trivial"
    assert fb.replace(mode="riemannian").replace(mode="fiber_bundle").connection_resolved == "content"
    given = FBC.tiny(mode="riemannian", attention=dict(connection="trivial"))
    assert given.replace(mode="fiber_bundle").connection_resolved == "trivial"
    assert rr.AttentionConfig().connection is None and rr.AttentionConfig().connection_resolved == "trivial"


def test_old_flat_names_say_where_they_moved():
    for make in (FBC.tiny, FBC.small, FBC.attention_stack, lambda **kw: FBC.grokking(5, **kw), FBC.tiny().replace):
        with pytest.raises(ValueError, match=r"metric_rank moved to attention: use attention=dict\(rank=4\)"):
            make(metric_rank=4)
    with pytest.raises(ValueError, match=r"shared_metric moved to attention: use attention=dict\(metric='shared'\)"):
        FBC.tiny(shared_metric=True)
    for old, new in config_module.MOVED_FIELDS.items():
        with pytest.raises(ValueError, match=f"{old} moved to attention: use attention=dict\\({new}="):
            FBC.tiny(**{old: True if new == "metric" else 1})
    with pytest.raises(ValueError, match="unknown fields \\['metric_rank'\\].*metric_rank is now rank"):
        FBC.tiny(attention=dict(metric_rank=2))
    with pytest.raises(ValueError, match="attention must be an AttentionConfig or a mapping"):
        FBC.tiny(attention=2)


@pytest.mark.parametrize("field, value, where", [
    ("d_model", 8, "the model's width: set FiberBundleConfig.d_model"),
    ("max_positions", 8, "the model's context: set FiberBundleConfig.block_size"),
    ("scores", "dot", "set by the mode: set FiberBundleConfig.mode"),
    ("init_std", 0.5, "set by the init scheme: set FiberBundleConfig.init"),
    ("cross_attention", True, "not an option of the model"),
])
def test_the_models_fields_of_the_attention_come_from_the_model(field, value, where):
    with pytest.raises(ValueError, match=f"attention.{field} is {where}"):
        FBC.tiny(mode="riemannian", attention={field: value})
    assert getattr(FBC.tiny(attention={field: getattr(FBC.tiny().attention, field)}).attention, field) == getattr(
        FBC.tiny().attention, field)  # the model's own value is accepted (and AttentionConfig's default)
    with pytest.raises(ValueError, match=r"attention: subspace must be an int in \[1, 16\]"):  # the model's d
        FBC.tiny(mode="riemannian", attention=dict(subspace=17))


def _another_value(default):
    """Values to try for an option other than its default (the first one accepted is used)."""
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, (int, float)):
        return [default * 2 if default else 1, default + 1, default / 2]
    choices = [c for t in (attention_layer.SCORES, attention_layer.METRICS, attention_layer.QK_INITS, METRIC_SIDES,
                           METRIC_FORMS, CONNECTIONS) for c in t]
    if default is None:
        return [1, 2, 0.5, *choices]
    return [c for t in (attention_layer.SCORES, attention_layer.METRICS, attention_layer.QK_INITS, METRIC_SIDES,
                        METRIC_FORMS, CONNECTIONS) if default in t for c in t if c != default]


@pytest.mark.parametrize("option", config_module.ATTENTION_OPTIONS)
def test_every_attention_option_reaches_every_block_unchanged(option):
    """Adding an attention option takes one field of AttentionConfig and its code in RiemannianAttention: the
    model passes any option through (this test covers a new field by itself, from dataclasses.fields)."""
    owned = {f.name for f in dataclasses.fields(rr.AttentionConfig)} - set(config_module.ATTENTION_OPTIONS)
    assert owned == set(config_module._MODEL_OWNED)
    default = {f.name: f.default for f in dataclasses.fields(rr.AttentionConfig)}[option]
    for value in _another_value(default):
        try:
            cfg = FBC.tiny(mode="riemannian", attention={option: value})
        except ValueError:
            continue
        break
    else:
        pytest.fail(f"no value other than the default {default!r} of {option} was accepted: extend _another_value")
    model = rr.FiberBundleTransformer(cfg)
    for blk in model.blocks:
        assert blk.attn.config is cfg.attention and getattr(blk.attn.config, option) == value
    assert FBC(**cfg.to_dict()).attention == cfg.attention  # and a saved config keeps it


# ------------------------------------------------------------------ attention stacks (rank collapse)

VARIANTS = [
    dict(mode="euclidean"),
    dict(mode="riemannian", attention=dict(metric="shared", rank=2)),
    dict(mode="riemannian", attention=dict(metric_side="key", rank=2)),
    dict(mode="riemannian", attention=dict(metric_side="query", rank=1)),
    dict(mode="riemannian", attention=dict(metric_side="mean", rank=3)),
    dict(mode="riemannian", attention=dict(connection="flat", rank=2)),
    dict(mode="riemannian", attention=dict(connection="content", metric_side="mean", rank=2)),
]
ARCHS = [dict(), dict(skip=True), dict(mlp=True), dict(skip=True, mlp=True, layer_norm=True)]


def _id(kw):
    return "-".join(f"{v}" for v in kw.values()) or "pure"


def stack(seed=0, **kw):
    torch.manual_seed(seed)
    return rr.FiberBundleTransformer(FBC.attention_stack(**{**dict(d_model=16, n_heads=2, n_layers=3), **kw})).double()


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
@pytest.mark.parametrize("arch", ARCHS, ids=_id)
def test_stack_shapes_and_row_stochastic(gen, variant, arch):
    model = stack(**variant, **arch)
    X = torch.randn(2, 5, 16, generator=gen, dtype=DT)
    out = model(embeds=X, return_hidden=True, return_weights=True)
    H, W = out.hidden, out.weights
    assert out.logits is None and out.loss is None  # a bare stack: no head
    assert H.shape == (4, 2, 5, 16) and W.shape == (3, 2, 2, 5, 5)
    assert torch.equal(H[0], X)  # no positions, no token embedding
    assert torch.all(W >= 0)
    torch.testing.assert_close(W.sum(-1), torch.ones(3, 2, 2, 5, dtype=DT))
    # the same forward without weights (the blockwise operator instead of the dense path)
    torch.testing.assert_close(model(embeds=X, return_hidden=True).hidden, H, rtol=1e-12, atol=1e-12)
    assert not torch.equal(H[-1], H[-2])


def test_euclidean_stack_layer_is_sdpa(gen):
    model = stack(mode="euclidean")
    attn = model.blocks[0].attn
    X = torch.randn(2, 5, 16, generator=gen, dtype=DT)
    q, k, v = attn.project(X)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # bidirectional
    ref = attn.out_proj(o.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(model(embeds=X, return_hidden=True).hidden[1], ref)  # pure: no skip, no norm


def test_fiber_bundle_mode_with_its_components_off_is_riemannian_mode(gen):
    X = torch.randn(2, 6, 16, generator=gen, dtype=DT)
    a = stack(mode="riemannian", attention=dict(rank=2, metric_side="mean"))
    b = stack(mode="fiber_bundle", attention=dict(connection="trivial", rank=2, metric_side="mean"))
    assert a.state_dict().keys() == b.state_dict().keys()
    torch.testing.assert_close(a(embeds=X, return_hidden=True).hidden, b(embeds=X, return_hidden=True).hidden)


def test_strength_zero_metrics_agree(gen):
    """U = 0 at init: per-token metrics are lam I, whatever the side."""
    X = torch.randn(2, 6, 16, generator=gen, dtype=DT)
    outs = [stack(mode="riemannian", attention=dict(rank=2, strength=0.0, metric_side=s))(
        embeds=X, return_hidden=True).hidden for s in ("key", "query", "mean")]
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2])
    hetero = stack(mode="riemannian", attention=dict(rank=2, metric_side="key"))(embeds=X, return_hidden=True).hidden
    assert (hetero - outs[0]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
@pytest.mark.parametrize("arch", ARCHS, ids=_id)
def test_identical_rows_are_a_fixed_point_unless_values_are_transported(gen, variant, arch):
    """Row-stochastic mixing of identical rows gives identical rows; a position-dependent transport does not."""
    x = torch.randn(2, 1, 16, generator=gen, dtype=DT)
    X = x.expand(2, 7, 16).contiguous()
    H = stack(**variant, **arch)(embeds=X, return_hidden=True).hidden
    r = rr.relative_residual(H[-1], "fro")
    if variant.get("attention", {}).get("connection") in ("flat", "content"):
        assert torch.all(r > 1e-3)
    else:
        assert torch.all(r < 1e-12)


def test_pure_stack_collapses_and_skip_stops_it(gen):
    X = torch.randn(4, 16, 16, generator=gen, dtype=DT)
    pure = stack(n_layers=8)
    skip = stack(n_layers=8, skip=True, mlp=True, layer_norm=True)
    assert rr.relative_residual(pure(embeds=X, return_hidden=True).hidden[-1]).max() < 1e-8
    assert rr.relative_residual(skip(embeds=X, return_hidden=True).hidden[-1]).min() > 1e-2


def test_qk_gain_scales_the_frames(gen):
    a = stack(mode="euclidean").blocks[0].attn
    b = stack(mode="euclidean", attention=dict(qk_gain=2.0)).blocks[0].attn
    torch.testing.assert_close(b.w_q, 2 * a.w_q)
    torch.testing.assert_close(b.w_k, 2 * a.w_k)
    assert torch.equal(b.v_proj.weight, a.v_proj.weight)
    X = torch.randn(1, 5, 16, generator=gen, dtype=DT)
    torch.testing.assert_close(b.scores(X), 4 * a.scores(X))  # dot scores scale by qk_gain**2


def test_path_products(gen):
    model = stack(mode="euclidean")
    X = torch.randn(2, 5, 16, generator=gen, dtype=DT)
    W = model(embeds=X, return_weights=True).weights
    P = rr.attention_path_products(W)
    assert P.shape == (3, 2, 5, 5)
    torch.testing.assert_close(P[2], W[2, :, 0] @ W[1, :, 0] @ W[0, :, 0])
    torch.testing.assert_close(P.sum(-1), torch.ones(3, 2, 5, dtype=DT))  # products of stochastic matrices
    heads = torch.tensor([1, 0, 1])
    P1 = rr.attention_path_products(W, heads)
    torch.testing.assert_close(P1[2], W[2, :, 1] @ W[1, :, 0] @ W[0, :, 1])
    with pytest.raises(ValueError, match="heads must lie in"):
        rr.attention_path_products(W, torch.tensor([0, 2, 0]))
    with pytest.raises(ValueError, match="heads must be a long tensor"):
        rr.attention_path_products(W, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="weights must have"):
        rr.attention_path_products(W[0])


@pytest.mark.parametrize("kw, match", [
    (dict(mode="cosine"), "mode must be one of"),
    (dict(d_model=10, n_heads=3), "divisible"),
    (dict(attention=dict(connection="levi-civita")), "connection must be one of"),
    (dict(n_layers=0), "n_layers must be an int >= 1"),
    (dict(attention=dict(qk_gain=0.0)), "qk_gain"),
    (dict(n_classes=4), "n_classes needs a vocab_size"),
    (dict(precondition_ffn=True), "precondition_ffn needs mlp=True"),
])
def test_bad_stack_config(kw, match):
    with pytest.raises(ValueError, match=match):
        FBC.attention_stack(**kw)


def test_bad_stack_input():
    model = stack()
    with pytest.raises(ValueError, match=r"embeds must have shape \[B, n, 16\]"):
        model(embeds=torch.zeros(2, 5, 8, dtype=DT))
    with pytest.raises(ValueError, match="no token embedding"):
        model(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="no head"):
        model(embeds=torch.zeros(2, 5, 16, dtype=DT), targets=torch.zeros(2, 5, dtype=torch.long))


def test_stack_classifier_learns_counting():
    tr = rr.counting(256, seq_len=6, vocab_size=3, generator=_g(0))
    va = rr.counting(128, seq_len=6, vocab_size=3, generator=_g(1))
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(FBC.attention_stack(vocab_size=3, n_classes=6, d_model=16, n_heads=2,
                                                          n_layers=2, skip=True, mlp=True, layer_norm=True))
    res = rr.train(model, tr, va, rr.TrainConfig(lr=1e-2, steps=60, batch_size=32, eval_interval=60))
    assert res.history["val_loss"][-1] < 0.8 * res.history["val_loss"][0]
    assert res.final["val_accuracy"] > 0.5


# ------------------------------------------------------------------ the grokking preset (was TinyTransformer)

@pytest.fixture
def grok():
    torch.manual_seed(0)
    return rr.FiberBundleTransformer(FBC.grokking(11, block_size=8, d_model=16, n_heads=2, head_dim=4,
                                                  mlp_ratio=2, n_layers=2))


def test_grokking_shapes_and_orthonormal_frames(grok):
    x = torch.randint(0, 11, (3, 8), generator=_g(1))
    assert grok(x).logits.shape == (3, 8, 11)
    frames = grok.qk_frame_parameters()
    assert len(frames) == 4 and all(f.shape == (2, 16, 4) for f in frames)
    for f in frames:
        rr.Stiefel().check_point(f.detach(), atol=1e-5)  # raises unless orthonormal
    assert grok.lm_head.weight is not grok.tok_emb.weight  # untied head


def test_grokking_is_causal(grok):
    x = torch.randint(0, 11, (2, 8), generator=_g(2))
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 1) % 11
    with torch.no_grad():
        a, b = grok(x).logits, grok(y).logits
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-4


def test_grokking_same_seed_same_model():
    torch.manual_seed(3)
    a = rr.FiberBundleTransformer(FBC.grokking(5))
    torch.manual_seed(3)
    b = rr.FiberBundleTransformer(FBC.grokking(5))
    torch.manual_seed(4)
    c = rr.FiberBundleTransformer(FBC.grokking(5))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_grokking_reads_modular_arithmetic_and_refuses_long_inputs(grok):
    train, _ = rr.modular_arithmetic(7, generator=_g(0))
    model = rr.FiberBundleTransformer(FBC.grokking(train.vocab_size))
    assert model(train.x).logits.shape == (len(train), 3, 8)
    with pytest.raises(ValueError, match="exceeds block_size = 8"):
        grok(torch.zeros(1, 9, dtype=torch.long))
