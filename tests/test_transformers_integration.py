"""The transformers backend (riemannian_ref.integrations.transformers) on small models built from configs.

No weights are downloaded: Llama (grouped-query attention), Qwen2 (grouped-query attention and a
sliding-window layer), Mistral (a sliding window in every layer) and GPT-2 configs with 2 layers and
tiny widths. The oracle for the switched model is transformers' own SDPA backend with distance
attention's dot-product form: with G = lam I, -(s lam / 2)|q - k|^2 = s lam q.k - (s lam / 2)|k|^2 +
(constant per row), so SDPA on queries lam q with the key-norm bias -(s lam / 2)|k_j|^2 must give the
same model, masks and all. With factors, a layer is checked against the dense reference, and the
rotary models against what SDPA guarantees: relative positions (a shift of every position, left
padding) change nothing.
"""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (AttentionInterface, DynamicCache, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

import riemannian_ref as rr  # noqa: E402
from riemannian_ref.geometry.metric import lam_from_raw, raw_from_lam  # noqa: E402
from riemannian_ref.integrations import transformers as rr_hf  # noqa: E402

F64 = torch.float64
V = 37


def _llama(**kw):
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        **kw))


def _qwen2(**kw):
    # layer 0 full attention, layer 1 a sliding window of 4 tokens
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        use_sliding_window=True, sliding_window=4, max_window_layers=1, **kw))


def _mistral(**kw):
    # a sliding window of 4 tokens in every layer
    return MistralForCausalLM(MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, sliding_window=4, **kw))


def _gpt2(**kw):
    # attn_pdrop = 0.1 (GPT-2's default): attention dropout in training
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, **kw))


MODELS = {"llama": _llama, "qwen2": _qwen2, "mistral": _mistral, "gpt2": _gpt2}
ROTARY = ["llama", "mistral", "qwen2"]


def _switched(name, seed=0, dtype=F64, **attach_kw):
    torch.manual_seed(seed)
    model = MODELS[name]().to(dtype)
    rr_hf.attach(model, **attach_kw)
    model.set_attn_implementation(rr_hf.NAME)
    return model


def _sdpa_key_norm(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' SDPA backend on distance attention's dot-product form, lam per head from the layer."""
    lam, _ = module.riemannian_metric(key)  # (h_kv,)
    g = query.shape[1] // key.shape[1]
    lam = lam.repeat_interleave(g).view(1, -1, 1, 1)  # (1, h, 1, 1)
    s = query.shape[-1] ** -0.5 if scaling is None else scaling
    bias = -(s * lam / 2) * repeat_kv(key, g).pow(2).sum(-1).unsqueeze(-2)  # (B, h, 1, n_k)
    return sdpa_attention_forward(module, query * lam, key, value, attention_mask, scaling=s, position_bias=bias,
                                  **kwargs)


AttentionInterface.register("sdpa_key_norm", _sdpa_key_norm)
AttentionMaskInterface.register("sdpa_key_norm", sdpa_mask)


def _batch(gen, B=3, n=12):
    ids = torch.randint(V, (B, n), generator=gen)
    mask = torch.ones(B, n, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    return ids, mask


def test_import_riemannian_ref_does_not_need_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import riemannian_ref, riemannian_ref.integrations\n"
            "assert 'riemannian_ref.integrations.transformers' not in sys.modules\n"
            "try:\n    import riemannian_ref.integrations.transformers\n"
            "except ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('imported without transformers')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "riemannian_ref[transformers]" in out.stdout


def _run(model, implementation, ids, mask=None):
    """Logits and every attention layer's output (after its output projection) under an implementation."""
    model.set_attn_implementation(implementation)
    outs = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: outs.append(out[0]))
             for _, layer in rr_hf._attention_layers(model)]
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
    finally:
        for hook in hooks:
            hook.remove()
    model.set_attn_implementation(rr_hf.NAME)
    return logits, outs


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("lam", ["one", "per_head"])
def test_zero_factors_are_sdpa_with_the_key_norm_bias(name, lam, gen):
    """The whole switched model, with padding (left and right), causal masks, GQA and a sliding window:
    every attention layer's output and the logits, on the real tokens."""
    model = _switched(name, strength=0.0).eval()
    if lam == "per_head":  # a different lambda in every head and layer, through the package's rule
        for i, (_, layer) in enumerate(rr_hf._attention_layers(model)):
            for j, net in enumerate(layer.riemannian_metric.heads):
                net.rho.data.fill_(raw_from_lam(0.5 + 0.3 * i + 0.2 * j))
    ids, mask = _batch(gen)
    real = mask.bool()  # padded positions may differ (fully masked rows): nothing reads them
    for m in (mask, None):  # a padding mask, and none at all (the is_causal path)
        sel = real if m is not None else torch.ones_like(real)
        ours, ours_attn = _run(model, rr_hf.NAME, ids, m)
        ref, ref_attn = _run(model, "sdpa_key_norm", ids, m)
        plain, plain_attn = _run(model, "sdpa", ids, m)  # the model's own attention
        torch.testing.assert_close(ours[sel], ref[sel], rtol=1e-10, atol=1e-12)
        for a, b, c in zip(ours_attn, ref_attn, plain_attn):
            assert _rel(a[sel], b[sel]) < 1e-10
            assert _rel(a[sel], c[sel]) > 1e-3  # the comparison has teeth: without the bias it differs


def test_a_layer_matches_the_dense_reference_with_factors(gen):
    """Nonzero factors, grouped-query attention and a padding mask: attention_forward against
    rr.riemannian_attention_reference with keys, values, U_k and lambda repeated to the query heads."""
    model = _switched("llama", strength=1.0)
    layer = model.model.layers[0].self_attn
    B, h, h_kv, n, d = 2, 4, 2, 7, 8
    q = torch.randn(B, h, n, d, generator=gen, dtype=F64)
    k, v = torch.randn(2, B, h_kv, n, d, generator=gen, dtype=F64).unbind(0)
    mask = torch.rand(B, 1, n, n, generator=gen) > 0.3
    mask[..., 0] = True
    out, weights = rr_hf.attention_forward(layer, q, k, v, mask, scaling=0.3)
    lam, U = layer.riemannian_metric(k)
    assert weights is None and U.shape == (B, h_kv, n, d, 2) and U.abs().min() > 0
    ref = rr.riemannian_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask, 0.0,
                                            False, 0.3, U_k=U.repeat_interleave(2, 1),
                                            lam=lam.repeat_interleave(2))
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)
    # causal without a mask, and the query side
    out = rr_hf.attention_forward(layer, q, k, v, None, scaling=0.3)[0]
    ref = rr.riemannian_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None, 0.0,
                                            True, 0.3, U_k=U.repeat_interleave(2, 1),
                                            lam=lam.repeat_interleave(2))
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-10)


def test_the_metric_reads_directions(gen):
    """The states are RMS-normalised: the factors of c k equal those of k, and strength sets their size
    as in MetricNet (E|U^T v|^2 = strength^2 |v|^2), whatever the scale of the model's keys."""
    k = 0.01 * torch.randn(64, 3, 8, 16, generator=gen, dtype=F64)  # small keys, as in a fresh model
    v = torch.randn(64, 3, 8, 16, generator=gen, dtype=F64)
    for form in ("factor", "gains"):
        metric = rr_hf.HeadMetric(3, 16, 2, strength=0.5, form=form).double()
        lam, U = metric(k)
        torch.testing.assert_close(metric(7.0 * k)[1], U)
        assert lam.shape == (3,) and U.shape == (64, 3, 8, 16, 2)
        ratio = (U.transpose(-1, -2) @ v.unsqueeze(-1)).pow(2).sum() / v.pow(2).sum()
        if form == "factor":
            assert 0.5 ** 2 / 2 < ratio < 0.5 ** 2 * 2
        else:  # r orthonormal directions with gains near 4 sigmoid(-2) = 0.48: E|U^T v|^2 = lam (r/d) gain |v|^2
            expect = 2 / 16 * 4 * torch.sigmoid(torch.tensor(-2.0)).item()
            assert expect / 1.5 < ratio < expect * 1.5


def test_query_side(gen):
    model = _switched("llama", side="query", strength=1.0)
    layer = model.model.layers[1].self_attn
    assert layer.riemannian_metric.n_heads == 4  # one metric network per query head
    q = torch.randn(1, 4, 5, 8, generator=gen, dtype=F64)
    k, v = torch.randn(2, 1, 2, 5, 8, generator=gen, dtype=F64).unbind(0)
    lam, U = layer.riemannian_metric(q)
    ref = rr.riemannian_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None, 0.0,
                                            True, 8 ** -0.5, U_q=U, lam=lam, metric_side="query")
    torch.testing.assert_close(rr_hf.attention_forward(layer, q, k, v, None)[0], ref.transpose(1, 2))
    ids = torch.randint(V, (2, 9), generator=gen)
    model(ids, labels=ids).loss.backward()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_and_backward_reach_every_weight(name, gen):
    model = _switched(name)
    ids, mask = _batch(gen)
    out = model(ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    metric = [p for n, p in model.named_parameters() if "riemannian_metric" in n]
    # per head: the direction map, the gain map's weight and bias, and lambda's parameter
    assert len(metric) == 4 * sum(m.riemannian_metric.n_heads for _, m in rr_hf._attention_layers(model))
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert all(p.grad.abs().sum() > 0 for p in metric)


def test_zero_strength_is_a_stationary_point(gen):
    """Why attach does not start the factors at exactly zero: U U^T is quadratic in the weights. In the gains form
    too (U = 0 there as well: the normalisation is smooth at 0, so the gradient is finite, and zero)."""
    for form in ("factor", "gains"):
        model = _switched("llama", strength=0.0, form=form)
        ids, mask = _batch(gen)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        for layer in model.model.layers:
            for net in layer.self_attn.riemannian_metric.heads:
                g = net.proj.weight.grad
                assert torch.isfinite(g).all() and g.abs().max() == 0, form
                assert net.rho.grad.abs().max() > 0  # lambda still learns


def test_loss_decreases_on_a_tiny_task():
    """Llama-style model, switched, trained for a few steps on a periodic sequence: the loss falls."""
    torch.manual_seed(0)
    model = _switched("llama", dtype=torch.float32).train()
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    ids = pattern.repeat(8, 3)[:, :20]  # (8, 20)
    ids = torch.stack([ids[i].roll(i) for i in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    metric = model.model.layers[0].self_attn.riemannian_metric.heads[0]
    assert metric.proj.weight.norm() > 5 * 0.01  # the factors moved off their small start


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_save_pretrained_round_trip_keeps_the_metric(name, tmp_path, gen):
    model = _switched(name, rank=3, side="key", lam_init=2.0, strength=0.5).eval()
    with torch.no_grad():  # a trained-looking lambda: not the init value
        model.get_submodule(rr_hf._attention_layers(model)[0][0]).riemannian_metric.heads[1].rho.add_(0.7)
    model.save_pretrained(tmp_path)
    loaded = rr_hf.from_pretrained(tmp_path, dtype=F64).eval()
    assert loaded.config._attn_implementation == rr_hf.NAME
    assert loaded.config.riemannian_metric == dict(rank=3, side="key", lam_init=2.0, lam_min=rr_hf.LAM_MIN,
                                                   strength=0.5, form="gains", max_gain=4.0, gain_bias=-2.0)
    assert type(loaded).__name__ == type(model).__name__
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and any("riemannian_metric" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    ids, mask = _batch(gen)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, loaded(ids, attention_mask=mask).logits,
                               rtol=0, atol=0)
    # shifted positions: the loaded rotary layers carry the metric with the rotary frame as the original's do
    pos = torch.arange(ids.shape[1]).unsqueeze(0) + 5
    torch.testing.assert_close(model(ids, position_ids=pos).logits, loaded(ids, position_ids=pos).logits,
                               rtol=0, atol=0)
    # a checkpoint saved without attach is refused with a message that says what to do
    plain = MODELS[name]()
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="attach"):
        rr_hf.from_pretrained(tmp_path / "plain")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_with_a_kv_cache_gives_the_full_forward_tokens(name, gen):
    """Greedy decoding with a dynamic cache, a static one, none, and by argmax of full forwards: the same tokens.
    Qwen2's second layer has a 4-token window, shorter than what is generated."""
    model = _switched(name, strength=1.0).eval()
    prompt = torch.randint(V, (1, 5), generator=gen)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kw)
    static = model.generate(prompt, cache_implementation="static", **kw)
    uncached = model.generate(prompt, use_cache=False, **kw)
    ids = prompt
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert cached.shape == (1, 15)
    assert torch.equal(cached, uncached) and torch.equal(static, uncached) and torch.equal(cached, ids)
    # beam search (the cache's rows are reordered between steps), with and without a cache
    beams = dict(kw, num_beams=3, max_new_tokens=6)
    assert torch.equal(model.generate(prompt, **beams), model.generate(prompt, use_cache=False, **beams))
    # and the cached logits agree with the full forward's to float64 precision
    out = model(prompt, use_cache=True)
    step = model(cached[:, 5:6], past_key_values=out.past_key_values).logits[:, -1]
    torch.testing.assert_close(step, model(cached[:, :6]).logits[:, -1], rtol=1e-9, atol=1e-9)


def test_dropout_applies_in_training_only(gen):
    torch.manual_seed(0)
    model = _llama(attention_dropout=0.5).to(F64)
    rr_hf.attach(model)
    model.set_attn_implementation(rr_hf.NAME)
    ids, mask = _batch(gen)
    model.train()
    torch.manual_seed(1)
    a = model(ids, attention_mask=mask).logits
    torch.manual_seed(2)
    b = model(ids, attention_mask=mask).logits
    assert not torch.allclose(a, b)
    model.eval()
    c = model(ids, attention_mask=mask).logits
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    model.train()
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, c)


def test_half_precision_runs(gen):
    model = _switched("llama", dtype=torch.bfloat16)
    ids, mask = _batch(gen)
    out = model(ids, attention_mask=mask, labels=ids)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()


def test_lambda_uses_the_package_rule():
    model = _switched("gpt2", lam_init=1.7)
    net = model.transformer.h[0].attn.riemannian_metric.heads[0]
    torch.testing.assert_close(net.lam(), lam_from_raw(net.rho, net.lam_min))
    torch.testing.assert_close(net.lam(), torch.tensor([1.7], dtype=F64))


def test_bad_input_is_refused_with_a_clear_error(gen):
    torch.manual_seed(0)
    model = _llama()
    model.set_attn_implementation("sdpa")
    rr_hf.register()
    model.set_attn_implementation(rr_hf.NAME)
    ids = torch.randint(V, (1, 4), generator=gen)
    with pytest.raises(ValueError, match=r"no Riemannian metric: call .*attach\(model\)"):
        model(ids)
    with pytest.raises(ValueError, match=r"side must be one of \('key', 'query'\), got 'mean'"):
        rr_hf.attach(model, side="mean")
    with pytest.raises(ValueError, match="rank must be an int >= 0, got -1"):
        rr_hf.attach(model, rank=-1)
    with pytest.raises(ValueError, match="model must be a transformers model"):
        rr_hf.attach(torch.nn.Linear(2, 2))
    rr_hf.attach(model)
    with pytest.raises(ValueError, match="already has a Riemannian metric: attach once"):
        rr_hf.attach(model)
    layer = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"does not implement softcap \(the model passed softcap=30.0\)"):
        rr_hf.attention_forward(layer, q, k, k, None, softcap=30.0)
    with pytest.raises(ValueError, match=r"does not implement cache"):
        rr_hf.attention_forward(layer, q, k, k, None, cache=object())
    with pytest.raises(ValueError, match=r"the key states must have shape \[B, 2, n, 8\], got \[1, 2, 3, 5\]"):
        layer.riemannian_metric(torch.randn(1, 2, 3, 5))
    # rotary frames: of the wrong type or size, or a rotation the backend does not carry
    with pytest.raises(ValueError, match=r"riemannian_frames must be a RotaryFrames .* got str"):
        rr_hf.attention_forward(layer, q, k, k, None, riemannian_frames="frames")
    c, s = torch.ones(1, 3, 8), torch.zeros(1, 3, 8)
    with pytest.raises(ValueError, match=r"without a KV cache the keys must be the call's 3 tokens, got 5 keys"):
        rr_hf.attention_forward(layer, q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), None,
                                riemannian_frames=rr_hf.RotaryFrames(c, s, c, s, False))
    with pytest.raises(ValueError, match=r"the rotary frames of the keys have shape \[1, 3, 6\], expected "
                                         r"\[1, 3, 8\] \(or batch 1\) for key states \[1, 2, 3, 8\]"):
        rr_hf.attention_forward(layer, q, k, k, None, riemannian_frames=rr_hf.RotaryFrames(
            c[..., :6], s[..., :6], c[..., :6], s[..., :6], False))
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match=r"position_embeddings \(cos, sin\) of shape \[B, n, head_dim=8\] .* got "
                                         r"cos \[1, 3, 4\] .* partial rotary embeddings are not supported"):
        layer(x, position_embeddings=(c[..., :4], s[..., :4]))
    angles = torch.rand(1, 3, 4)
    interleaved = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    with pytest.raises(ValueError, match=r"in the rotate_half layout .* LlamaAttention got another layout"):
        layer(x, position_embeddings=interleaved)


# ------------------------------------------------------------------ rotary models: relative positions only

def _rotation_matrices(cos, sin):
    """Dense rotations [.., n, d, d] of the rotate_half layout: pair (l, l + d/2) turned by the angle of (cos, sin)."""
    d = cos.shape[-1]
    m = d // 2
    R = torch.zeros(*cos.shape, d, dtype=cos.dtype)
    idx = torch.arange(m)
    c, s = cos[..., :m], sin[..., :m]
    R[..., idx, idx], R[..., idx + m, idx + m] = c, c
    R[..., idx, idx + m], R[..., idx + m, idx] = -s, s
    return R


@pytest.mark.parametrize("side", ["key", "query"])
def test_rotary_frames_against_the_dense_reference(side, gen):
    """attention_forward with rotary frames: the metric network reads R^T x and its factors are R U(R^T x),
    with R built here as dense matrices from the angles (not with rotate_half), and the sequence of
    positions arbitrary (GQA, a padding mask, different positions per batch row)."""
    model = _switched("llama", side=side, strength=1.0)
    layer = model.model.layers[0].self_attn
    B, h, h_kv, n, d = 2, 4, 2, 6, 8
    angles = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 3, 9, 10, 11, 30]], dtype=F64)[..., None] \
        * torch.rand(d // 2, generator=gen, dtype=F64)  # (B, n, d/2)
    cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)  # rotate_half layout (B, n, d)
    R = _rotation_matrices(cos, sin).unsqueeze(1)  # (B, 1, n, d, d)
    q0 = torch.randn(B, h, n, d, generator=gen, dtype=F64)
    k0, v = torch.randn(2, B, h_kv, n, d, generator=gen, dtype=F64).unbind(0)
    q, k = (R @ q0.unsqueeze(-1)).squeeze(-1), (R @ k0.unsqueeze(-1)).squeeze(-1)
    mask = torch.rand(B, 1, n, n, generator=gen) > 0.3
    mask[..., 0] = True
    frames = rr_hf.RotaryFrames(cos, sin, cos, sin, False)
    out, _ = rr_hf.attention_forward(layer, q, k, v, mask, scaling=0.3, riemannian_frames=frames)
    lam, U0 = layer.riemannian_metric(k0 if side == "key" else q0)  # the unrotated states' factors
    U = R @ U0  # their columns rotated with the states
    if side == "key":
        U, lam = U.repeat_interleave(2, 1), lam.repeat_interleave(2)
    ref = rr.riemannian_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask, 0.0,
                                            False, 0.3, lam=lam, metric_side=side,
                                            **({"U_k": U} if side == "key" else {"U_q": U}))
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    # without frames the states are read as given (rotated): another function
    plain = rr_hf.attention_forward(layer, q, k, v, mask, scaling=0.3)[0]
    assert _rel(plain, out) > 1e-3


def _logits(model, implementation, ids, **kw):
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return model(ids, **kw).logits
    finally:
        model.set_attn_implementation(rr_hf.NAME)


def _without_frames(model):
    """The same model with the rotary pre-hooks removed: the metric reads the rotated keys (the old backend)."""
    import copy
    plain = copy.deepcopy(model)
    for _, layer in rr_hf._attention_layers(plain):
        layer._forward_pre_hooks.clear()
        layer._forward_pre_hooks_with_kwargs.clear()
    return plain


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_models_depend_on_relative_positions_only(name, gen):
    """Every position shifted by 5: the last logits stay within 1e-6 (relative), as with SDPA in the same
    test; Qwen2's second layer and both of Mistral's have a 4-token sliding window, shorter than the prompt."""
    model = _switched(name, strength=1.0).eval()
    ids = torch.randint(V, (2, 11), generator=gen)
    pos = torch.arange(11).unsqueeze(0)
    errors = {}
    for impl in ("sdpa", rr_hf.NAME):
        errors[impl] = _rel(_logits(model, impl, ids, position_ids=pos + 5)[:, -1],
                            _logits(model, impl, ids, position_ids=pos)[:, -1])
    assert errors["sdpa"] < 1e-7 and errors[rr_hf.NAME] < 1e-6, errors
    # the test has teeth: reading the rotated keys, the metric depends on absolute positions
    plain = _without_frames(model)
    assert _rel(_logits(plain, rr_hf.NAME, ids, position_ids=pos + 5)[:, -1],
                _logits(plain, rr_hf.NAME, ids, position_ids=pos)[:, -1]) > 1e-4


@pytest.mark.parametrize("name", ROTARY)
def test_a_left_padded_batch_gives_each_prompt_alone(name, gen):
    """Two prompts of 11 and 7 tokens, the shorter left-padded: without position_ids (transformers counts
    positions from the first slot, so the short prompt sits at 4..10) and with them (0..6), the logits
    of each prompt's tokens and the greedy continuation equal those of the prompt alone."""
    model = _switched(name, strength=1.0).eval()
    ids = torch.randint(1, V, (2, 11), generator=gen)
    ids[1, :4] = 0
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    alone = [_logits(model, rr_hf.NAME, ids[:1])[0], _logits(model, rr_hf.NAME, ids[1:, 4:])[0]]
    for impl in ("sdpa", rr_hf.NAME):
        for pos in (None, (mask.cumsum(-1) - 1).clamp_min(0)):
            out = _logits(model, impl, ids, attention_mask=mask, position_ids=pos)
            ref = alone if impl == rr_hf.NAME else [_logits(model, "sdpa", ids[:1])[0],
                                                   _logits(model, "sdpa", ids[1:, 4:])[0]]
            err = max(_rel(out[0], ref[0]), _rel(out[1, 4:], ref[1]))
            assert err < 1e-6, (impl, pos is None, err)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    both = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(both[1, 4:], model.generate(ids[1:, 4:], **kw)[0])
    assert torch.equal(both[0], model.generate(ids[:1], **kw)[0])
    plain = _without_frames(model)  # teeth: the old backend moves the short prompt's logits
    out = _logits(plain, rr_hf.NAME, ids, attention_mask=mask)
    assert _rel(out[1, 4:], _logits(plain, rr_hf.NAME, ids[1:, 4:])[0]) > 1e-4


def test_the_cache_keeps_the_frames_of_its_keys(gen):
    """A DynamicCache: prefill, crop, step (the frames of the removed tokens are dropped); a cache reused
    after reset; a batch that changes between calls and a cache filled before attach are refused."""
    model = _switched("llama", strength=1.0).eval()
    ids = torch.randint(V, (2, 9), generator=gen)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :7], past_key_values=cache, position_ids=torch.arange(7).unsqueeze(0) + 3)
        cache.crop(-2)  # back to 5 tokens
        step = model(ids[:, 5:6], past_key_values=cache, position_ids=torch.tensor([[8]])).logits[:, -1]
        full = model(ids[:, :6], position_ids=torch.arange(6).unsqueeze(0) + 3).logits[:, -1]
        torch.testing.assert_close(step, full, rtol=1e-12, atol=1e-12)
        cache.reset()  # reused from empty: the old frames are not read
        model(ids[:, 2:7], past_key_values=cache)
        step = model(ids[:, 7:8], past_key_values=cache).logits[:, -1]
        torch.testing.assert_close(step, model(ids[:, 2:8]).logits[:, -1], rtol=1e-12, atol=1e-12)
        # rows at different positions, then a call with another batch: which rows were kept is unknown
        cache = DynamicCache(config=model.config)
        model(ids[:, :3], past_key_values=cache, position_ids=torch.tensor([[0, 1, 2], [4, 5, 6]]))
        with pytest.raises(ValueError, match=r"batch changed from 2 to 3 rows"):
            model(ids[:1, 3:4].expand(3, 1), past_key_values=cache, position_ids=torch.tensor([[3], [7], [7]]))
        filled = DynamicCache(config=model.config)
        MODELS["llama"]().to(F64).eval()(ids[:, :4], past_key_values=filled)  # filled by a model without attach()
        with pytest.raises(ValueError, match=r"holds 4 tokens of layer 0 but the rotary frames of only 0"):
            model(ids[:, 4:5], past_key_values=filled)


@pytest.mark.parametrize("fill", ["finfo_min", "-inf"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_4d_float_mask_with_fully_masked_rows(name, fill, gen):
    """A 4-D additive mask (causal and padding, the padded queries' rows fully masked): finite logits
    everywhere, the same as the boolean 4-D mask (fully masked rows give 0 in both), and on the real
    tokens the same as the model's 2-D padding mask; with zero factors, SDPA's (key-norm oracle)."""
    n = 10
    ids, mask = _batch(gen, n=n)
    real = mask.bool()
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool)) & real[:, None, :] & real[:, :, None]  # (B, n, n)
    assert (~allowed).all(-1).any()  # some rows are fully masked
    value = torch.finfo(F64).min if fill == "finfo_min" else float("-inf")
    float_mask = torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, value).unsqueeze(1)
    for strength in (1.0, 0.0):
        model = _switched(name, strength=strength).eval()
        out = _logits(model, rr_hf.NAME, ids, attention_mask=float_mask)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, _logits(model, rr_hf.NAME, ids, attention_mask=allowed.unsqueeze(1)),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[real], _logits(model, rr_hf.NAME, ids, attention_mask=mask)[real],
                                   rtol=1e-10, atol=1e-12)
        if strength == 0.0:
            sdpa = _logits(model, "sdpa_key_norm", ids, attention_mask=float_mask)
            torch.testing.assert_close(out[real], sdpa[real], rtol=1e-10, atol=1e-12)
    # a float mask of another kind is refused with its dtype named
    layer = rr_hf._attention_layers(model)[0][1]
    q = torch.randn(1, 4, 3, 8, dtype=F64, generator=gen)
    k = torch.randn(1, layer.riemannian_metric.n_heads, 3, 8, dtype=F64, generator=gen)
    with pytest.raises(ValueError, match=r"attention_mask must be boolean or floating point, got dtype torch.int64"):
        rr_hf.attention_forward(layer, q, k, k, torch.zeros(1, 1, 3, 3, dtype=torch.long))


# ------------------------------------------------------------------ mixed precision and dropout

def test_bf16_autocast_training_with_dropout_on_gpt2(monkeypatch):
    """GPT-2 (attn_pdrop = 0.1) in float32, trained under CPU autocast to bfloat16: every attention call
    has dropout and runs under autocast, the loss stays finite and falls."""
    torch.manual_seed(0)
    model = _switched("gpt2", dtype=torch.float32).train()
    assert model.config.attn_pdrop == 0.1
    calls = []
    inner = rr_hf.riemannian_attention

    def spy(query, key, value, mask, dropout_p, *args, **kwargs):
        calls.append((query.dtype, dropout_p, torch.is_autocast_enabled("cpu")))
        return inner(query, key, value, mask, dropout_p, *args, **kwargs)

    monkeypatch.setattr(rr_hf, "riemannian_attention", spy)
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    ids = torch.stack([pattern.repeat(3)[:16].roll(i) for i in range(8)])  # (8, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert set(calls) == {(torch.bfloat16, 0.1, True)}
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.8 * losses[0], losses
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dropout_is_computed_in_float32(dtype, gen):
    """With dropout (here 1e-7, so that nothing is dropped) half-precision inputs are computed in float32
    as without it: the error against the float64 reference of the same rounded inputs is that of the
    dropout-free call (the half-precision dense path gave 35 (float16) to 60 (bfloat16) times more)."""
    model = _switched("gpt2", strength=1.0)
    layer = model.transformer.h[0].attn.to(dtype)
    B, h, n, d = 2, 4, 48, 8
    q, k = (3 * torch.randn(2, B, h, n, d, generator=gen)).to(dtype).unbind(0)
    v = torch.randn(B, h, n, d, generator=gen).to(dtype)
    lam, U = layer.riemannian_metric(k)
    ref = rr.riemannian_attention_reference(q.double(), k.double(), v.double(), None, 0.0, True, d ** -0.5,
                                            U_k=U.double(), lam=lam.double()).transpose(1, 2)
    errors = []
    for p in (0.0, 1e-7):
        torch.manual_seed(5)
        out = rr_hf.attention_forward(layer, q, k, v, None, dropout=p)[0]
        assert out.dtype == dtype
        errors.append((out.double() - ref).abs().max().item())
    assert errors[1] <= 1.5 * errors[0] + 1e-3 and errors[1] < 0.05, errors
