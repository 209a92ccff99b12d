"""The transformers backend (riemannian_ref.integrations.transformers) on small models built from configs.

No weights are downloaded: Llama (grouped-query attention), Qwen2 (grouped-query attention and a
sliding-window layer) and GPT-2 configs with 2 layers and tiny widths. The oracle for the switched
model is transformers' own SDPA backend with distance attention's dot-product form: with G = lam I,
-(s lam / 2)|q - k|^2 = s lam q.k - (s lam / 2)|k|^2 + (constant per row), so SDPA on queries
lam q with the key-norm bias -(s lam / 2)|k_j|^2 must give the same model, masks and all.
"""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (AttentionInterface, GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)
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


def _gpt2(**kw):
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, **kw))


MODELS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}


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
    metric = rr_hf.HeadMetric(3, 16, 2, strength=0.5).double()
    k = 0.01 * torch.randn(64, 3, 8, 16, generator=gen, dtype=F64)  # small keys, as in a fresh model
    lam, U = metric(k)
    torch.testing.assert_close(metric(7.0 * k)[1], U)
    v = torch.randn(64, 3, 8, 16, generator=gen, dtype=F64)
    ratio = (U.transpose(-1, -2) @ v.unsqueeze(-1)).pow(2).sum() / v.pow(2).sum()
    assert 0.5 ** 2 / 2 < ratio < 0.5 ** 2 * 2
    assert lam.shape == (3,) and U.shape == (64, 3, 8, 16, 2)


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
    assert len(metric) == 2 * sum(m.riemannian_metric.n_heads for _, m in rr_hf._attention_layers(model))
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert all(p.grad.abs().sum() > 0 for p in metric)


def test_zero_strength_is_a_stationary_point(gen):
    """Why attach does not start the factors at exactly zero: U U^T is quadratic in the weights."""
    model = _switched("llama", strength=0.0)
    ids, mask = _batch(gen)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    for layer in model.model.layers:
        for net in layer.self_attn.riemannian_metric.heads:
            assert net.proj.weight.grad.abs().max() == 0
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


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_save_pretrained_round_trip_keeps_the_metric(name, tmp_path, gen):
    model = _switched(name, rank=3, side="key", lam_init=2.0, strength=0.5).eval()
    with torch.no_grad():  # a trained-looking lambda: not the init value
        model.get_submodule(rr_hf._attention_layers(model)[0][0]).riemannian_metric.heads[1].rho.add_(0.7)
    model.save_pretrained(tmp_path)
    loaded = rr_hf.from_pretrained(tmp_path, dtype=F64).eval()
    assert loaded.config._attn_implementation == rr_hf.NAME
    assert loaded.config.riemannian_metric == dict(rank=3, side="key", lam_init=2.0, lam_min=rr_hf.LAM_MIN,
                                                   strength=0.5)
    assert type(loaded).__name__ == type(model).__name__
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and any("riemannian_metric" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    ids, mask = _batch(gen)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, loaded(ids, attention_mask=mask).logits,
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
