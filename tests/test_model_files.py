"""Model files: atomic saves, strict loads, the format and its migrations, config size bounds.

The shared atomic writer (riemannian_ref/_io.py) is tested here too: the model's
save is its first user."""
import dataclasses
import os
import signal
import stat
import time

import pytest
import torch

import riemannian_ref as rr
from _helpers import nested
from riemannian_ref import _io
from riemannian_ref.models import transformer as tmod
from riemannian_ref.models.config import ATTENTION_OPTIONS, nest_flat

B, N = 2, 12
V1 = "riemannian_ref.FiberBundleTransformer/1"
# the (flat) config fields added while files were written in format 1 (none of them changes an older model)
FACTOR_FORM = {"metric_form": "factor", "max_gain": 4.0, "gain_bias": -2.0}  # metrics of formats 1 and 2
V1_ADDED = {"position_metric": False, "metric_bias": False, "scale_residual": True, "metric_subspace": None,
            **FACTOR_FORM}


def _model(seed=0, **kw):
    """A tiny model; ``kw``: fields of the config and options of its attention."""
    torch.manual_seed(seed)
    return rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(**nested(**kw))).eval()


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _rewrite(path, edit):
    blob = torch.load(path, weights_only=True)
    edit(blob)
    torch.save(blob, path)


# ------------------------------------------------------------------ the atomic writer (_io)

def test_atomic_write_leaves_the_target_untouched_when_write_raises(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def failing(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half of the new")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):  # the writer's own error, unchanged
        _io.atomic_write(target, failing)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # no temporary file left behind
    with pytest.raises(KeyboardInterrupt):  # also for an interrupt (a BaseException)
        _io.atomic_write(target, lambda tmp: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_atomic_write_gives_the_permissions_of_open_and_replaces_the_content(tmp_path):
    plain = tmp_path / "plain.bin"
    with open(plain, "wb") as f:
        f.write(b"x")
    new = tmp_path / "new.bin"
    _io.atomic_write_bytes(new, b"new")
    assert new.read_bytes() == b"new"
    assert stat.S_IMODE(new.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)  # not mkstemp's 0600
    _io.atomic_write_bytes(new, b"newer")  # over an existing file
    assert new.read_bytes() == b"newer" and sorted(p.name for p in tmp_path.iterdir()) == ["new.bin", "plain.bin"]
    with pytest.raises(ValueError, match="is a directory"):
        _io.atomic_write_bytes(tmp_path, b"x", what="out")


# ------------------------------------------------------------------ D1: atomic save

@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_D1_a_save_killed_at_any_moment_leaves_the_old_or_the_new_file(tmp_path):
    # D1: a save over a good file, SIGKILLed at several moments of the write, never leaves a damaged file.
    # The child is a fork of this process (no re-import), so the kills land at known fractions of a save.
    cfg = rr.FiberBundleConfig(vocab_size=64, d_model=512, n_layers=4, n_heads=8, block_size=64, mode="euclidean")
    torch.manual_seed(0)
    old = rr.FiberBundleTransformer(cfg)  # 13M parameters: a 50 MB file
    torch.manual_seed(1)
    new = rr.FiberBundleTransformer(cfg)
    path = tmp_path / "model.pt"

    def save_in_child(delay):
        """Fork; the child saves ``new`` over ``path``; SIGKILL it ``delay`` s after it starts (None: wait)."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(r)
                os.write(w, b"s")  # 'saving'
                new.save(path)
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"s"
        os.close(r)
        t0 = time.perf_counter()
        if delay is None:
            os.waitpid(pid, 0)
            return time.perf_counter() - t0
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None

    old.save(path)
    good = path.read_bytes()
    full = save_in_child(None)  # an uninterrupted save: how long one takes here
    assert _same_weights(rr.FiberBundleTransformer.load(path), new)
    outcomes = []
    for frac in (0.05, 0.3, 0.6, 0.9):
        path.write_bytes(good)
        for p in tmp_path.iterdir():
            if p.name != "model.pt":
                p.unlink()
        save_in_child(frac * full)
        loaded = rr.FiberBundleTransformer.load(path)  # never a damaged file
        was_old, was_new = _same_weights(loaded, old), _same_weights(loaded, new)
        assert was_old or was_new, frac
        left = [p.name for p in tmp_path.iterdir() if p.name != "model.pt"]
        assert all(n.startswith(".model.pt.") for n in left)  # at most the writer's temporary file
        outcomes.append((frac, "old" if was_old else "new", bool(left)))
    print(f"full save {full * 1e3:.0f} ms; kills (fraction, file left, temporary left): {outcomes}")
    # not vacuous: at least one kill landed while the temporary file was being written
    assert any(o == "old" and tmp for _, o, tmp in outcomes), (full, outcomes)


# ------------------------------------------------------------------ D13: unwritable paths

def test_D13_save_to_an_unwritable_path_names_it(tmp_path):
    # D13
    model = _model()
    with pytest.raises(ValueError, match=r"'/proc/rr_model\.pt' cannot be written"):
        model.save("/proc/rr_model.pt")
    with pytest.raises(ValueError, match="is a directory"):
        model.save(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot be written"):
        model.save(tmp_path / "file" / "m.pt")
    with pytest.raises(ValueError, match="path must be a str or path-like"):
        model.save(3)


# ------------------------------------------------------------------ D2: strict configs, the format and v1 files

def test_D2_a_config_missing_a_field_is_refused_naming_the_file_and_field(tmp_path):
    # D2 (the probe): a bidirectional model whose file lost "causal" must not come back causal
    model = _model(causal=False)
    p = tmp_path / "m.pt"
    model.save(p)
    _rewrite(p, lambda b: b["config"].pop("causal"))
    with pytest.raises(ValueError, match=r"lacks the fields \['causal'\]") as err:
        rr.FiberBundleTransformer.load(p)
    assert str(p) in str(err.value) and "config=" in str(err.value)  # says how to load it anyway
    # the way out the message names: the caller states the config; the file's other fields must agree
    back = rr.FiberBundleTransformer.load(p, config=model.config)
    assert back.config == model.config and _same_weights(back, model)
    with pytest.raises(ValueError, match="saved with another config"):
        rr.FiberBundleTransformer.load(p, config=model.config.replace(causal=False, n_layers=3))


def test_save_records_the_full_config_and_format_4(tmp_path):
    model = _model(mode="riemannian", metric_bias=True)
    p = tmp_path / "m.pt"
    model.save(p)
    blob = torch.load(p, weights_only=True)
    assert blob["format"] == "riemannian_ref.FiberBundleTransformer/4"
    assert blob["config"] == model.config.to_dict() and blob["config"]["attention"]["metric_bias"] is True
    assert set(blob["config"]) == {f.name for f in dataclasses.fields(rr.FiberBundleConfig)}
    assert set(blob["config"]["attention"]) == set(ATTENTION_OPTIONS)  # every option, none of the model's fields
    assert blob["config"]["attention"]["connection"] is None  # left to the mode, and so it loads
    back = rr.FiberBundleTransformer.load(p)
    assert back.config == model.config and back.config.replace(mode="fiber_bundle").connection_resolved == "content"
    for edit, msg in ((lambda c: c["attention"].pop("rank"), r"lacks the fields \['attention.rank'\]"),
                      (lambda c: c["attention"].update(d_model=32), r"unknown fields \['attention.d_model'\]"),
                      (lambda c: c.update(metric_rank=2), r"unknown fields \['metric_rank'\]"),
                      (lambda c: c.update(attention=[2]), "attention is a list")):
        model.save(p)
        _rewrite(p, lambda b: edit(b["config"]))
        with pytest.raises(ValueError, match=msg):
            rr.FiberBundleTransformer.load(p)


def test_an_option_added_later_loads_older_files_by_its_absent_value(tmp_path, monkeypatch, gen):
    """A new AttentionConfig field declares metadata={"absent": value}: files saved before it load with that
    value, flat formats too, with no new format version; a field without it makes them refused."""
    model = _model(mode="riemannian")
    p = tmp_path / "m.pt"
    model.save(p)
    _rewrite(p, lambda b: b["config"]["attention"].pop("lam_min"))  # lam_min declares its absent value
    assert rr.FiberBundleTransformer.load(p).config == model.config
    _rewrite(p, lambda b: b["config"]["attention"].pop("qk_gain"))  # as if qk_gain were added after the save
    with pytest.raises(ValueError, match=r"lacks the fields \['attention.qk_gain'\]"):
        rr.FiberBundleTransformer.load(p)
    absent = tmod._absent_options()
    monkeypatch.setattr(tmod, "_absent_options", lambda: {**absent, "qk_gain": 1.0})
    back = rr.FiberBundleTransformer.load(p)
    assert back.config == model.config and _same_weights(back, model)
    monkeypatch.setattr(tmod, "_absent_options", lambda: {**absent, "qk_gain": 2.0})  # the value is used
    assert rr.FiberBundleTransformer.load(p).config.attention.qk_gain == 2.0
    old = _model(mode="riemannian", metric_form="factor")  # the metrics format-1 files hold
    _v1_file(p, old)  # flat files never had lam_min (or any later option): they take the absent values
    assert rr.FiberBundleTransformer.load(p).config == old.config


def _v1_file(path, model, drop=tuple(V1_ADDED)):
    """A file as format-1 saves wrote it: the flat config of then (without the fields added since), the weights."""
    cfg = {k: v for k, v in tmod._flat(model.config).items() if k not in drop}
    torch.save({"format": V1, "config": cfg, "state_dict": model.state_dict()}, path)


def test_a_flat_format_3_file_written_by_the_package_before_nesting_loads_to_the_same_model(tmp_path, gen):
    """The config as version 0.4 saved it, written out by hand: every attention option a field of its own."""
    flat = dict(vocab_size=16, block_size=32, d_model=32, n_heads=2, head_dim=None, n_layers=2, mode="riemannian",
                metric_side="mean", metric_rank=3, metric_strength=0.5, shared_metric=False, position_metric=True,
                metric_bias=False, metric_subspace=None, metric_form="factor", max_gain=4.0, gain_bias=-2.0,
                lam_init=1.5, learn_temperature=True, connection="flat", transport_values=False, rotary_base=100.0,
                content_rate_std=0.5, precondition_ffn=None, ffn_metric_rank=2, eta_init=1.0,
                learned_positions=None, skip=True, mlp=True, layer_norm=True, causal=True, mlp_ratio=4,
                activation="gelu", bias=False, dropout=0.0, tie_weights=True, n_classes=None, init="gpt2",
                scale_residual=True, qk_init="orthonormal", qk_gain=2.0)
    model = _model(mode="riemannian", metric_side="mean", rank=3, strength=0.5, metric="position",
                   metric_form="factor", lam_init=1.5, learn_temperature=True, connection="flat",
                   transport_values=False, rotary_base=100.0, qk_init="orthonormal", qk_gain=2.0)
    p = tmp_path / "v3.pt"
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/3", "config": flat,
                "state_dict": model.state_dict()}, p)
    back = rr.FiberBundleTransformer.load(p)  # the weights load strictly: same names and shapes
    assert back.config == model.config and _same_weights(back, model)
    idx = torch.randint(0, 16, (B, N), generator=gen)
    assert torch.equal(back(idx).logits, model(idx).logits)
    assert tmod._flat(model.config) == flat  # and the test's inverse writes what that version wrote
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/3",
                "config": dict(flat, shared_metric=True), "state_dict": model.state_dict()}, p)
    with pytest.raises(ValueError, match="shared_metric and position_metric are exclusive"):
        rr.FiberBundleTransformer.load(p)


def test_D2_a_format_1_file_is_migrated_with_the_old_behaviour(tmp_path, gen):
    # D2: the config fields added since format 1 get the values that reproduce a model of then
    assert tmod._CONFIG_MIGRATIONS == {1: V1_ADDED, 2: FACTOR_FORM, 3: {}}
    for kw in (dict(mode="euclidean", **FACTOR_FORM),
               dict(mode="fiber_bundle", causal=False, connection="flat", **FACTOR_FORM),
               dict(mode="riemannian", metric_side="mean", **FACTOR_FORM)):
        model = _model(**kw)
        p = tmp_path / "v1.pt"
        _v1_file(p, model)
        back = rr.FiberBundleTransformer.load(p)
        assert back.config == model.config and _same_weights(back, model)
        idx = torch.randint(0, 16, (B, N), generator=gen)
        assert torch.equal(back(idx).logits, model(idx).logits)
    # the attention_stack preset switches scale_residual off today: its format-1 file still gets True,
    # the old behaviour (the division by sqrt(2L) at init was then always on with skip or gpt2 init)
    stack = rr.FiberBundleTransformer(rr.FiberBundleConfig.attention_stack(n_layers=2, d_model=16, block_size=8,
                                                                          attention=dict(metric_form="factor")))
    _v1_file(p, stack)
    assert rr.FiberBundleTransformer.load(p).config == stack.config.replace(scale_residual=True)
    # a format-1 file written after some of those fields existed keeps its own values
    model = _model(mode="riemannian", metric_bias=True, metric_form="factor")
    _v1_file(p, model, drop=("scale_residual", "metric_subspace", *FACTOR_FORM))
    assert rr.FiberBundleTransformer.load(p).config == model.config
    # a format-1 file that lacks a field that format-1 saves always wrote is refused
    _v1_file(p, model, drop=("causal", "metric_subspace", *FACTOR_FORM))
    with pytest.raises(ValueError, match=r"lacks the fields \['causal'\]") as err:
        rr.FiberBundleTransformer.load(p)
    assert str(p) in str(err.value)
    # a format-1 file whose weights need a newer field's other value is refused by the weights check
    _v1_file(p, model)  # metric_bias=True weights, read as metric_bias=False
    with pytest.raises(ValueError, match="the weights do not match"):
        rr.FiberBundleTransformer.load(p)
    # a migrated file saved again is a format-4 file with the full config
    _v1_file(p, _model(mode="riemannian", metric_form="factor"))
    q = tmp_path / "v4.pt"
    rr.FiberBundleTransformer.load(p).save(q)
    assert torch.load(q, weights_only=True)["format"].endswith("/4")


def test_a_format_2_file_loads_with_the_factor_metrics_it_was_written_with(tmp_path, gen):
    """Format 2 predates metric_form: its metrics are the unbounded factor form, and its file says so by lacking
    the three fields. A format-2 file with gains weights cannot exist; if forged, the weights check refuses it."""
    p = tmp_path / "v2.pt"
    old = _model(mode="riemannian", metric_form="factor")
    cfg = {k: v for k, v in tmod._flat(old.config).items() if k not in FACTOR_FORM}
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/2", "config": cfg, "state_dict": old.state_dict()},
               p)
    back = rr.FiberBundleTransformer.load(p)
    assert back.config.attention.metric_form == "factor" and back.config == old.config
    idx = torch.randint(0, 16, (B, N), generator=gen)
    assert torch.equal(back(idx).logits, old(idx).logits)
    new = _model(mode="riemannian")  # today's default: gains
    assert new.config.attention.metric_form == "gains"
    cfg = {k: v for k, v in tmod._flat(new.config).items() if k not in FACTOR_FORM}
    torch.save({"format": "riemannian_ref.FiberBundleTransformer/2", "config": cfg, "state_dict": new.state_dict()},
               p)
    with pytest.raises(ValueError, match="the weights do not match"):
        rr.FiberBundleTransformer.load(p)


def test_D2_a_format_1_file_with_the_content_connection_needs_its_rule_stated(tmp_path, gen):
    # D2: connection="content" meant the source rule in 0.2.0 (today's "content_source") and the two-endpoint
    # rule later; a format-1 file without scale_residual does not say which, so the caller must
    torch.manual_seed(0)
    old = _model(connection="content_source", metric_form="factor")
    p = tmp_path / "v020.pt"
    cfg = {k: v for k, v in tmod._flat(old.config).items() if k not in V1_ADDED}
    cfg["connection"] = None  # as 0.2.0 saved the fiber_bundle default
    torch.save({"format": V1, "config": cfg, "state_dict": old.state_dict()}, p)
    with pytest.raises(ValueError, match="connection='content_source'") as err:
        rr.FiberBundleTransformer.load(p)
    assert str(p) in str(err.value) and "0.2.0" in str(err.value)
    back = rr.FiberBundleTransformer.load(p, config=old.config)  # the rule stated: the model of 0.2.0
    idx = torch.randint(0, 16, (B, N), generator=gen)
    assert back.config == old.config and torch.equal(back(idx).logits, old(idx).logits)
    q = tmp_path / "v4.pt"
    back.save(q)  # saved again: the current format records the rule
    assert rr.FiberBundleTransformer.load(q).config.connection_resolved == "content_source"
    with pytest.raises(ValueError, match="connection it was trained with"):  # not a content rule
        rr.FiberBundleTransformer.load(p, config=old.config.replace(attention=dict(connection="flat")))
    # the way the load docstring shows: the file's flat config nested, the rule stated
    saved = nest_flat(torch.load(p, weights_only=True)["config"])
    saved["attention"].update(connection="content_source", metric_form="factor")  # its rule, its metrics
    again = rr.FiberBundleTransformer.load(p, config=rr.FiberBundleConfig(**saved))
    assert again.config == old.config.replace(scale_residual=True) and _same_weights(again, old)
    # a format-1 file that records scale_residual was written after the change: "content" is today's rule
    new = _model()
    _v1_file(p, new, drop=("metric_subspace",))
    assert rr.FiberBundleTransformer.load(p).config == new.config


def test_D2_unknown_format_versions_and_unknown_fields_are_refused(tmp_path):
    model = _model()
    p = tmp_path / "m.pt"
    model.save(p)
    for fmt, msg in (("riemannian_ref.FiberBundleTransformer/5", "format version 5"),
                     ("riemannian_ref.FiberBundleTransformer/0", "format version 0"),
                     ("riemannian_ref.FiberBundleTransformer/x", "not a riemannian_ref model file"),
                     (2, "not a riemannian_ref model file"), (None, "not a riemannian_ref model file")):
        _rewrite(p, lambda b: b.__setitem__("format", fmt))
        with pytest.raises(ValueError, match=msg) as err:
            rr.FiberBundleTransformer.load(p)
        assert str(p) in str(err.value)
    model.save(p)
    _rewrite(p, lambda b: b["config"].update(depth=3, width=2))
    with pytest.raises(ValueError, match=r"unknown fields \['depth', 'width'\]") as err:
        rr.FiberBundleTransformer.load(p)
    assert str(p) in str(err.value)


# ------------------------------------------------------------------ D20: the file's parts have the wrong type

@pytest.mark.parametrize("part,value,msg", [
    ("state_dict", [1, 2], "state_dict is a list"),
    ("state_dict", {"tok_emb.weight": "x"}, "'tok_emb.weight' is a str"),
    ("state_dict", {3: torch.zeros(1)}, "state_dict"),
    ("config", ["causal"], "config is a list"),
    ("config", {3: 1}, "config"),
])
def test_D20_a_file_part_of_the_wrong_type_is_refused_naming_the_file(tmp_path, part, value, msg):
    # D20
    p = tmp_path / "m.pt"
    _model().save(p)
    _rewrite(p, lambda b: b.__setitem__(part, value))
    with pytest.raises(ValueError, match=msg) as err:
        rr.FiberBundleTransformer.load(p)
    assert str(p) in str(err.value)


def test_D20_any_error_of_load_state_dict_is_wrapped_naming_the_file(tmp_path, monkeypatch):
    # D20
    p = tmp_path / "m.pt"
    _model().save(p)

    def odd(self, *a, **k):
        raise TypeError("something torch did not expect")

    monkeypatch.setattr(rr.FiberBundleTransformer, "load_state_dict", odd)
    with pytest.raises(ValueError, match="the weights do not match the saved config") as err:
        rr.FiberBundleTransformer.load(p)
    assert str(p) in str(err.value) and "something torch did not expect" in str(err.value)


# ------------------------------------------------------------------ D12: non-finite weights

def test_D12_load_refuses_non_finite_weights_naming_the_file_and_parameters(tmp_path):
    # D12 (load)
    p = tmp_path / "m.pt"
    model = _model()
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
        model.blocks[1].attn.v_proj.weight[1, 1] = float("-inf") if hasattr(model.blocks[1].attn, "v_proj") \
            else float("nan")
    model.save(p)  # saving is allowed (a diverged model can be inspected)
    with pytest.raises(ValueError, match="not finite") as err:
        rr.FiberBundleTransformer.load(p)
    msg = str(err.value)
    assert str(p) in msg and "blocks.0.mlp.fc.weight" in msg and "blocks.1." in msg


@pytest.mark.parametrize("mode", ["fiber_bundle", "riemannian", "euclidean"])
def test_D12_forward_with_a_non_finite_parameter_names_it(mode, gen):
    # D12 (forward): the preconditioned FFN's solve fails on non-finite values; the error names the parameter
    model = _model(mode=mode)
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    idx = torch.randint(0, 16, (B, N), generator=gen)
    if not model.config.precondition_ffn_resolved:  # no solve: NaN logits, as any torch model
        assert not torch.isfinite(model(idx).logits).all()
        return
    with pytest.raises(FloatingPointError, match=r"blocks\.0\.mlp\.fc\.weight") as err:
        model(idx)
    assert "not finite" in str(err.value)
    # a non-finite input (embeds) is named as such when every parameter is finite
    model = _model(mode=mode, vocab_size=None)
    x = torch.randn(B, N, 32, generator=gen)
    x[0, 0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"the input \(embeds\) is not finite"):
        model(embeds=x)


# ------------------------------------------------------------------ D22: size bounds of the config

def test_D22_sizes_beyond_an_int64_element_count_are_refused_naming_the_field():
    # D22 (the probe)
    with pytest.raises(ValueError, match="d_model") as err:
        rr.FiberBundleConfig.tiny(d_model=2**70, n_heads=2**65)
    assert "2**63" in str(err.value) or str(2**63 - 1) in str(err.value)
    with pytest.raises(ValueError, match="vocab_size"):
        rr.FiberBundleConfig.tiny(vocab_size=2**62)
    with pytest.raises(ValueError, match="block_size"):
        rr.FiberBundleConfig.tiny(block_size=2**50, d_model=2**12, n_heads=2)
    # large but real models are accepted (configs only: nothing is allocated)
    rr.FiberBundleConfig(vocab_size=256_000, d_model=16_384, n_heads=128, n_layers=128, block_size=2**20,
                         mode="euclidean", tie_weights=False)
    rr.FiberBundleConfig(vocab_size=256_000, d_model=16_384, n_heads=128, n_layers=128, block_size=2**20,
                         ffn_metric_rank=64, attention=dict(rank=64, metric="position"))


def test_load_keeps_the_saved_dtype(tmp_path):
    """A float64 model comes back float64 with the same logits, not silently cast to float32."""
    torch.manual_seed(0)
    m = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(mode="riemannian")).double().eval()
    p = tmp_path / "m64.pt"
    m.save(p)
    m2 = rr.FiberBundleTransformer.load(p).eval()
    assert {t.dtype for t in m2.state_dict().values() if t.is_floating_point()} == {torch.float64}
    idx = torch.randint(0, m.config.vocab_size, (2, 8))
    assert torch.equal(m(idx).logits, m2(idx).logits)
