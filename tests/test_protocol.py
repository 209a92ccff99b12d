"""The comparison protocol: seeds kept apart, schema of the runs, reproducibility, paired
statistics against scipy, the convergence criterion, matched wall-clock, and bad input."""
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

import riemannian_ref as rr
from riemannian_ref.protocol import Arm, paired_difference, plateau, steps_to_target


def data(seed):
    return rr.data.make_task("lookup", seed=seed, n_train=256, n_val=64, n_keys=6, n_values=4, n_pairs=3)


def head(scores):
    return lambda: rr.RecallHead(6, 4, 16, 2, scores=scores, attention=dict(rank=0))


ARMS = {"dot": Arm(head("dot")), "distance": Arm(head("metric"))}
CFG = rr.TrainConfig(steps=12, batch_size=32, eval_interval=4, schedule="constant")


@pytest.fixture(scope="module")
def result():
    return rr.compare(ARMS, data, CFG, lrs=(3e-3, 3e-2), tune_seeds=(100,), eval_seeds=(0, 1, 2), target=0.3)


def test_runs_have_the_documented_fields_and_roles(result):
    runs = result["runs"]
    assert {r["role"] for r in runs} == {"tune", "eval"}
    for r in runs:
        for key in ("mode", "seed", "role", "lr", "steps", "wall_s", "curve", "final", "budget", "n_params"):
            assert key in r
        assert [row[0] for row in r["curve"]] == [0, 4, 8, 12]
        assert r["final"] == {"val_loss": r["curve"][-1][1], "val_acc": r["curve"][-1][2]}
        assert all(len(row) == 3 for row in r["curve"])
    # tuning seeds are never evaluated, evaluation seeds never tune
    assert {r["seed"] for r in runs if r["role"] == "tune"} == {100}
    assert {r["seed"] for r in runs if r["role"] == "eval"} == {0, 1, 2}
    # two lrs per arm on one tuning seed, then one run per arm and evaluation seed
    assert sum(r["role"] == "tune" for r in runs) == 4 and sum(r["role"] == "eval" for r in runs) == 6
    json.dumps(result)  # JSON-ready


def test_tuning_picks_the_lowest_mean_final_loss_and_evaluates_at_it(result):
    for arm in ARMS:
        tune = [r for r in result["runs"] if r["role"] == "tune" and r["mode"] == arm]
        best = min(tune, key=lambda r: r["final"]["val_loss"])
        assert result["tuned"][arm]["lr"] == best["lr"]
        assert result["tuned"][arm]["at_edge"]  # a two-point grid: the choice is always on its edge
        assert all(r["lr"] == best["lr"] for r in result["runs"] if r["role"] == "eval" and r["mode"] == arm)


def test_paired_numbers_are_those_of_the_runs(result):
    ev = {a: sorted((r for r in result["runs"] if r["role"] == "eval" and r["mode"] == a), key=lambda r: r["seed"])
          for a in ARMS}
    a = [r["final"]["val_loss"] for r in ev["distance"]]
    b = [r["final"]["val_loss"] for r in ev["dot"]]
    p = result["paired"]["steps"]["distance"]["val_loss"]
    assert p["mean"] == pytest.approx(np.mean(np.subtract(a, b)))
    assert result["summary"]["steps"]["dot"]["val_loss"]["values"] == b
    assert result["plateau"]["best_arm"] in ARMS


def test_same_arguments_reproduce_every_number(result):
    again = rr.compare(ARMS, data, CFG, lrs=(3e-3, 3e-2), tune_seeds=(100,), eval_seeds=(0, 1, 2), target=0.3)
    strip = lambda res: [(r["mode"], r["seed"], r["role"], r["lr"], r["curve"]) for r in res["runs"]]  # noqa: E731
    assert strip(again) == strip(result)
    assert again["paired"] == result["paired"] and again["tuned"] == result["tuned"]


def test_parallel_workers_reproduce_every_number(result):
    """Runs seed themselves: two forked workers give the one-worker numbers, in the same order."""
    seen = []
    par = rr.compare(ARMS, data, CFG, lrs=(3e-3, 3e-2), tune_seeds=(100,), eval_seeds=(0, 1, 2), target=0.3,
                     workers=2, progress=seen.append)
    strip = lambda res: [(r["mode"], r["seed"], r["role"], r["lr"], r["curve"]) for r in res["runs"]]  # noqa: E731
    assert strip(par) == strip(result)
    assert par["paired"] == result["paired"] and par["tuned"] == result["tuned"]
    assert par["machine"]["workers"] == 2 and result["machine"]["workers"] == 1
    assert len(seen) == len(par["runs"]) and seen[0].startswith("tune dot seed 100")


FORK_PROBE = """
import json, os, sys
import torch
import riemannian_ref as rr
from riemannian_ref.attention import _blockwise
from riemannian_ref.protocol import Arm

def data(seed):
    return rr.data.make_task("lookup", seed=seed, n_train=256, n_val=64, n_keys=6, n_values=4, n_pairs=3)

arms = {s: Arm(lambda s=s: rr.RecallHead(6, 4, 16, 2, scores=s, attention=dict(rank=0))) for s in ("dot", "metric")}
cfg = rr.TrainConfig(steps=12, batch_size=32, eval_interval=4, schedule="constant")
kw = dict(lrs=(3e-3, 3e-2), tune_seeds=(100,), eval_seeds=(0, 1), wallclock=True,
          wallclock_steps={"dot": 12, "metric": 6})
# What wallclock=True's timing does before it forks: multi-threaded torch work in this process, here
# explicit (4 threads, so that the old rule, threads // workers, gave each child 2), and the attention
# operator's own thread pool started.
torch.set_num_threads(4)
a = torch.randn(512, 512)
(a @ a).sum()
x = torch.randn(8, 2, 64, 8)
rr.riemannian_attention(x, x, x, U_k=torch.randn(8, 2, 64, 8, 2))
res = {"pool_live": _blockwise._POOL is not None}
pid = os.fork()
if pid == 0:  # a forked child must not inherit the operator's pool (its threads are not copied)
    os._exit(0 if _blockwise._POOL is None else 3)
res["child_forgot_pool"] = os.waitpid(pid, 0)[1] == 0
par = rr.compare(arms, data, cfg, workers=2, **kw)
torch.set_num_threads(1)
one = rr.compare(arms, data, cfg, workers=1, **kw)
def strip(r):
    return [(x["mode"], x["seed"], x["role"], x["budget"], x["lr"], x["steps"], x["curve"]) for x in r["runs"]]
res.update(same_runs=strip(par) == strip(one), same_paired=par["paired"] == one["paired"],
           time_steps=sorted(x["steps"] for x in par["runs"] if x["budget"] == "time"),
           workers=par["machine"]["workers"])
print(json.dumps(res))
"""


def test_forked_workers_after_multithreaded_work_finish_and_reproduce_one_worker():
    """compare(workers=2, wallclock=True) after the parent ran 4-thread torch work: no hang, the workers=1 numbers.

    A forked child with more than one thread would wait forever for OpenMP threads it does not have; the
    probe runs in its own session under a timeout, so a hang fails this test (and is killed) instead of
    hanging the suite.
    """
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen([sys.executable, "-c", FORK_PROBE], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the probe and its forked workers
        proc.communicate()
        pytest.fail("rr.compare(workers=2) hung after multi-threaded torch work in the parent")
    assert proc.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["pool_live"] and res["child_forgot_pool"]
    # the matched wall-clock phase: the metric arm's two 6-step runs are trained by the workers too
    assert res["workers"] == 2 and res["time_steps"] == [6, 6, 12, 12]
    assert res["same_runs"] and res["same_paired"]


def test_matched_wallclock_reuses_equal_budgets_and_honours_given_steps():
    res = rr.compare(ARMS, data, CFG, lrs=(1e-2,), eval_seeds=(0, 1), wallclock=True,
                     wallclock_steps={"dot": 12, "distance": 6})
    timed = [r for r in res["runs"] if r["budget"] == "time"]
    assert {(r["mode"], r["steps"]) for r in timed} == {("dot", 12), ("distance", 6)}
    same = {(r["mode"], r["seed"]): r["curve"] for r in res["runs"] if r["budget"] == "steps" and r["role"] == "eval"}
    assert all(r["curve"] == same[(r["mode"], r["seed"])] for r in timed if r["mode"] == "dot")
    assert set(res["summary"]) == {"steps", "time"} and res["wallclock_steps"] == {"dot": 12, "distance": 6}
    # steps to a target pair only under a shared step budget
    res = rr.compare(ARMS, data, CFG, lrs=(1e-2,), eval_seeds=(0, 1), wallclock=True, target=0.3,
                     wallclock_steps={"dot": 12, "distance": 6})
    assert "steps_to_target" in res["paired"]["steps"]["distance"]
    assert "steps_to_target" not in res["paired"]["time"]["distance"]
    measured = rr.compare(ARMS, data, CFG.__class__(steps=4, batch_size=8, eval_interval=4), lrs=(1e-2,),
                          eval_seeds=(0, 1), wallclock=True)
    assert set(measured["seconds_per_step"]) == set(ARMS) and all(v > 0 for v in measured["seconds_per_step"].values())
    assert measured["wallclock_steps"]["dot"] == 4  # the reference keeps its own budget


def test_a_custom_optimizer_and_a_warmup_grid_are_used():
    built = []

    def sgd(model, lr):
        built.append(lr)
        return torch.optim.SGD(model.parameters(), lr=lr)

    arms = {"adamw": Arm(head("dot")), "sgd": Arm(head("dot"), optimizer=sgd, lrs=(0.1,))}
    res = rr.compare(arms, data, CFG, lrs=(1e-2,), warmups=(0, 4), eval_seeds=(0, 1))
    assert set(built) == {0.1} and len(built) == 2 + 2  # two warm-ups x one tuning seed, then two seeds
    assert {r["warmup_steps"] for r in res["runs"] if r["role"] == "tune"} == {0, 4}


def test_paired_difference_matches_scipy():
    a, b = [1.0, 2.5, 3.1, 4.0, 5.2], [0.8, 2.0, 3.3, 3.1, 4.0]
    p = paired_difference(a, b)
    t = stats.ttest_rel(a, b)
    ci = t.confidence_interval(0.95)
    d = np.subtract(a, b)
    assert p["t_ci"] == pytest.approx([ci.low, ci.high]) and p["t_p"] == pytest.approx(t.pvalue)
    assert p["wilcoxon_p"] == pytest.approx(stats.wilcoxon(d).pvalue)
    assert p["effect_size"] == pytest.approx(d.mean() / d.std(ddof=1)) and p["n_positive"] == 4
    assert p["boot_ci"][0] <= d.mean() <= p["boot_ci"][1]
    assert paired_difference(a, b) == p  # the bootstrap is seeded
    same = paired_difference([1.0, 2.0], [1.0, 2.0])
    assert same["mean"] == 0 and same["effect_size"] is None and same["wilcoxon_p"] is None
    with pytest.raises(ValueError, match="same length"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        paired_difference([1.0, math.inf], [1.0, 2.0])


def test_plateau_and_steps_to_target():
    flat = [[0, 3.0, 0.1], [50, 1.02, 0.9], [75, 1.01, 0.96], [100, 1.0, 0.97]]
    falling = [[0, 3.0, 0.1], [50, 2.0, 0.5], [75, 1.5, 0.6], [100, 1.0, 0.7]]
    assert plateau([flat]) == {"rel_drop": pytest.approx(0.01 / 1.01), "abs_drop": pytest.approx(0.01),
                               "from_step": 75, "to_step": 100, "converged": True}
    assert not plateau([falling])["converged"]
    # a loss near zero may halve and still have converged: the absolute tolerance
    tiny = [[0, 2.0, 0.1], [50, 0.01, 1.0], [75, 0.004, 1.0], [100, 0.002, 1.0]]
    assert plateau([tiny])["rel_drop"] == pytest.approx(0.5) and plateau([tiny])["converged"]
    assert not plateau([tiny], atol=0.001)["converged"]
    assert steps_to_target(flat, 0.95) == 75 and steps_to_target(falling, 0.95) is None
    with pytest.raises(ValueError, match="same steps"):
        plateau([flat, falling[:3]])
    with pytest.raises(ValueError, match="target"):
        steps_to_target(flat, 1.5)


@pytest.mark.parametrize("kw, match", [
    (dict(tune_seeds=(0,), eval_seeds=(0, 1)), "disjoint"),
    (dict(eval_seeds=(0,)), "at least 2"),
    (dict(eval_seeds=(0, 0)), "distinct"),
    (dict(reference="euclid"), "reference"),
    (dict(select="accuracy"), "select"),
    (dict(select="steps_to_target"), "needs a target"),
    (dict(lrs=(0.0,)), "learning-rate grid"),
    (dict(warmups=(12,)), "warmups"),
    (dict(wallclock=True, wallclock_steps={"dot": 3}), "missing"),
    (dict(plateau_window=1.0), "window"),
    (dict(workers=0), "workers must be an int >= 1"),
    (dict(workers=2.0), "workers must be an int >= 1"),
    (dict(workers=2, config_device="meta"), "needs config.device='cpu'"),
])
def test_bad_arguments_are_refused_by_name(kw, match):
    kw = dict(kw)
    cfg = CFG if "config_device" not in kw else CFG.__class__(**{**CFG.__dict__, "device": kw.pop("config_device")})
    with pytest.raises(ValueError, match=match):
        rr.compare(ARMS, data, cfg, **kw)


def test_arms_must_be_arms():
    with pytest.raises(ValueError, match="at least two"):
        rr.compare({"dot": ARMS["dot"]}, data, CFG)
    with pytest.raises(ValueError, match="must be an Arm"):
        rr.compare({"dot": ARMS["dot"], "bare": nn.Linear(2, 2)}, data, CFG)
    with pytest.raises(ValueError, match="TrainConfig"):
        rr.compare(ARMS, data, {"steps": 3})
