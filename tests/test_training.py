"""The one training loop: schedule, determinism, exact resumption, caller-built optimisers,
full batch, two-process DDP, the command line, and errors for bad configurations.

The task generators are tested in test_data.py."""
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import riemannian_ref as rr
from riemannian_ref import data
from riemannian_ref.training import lr_at, masked_cross_entropy

from _helpers import train_script


class TinyLM(nn.Module):
    """One causal self-attention layer: enough to exercise the loop quickly."""

    def __init__(self, vocab: int, n: int, D: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.pos = nn.Parameter(torch.zeros(n, D))
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab)
        self.register_buffer("scale", torch.ones(()))  # a buffer, as DDP broadcasts them in forward

    def forward(self, idx):
        B, n = idx.shape
        x = self.emb(idx) + self.pos[:n]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        a, _ = self.attn(x, x, x, attn_mask=causal, need_weights=False)
        return self.head(self.norm(x + a)) * self.scale


def _recall(seed=0):
    return data.make_task("recall", seed=seed, n_train=256, n_val=64, vocab_size=16, n_pairs=3, seq_len=12)


def _model(seed=0, vocab=16, n=12):
    torch.manual_seed(seed)
    return TinyLM(vocab, n)


# ---- training loop --------------------------------------------------------

def _cfg(**kw):
    base = dict(lr=3e-3, steps=12, batch_size=8, eval_interval=4, seed=0, warmup_steps=2)
    base.update(kw)
    return rr.TrainConfig(**base)


def test_schedule_shape():
    c = rr.TrainConfig(lr=1.0, steps=100, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, c) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    c2 = rr.TrainConfig(lr=0.5, steps=50, schedule="constant")
    assert {lr_at(s, c2) for s in range(50)} == {0.5}


def test_training_learns_and_history_is_complete():
    tr, va = _recall()
    seen = []
    res = rr.train(_model(), tr, va, _cfg(steps=60, eval_interval=20, lr=1e-2),
                   hooks=[lambda step, m: seen.append((step, m["val_loss"]))])
    h = res.history
    assert h["step"] == [0, 20, 40, 60] and [s for s, _ in seen] == h["step"]
    assert all(len(v) == 4 for v in h.values())
    assert math.isnan(h["train_loss"][0]) and h["train_loss"][-1] < h["train_loss"][1]
    assert res.tokens_per_s > 0 and res.n_params == sum(p.numel() for p in _model().parameters())
    assert 0 <= res.final["val_accuracy"] <= 1


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_deterministic_given_seed(opt):
    tr, va = _recall()
    r1 = rr.train(m1 := _model(), tr, va, _cfg(optimizer=opt))
    r2 = rr.train(m2 := _model(), tr, va, _cfg(optimizer=opt))
    r3 = rr.train(m3 := _model(), tr, va, _cfg(optimizer=opt, seed=1))
    assert r1.history["val_loss"] == r2.history["val_loss"] != r3.history["val_loss"]
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m3.state_dict().values()))


@pytest.mark.parametrize("stop", [4, 7])  # at an evaluation and between two
def test_resume_matches_uninterrupted(tmp_path, stop):
    tr, va = _recall()
    full = rr.train(m_full := _model(), tr, va, _cfg())
    ck = str(tmp_path / "ck.pt")
    rr.train(_model(), tr, va, _cfg(checkpoint_path=ck, stop_at_step=stop))
    # a fresh model (different init): everything must come from the checkpoint
    res = rr.train(m_res := _model(seed=5), tr, va, _cfg(checkpoint_path=ck, resume=True))
    assert res.steps_done == 12
    for k in ("step", "lr", "train_loss", "val_loss", "val_accuracy"):
        assert res.history[k][1:] == full.history[k][1:], k
    assert res.history["val_loss"][0] == full.history["val_loss"][0]
    for a, b in zip(m_full.state_dict().values(), m_res.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw,msg", [
    (dict(optimizer="adam"), "optimizer"), (dict(schedule="linear"), "schedule"),
    (dict(lr=-1.0), "lr"), (dict(steps=0), "steps"), (dict(warmup_steps=12), "warmup_steps"),
    (dict(grad_clip=0.0), "grad_clip"), (dict(resume=True), "checkpoint_path"),
    (dict(stop_at_step=13), "stop_at_step"), (dict(batch_size=2.5), "batch_size"),
])
def test_bad_config(kw, msg):
    tr, va = _recall()
    with pytest.raises(ValueError, match=msg):
        rr.train(_model(), tr, va, _cfg(**kw))


def test_masked_loss_ignores_unscored_positions(gen):
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 7, (2, 5), generator=gen)
    mask = torch.tensor([[0, 1, 0, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    other = logits.clone()
    other[~mask] = 100.0
    a = masked_cross_entropy(logits, y, mask)
    assert torch.equal(a, masked_cross_entropy(other, y, mask))
    manual = -torch.log_softmax(logits, -1)[mask].gather(1, y[mask][:, None]).mean()
    assert a.dtype == torch.float64 and torch.allclose(a, manual, rtol=1e-14, atol=0)  # float64 stays float64


def test_masked_loss_upcasts_half_precision_only(gen):
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 7, (2, 5), generator=gen)
    mask = torch.ones(2, 5, dtype=torch.bool)
    want = masked_cross_entropy(logits, y, mask)
    for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        got = masked_cross_entropy(logits.to(dt), y, mask)
        assert got.dtype == torch.float32, dt
        assert abs(got.item() - want.item()) < tol * want.item(), dt


def test_caller_built_optimizer_keeps_each_groups_peak_rate_under_the_schedule():
    """RiemannianAdam with the frames on Stiefel at their own rate: the schedule scales each group's own peak."""
    tr, va = _recall()
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(mode="euclidean", block_size=12,
                                                                attention=dict(qk_init="orthonormal")))
    frames = model.qk_frame_parameters()
    ids = {id(p) for p in frames}
    rest = [p for p in model.parameters() if id(p) not in ids]
    rr.optim.constrain_(rr.Stiefel(), *frames)
    opt = rr.RiemannianAdam([{"params": frames, "lr": 2e-2},
                             {"params": rest, "lr": 5e-3, "weight_decay": 0.1}], lr=1e-4)
    seen = []
    step = opt.step

    def recording_step(*args, **kw):
        seen.append([g["lr"] for g in opt.param_groups])
        return step(*args, **kw)

    opt.step = recording_step
    cfg = _cfg(lr=1e-3, steps=8, warmup_steps=2, eval_interval=4)  # config lr: only the schedule's shape
    before = [p.detach().clone() for p in frames]
    res = rr.train(model, tr, va, cfg, optimizer=opt)
    assert len(seen) == 8
    for s, lrs in enumerate(seen):
        factor = lr_at(s, cfg) / cfg.lr
        assert lrs == pytest.approx([2e-2 * factor, 5e-3 * factor], rel=1e-12), s
    assert seen[1] == pytest.approx([2e-2, 5e-3])  # the peak, at the end of the warm-up
    assert res.history["lr"] == pytest.approx([2e-2 * lr_at(max(t - 1, 0), cfg) / cfg.lr
                                               for t in res.history["step"]])  # the first group's rate
    # the caller's optimiser did the steps: the frames moved and stayed orthonormal
    eye = torch.eye(model.config.qk_dim)
    for W, W0 in zip(frames, before):
        assert (W - W0).abs().max() > 1e-4
        torch.testing.assert_close(W.transpose(-1, -2) @ W, eye.expand(W.shape[0], -1, -1), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        rr.train(model, tr, va, cfg, optimizer="adamw")


class _Recording(nn.Module):
    """Records the inputs of its training-mode forwards."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.inputs = inner, []

    def forward(self, idx):
        if self.training:
            self.inputs.append(idx.clone())
        return self.inner(idx)


def test_full_batch_uses_every_example_in_order_at_every_step():
    tr, va = _recall()
    tr = tr.subset(slice(0, 40))
    rec = _Recording(_model())
    res = rr.train(rec, tr, va, _cfg(batch_size=None, steps=5, eval_interval=5))
    assert res.steps_done == 5 and len(rec.inputs) == 5
    assert all(torch.equal(x, tr.x) for x in rec.inputs)
    # the batch-order seed plays no part: another seed gives the same weights
    m1, m2 = _model(), _model()
    rr.train(m1, tr, va, _cfg(batch_size=None, steps=5, eval_interval=5, seed=0))
    rr.train(m2, tr, va, _cfg(batch_size=None, steps=5, eval_interval=5, seed=7))
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    # while with minibatches it does
    m3, m4 = _model(), _model()
    rr.train(m3, tr, va, _cfg(batch_size=8, steps=5, eval_interval=5, seed=0))
    rr.train(m4, tr, va, _cfg(batch_size=8, steps=5, eval_interval=5, seed=7))
    assert not all(torch.equal(a, b) for a, b in zip(m3.state_dict().values(), m4.state_dict().values()))


def test_model_returning_a_fiber_bundle_output_trains():
    """FiberBundleTransformer returns a named tuple; the loop reads its logits."""
    tr, va = _recall()
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(block_size=12))
    res = rr.train(model, tr, va, _cfg(steps=30, eval_interval=30, lr=1e-2))
    ev = rr.evaluate(model, va)
    assert res.final["val_loss"] == pytest.approx(ev["loss"]) and res.final["val_accuracy"] == ev["accuracy"]
    assert res.history["val_loss"][-1] < res.history["val_loss"][0]


# ---- two processes, gloo ----------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_gloo(rank: int, world: int, port: int) -> None:
    """Join a gloo process group of ``world`` processes on this machine, one thread each (test_fsdp.py too)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    _init_gloo(rank, world, port)
    try:
        tr, va = _recall()
        va = tr.subset(slice(0, 65))  # shards of 33 and 32: 2 and 1 evaluation batches of 32
        model = _model(seed=rank)  # different inits: DDP must broadcast rank 0's
        res = rr.train(model, tr, va, _cfg(steps=6, eval_interval=3, eval_batch_size=32))
        torch.save({"state": model.state_dict(), "history": res.history}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_two_ranks_end_identical(tmp_path):
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in (0, 1))
    for k, a in r0["state"].items():
        assert torch.equal(a, r1["state"][k]), k
    assert r0["history"]["val_loss"] == r1["history"]["val_loss"]
    # rank 0's initial weights were broadcast: the loss at step 0 is rank 0's model's
    tr, _ = _recall()
    va = tr.subset(slice(0, 65))
    assert r0["history"]["val_loss"][0] == pytest.approx(rr.evaluate(_model(seed=0), va)["loss"], rel=1e-6)


# ---- the command line -------------------------------------------------------

@pytest.mark.parametrize("mode", ["euclidean", "riemannian"])
def test_train_script_result_and_resume(tmp_path, mode):
    script = train_script()
    args = ["--task", "recall", "--mode", mode, "--d-model", "16", "--n-heads", "2", "--n-layers", "1",
            "--vocab-size", "16", "--n-pairs", "3", "--seq-len", "12", "--steps", "6", "--eval-interval", "3",
            "--batch-size", "8", "--device", "cpu", "--no-progress", "--checkpoint", str(tmp_path / "c.pt")]
    full = script.main(args + ["--out", str(tmp_path / "full.json"), "--checkpoint", str(tmp_path / "f.pt")])
    script.main(args + ["--out", str(tmp_path / "part.json"), "--stop-at-step", "4"])
    resumed = script.main(args + ["--out", str(tmp_path / "part.json"), "--resume"])
    assert resumed["history"]["val_loss"] == full["history"]["val_loss"]
    import json
    with open(tmp_path / "part.json") as f:
        on_disk = json.load(f)
    assert on_disk["steps_done"] == 6 and on_disk["model"]["mode"] == mode and on_disk["n_params"] > 0


def test_train_script_config_file_and_bad_keys(tmp_path):
    script = train_script()
    good = tmp_path / "cfg.json"
    good.write_text('{"task": {"name": "modular", "p": 7}, "train": {"lr": 0.01, "steps": 3}}')
    cfg, _ = script.parse_args(["--config", str(good), "--steps", "5"])
    assert cfg.task.name == "modular" and cfg.task.p == 7 and cfg.train.lr == 0.01 and cfg.train.steps == 5
    bad = tmp_path / "bad.json"
    bad.write_text('{"train": {"learning_rate": 0.01}}')
    with pytest.raises(ValueError, match="learning_rate"):
        script.parse_args(["--config", str(bad)])
    with pytest.raises(ValueError, match="mode"):
        script.build_model(script.RunConfig().model.replace(mode="hyperbolic"), 16, 12)
