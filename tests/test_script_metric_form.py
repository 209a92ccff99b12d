"""The experiment scripts build their metrics in the form of the stored results unless told otherwise.

The package's default metric parameterisation is the bounded-gains form; every
result file of ``results/`` was made with the factor form G = lam I + U U^T.
Each script that builds metric networks takes ``--metric-form`` (default
``factor``), passes it to every metric it builds and records it. Tiny runs
only: what is checked is the models the scripts build, not what they learn.
"""
import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

import riemannian_ref as rr
from _helpers import experiment_script, train_script

ROOT = Path(__file__).resolve().parents[1]


def _forms(model) -> set[str]:
    """The ``form`` of every attention metric network in ``model`` (the FFN preconditioner is always a factor)."""
    return {m.form for name, m in model.named_modules() if isinstance(m, rr.MetricNet) and "ffn_metric" not in name}


@pytest.mark.parametrize("flag, form", [([], "factor"), (["--metric-form", "gains"], "gains")])
def test_train_script_builds_and_records_the_metric_form(tmp_path, monkeypatch, flag, form):
    script = train_script()
    built, real = [], rr.train
    monkeypatch.setattr(rr, "train", lambda model, *a, **k: (built.append(model), real(model, *a, **k))[1])
    args = ["--task", "recall", "--mode", "riemannian", "--d-model", "16", "--n-heads", "2", "--n-layers", "1",
            "--vocab-size", "16", "--n-pairs", "3", "--seq-len", "12", "--steps", "1", "--eval-interval", "1",
            "--batch-size", "4", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "r.json"),
            "--checkpoint", str(tmp_path / "c.pt"), *flag]
    record = script.main(args)
    assert _forms(built[0]) == {form} and record["model"]["attention"]["metric_form"] == form
    assert json.loads((tmp_path / "r.json").read_text())["model"]["attention"]["metric_form"] == form


def test_train_script_takes_a_fiber_bundle_config():
    """The script's model is a FiberBundleConfig: a config file nests the attention options, flags set them,
    old flat names say where they moved."""
    script = train_script()
    cfg, _ = script.parse_args(["--task", "recall", "--mode", "riemannian"])
    assert isinstance(cfg.model, rr.FiberBundleConfig) and cfg.model.attention.metric_form == "factor"
    cfg, _ = script.parse_args(["--metric-rank", "3", "--metric-form", "gains"])
    assert (cfg.model.attention.rank, cfg.model.attention.metric_form) == (3, "gains")
    assert script.run_id(cfg) != script.run_id(script.parse_args([])[0])
    with pytest.raises(ValueError, match=r"metric_rank moved to attention: use attention=dict\(rank=3\)"):
        script._merge(script.RunConfig(), {"model": {"metric_rank": 3}})
    with pytest.raises(ValueError, match="unknown config keys for FiberBundleConfig"):
        script._merge(script.RunConfig(), {"model": {"depth": 3}})
    merged = script._merge(script.RunConfig(), {"model": {"d_model": 32, "attention": {"metric_side": "mean"}}})
    assert (merged.model.d_model, merged.model.attention.d_model) == (32, 32)
    assert (merged.model.attention.metric_side, merged.model.attention.metric_form) == ("mean", "factor")


@pytest.mark.parametrize("flag, form", [([], "factor"), (["--metric-form", "gains"], "gains")])
def test_compare_script_builds_and_records_the_metric_form(tmp_path, monkeypatch, flag, form):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))  # compare.py imports train.py by name
    script = experiment_script("compare.py")
    built, real = [], rr.FiberBundleTransformer
    monkeypatch.setattr(rr, "FiberBundleTransformer", lambda cfg: built.append(real(cfg)) or built[-1])
    out = tmp_path / "c.json"
    script.main(["--task", "recall", "--arms", "euclidean,riemannian,fiber_bundle", "--d-model", "16",
                 "--n-layers", "1", "--n-train", "64", "--n-val", "16", "--steps", "1", "--eval-interval", "1",
                 "--batch-size", "4", "--warmup", "0", "--lrs", "1e-3", "--seeds", "0,1", "--device", "cpu",
                 "--no-progress", "--out", str(out), *flag])
    assert {f for m in built for f in _forms(m)} == {form}
    res = json.loads(out.read_text())
    assert res["metric_form"] == form
    assert {res["models"][a]["attention"]["metric_form"] for a in ("riemannian", "fiber_bundle")} == {form}


def test_compare_script_tuning_split_scores_tuning_seeds_on_the_tuning_topics(tmp_path, monkeypatch):
    """--tuning-split: the tuning seeds see the tuning topics, the evaluation seeds the validation topics."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    script = experiment_script("compare.py")
    seen, real = {}, rr.compare

    def spy(arms, data, config, **kw):
        for s in (*kw["tune_seeds"], *kw["eval_seeds"]):
            seen[s] = data(s)
        return real(arms, data, config, **kw)

    monkeypatch.setattr(rr, "compare", spy)
    out = tmp_path / "c.json"
    script.main(["--task", "charlm", "--arms", "euclidean,rope", "--d-model", "8", "--n-layers", "1",
                 "--block-size", "8", "--steps", "1", "--eval-interval", "1", "--batch-size", "2",
                 "--eval-max", "4", "--warmup", "0", "--lrs", "1e-3", "--tune-seeds", "1000", "--seeds", "0,1",
                 "--tuning-split", "0.1", "--device", "cpu", "--no-progress", "--out", str(out)])
    _, tune, _ = rr.char_lm(block_size=8, tune_fraction=0.1, split="tune")
    train, val, _ = rr.char_lm(block_size=8, tune_fraction=0.1)
    assert torch.equal(seen[1000][1].x, tune.x) and torch.equal(seen[0][1].x, val.x)
    assert all(torch.equal(seen[s][0].x, train.x) for s in seen)
    assert json.loads(out.read_text())["tuning_split"] == 0.1
    with pytest.raises(SystemExit, match="charlm only"):
        script.main(["--task", "recall", "--tuning-split", "0.1", "--out", str(out)])
    with pytest.raises(SystemExit, match="must lie in"):
        script.main(["--task", "charlm", "--tuning-split", "1.5", "--out", str(out)])
    train_script = experiment_script("train.py")
    with pytest.raises(ValueError, match="charlm task only"):
        train_script.task_data(train_script.TaskConfig(name="recall"), 0, split="tune")


@pytest.mark.parametrize("flag, form", [([], "factor"), (["--metric-form", "gains"], "gains")])
def test_rank_collapse_controlled_builds_and_records_the_metric_form(tmp_path, flag, form):
    script = experiment_script("rank_collapse_controlled.py")
    out = tmp_path / "rcc.json"
    script.main(["--seeds", "1", "--tune-seeds", "1", "--probe-seeds", "1", "--depth", "2", "--n", "8",
                 "--d-model", "8", "--batch", "1", "--bisect-steps", "1", "--variants", "hetero-key",
                 "--eps-points", "3", "--vocab", "4", "--probe-train", "4", "--probe-test", "4",
                 "--probe-depths", "0", "1", "--out", str(out), *flag])
    meta = json.loads(out.read_text())["meta"]
    assert meta["metric_form"] == form
    args = Namespace(d_model=8, heads=2, depth=2, n=8, metric_form=form)
    assert _forms(script.build("hetero-key", 0, 4.0, args)) == {form}


def test_rank_collapse_controlled_namespace_without_the_form_builds_factor():
    """Chapter 9 rebuilds the stacks from a result file's meta: one written before the option means factor."""
    script = experiment_script("rank_collapse_controlled.py")
    old = Namespace(d_model=8, heads=2, depth=1, n=8)
    new = Namespace(**vars(old), metric_form="factor")
    a, b = script.build("hetero-query", 0, 4.0, old), script.build("hetero-query", 0, 4.0, new)
    assert _forms(a) == {"factor"}
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("flag, form", [([], "factor"), (["--metric-form", "gains"], "gains")])
def test_nanogpt_stall_passes_the_metric_form_to_the_example(tmp_path, monkeypatch, flag, form):
    script = experiment_script("nanogpt_stall.py")
    built = []

    class Spy(script.example.GPT):
        def __init__(self, config):
            super().__init__(config)
            built.append(self)

    monkeypatch.setattr(script.example, "GPT", Spy)
    monkeypatch.setattr(script.example.rr.data, "stdlib_docstring_text", lambda: "abcdefgh " * 400)
    parse = script.example.parse_args  # a tiny model (the last of a repeated flag wins)
    monkeypatch.setattr(script.example, "parse_args", lambda argv: parse(argv + [
        "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4", "--eval-iters", "1"]))
    out = tmp_path / "s.json"
    script.main(["--steps", "1", "--n-layer", "1", "--eval-every", "1", "--variants", "sdpa", "distance", "metric",
                 "--out", str(out), *flag])
    assert _forms(built[0]) == set() and _forms(built[2]) == {form}
    assert built[1].h[0].attn.metric.rank == 0  # the distance form (no factor whose form could matter)
    res = json.loads(out.read_text())
    assert res["metric_form"] == form and res["runs"]["metric"]["config"]["metric_form"] == form


def test_nanogpt_example_keeps_the_package_default():
    """The example's own default is the package's; --metric-form overrides it."""
    example = experiment_script("nanogpt_stall.py").example
    config = example.GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=16)
    assert config.metric_form is None and _forms(example.GPT(config)) == {rr.MetricNet(4, 1, 4, 2).form}
    assert example.parse_args([]).metric_form is None
    assert example.parse_args(["--metric-form", "factor"]).metric_form == "factor"
    factor = example.GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=16, metric_form="factor")
    assert _forms(example.GPT(factor)) == {"factor"}


@pytest.mark.parametrize("flag, form", [([], "factor"), (["--metric-form", "gains"], "gains")])
def test_intrinsic_rank_recall_heads_take_the_form(tmp_path, monkeypatch, flag, form):
    """The script's heads are rr.RecallHead with the metric form given through attention= (no subclass)."""
    script = experiment_script("intrinsic_rank.py")
    seen = {}
    monkeypatch.setattr(rr, "compare", lambda arms, data, config, **kw: seen.update(arms) or {})
    # head dimension 2 for the metric arm: the gains form's two directions need two dimensions
    monkeypatch.setattr("sys.argv", ["intrinsic_rank.py", "--part", "trainability", "--head-dims", "2",
                                     "--metric-head-dims", "2", "--no-progress", "--out", str(tmp_path / "t.json"),
                                     *flag])
    script.main()
    heads = {name: arm.model() for name, arm in seen.items()}
    assert all(type(h) is rr.RecallHead for h in heads.values())
    assert _forms(heads["distance-d2"]) == _forms(heads["metric-d2"]) == {form}
    assert heads["metric-d2"].attn.config.rank == 2 and heads["distance-d2"].attn.config.rank == 0


def test_geodesic_gap_case_takes_the_form():
    script = experiment_script("geodesic_gap.py")
    factor = script.gap_case(1.0, 1, 8, 5)
    assert script.gap_case(1.0, 1, 8, 5, form="factor") == factor
    assert script.gap_case(1.0, 1, 8, 5, form="gains") != factor


def test_geodesic_gap_records_the_form(tmp_path):
    script = experiment_script("geodesic_gap.py")
    for flag, form in (([], "factor"), (["--metric-form", "gains"], "gains")):
        out = tmp_path / f"{form}.json"
        script.main(["--strengths", "1.0", "--seeds", "1", "--n-points", "8", "--steps", "5", "--out", str(out),
                     *flag])
        res = json.loads(out.read_text())
        assert res["config"]["metric_form"] == form
        assert res["rows"][0]["pair_mean"] == script.gap_case(1.0, 0, 8, 5, form=form)[0]


@pytest.mark.parametrize("flag, form", [([], "factor"), (["--metric-form", "gains"], "gains")])
def test_rank_collapse_builds_and_records_the_metric_form(tmp_path, monkeypatch, flag, form):
    script = experiment_script("rank_collapse.py")
    built, real = [], rr.FiberBundleTransformer
    monkeypatch.setattr(rr, "FiberBundleTransformer", lambda cfg: built.append(real(cfg)) or built[-1])
    out = tmp_path / "rc.json"
    script.main(["--seeds", "1", "--depth", "1", "--n", "4", "--d-model", "8", "--batch", "1",
                 "--variants", "hetero-key-r1-s1", "--archs", "pure", "--euclid-archs", "pure",
                 "--train-variants", "hetero-key-r1-s1", "--train-archs", "pure", "--train-seeds", "1",
                 "--train-depth", "1", "--train-d-model", "8", "--train-steps", "1", "--train-n", "4",
                 "--train-vocab", "2", "--train-examples", "8", "--train-batch", "4", "--out", str(out), *flag])
    assert len(built) == 2 and {f for m in built for f in _forms(m)} == {form}  # the init and trained parts
    assert json.loads(out.read_text())["meta"]["metric_form"] == form


def test_bench_model_configs_take_the_form(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_model

    for form in ("factor", "gains"):
        assert bench_model.config("riemannian", 32, form).attention.metric_form == form
        assert bench_model.target_config("fiber_bundle", 32, form).attention.metric_form == form
    assert bench_model.config("riemannian", 32).attention.metric_form == "factor"
    assert bench_model.target_config("riemannian", 32).attention.metric_form == "factor"


@pytest.mark.parametrize("kinds, expected, reference", [
    ([], ["dot-d2", "dot-d3", "distance-d2", "distance-d3", "metric-d1"], "dot-d3"),
    (["--kinds", "dot"], ["dot-d2", "dot-d3"], "dot-d3"),
    (["--kinds", "distance", "metric"], ["distance-d2", "distance-d3", "metric-d1"], "distance-d2"),
])
def test_intrinsic_rank_trainability_kinds(tmp_path, monkeypatch, kinds, expected, reference):
    """--kinds selects the heads --part trainability trains; the reference is the widest dot head if present."""
    script = experiment_script("intrinsic_rank.py")
    seen = {}

    def fake_compare(arms, data, config, **kw):
        seen.update(arms=list(arms), reference=kw["reference"], lrs=kw["lrs"], steps=config.steps)
        return {}

    monkeypatch.setattr(rr, "compare", fake_compare)
    monkeypatch.setattr("sys.argv", ["intrinsic_rank.py", "--part", "trainability", "--head-dims", "2", "3",
                                     "--metric-head-dims", "1", "--lrs", "1e-4,1e-3", "--recall-steps", "7",
                                     "--no-progress", "--out", str(tmp_path / "t.json"), *kinds])
    script.main()
    assert seen == {"arms": expected, "reference": reference, "lrs": [1e-4, 1e-3], "steps": 7}
    assert json.loads((tmp_path / "t.json").read_text())["meta"]["args"]["kinds"] == (kinds[1:] or
                                                                                      ["dot", "distance", "metric"])
