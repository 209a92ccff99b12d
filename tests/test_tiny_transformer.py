"""TinyTransformer and the two tiny tasks: shapes, causality, frames at init."""
import pytest
import torch

import riemannian_ref as rr


@pytest.fixture
def model():
    cfg = rr.TinyTransformerConfig(vocab=11, n_ctx=8, d_model=16, n_heads=2, head_dim=4, d_mlp=32, n_layers=2)
    return rr.TinyTransformer(cfg, generator=torch.Generator().manual_seed(0))


def test_shapes_and_frames(model):
    x = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(1))
    assert model(x).shape == (3, 8, 11)
    frames = model.qk_frame_parameters()
    assert len(frames) == 4 and all(f.shape == (2, 16, 4) for f in frames)
    assert all(rr.Stiefel().check_point(f.detach(), atol=1e-5)[0] for f in frames)


def test_causal(model):
    x = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[:, 5:] = (y[:, 5:] + 1) % 11
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :5], model(y)[:, :5])
        assert (model(x)[:, 5:] - model(y)[:, 5:]).abs().max() > 1e-4


def test_same_seed_same_model():
    cfg = rr.TinyTransformerConfig(vocab=5, n_ctx=3)
    a = rr.TinyTransformer(cfg, generator=torch.Generator().manual_seed(3))
    b = rr.TinyTransformer(cfg, generator=torch.Generator().manual_seed(3))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("p,frac", [(7, 0.5), (13, 0.3)])
def test_modular_addition_data(p, frac):
    xtr, ytr, xva, yva = rr.modular_addition_data(p, frac, generator=torch.Generator().manual_seed(0))
    assert len(xtr) + len(xva) == p * p and len(xtr) == round(frac * p * p)
    x, y = torch.cat([xtr, xva]), torch.cat([ytr, yva])
    assert torch.equal((x[:, 0] + x[:, 1]) % p, y) and (x[:, 2] == p).all()
    assert len({tuple(r) for r in x.tolist()}) == p * p  # every pair exactly once


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="train_frac"):
        rr.modular_addition_data(5, 1.0)
    with pytest.raises(ValueError, match="n_ctx"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_stdlib_corpus_round_trips():
    tokens, chars = rr.stdlib_char_corpus("this")
    import inspect
    import this  # noqa: F401  (prints the Zen of Python once on import)

    assert "".join(chars[i] for i in tokens.tolist()) == inspect.getsource(this)
