"""The transformers backend refuses a saved config whose recorded metric settings are damaged (issue 28).

``from_pretrained`` reads the ``riemannian_metric`` entry that ``attach`` wrote into ``config.json``: an
unknown or missing key, a value of the wrong type or range, or settings that do not describe the saved
metric networks give a ``ValueError`` that names the config's directory and the key.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from riemannian_ref.integrations import transformers as rr_hf  # noqa: E402


def _saved(tmp_path, **attach_kw):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    rr_hf.attach(model, **attach_kw)
    model.save_pretrained(tmp_path)
    return model


def _edit(tmp_path, change):
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg["riemannian_metric"])
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, key", [
    (lambda s: s.update(temperature=2.0), "temperature"),   # unknown key
    (lambda s: s.pop("strength"), "strength"),              # missing key
    (lambda s: s.update(rank="2"), "rank"),
    (lambda s: s.update(rank=-1), "rank"),
    (lambda s: s.update(rank=2.0), "rank"),
    (lambda s: s.update(side="both"), "side"),
    (lambda s: s.update(lam_init="1"), "lam_init"),
    (lambda s: s.update(lam_init=0.0), "lam_init"),
    (lambda s: s.update(lam_min=-1.0), "lam_min"),
    (lambda s: s.update(strength=True), "strength"),
    (lambda s: s.update(strength=-0.1), "strength"),
])
def test_a_damaged_spec_is_refused_naming_the_config_and_key(tmp_path, change, key):
    # D17
    _saved(tmp_path, rank=2)
    _edit(tmp_path, change)
    with pytest.raises(ValueError, match=f"(?s)config at {tmp_path}.*{key}"):
        rr_hf.from_pretrained(tmp_path)


def test_a_spec_that_does_not_describe_the_saved_weights_is_refused(tmp_path):
    # D17: side "key" has a metric per key head (2), "query" one per query head (4): heads 2 and 3 would be
    # initialised afresh; refused instead. (Without grouped-query attention both sides have the same shapes,
    # and a swapped side cannot be told from the weights: documented in from_pretrained.)
    _saved(tmp_path, rank=2, side="key")
    _edit(tmp_path, lambda s: s.update(side="query"))
    with pytest.raises(ValueError, match="(?s)riemannian_metric.*does not match the saved metric networks"):
        rr_hf.from_pretrained(tmp_path)
    # rank: transformers refuses the size mismatch itself (ignore_mismatched_sizes=False)
    _saved(tmp_path, rank=2)
    _edit(tmp_path, lambda s: s.update(rank=3))
    with pytest.raises(Exception, match="(?i)size mismatch|mismatched_sizes"):
        rr_hf.from_pretrained(tmp_path)


def test_the_untouched_spec_loads_and_loading_info_is_passed_through(tmp_path):
    model = _saved(tmp_path, rank=2, lam_init=2.0)
    loaded, info = rr_hf.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    ids = torch.randint(37, (2, 6))
    model.set_attn_implementation(rr_hf.NAME)
    torch.testing.assert_close(model.eval()(ids).logits, loaded.eval()(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name, kw", [("head_dim", dict(head_dim=0)), ("n_heads", dict(n_heads=0)),
                                      ("rank", dict(rank=-1)), ("head_dim", dict(head_dim=2.0))])
def test_head_metric_names_the_bad_argument(name, kw):
    # D18
    args = dict(n_heads=2, head_dim=4, rank=2) | kw
    with pytest.raises(ValueError, match=f"HeadMetric: {name} must be"):
        rr_hf.HeadMetric(args["n_heads"], args["head_dim"], args["rank"])
