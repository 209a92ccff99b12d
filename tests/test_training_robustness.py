"""The training loop's guarantees under damage and misuse: atomic checkpoints (a process killed
while writing one keeps the previous one, which resumes bitwise), a resume that checks the whole
file and the optimiser's hyper-parameters before loading anything and then restores all or
nothing, and checks before the first step (writable checkpoint path, scored examples, enough
outputs, finite parameters). One test per defect, named in a comment (D3, D5, D6, ...)."""
from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import riemannian_ref as rr
from riemannian_ref import _checkpoint, _io, data
from riemannian_ref.models import transformer as tmod
from riemannian_ref.training import _make_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tiny(nn.Module):
    """Embedding, one linear layer: a model the loop trains in milliseconds."""

    def __init__(self, vocab: int = 16, D: int = 8, out: int | None = None):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, D), nn.Linear(D, out or vocab)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


class DropTiny(Tiny):
    """Tiny with dropout: training draws from torch's global RNG, which a resume must restore."""

    def forward(self, idx):
        return self.head(nn.functional.dropout(torch.tanh(self.emb(idx)), 0.2, self.training))


def _recall():
    return data.make_task("recall", seed=0, n_train=128, n_val=32, vocab_size=16, n_pairs=3, seq_len=12)


def _model(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def _cfg(path=None, **kw):
    base = dict(lr=3e-3, steps=9, batch_size=8, eval_interval=3, seed=0, warmup_steps=1,
                checkpoint_path=None if path is None else str(path))
    return rr.TrainConfig(**{**base, **kw})


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_snapshot(opt):
    sd = copy.deepcopy(opt.state_dict())
    return sd, [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _opt_same(opt, snap) -> bool:
    sd, groups = snap
    now = opt.state_dict()
    if now["state"].keys() != sd["state"].keys():
        return False
    for i in sd["state"]:
        if now["state"][i].keys() != sd["state"][i].keys():
            return False
        for k, v in sd["state"][i].items():
            w = now["state"][i][k]
            if isinstance(v, torch.Tensor) != isinstance(w, torch.Tensor):
                return False
            if isinstance(v, torch.Tensor) and not torch.equal(v, w) or not isinstance(v, torch.Tensor) and v != w:
                return False
    return groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.fixture
def ck(tmp_path):
    """A checkpoint of step 3 of a 9-step run (stopped there), with the model that wrote it."""
    tr, va = _recall()
    path = tmp_path / "ck.pt"
    rr.train(_model(), tr, va, _cfg(path, stop_at_step=3))
    return path


# ---------------------------------------------------------------- atomic writes, kill while writing

def test_checkpoint_write_goes_through_the_shared_atomic_writer(tmp_path, monkeypatch):
    calls = []
    real = _io.atomic_write

    def spy(path, write, what="path"):
        calls.append((os.fspath(path), what))
        return real(path, write, what)

    monkeypatch.setattr(_checkpoint, "atomic_write", spy)
    tr, va = _recall()
    rr.train(_model(), tr, va, _cfg(tmp_path / "ck.pt"))
    assert calls == [(str(tmp_path / "ck.pt"), "checkpoint_path")] * 3  # steps 3, 6, 9
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]  # no temporary file left behind
    assert not (tmp_path / "ck.pt.tmp").exists()


_CHILD = textwrap.dedent("""
    import os, sys, time, io
    import torch
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import riemannian_ref as rr
    from riemannian_ref import _io
    from test_training_robustness import _recall, _model, _cfg
    path, where = sys.argv[1], sys.argv[2]
    real_save, real_replace = torch.save, os.replace
    n = [0]

    def announce():
        print("KILLME", flush=True)
        time.sleep(60)

    def slow_save(obj, f, *a, **k):  # the second checkpoint (step 6) is written over the first (step 3)
        n[0] += 1
        if n[0] < 2:
            return real_save(obj, f, *a, **k)
        if where == "empty":
            open(f, "wb").close(); announce()
        buf = io.BytesIO(); real_save(obj, buf, *a, **k); raw = buf.getvalue()
        with open(f, "wb") as fh:
            fh.write(raw[: len(raw) // 2] if where == "half" else raw); fh.flush()
        if where in ("half", "written"):
            announce()

    def slow_replace(src, dst):
        if n[0] >= 2 and where == "rename":
            announce()
        return real_replace(src, dst)

    torch.save = slow_save
    _io.os.replace = slow_replace
    tr, va = _recall()
    rr.train(_model(), tr, va, _cfg(path))
    print("FINISHED", flush=True)
""")


def test_a_process_killed_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path):
    """SIGKILL at four points of writing the step-6 checkpoint over the step-3 one: the step-3 file
    still reads, and resuming from it ends bitwise where the uninterrupted run ends."""
    tr, va = _recall()
    m_full = _model()
    full = rr.train(m_full, tr, va, _cfg())
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(repo=REPO, tests=os.path.join(REPO, "tests")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    points = ("empty", "half", "written", "rename")
    procs = {where: subprocess.Popen([sys.executable, str(script), str(tmp_path / f"ck_{where}.pt"), where],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for where in points}  # in parallel: each child's start-up (importing torch) dominates
    try:
        for where, proc in procs.items():
            line = proc.stdout.readline()
            assert line.strip() == "KILLME", (where, line, proc.stderr.read() if proc.poll() is not None else "")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for where in points:
        path = tmp_path / f"ck_{where}.pt"
        assert torch.load(path, weights_only=True)["step"] == 3, where  # the previous checkpoint, complete
        leftovers = [f for f in os.listdir(tmp_path) if f.startswith(f".ck_{where}.pt.") and f.endswith(".tmp")]
        assert len(leftovers) == 1, where  # the kill left the temporary file behind: it is never read
        m = _model(seed=5)
        res = rr.train(m, tr, va, _cfg(path, resume=True))
        assert res.steps_done == 9 and res.history["step"] == full.history["step"]
        assert res.history["val_loss"] == full.history["val_loss"], where
        assert _same(_state(m), _state(m_full)), where


# ---------------------------------------------------------------- D13: checkpoint_path checked first

@pytest.mark.parametrize("bad", ["under_a_file", "directory", "proc"])
def test_an_unwritable_checkpoint_path_is_refused_before_any_step(tmp_path, bad):  # D13
    (tmp_path / "afile").write_text("x")
    path = {"under_a_file": tmp_path / "afile" / "ck.pt", "directory": tmp_path,
            "proc": "/proc/rr_ck.pt"}[bad]
    if bad == "proc" and not os.path.isdir("/proc"):
        pytest.skip("no /proc")
    tr, va = _recall()
    model, seen = _model(), []
    before = _state(model)
    with pytest.raises(ValueError, match=rf"checkpoint_path {str(path)!r}"):
        rr.train(model, tr, va, _cfg(path), hooks=[lambda s, m: seen.append(s)])
    assert seen == [] and _same(before, _state(model))  # not even the step-0 evaluation ran


# ---------------------------------------------------------------- D6, D14, D12: damaged checkpoints

def _damage(blob: dict, how: str) -> dict:
    blob = copy.deepcopy(blob)
    st = blob["optimizer"]["state"]
    if how == "rng_size":
        blob["torch_rng"] = torch.zeros(3, dtype=torch.uint8)
    elif how == "rng_content":
        blob["torch_rng"] = torch.zeros_like(blob["torch_rng"])
    elif how == "sampler_size":
        blob["sampler"] = [torch.zeros(7, dtype=torch.uint8)]
    elif how == "history_key":
        del blob["history"]["val_loss"]
    elif how == "history_lengths":
        blob["history"]["val_loss"].append(1.0)
    elif how == "history_steps":
        blob["history"]["step"] = [0, 2]
    elif how == "step_beyond":
        blob["step"] = 99
    elif how == "step_vs_history":
        blob["step"] = 7
    elif how == "n_since":
        blob["n_since"] = 2
    elif how == "time_nan":
        blob["train_time_s"] = float("nan")
    elif how == "time_negative":
        blob["train_time_s"] = -1.0
    elif how == "exp_avg_shape":
        for s in st.values():
            s["exp_avg"] = torch.zeros(1)
    elif how == "exp_avg_sq_missing":
        for s in st.values():
            del s["exp_avg_sq"]
    elif how == "state_nan":
        next(iter(st.values()))["exp_avg"].fill_(float("nan"))
    elif how == "state_index":
        st[17] = copy.deepcopy(st[0])
    elif how == "param_nan":
        blob["model"]["head.weight"][0, 0] = float("nan")
    return blob


_DAMAGE = {  # how -> the field the message names
    "rng_size": r"'torch_rng'.*uint8, 5056 bytes", "rng_content": r"'torch_rng'.*not a valid CPU generator state",
    "sampler_size": r"'sampler' state of rank 0", "history_key": r"'history'.*missing \['val_loss'\]",
    "history_lengths": r"'history' has lists of different lengths",
    "history_steps": r"'history' list 'step' is \[0, 2\]", "step_beyond": r"'step' is 99, outside \[0, steps=9\]",
    "step_vs_history": r"'history' list 'step'.*at step 7", "n_since": r"'n_since' is 2",
    "time_nan": r"'train_time_s' is nan", "time_negative": r"'train_time_s' is -1\.0",
    "exp_avg_shape": r"'optimizer' state of parameter 0, key 'exp_avg',.*shape \(1,\).*\(16, 8\)",
    "exp_avg_sq_missing": r"'optimizer' state of parameter 0 has keys.*exp_avg_sq",
    "state_nan": r"'optimizer' state of parameter 0 holds non-finite values",
    "state_index": r"'optimizer' state of parameter 17 names no parameter",
    "param_nan": r"model parameter 'head\.weight' is not finite \(1 of 128 entries\)",  # D12
}


@pytest.mark.parametrize("how", list(_DAMAGE))
def test_a_damaged_checkpoint_is_refused_before_anything_is_loaded(tmp_path, ck, how):  # D6, D14, D12
    blob = torch.load(ck, weights_only=True)
    bad = tmp_path / f"bad_{how}.pt"
    torch.save(_damage(blob, how), bad)
    tr, va = _recall()
    model = _model(seed=4)
    opt = _make_optimizer(model, _cfg())
    model(tr.x[:4]).sum().backward()  # a caller's optimiser with state of its own
    opt.step()
    opt.zero_grad(set_to_none=True)
    before, snap = _state(model), _opt_snapshot(opt)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=rf"{bad.name}.*{_DAMAGE[how]}"):
        rr.train(model, tr, va, _cfg(bad, resume=True), optimizer=opt)
    assert _same(before, _state(model)), how  # nothing was loaded: the model,
    assert _opt_same(opt, snap), how  # the optimiser (state and groups),
    assert torch.equal(torch.get_rng_state(), rng), how  # and torch's global RNG are as they were
    # the batch sampler (internal to train) is untouched as well: the same refusal, one level down
    sampler = torch.Generator().manual_seed(99)
    s0 = sampler.get_state()
    with pytest.raises(ValueError, match=rf"{bad.name}.*{_DAMAGE[how]}"):
        _checkpoint.resume(str(bad), config=_cfg(bad, resume=True), module=model, optimizer=opt, sampler=sampler,
                           rank=0, world_size=1, device=torch.device("cpu"))
    assert torch.equal(sampler.get_state(), s0) and _same(before, _state(model)) and _opt_same(opt, snap)
    # the undamaged file resumes (the control: the damage is what is refused)
    res = rr.train(_model(seed=4), tr, va, _cfg(ck, resume=True))
    assert res.steps_done == 9


def test_a_restore_that_fails_midway_is_rolled_back(tmp_path, ck, monkeypatch):  # D6
    """Model and optimiser already loaded, then the last state fails to load: all four are put back."""
    tr, va = _recall()
    model = _model(seed=4)
    opt = _make_optimizer(model, _cfg())
    before, snap = _state(model), _opt_snapshot(opt)
    sampler = torch.Generator().manual_seed(99)
    s0, rng = sampler.get_state(), torch.get_rng_state()
    real = torch.set_rng_state
    calls = []

    def failing(state):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated failure")
        return real(state)

    monkeypatch.setattr(torch, "set_rng_state", failing)
    with pytest.raises(ValueError, match=r"ck\.pt.*torch's global RNG state does not load.*nothing was loaded"):
        _checkpoint.resume(str(ck), config=_cfg(ck, resume=True), module=model, optimizer=opt, sampler=sampler,
                           rank=0, world_size=1, device=torch.device("cpu"))
    assert _same(before, _state(model)) and _opt_same(opt, snap)
    assert torch.equal(sampler.get_state(), s0) and torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("kind", ["stiefel", "lowrank"])
def test_package_optimisers_state_is_checked_against_their_own_layout(tmp_path, kind):  # D14
    tr, va = _recall()
    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        m = Tiny()
        if kind == "stiefel":
            frame = rr.ManifoldParameter(rr.Stiefel().random(8, 3, generator=torch.Generator().manual_seed(0)),
                                         rr.Stiefel())
            m.frame = frame  # a Stiefel frame the model uses
            m.forward = lambda idx, m=m: m.head(torch.tanh(m.emb(idx) @ m.frame @ m.frame.T))
            opt = rr.RiemannianAdam([{"params": [m.frame]},
                                     {"params": [m.emb.weight, m.head.weight, m.head.bias]}], lr=1e-2)
        else:
            m.A, m.B = nn.Parameter(0.1 * torch.randn(8, 2)), nn.Parameter(0.1 * torch.randn(8, 2))
            rr.optim.constrain_(rr.optim.FixedRankEmbedded(), m.A, m.B)
            m.forward = lambda idx, m=m: m.head(torch.tanh(m.emb(idx) @ (torch.eye(8) + m.A @ m.B.T)))
            opt = rr.RiemannianAdam([{"params": [m.A, m.B]},
                                     {"params": [m.emb.weight, m.head.weight, m.head.bias]}], lr=1e-2)
        return m, opt

    path = tmp_path / "ck.pt"
    m, opt = build()
    rr.train(m, tr, va, _cfg(path, stop_at_step=3), optimizer=opt)
    blob = torch.load(path, weights_only=True)
    m2, opt2 = build()
    rr.train(m2, tr, va, _cfg(path, resume=True), optimizer=opt2)  # the control: it resumes
    st = blob["optimizer"]["state"]
    if kind == "stiefel":  # one second moment per frame: a per-entry one is refused
        st[0]["exp_avg_sq"] = torch.zeros(8, 3)
        want = r"state of parameter 0, key 'exp_avg_sq',.*shape \(8, 3\).*keeps a tensor of shape \(1, 1\)"
    else:  # the embedded momentum is one m x n matrix
        st[0]["exp_avg"] = torch.zeros(8, 2)
        want = r"state of parameter 0, key 'exp_avg',.*shape \(8, 2\).*keeps a tensor of shape \(8, 8\)"
    bad = tmp_path / "bad.pt"
    torch.save(blob, bad)
    m3, opt3 = build()
    before = _state(m3)
    with pytest.raises(ValueError, match=rf"bad\.pt.*{want}"):
        rr.train(m3, tr, va, _cfg(bad, resume=True), optimizer=opt3)
    assert _same(before, _state(m3)) and len(opt3.state) == 0


# ---------------------------------------------------------------- D3: changed hyper-parameters

def test_changed_optimiser_hyperparameters_are_refused_or_applied_as_asked(tmp_path):  # D3
    tr, va = _recall()
    path = tmp_path / "ck.pt"
    m = _model()
    rr.train(m, tr, va, _cfg(path, stop_at_step=3), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3))
    m2 = _model(seed=1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5e-2, weight_decay=0.5)
    before = _state(m2)
    with pytest.raises(ValueError, match=r"ck\.pt.*another run.*optimizer group 0 peak_lr: checkpoint 0\.001, "
                                         r"now 0\.05.*optimizer group 0 weight_decay: checkpoint 0\.01, now 0\.5"):
        rr.train(m2, tr, va, _cfg(path, resume=True), optimizer=opt2)
    assert _same(before, _state(m2)) and len(opt2.state) == 0
    # "new": the caller's values apply from the resumed step on, and a warning lists them
    with pytest.warns(UserWarning, match=r"resume_hparams='new'.*peak_lr: checkpoint 0\.001, now 0\.05"):
        rr.train(m2, tr, va, _cfg(path, resume=True, resume_hparams="new", stop_at_step=6), optimizer=opt2)
    g = opt2.param_groups[0]
    assert g["peak_lr"] == 5e-2 and g["weight_decay"] == 0.5
    assert torch.load(path, weights_only=True)["optimizer"]["param_groups"][0]["weight_decay"] == 0.5
    # "checkpoint": the checkpoint's values apply (now the new ones), the caller's are discarded, with a warning
    m3 = _model(seed=2)
    opt3 = torch.optim.AdamW(m3.parameters(), lr=1e-4, weight_decay=0.0)
    with pytest.warns(UserWarning, match=r"resume_hparams='checkpoint'.*discarded.*weight_decay: checkpoint 0\.5"):
        rr.train(m3, tr, va, _cfg(path, resume=True, resume_hparams="checkpoint"), optimizer=opt3)
    assert opt3.param_groups[0]["peak_lr"] == 5e-2 and opt3.param_groups[0]["weight_decay"] == 0.5
    # the same values resume without a word; the built-in optimiser's config fields are covered too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p2 = tmp_path / "ck2.pt"
        rr.train(_model(), tr, va, _cfg(p2, stop_at_step=3))
        rr.train(_model(), tr, va, _cfg(p2, resume=True, stop_at_step=6))
    with pytest.raises(ValueError, match=r"TrainConfig\.weight_decay: checkpoint 0\.0, now 0\.1.*weight_decay"):
        rr.train(_model(), tr, va, _cfg(p2, resume=True, weight_decay=0.1))
    with pytest.warns(UserWarning, match=r"optimizer group 0 weight_decay: checkpoint 0\.0, now 0\.1"):
        rr.train(_model(), tr, va, _cfg(p2, resume=True, weight_decay=0.1, resume_hparams="new"))
    with pytest.raises(ValueError, match="resume_hparams must be one of"):
        _cfg(resume_hparams="keep")
    assert "resume_hparams" not in _cfg().run_fields()


# ---------------------------------------------------------------- D5, D11, D12: checks before the first step

@pytest.mark.parametrize("which", ["train_data", "val_data"])
def test_examples_with_no_scored_position_are_refused_up_front(which):  # D5
    tr, va = _recall()
    d = tr if which == "train_data" else va
    mask = d.mask.clone()
    mask[1::2] = False
    bad = data.TaskData(d.x, d.y, mask, 16)
    args = (bad, va) if which == "train_data" else (tr, bad)
    with pytest.raises(ValueError, match=rf"{which} has {len(d) // 2} of {len(d)} examples with no scored "
                                         rf"position.*{which}\.subset\({which}\.mask\.any\(dim=1\)\)"):
        rr.train(_model(), *args, _cfg(batch_size=1, steps=40, eval_interval=40))
    # the fix the message gives trains
    fixed = bad.subset(bad.mask.any(dim=1))
    args = (fixed, va) if which == "train_data" else (tr, fixed)
    assert rr.train(_model(), *args, _cfg(batch_size=1, steps=4, eval_interval=4)).steps_done == 4


def test_targets_beyond_the_models_outputs_are_refused_before_any_step():  # D11
    ct = data.counting(16, seq_len=16, vocab_size=16, generator=torch.Generator().manual_seed(0))
    m = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(block_size=16, n_classes=4, tie_weights=False))
    with pytest.raises(ValueError, match=rf"train_data has {ct.out_dim} classes \(targets up to \d+\), but the "
                                         r"model outputs 4 per position"):
        rr.train(m, ct, ct, rr.TrainConfig(steps=1))
    tr, va = _recall()  # a generic model: read from one forward, which leaves the global RNG alone
    torch.manual_seed(7)
    ten = DropTiny(out=10)  # dropout would draw from the RNG in a training-mode forward
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"train_data has 16 classes.*model outputs 10 per position"):
        rr.train(ten, tr, va, _cfg())
    assert torch.equal(torch.get_rng_state(), rng) and ten.training
    big = data.TaskData(tr.x, tr.y, tr.mask, 16)
    small = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(vocab_size=8, block_size=12))
    with pytest.raises(ValueError, match=r"train_data holds token ids up to 15.*model's vocab_size is 8"):
        rr.train(small, big, big, _cfg())
    assert Tiny(out=20)  # more outputs than classes is legal
    rr.train(Tiny(out=20), tr, va, _cfg(steps=2, eval_interval=2))


@pytest.mark.parametrize("mode", ["euclidean", "fiber_bundle"])
def test_non_finite_parameters_are_named_before_training(mode):  # D12
    tr, va = _recall()
    torch.manual_seed(0)
    m = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(block_size=12, mode=mode))
    with torch.no_grad():
        m.blocks[0].mlp.fc.weight[0, 0] = float("nan")
    seen = []
    with pytest.raises(ValueError, match=r"model parameter 'blocks\.0\.mlp\.fc\.weight' \(1 of \d+ entries\) is "
                                         r"not finite \(inf or NaN\) before training"):
        rr.train(m, tr, va, _cfg(steps=3, eval_interval=3), hooks=[lambda s, x: seen.append(s)])
    assert seen == []


def test_a_hook_that_breaks_the_parameters_is_not_blamed_on_the_optimiser(tmp_path):  # D12
    tr, va = _recall()
    m = _model()

    def vandal(step, metrics):
        if step == 3:
            with torch.no_grad():
                m.head.bias[0] = float("inf")

    path = tmp_path / "ck.pt"
    with pytest.raises(ValueError, match=r"an evaluation hook made parameter\(s\) \['head\.bias'\] non-finite at "
                                         r"step 3.*no optimiser step did"):
        rr.train(m, tr, va, _cfg(path), hooks=[vandal])
    assert not path.exists()  # the refused save wrote nothing


def test_a_save_of_non_finite_parameters_is_refused_and_the_last_checkpoint_kept(tmp_path, ck):  # D12
    blob = torch.load(ck, weights_only=True)
    m = _model()
    with torch.no_grad():
        m.emb.weight[2, 1] = float("nan")
    opt = _make_optimizer(m, _cfg())
    with pytest.raises(FloatingPointError, match=r"refusing to write checkpoint .*ck\.pt.*\['emb\.weight'\].*left "
                                                 r"as it was"):
        _checkpoint.save(str(ck), config=_cfg(ck), module=m, optimizer=opt, sampler=torch.Generator(), rank=0,
                         world_size=1, progress={})
    after = torch.load(ck, weights_only=True)
    assert after["step"] == blob["step"] and _same(after["model"], blob["model"])


def test_resume_keeps_the_bitwise_promise_with_all_checks_on(tmp_path):
    """The checks draw nothing from the global RNG and change no state: stop, resume, and the
    uninterrupted run agree bitwise (dropout makes the RNG part of the run)."""
    tr, va = _recall()

    def fresh(seed=0):
        torch.manual_seed(seed)
        return DropTiny()

    full = rr.train(m_full := fresh(), tr, va, _cfg())
    path = tmp_path / "ck.pt"
    torch.manual_seed(0)
    rr.train(fresh(), tr, va, _cfg(path, stop_at_step=4))
    torch.manual_seed(11)  # the global RNG comes from the checkpoint
    res = rr.train(m := fresh(seed=9), tr, va, _cfg(path, resume=True))
    assert res.history["val_loss"] == full.history["val_loss"] and _same(_state(m), _state(m_full))
    assert all(math.isfinite(v) for v in res.history["val_loss"][1:])


def test_an_optimiser_that_cannot_be_copied_still_resumes_exactly(tmp_path):  # D14 (the fallback)
    """The state check steps a deep copy of the optimiser; one that cannot be copied skips that check
    (torch's load and the all-or-nothing restore remain) and resumes as before."""
    import threading

    class LockedSGD(torch.optim.SGD):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.lock = threading.Lock()  # not deep-copyable

    with pytest.raises(TypeError):
        copy.deepcopy(threading.Lock())
    tr, va = _recall()
    full = rr.train(m_full := _model(), tr, va, _cfg(), optimizer=LockedSGD(m_full.parameters(), lr=0.1,
                                                                             momentum=0.9))
    path = tmp_path / "ck.pt"
    m = _model()
    rr.train(m, tr, va, _cfg(path, stop_at_step=4), optimizer=LockedSGD(m.parameters(), lr=0.1, momentum=0.9))
    m2 = _model(seed=3)
    res = rr.train(m2, tr, va, _cfg(path, resume=True), optimizer=LockedSGD(m2.parameters(), lr=0.1, momentum=0.9))
    assert res.history["val_loss"] == full.history["val_loss"] and _same(_state(m2), _state(m_full))


def test_a_format_1_checkpoint_with_a_flat_model_config_resumes(tmp_path):
    """Format 1 recorded a FiberBundleConfig with its attention options flat: read() nests them, so the run
    resumes; a checkpoint of another model is still refused, naming the nested field."""
    tr, va = _recall()
    cfg = rr.FiberBundleConfig.tiny(mode="riemannian", block_size=12, n_layers=1,
                                    attention=dict(rank=3, metric="shared"))
    path = tmp_path / "ck.pt"

    def model():
        torch.manual_seed(0)
        return rr.FiberBundleTransformer(cfg)

    full = rr.train(model(), tr, va, _cfg())
    rr.train(model(), tr, va, _cfg(path, stop_at_step=3))
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == "riemannian_ref.train/2" and blob["model_config"]["attention"]["rank"] == 3
    flat = tmod._flat(cfg)
    torch.save({**blob, "format": "riemannian_ref.train/1", "model_config": flat}, path)
    res = rr.train(model(), tr, va, _cfg(path, resume=True))
    assert res.steps_done == 9 and res.history["val_loss"] == full.history["val_loss"]
    rr.train(model(), tr, va, _cfg(path, stop_at_step=3))
    blob = torch.load(path, weights_only=True)
    torch.save({**blob, "format": "riemannian_ref.train/1", "model_config": dict(flat, metric_rank=2)}, path)
    with pytest.raises(ValueError, match="another run.*model config attention.rank: checkpoint 2, now 3"):
        rr.train(model(), tr, va, _cfg(path, resume=True))
