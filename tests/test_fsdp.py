"""FSDP2 (``fully_shard``): every model mode trains on two CPU processes over gloo as one process does on
the same global batch; checkpoints written sharded resume; files and checkpoints of the 0-d ``eta`` load.

One spawn runs every case (importing torch twice is most of its time)."""
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

import riemannian_ref as rr
from riemannian_ref import _checkpoint, data

from test_training import _free_port, _init_gloo  # the DDP test's two gloo processes

#: every mode, and the variants users reach: per-position and per-head metrics, a metric subspace, a
#: learned temperature, both metric forms, the preconditioned FFN (its eta) with and without the connection
CASES = {
    "euclidean": dict(mode="euclidean"),
    "riemannian": dict(mode="riemannian", attention=dict(subspace=2, learn_temperature=True)),
    "fiber_bundle": dict(mode="fiber_bundle"),
    "position_metric": dict(mode="riemannian", precondition_ffn=True,
                            attention=dict(metric="position", metric_form="factor")),
    "shared_metric": dict(mode="fiber_bundle", attention=dict(metric="shared", learn_temperature=True)),
}
RTOL = 1e-5  # float32 over 2 steps; what is measured is printed (pytest -s)
#: the comparisons with one process use SGD: Adam turns rounding-level gradients of weights the batch
#: barely touches into steps of size lr, so its weights agree only to ~1e-4 relative
SGD = dict(optimizer="sgd", lr=0.1)


def _data():
    tr, _ = data.make_task("recall", seed=0, n_train=32, n_val=8, vocab_size=16, n_pairs=3, seq_len=12)
    assert len(set(tr.mask.sum(1).tolist())) == 1  # as many scored positions in every example: the mean of
    # the ranks' mean losses is the mean loss of the global batch
    return tr, tr.subset(slice(0, 13))  # validation shards of 7 and 6: 2 and 1 batches of 4 on two ranks


def _model(case, seed):
    torch.manual_seed(seed)
    return rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(block_size=12, n_layers=2, **CASES[case]))


def _cfg(**kw):
    # full batch: one process and the two ranks' shards together see the same global batch
    base = dict(lr=1e-2, steps=2, batch_size=None, eval_interval=1, eval_batch_size=4, grad_clip=0.05,
                diagnostics=2, entropy_floor=None, warmup_steps=1)
    return rr.TrainConfig(**{**base, **kw})


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    _init_gloo(rank, world, port)
    try:
        tr, va = _data()
        out = {}
        for case in CASES:
            model = _model(case, seed=rank)  # different inits: rank 0's must be the one trained
            res = rr.train(model, tr, va, _cfg(parallel="fsdp", **SGD))
            assert _checkpoint.is_sharded(model)
            out[case] = {"history": res.history, "state": _checkpoint.model_state(model)}
        ddp = _model("fiber_bundle", seed=rank)
        out["ddp"] = {"history": rr.train(ddp, tr, va, _cfg(**SGD)).history, "state": ddp.state_dict()}
        # a run stopped at step 1 under FSDP2 resumes under FSDP2 (and under DDP) as the run it was
        cks = [os.path.join(out_dir, f"ck{i}.pt") for i in range(2)]
        rr.train(_model("fiber_bundle", 0), tr, va, _cfg(parallel="fsdp", checkpoint_path=cks[0], stop_at_step=1,
                                                         **SGD))
        if rank == 0:
            shutil.copyfile(cks[0], cks[1])
            out["checkpoint"] = torch.load(cks[0], weights_only=True)
        dist.barrier()
        for ck, parallel in zip(cks, ("fsdp", "ddp")):
            resumed = _model("fiber_bundle", 0)
            res = rr.train(resumed, tr, va, _cfg(parallel=parallel, checkpoint_path=ck, resume=True, **SGD))
            out[f"resumed_{parallel}"] = {"history": res.history, "state": _checkpoint.model_state(resumed)}
        # frames on Stiefel: fully_shard would turn them into plain shards, so the run is refused
        frames = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(
            block_size=12, mode="euclidean", attention=dict(qk_init="orthonormal")))
        rr.optim.constrain_(rr.Stiefel(), *frames.qk_frame_parameters())
        try:
            rr.train(frames, tr, va, _cfg(parallel="fsdp"))
        except ValueError as exc:
            out["manifold_error"] = str(exc)
        # a caller-built optimiser over the parameters that fully_shard replaced is refused
        model = _model("euclidean", 0)
        stale = torch.optim.AdamW(model.parameters())
        try:
            rr.train(model, tr, va, _cfg(parallel="fsdp"), optimizer=stale)
        except ValueError as exc:
            out["stale_error"] = str(exc)
        try:  # a sharded model under parallel="ddp"
            rr.train(model, tr, va, _cfg())
        except ValueError as exc:
            out["ddp_error"] = str(exc)
        # the model train() sharded, now with an optimiser the caller built over it
        opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=0.9)
        rr.train(model, tr, va, _cfg(parallel="fsdp", **SGD), optimizer=opt)
        out["caller_sharded"] = {"state": _checkpoint.model_state(model)}
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "fsdp.pt"))
    finally:
        dist.destroy_process_group()


def _same_run(a: dict, b: dict) -> bool:
    """Two histories alike but for their timings (NaN equal to NaN)."""
    return str({k: v for k, v in a.items() if k not in ("time_s", "tokens_per_s")}) == \
        str({k: v for k, v in b.items() if k not in ("time_s", "tokens_per_s")})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out / "fsdp.pt", weights_only=True)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_matches_one_process(two_ranks, case):
    tr, va = _data()
    one = _model(case, seed=0)
    h = rr.train(one, tr, va, _cfg(**SGD)).history
    got = two_ranks[case]
    assert got["history"]["step"] == h["step"] == [0, 1, 2]
    keys = ["train_loss", "val_loss", "val_accuracy", "attn_entropy", "metric_eig"]  # step 0: rank 0's init
    for key in keys:
        a, b = torch.tensor(got["history"][key]), torch.tensor(h[key])
        torch.testing.assert_close(a, b, rtol=RTOL, atol=0, equal_nan=True, msg=lambda m: f"{key}: {m}")
    loss_rel = _rel(torch.tensor(got["history"]["train_loss"][1:]), torch.tensor(h["train_loss"][1:]))
    state = one.state_dict()
    assert got["state"].keys() == state.keys()
    w_rel = max(_rel(got["state"][k], v) for k, v in state.items() if v.is_floating_point())
    w_abs = max(float((got["state"][k] - v).abs().max()) for k, v in state.items() if v.is_floating_point())
    for k, v in state.items():
        torch.testing.assert_close(got["state"][k], v, rtol=RTOL, atol=1e-7, msg=k)
    print(f"{case}: losses within {loss_rel:.1e} relative, weights within {w_abs:.1e} ({w_rel:.1e} relative)")


def test_ddp_and_fsdp_agree(two_ranks):
    a, b = two_ranks["ddp"], two_ranks["fiber_bundle"]
    torch.testing.assert_close(torch.tensor(a["history"]["train_loss"][1:]),
                               torch.tensor(b["history"]["train_loss"][1:]), rtol=RTOL, atol=0)
    for k, v in a["state"].items():
        torch.testing.assert_close(b["state"][k], v, rtol=RTOL, atol=1e-7, msg=k)


def test_fsdp_checkpoint_resumes(two_ranks):
    whole, resumed = two_ranks["fiber_bundle"], two_ranks["resumed_fsdp"]
    assert _same_run(resumed["history"], whole["history"])  # the run it was, exactly
    for k, v in whole["state"].items():
        assert torch.equal(resumed["state"][k], v), k
    other = two_ranks["resumed_ddp"]  # the same file under DDP: the same run up to rounding
    assert other["history"]["step"] == whole["history"]["step"]
    for k, v in whole["state"].items():
        torch.testing.assert_close(other["state"][k], v, rtol=RTOL, atol=1e-7, msg=k)
    # the file holds the whole model and optimiser state, as one process writes it: a single-process
    # model and optimiser take them
    ck = two_ranks["checkpoint"]
    one = _model("fiber_bundle", 1)
    one.load_state_dict(ck["model"])
    opt = torch.optim.SGD([{"params": [p for p in one.parameters() if p.dim() >= 2]},
                           {"params": [p for p in one.parameters() if p.dim() < 2]}], lr=0.1, momentum=0.9)
    opt.load_state_dict(ck["optimizer"])
    assert set(ck["optimizer"]["state"]) == set(range(len(list(one.parameters()))))
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for g in opt.param_groups for p in g["params"])


def test_fsdp_takes_a_sharded_model_and_refuses_misuse(two_ranks):
    assert "optimizer must be built over the sharded model's parameters" in two_ranks["stale_error"]
    assert "parallel='fsdp'" in two_ranks["ddp_error"]
    assert "cannot shard parameters on a manifold (blocks.0.attn." in two_ranks["manifold_error"]
    for k, v in two_ranks["euclidean"]["state"].items():
        torch.testing.assert_close(two_ranks["caller_sharded"]["state"][k], v, rtol=RTOL, atol=1e-7, msg=k)
    with pytest.raises(ValueError, match="parallel"):
        rr.TrainConfig(parallel="zero")


# ---- the 0-d eta of older files (one process) --------------------------------------------------------------

def _zero_d_eta(state: dict) -> int:
    names = [k for k in state if k.endswith(".eta")]
    for k in names:
        state[k] = state[k].reshape(())
    return len(names)


@pytest.mark.parametrize("attention", [dict(subspace=2), dict(qk_init="orthonormal"), dict(metric="shared"),
                                       dict(metric="position"), dict(metric_form="factor", subspace=1, rank=3)])
@pytest.mark.parametrize("mode", ["riemannian", "fiber_bundle"])
def test_every_parameter_is_1d_or_more_and_contiguous(mode, attention):
    """What fully_shard needs of every parameter, checked without processes: no 0-d one (eta was) and no
    strided one (the subspace basis, made by QR, was column-major)."""
    model = rr.FiberBundleTransformer(rr.FiberBundleConfig.tiny(mode=mode, attention=attention))
    bad = [n for n, p in model.named_parameters() if p.dim() == 0 or not p.is_contiguous()]
    assert not bad


def test_model_file_with_0d_eta_loads_bit_identically(tmp_path):
    model = _model("fiber_bundle", 0)
    assert all(blk.eta.shape == (1,) for blk in model.blocks)
    model.save(tmp_path / "m.pt")
    blob = torch.load(tmp_path / "m.pt", weights_only=True)
    assert _zero_d_eta(blob["state_dict"]) == 2
    torch.save(blob, tmp_path / "old.pt")
    old = rr.FiberBundleTransformer.load(tmp_path / "old.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(old.state_dict()[k], v), k
    state = model.state_dict()
    _zero_d_eta(state)
    again = _model("fiber_bundle", 1)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    assert state["blocks.0.eta"].shape == ()  # the caller's dict is left as it was


def test_training_checkpoint_with_0d_eta_resumes(tmp_path):
    tr, va = _data()
    whole = _model("fiber_bundle", 0)
    h = rr.train(whole, tr, va, _cfg()).history
    ck = tmp_path / "ck.pt"
    rr.train(_model("fiber_bundle", 0), tr, va, _cfg(checkpoint_path=str(ck), stop_at_step=1))
    blob = torch.load(ck, weights_only=True)
    assert _zero_d_eta(blob["model"]) == 2
    names = [n for n, p in whole.named_parameters() if p.dim() >= 2] + \
        [n for n, p in whole.named_parameters() if p.dim() < 2]  # the loop's AdamW groups: matrices, then vectors
    etas = [i for i, n in enumerate(names) if n.endswith(".eta")]
    for i in etas:  # AdamW's moments of eta were 0-d too
        for key in ("exp_avg", "exp_avg_sq"):
            blob["optimizer"]["state"][i][key] = blob["optimizer"]["state"][i][key].reshape(())
    del blob["torch_rngs"]  # absent from files written before it
    torch.save(blob, ck)
    resumed = _model("fiber_bundle", 0)
    assert _same_run(rr.train(resumed, tr, va, _cfg(checkpoint_path=str(ck), resume=True)).history, h)
    for k, v in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
