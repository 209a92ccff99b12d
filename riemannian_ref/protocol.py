r"""The comparison protocol of the book's learning experiments: tune, evaluate, pair, check.

Every comparison of training modes in the book (Euclidean against Riemannian
attention, one optimiser against another, one head dimension against another)
runs through :func:`compare`, so that each follows the same rules:

1. **Tuning on its own seeds.** Every arm's learning rate (and, when a grid of
   warm-up lengths is given, its warm-up) is chosen on ``tune_seeds``, which
   must not overlap ``eval_seeds``: the runs that choose a setting never
   count in the comparison.
2. **Evaluation on fresh, shared seeds.** Every arm is trained at its tuned
   setting once per evaluation seed. Seed :math:`s` fixes the data
   (``data(s)``), the initialisation (``torch.manual_seed(s)`` before the
   model is built) and the batch order (``TrainConfig.seed = s``) for every
   arm alike, so the runs of two arms on one seed form a pair.
3. **Paired statistics.** Differences between arms are taken seed by seed;
   their mean comes with a Student-t interval (:func:`scipy.stats.ttest_rel`),
   a bootstrap interval (:func:`scipy.stats.bootstrap`), a Wilcoxon
   signed-rank p-value (:func:`scipy.stats.wilcoxon`) and the effect size
   :math:`d_z = \bar\delta / s_\delta` (:func:`paired_difference`).
4. **Curves, not only end points.** Every run keeps its validation curve
   ``[step, val_loss, val_acc]`` and the training time at each evaluation.
5. **Two budgets.** ``budget="steps"``: the same number of optimiser steps
   for every arm (with matched parameter counts, the caller's job, e.g. with
   :func:`~riemannian_ref.models.budget.match_width`; the counts are
   recorded). With ``wallclock=True`` a second evaluation gives every arm the
   training time the reference arm needs for ``config.steps``: the seconds
   per step of each arm are measured interleaved, arm after arm, with the
   same training loop (or given as ``wallclock_steps``, to reproduce a run).
6. **A stated convergence check.** For each arm the seed-mean validation
   loss may fall over the last ``plateau_window`` of its steps by less than
   ``plateau_tol`` (relative) or less than ``plateau_atol`` (nats, for losses
   near zero); the result says whether the best arm passed.

Everything is trained by :func:`~riemannian_ref.training.train`, the
package's one training loop. The result is a JSON-ready dict; with the same
arguments a second call reproduces every number in it except the measured
times, whatever ``workers`` is (every run seeds itself, so running the
independent runs of a phase in parallel processes changes no number).
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .data import TaskData
from .training import TrainConfig, train

__all__ = ["Arm", "compare"]

SELECT = ("val_loss", "val_acc", "steps_to_target")


@dataclass(frozen=True)
class Arm:
    """One arm of a comparison: how to build its model and, optionally, its optimiser.

    Parameters
    ----------
    model : callable ``() -> nn.Module``
        Builds a fresh model; :func:`compare` seeds torch's global generator
        just before calling it.
    optimizer : callable ``(model, lr) -> torch.optim.Optimizer``, optional
        Builds the optimiser with peak rate ``lr`` (for example a
        :class:`~riemannian_ref.RiemannianAdam` with frames tagged by
        :func:`~riemannian_ref.optim.constrain_`, or AdamW with frozen query/key frames); None: the AdamW (or SGD) of
        the :class:`~riemannian_ref.training.TrainConfig`.
    lrs : sequence of float, optional
        This arm's learning-rate grid; None: the ``lrs`` of :func:`compare`.
    """

    model: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None
    lrs: Sequence[float] | None = None


def steps_to_target(curve: Sequence[Sequence], target: float) -> int | None:
    """The first evaluated step whose validation accuracy reaches ``target`` (None: never).

    Parameters
    ----------
    curve : sequence of [step, val_loss, val_acc]
        A run's validation curve, as :func:`compare` stores it.
    target : float
        Accuracy in ``(0, 1]``.

    Returns
    -------
    int or None
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must lie in (0, 1], got {target!r}")
    for step, _, acc in curve:
        if acc is not None and acc >= target:
            return int(step)
    return None


def plateau(curves: Sequence[Sequence[Sequence]], *, window: float = 0.25, tol: float = 0.02,
            atol: float = 0.01) -> dict:
    r"""Has the seed-mean validation loss stopped falling? The protocol's convergence criterion.

    With :math:`\bar L(t)` the mean validation loss over the runs at step
    :math:`t` and :math:`T` the last step, the relative drop over the last
    fraction ``window`` of training is
    :math:`\rho = (\bar L(t_0) - \bar L(T)) / \bar L(t_0)`, where :math:`t_0`
    is the first evaluated step at or after :math:`(1 - \text{window})\,T`;
    the runs have converged when :math:`\rho <` ``tol`` or the drop itself,
    :math:`\bar L(t_0) - \bar L(T)`, is below ``atol`` (a loss already near
    zero may halve and still not matter).

    Parameters
    ----------
    curves : sequence of curves
        One curve per run (``[step, val_loss, val_acc]`` rows), all
        evaluated at the same steps.
    window : float, default 0.25
        Fraction of training inspected, in ``(0, 1)``.
    tol : float, default 0.02
        Largest relative drop still called a plateau, ``> 0``.
    atol : float, default 0.01
        Largest absolute drop (in the loss's units, nats) still called a
        plateau, ``>= 0``.

    Returns
    -------
    dict
        ``rel_drop`` (:math:`\rho`), ``abs_drop``, ``from_step``
        (:math:`t_0`), ``to_step`` (:math:`T`), ``converged`` (bool).
    """
    if not 0.0 < window < 1.0:
        raise ValueError(f"window must lie in (0, 1), got {window!r}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol!r}")
    if not atol >= 0:
        raise ValueError(f"atol must be >= 0, got {atol!r}")
    if not curves:
        raise ValueError("curves must hold at least one curve")
    steps = [row[0] for row in curves[0]]
    if any([row[0] for row in c] != steps for c in curves):
        raise ValueError("every curve must be evaluated at the same steps")
    mean = np.mean([[row[1] for row in c] for c in curves], axis=0)  # (n_evals,)
    T = steps[-1]
    i0 = next(i for i, s in enumerate(steps) if s >= (1 - window) * T)
    drop = float(mean[i0] - mean[-1])
    rel = drop / abs(float(mean[i0])) if mean[i0] != 0 else 0.0
    return {"rel_drop": rel, "abs_drop": drop, "from_step": int(steps[i0]), "to_step": int(T),
            "converged": bool(rel < tol or drop < atol)}


def paired_difference(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                      n_resamples: int = 2000, seed: int = 0) -> dict:
    r"""Paired comparison of two arms on shared seeds: the differences :math:`\delta_s = a_s - b_s`.

    Parameters
    ----------
    a, b : sequence of float
        One value per seed, in the same seed order (at least 2).
    confidence : float, default 0.95
        Level of both intervals.
    n_resamples : int, default 2000
        Bootstrap resamples (percentile interval of the mean difference).
    seed : int, default 0
        Seed of the bootstrap, so the interval is reproducible.

    Returns
    -------
    dict
        ``n``, ``mean`` (:math:`\bar\delta`), ``sd`` (:math:`s_\delta`),
        ``t_ci`` (Student-t interval of the mean, from
        :func:`scipy.stats.ttest_rel`), ``t_p`` (two-sided), ``boot_ci``
        (bootstrap interval), ``wilcoxon_p`` (two-sided exact signed-rank
        test; None when every difference is zero), ``effect_size``
        (:math:`d_z = \bar\delta / s_\delta`; None when :math:`s_\delta = 0`)
        and ``n_positive`` (seeds with :math:`\delta_s > 0`).
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or len(a) < 2:
        raise ValueError(f"a and b must be 1-D with the same length >= 2 (one value per seed), got shapes "
                         f"{a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite (censor a never-reached target at the budget first)")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    d = a - b
    n, mean = len(d), float(d.mean())
    sd = float(d.std(ddof=1))
    out = {"n": n, "mean": mean, "sd": sd, "n_positive": int((d > 0).sum())}
    if sd == 0.0:
        out.update(t_ci=[mean, mean], t_p=None if mean == 0 else 0.0, boot_ci=[mean, mean], wilcoxon_p=None,
                   effect_size=None)
        return out
    from scipy import stats  # here, not at import: scipy.stats costs 0.7 s, more than the package itself

    t = stats.ttest_rel(a, b)
    ci = t.confidence_interval(confidence)
    boot = stats.bootstrap((d,), np.mean, confidence_level=confidence, n_resamples=n_resamples,
                           method="percentile", random_state=np.random.default_rng(seed))
    w = stats.wilcoxon(d) if np.any(d != 0) else None
    out.update(t_ci=[float(ci.low), float(ci.high)], t_p=float(t.pvalue),
               boot_ci=[float(boot.confidence_interval.low), float(boot.confidence_interval.high)],
               wilcoxon_p=None if w is None else float(w.pvalue), effect_size=mean / sd)
    return out


def _curve(history: dict) -> list[list]:
    return [[int(s), float(l), None if a is None or not math.isfinite(a) else float(a)]
            for s, l, a in zip(history["step"], history["val_loss"], history["val_accuracy"])]


def _check_seeds(seeds, name: str) -> list[int]:
    seeds = list(seeds)
    if any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"{name} must be distinct ints, got {seeds!r}")
    return seeds


def compare(arms: Mapping[str, Arm], data: Callable[[int], tuple[TaskData, TaskData]], config: TrainConfig, *,
            lrs: Sequence[float] = (1e-3, 3e-3, 1e-2), warmups: Sequence[int] | None = None,
            tune_seeds: Sequence[int] = (1000,), eval_seeds: Sequence[int] = (0, 1, 2, 3, 4),
            reference: str | None = None, select: str = "val_loss", target: float | None = None,
            accuracy: bool = True, wallclock: bool = False, wallclock_steps: Mapping[str, int] | None = None,
            plateau_window: float = 0.25, plateau_tol: float = 0.02, plateau_atol: float = 0.01,
            confidence: float = 0.95, workers: int = 1,
            progress: Callable[[str], None] | None = None) -> dict:
    r"""Compare training arms under the book's protocol (module docstring): tune, evaluate, pair, check.

    Parameters
    ----------
    arms : mapping of str to Arm
        The arms, by name (the ``mode`` of every run); at least two.
    data : callable ``seed -> (train, val)``
        The task's data for a seed (called once per seed; a deterministic
        task may ignore the seed).
    config : TrainConfig
        Everything but ``lr``, ``warmup_steps`` and ``seed``, which the
        protocol sets (``steps`` is the step budget of every arm).
    lrs : sequence of float, default (1e-3, 3e-3, 1e-2)
        The learning-rate grid (an :class:`Arm` may bring its own).
    warmups : sequence of int, optional
        A grid of warm-up lengths tuned jointly with the rate; None: only
        ``config.warmup_steps``.
    tune_seeds : sequence of int, default (1000,)
        Seeds of the tuning runs; disjoint from ``eval_seeds``.
    eval_seeds : sequence of int, default (0, 1, 2, 3, 4)
        Seeds of the evaluation runs, at least 2 (the book uses at least 5).
    reference : str, optional
        The arm every other arm is paired with, and whose step budget sets
        the matched wall-clock; None: the first arm.
    select : {"val_loss", "val_acc", "steps_to_target"}, default "val_loss"
        Tuning criterion, averaged over the tuning seeds: lowest final
        validation loss, highest final accuracy, or fewest steps to
        ``target`` (a run that never gets there counts as the budget plus
        one evaluation interval; ties go to the lower final loss).
    target : float, optional
        A validation accuracy in ``(0, 1]``: every run records its steps to
        reach it, and the summaries and pairs report them.
    accuracy : bool, default True
        Store the validation accuracy in the curves (False: ``None``, for
        tasks where it does not apply).
    wallclock : bool, default False
        Add the matched wall-clock evaluation (runs with ``budget="time"``).
    wallclock_steps : mapping of str to int, optional
        Step budget of every arm at matched wall-clock (reproduces an earlier
        call); None: measured (see the module docstring).
    plateau_window, plateau_tol, plateau_atol : float, default 0.25, 0.02, 0.01
        The convergence criterion, :func:`plateau`.
    confidence : float, default 0.95
        Level of the intervals.
    workers : int, default 1
        Processes that train the independent runs of each phase (the tuning
        grid, then the evaluation seeds) side by side, forked from this one,
        each with one intra-op thread: once this process has run a
        multi-threaded torch region (``wallclock=True`` trains here before
        it forks), a forked child with more threads hangs in its first
        parallel region, since it has none of the parent's OpenMP threads
        (torch's CPU build uses GNU OpenMP, which does not rebuild its pool
        in a child); with one thread a child runs every kernel inline. Use
        about one worker per core: on a machine whose cores one small model
        cannot keep busy this divides the wall time. The numbers are those of ``workers=1`` with one thread
        (other thread counts can differ at round-off where a CPU kernel
        splits a sum over threads), the recorded ``wall_s`` of each run are
        those of a one-thread run sharing the machine with ``workers - 1``
        others. Needs the ``fork`` start method (Linux) and a CPU device (the
        arms and ``data`` are inherited, not pickled, so lambdas work); the
        matched wall-clock timing always runs alone, in this process.
    progress : callable ``(message) -> None``, optional
        Called before every run (e.g. a progress bar's ``set_description``);
        with several workers, as each run finishes.

    Returns
    -------
    dict
        ``protocol`` (the settings, the criteria and the seeds), ``tuned``
        (per arm: the chosen ``lr`` and ``warmup_steps``, the grid's mean
        scores, ``at_edge`` when the choice lies on the grid's edge),
        ``runs`` (every run: ``mode``, ``seed``, ``role`` ("tune" or
        "eval"), ``budget`` ("steps" or "time"), ``lr``, ``warmup_steps``,
        ``steps``, ``wall_s``, ``train_s``, ``n_params``, ``curve`` (rows
        ``[step, val_loss, val_acc]``), ``curve_time_s``, ``final``
        (``val_loss``, ``val_acc``) and ``steps_to_target``), ``summary``
        (per budget and arm: mean, sd and t-interval of the final numbers;
        the count of runs reaching ``target``), ``paired`` (per budget, each
        arm against the reference: :func:`paired_difference` of the final
        loss and accuracy, and at matched steps of the steps to target, a run
        that never gets there censored at the budget), ``plateau`` (per arm,
        :func:`plateau` of its step-budget runs; ``best_arm`` and
        ``best_arm_converged``), ``wallclock_steps``, ``seconds_per_step``
        and ``machine`` (threads, load averages, wall time).
    """
    if not isinstance(arms, Mapping) or len(arms) < 2:
        raise ValueError(f"arms must map at least two names to Arm, got {arms!r}")
    for name, arm in arms.items():
        if not isinstance(arm, Arm):
            raise ValueError(f"arms[{name!r}] must be an Arm, got {type(arm).__name__}")
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    config.validate()
    tune_seeds, eval_seeds = _check_seeds(tune_seeds, "tune_seeds"), _check_seeds(eval_seeds, "eval_seeds")
    if len(eval_seeds) < 2:
        raise ValueError(f"eval_seeds must hold at least 2 seeds (paired statistics), got {eval_seeds}")
    if not tune_seeds:
        raise ValueError("tune_seeds must hold at least one seed")
    overlap = sorted(set(tune_seeds) & set(eval_seeds))
    if overlap:
        raise ValueError(f"tune_seeds and eval_seeds must be disjoint (a tuning run is never evaluated), "
                         f"both hold {overlap}")
    reference = next(iter(arms)) if reference is None else reference
    if reference not in arms:
        raise ValueError(f"reference must be one of the arms {list(arms)}, got {reference!r}")
    if select not in SELECT:
        raise ValueError(f"select must be one of {SELECT}, got {select!r}")
    if target is not None and not (isinstance(target, (int, float)) and 0.0 < target <= 1.0):
        raise ValueError(f"target must be an accuracy in (0, 1] or None, got {target!r}")
    if select == "steps_to_target" and target is None:
        raise ValueError("select='steps_to_target' needs a target accuracy")
    for name, arm in arms.items():
        grid = list(arm.lrs if arm.lrs is not None else lrs)
        if not grid or not all(isinstance(v, (int, float)) and v > 0 and math.isfinite(v) for v in grid):
            raise ValueError(f"the learning-rate grid of arm {name!r} must hold positive numbers, got {grid!r}")
    warm_grid = [config.warmup_steps] if warmups is None else list(warmups)
    for w in warm_grid:
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < config.steps:
            raise ValueError(f"warmups must be ints in [0, steps={config.steps}), got {warm_grid!r}")
    if wallclock_steps is not None:
        missing = sorted(set(arms) - set(wallclock_steps))
        if missing:
            raise ValueError(f"wallclock_steps must give a step budget for every arm, missing {missing}")
    plateau([[[0, 1.0, None], [1, 1.0, None]]], window=plateau_window, tol=plateau_tol,
            atol=plateau_atol)  # validates the three
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if workers > 1 and torch.device(config.device).type != "cpu":
        raise ValueError(f"workers > 1 runs in forked processes and needs config.device='cpu', "
                         f"got {config.device!r} (use workers=1 on an accelerator)")
    if workers > 1 and "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError("workers > 1 needs the 'fork' start method, which this platform lacks; use workers=1")

    t_start, load_start = time.perf_counter(), os.getloadavg()
    cache: dict[int, tuple[TaskData, TaskData]] = {}

    def data_of(seed: int):
        if seed not in cache:
            cache[seed] = data(seed)
        return cache[seed]

    def run(name: str, seed: int, role: str, budget: str, lr: float, warmup: int, steps: int) -> dict:
        train_data, val_data = data_of(seed)
        arm = arms[name]
        torch.manual_seed(seed)
        model = arm.model()
        opt = None if arm.optimizer is None else arm.optimizer(model, lr)
        cfg = dataclasses.replace(config, lr=lr, warmup_steps=min(warmup, steps - 1), seed=seed, steps=steps,
                                  eval_interval=min(config.eval_interval, steps))
        t0 = time.perf_counter()
        res = train(model, train_data, val_data, cfg, optimizer=opt)
        curve = _curve(res.history)
        if not accuracy:
            curve = [[s, l, None] for s, l, _ in curve]
        return {"mode": name, "seed": seed, "role": role, "budget": budget, "lr": lr, "warmup_steps": cfg.warmup_steps,
                "steps": steps, "wall_s": time.perf_counter() - t0, "train_s": res.train_time_s,
                "n_params": res.n_params, "curve": curve, "curve_time_s": list(res.history["time_s"]),
                "final": {"val_loss": curve[-1][1], "val_acc": curve[-1][2]},
                "steps_to_target": None if target is None else steps_to_target(curve, target)}

    def score(r: dict) -> tuple:
        loss = r["final"]["val_loss"] if math.isfinite(r["final"]["val_loss"]) else float("inf")
        if select == "val_loss":
            return (loss,)
        if select == "val_acc":
            return (-(r["final"]["val_acc"] or 0.0), loss)
        s = r["steps_to_target"]
        return (config.steps + config.eval_interval if s is None else s, loss)

    def run_all(jobs: list[tuple]) -> list[dict]:
        """Every job ``(name, seed, role, budget, lr, warmup, steps)`` run, in order (in parallel with workers)."""
        def say(job):
            if progress is not None:
                name, seed, role, budget, lr, _, steps = job
                progress(f"{role} {name} seed {seed} lr {lr:g} ({budget}, {steps} steps)")
        for job in jobs:  # the data are made once, in this process, and inherited by the workers
            data_of(job[1])
        if workers == 1 or len(jobs) < 2:
            out = []
            for job in jobs:
                say(job)
                out.append(run(*job))
            return out
        return _run_forked(run, jobs, min(workers, len(jobs)), say)

    # 1. tuning: every arm on its grid, on the tuning seeds only
    runs, tuned = [], {}
    grids = {name: [(float(lr), w) for w in warm_grid for lr in (arm.lrs if arm.lrs is not None else lrs)]
             for name, arm in arms.items()}
    jobs = [(name, s, "tune", "steps", lr, w, config.steps) for name in arms for lr, w in grids[name]
            for s in tune_seeds]
    done = iter(run_all(jobs))
    for name, arm in arms.items():
        scores = []
        for lr, w in grids[name]:
            rs = [next(done) for _ in tune_seeds]
            runs += rs
            mean_score = tuple(statistics.fmean(x) for x in zip(*(score(r) for r in rs)))
            scores.append({"lr": float(lr), "warmup_steps": w, "score": list(mean_score)})
        best = min(scores, key=lambda e: tuple(e["score"]))
        lr_values = sorted({e["lr"] for e in scores})
        tuned[name] = {"lr": best["lr"], "warmup_steps": best["warmup_steps"], "grid": scores,
                       "at_edge": len(lr_values) > 1 and best["lr"] in (lr_values[0], lr_values[-1])}

    # 2. evaluation at matched steps: fresh seeds, shared across arms
    runs += run_all([(name, seed, "eval", "steps", tuned[name]["lr"], tuned[name]["warmup_steps"], config.steps)
                     for seed in eval_seeds for name in arms])

    # 3. evaluation at matched wall-clock
    sec_per_step = None
    if wallclock:
        if wallclock_steps is None:
            sec_per_step = _seconds_per_step(arms, data_of(eval_seeds[0]), config, tuned)
            ref_time = config.steps * sec_per_step[reference]
            wallclock_steps = {a: max(2, round(ref_time / sec_per_step[a])) for a in arms}
        wallclock_steps = {a: int(wallclock_steps[a]) for a in arms}
        timed = iter(run_all([(name, seed, "eval", "time", tuned[name]["lr"], tuned[name]["warmup_steps"],
                               wallclock_steps[name]) for seed in eval_seeds for name in arms
                              if wallclock_steps[name] != config.steps]))
        for seed in eval_seeds:
            for name in arms:
                if wallclock_steps[name] == config.steps:  # the same run as at matched steps
                    same = next(r for r in runs if r["role"] == "eval" and r["budget"] == "steps"
                                and r["mode"] == name and r["seed"] == seed)
                    runs.append({**same, "budget": "time"})
                else:
                    runs.append(next(timed))

    budgets = ["steps"] + (["time"] if wallclock else [])
    summary, paired = {}, {}
    for budget in budgets:
        summary[budget], paired[budget] = {}, {}
        ev = {name: sorted((r for r in runs if r["role"] == "eval" and r["budget"] == budget
                            and r["mode"] == name), key=lambda r: r["seed"]) for name in arms}
        for name, rs in ev.items():
            summary[budget][name] = _summarise(rs, target, confidence)
        for name in arms:
            if name == reference:
                continue
            # steps to target pair only under a shared step budget (at matched time the budgets differ)
            paired[budget][name] = _pair(ev[name], ev[reference], target if budget == "steps" else None,
                                         confidence)
    plat = {name: plateau([r["curve"] for r in runs if r["role"] == "eval" and r["budget"] == "steps"
                           and r["mode"] == name], window=plateau_window, tol=plateau_tol, atol=plateau_atol)
            for name in arms}
    best_arm = min(arms, key=lambda a: summary["steps"][a]["val_loss"]["mean"])
    return {
        "protocol": {"arms": list(arms), "reference": reference, "tune_seeds": tune_seeds, "eval_seeds": eval_seeds,
                     "lrs": {a: list(arms[a].lrs if arms[a].lrs is not None else lrs) for a in arms},
                     "warmups": warm_grid, "select": select, "target": target, "confidence": confidence,
                     "plateau": {"window": plateau_window, "tol": plateau_tol, "atol": plateau_atol,
                                 "criterion": "the seed-mean validation loss falls over the last "
                                              f"{plateau_window:g} of the steps by less than {plateau_tol:g} "
                                              f"(relative) or less than {plateau_atol:g} nats"},
                     "config": dataclasses.asdict(config)},
        "tuned": tuned, "runs": runs, "summary": summary, "paired": paired,
        "plateau": {"arms": plat, "best_arm": best_arm, "best_arm_converged": plat[best_arm]["converged"]},
        "wallclock_steps": wallclock_steps, "seconds_per_step": sec_per_step,
        "machine": {"threads": torch.get_num_threads(), "workers": workers, "cpu_count": os.cpu_count(),
                    "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg(), "wall_s": time.perf_counter() - t_start,
                    "torch": torch.__version__, "device": config.device},
    }


_FORKED_RUN: Callable | None = None  # the run function the forked workers inherit


def _call_forked(job: tuple) -> dict:
    return _FORKED_RUN(*job)


def _init_worker() -> None:
    # One thread, before any torch work in the child: the parent's OpenMP pool did not survive the fork, and
    # the child's first multi-threaded region would wait for its threads forever (a parent that ever ran a
    # multi-threaded region is enough). A single-threaded child runs every kernel inline.
    torch.set_num_threads(1)


def _run_forked(run: Callable, jobs: list[tuple], workers: int, say: Callable) -> list[dict]:
    """``[run(*job) for job in jobs]`` in ``workers`` forked processes, in order.

    Forked, so the workers inherit ``run`` (a closure over the arms and the
    data) without pickling it; only the jobs and the result dicts cross.
    Each worker runs with one intra-op thread (:func:`_init_worker`).
    """
    global _FORKED_RUN
    _FORKED_RUN = run
    try:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
            out = []
            for job, res in zip(jobs, pool.imap(_call_forked, jobs)):
                say(job)
                out.append(res)
            return out
    finally:
        _FORKED_RUN = None


def _mean_ci(values: list[float], confidence: float) -> dict:
    from scipy import stats

    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    half = float(stats.t.ppf(0.5 + confidence / 2, len(v) - 1) * sd / math.sqrt(len(v))) if len(v) > 1 else 0.0
    return {"mean": mean, "sd": sd, "ci": [mean - half, mean + half], "values": [float(x) for x in v]}


def _summarise(rs: list[dict], target: float | None, confidence: float) -> dict:
    out = {"n": len(rs), "seeds": [r["seed"] for r in rs], "lr": rs[0]["lr"], "steps": rs[0]["steps"],
           "n_params": rs[0]["n_params"], "train_s_mean": statistics.fmean(r["train_s"] for r in rs),
           "val_loss": _mean_ci([r["final"]["val_loss"] for r in rs], confidence)}
    if all(r["final"]["val_acc"] is not None for r in rs):
        out["val_acc"] = _mean_ci([r["final"]["val_acc"] for r in rs], confidence)
    if target is not None:
        hit = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        out["reached_target"] = len(hit)
        out["steps_to_target"] = _mean_ci(hit, confidence) if hit else None
    return out


def _pair(rs: list[dict], ref: list[dict], target: float | None, confidence: float) -> dict:
    seeds = [r["seed"] for r in rs]
    if seeds != [r["seed"] for r in ref]:
        raise ValueError(f"paired runs need the same seeds, got {seeds} and {[r['seed'] for r in ref]}")
    out = {"seeds": seeds, "val_loss": paired_difference([r["final"]["val_loss"] for r in rs],
                                                         [r["final"]["val_loss"] for r in ref],
                                                         confidence=confidence)}
    if all(r["final"]["val_acc"] is not None for r in rs + ref):
        out["val_acc"] = paired_difference([r["final"]["val_acc"] for r in rs], [r["final"]["val_acc"] for r in ref],
                                           confidence=confidence)
    if target is not None:
        # a run that never reaches the target is censored at its step budget (a lower bound)
        def cens(r):
            return r["steps"] if r["steps_to_target"] is None else r["steps_to_target"]
        out["steps_to_target"] = paired_difference([cens(r) for r in rs], [cens(r) for r in ref],
                                                   confidence=confidence)
        out["steps_to_target"]["censored"] = sum(r["steps_to_target"] is None for r in rs + ref)
    return out


def _seconds_per_step(arms: Mapping[str, Arm], data: tuple[TaskData, TaskData], config: TrainConfig,
                      tuned: dict, reps: int = 5, steps: int = 40) -> dict[str, float]:
    """Median training seconds per step of every arm, measured interleaved with :func:`train` itself.

    Five rounds of forty steps: on a shared machine ten-step rounds gave
    ratios that moved by a factor of two between runs.
    """
    train_data, val_data = data
    probe = val_data.subset(slice(0, 1))
    times: dict[str, list[float]] = {a: [] for a in arms}
    for rep in range(reps + 1):  # the first round warms up and is discarded
        for name, arm in arms.items():
            torch.manual_seed(rep)
            model = arm.model()
            lr = tuned[name]["lr"]
            opt = None if arm.optimizer is None else arm.optimizer(model, lr)
            cfg = dataclasses.replace(config, lr=lr, warmup_steps=0, steps=steps, eval_interval=steps, seed=rep)
            res = train(model, train_data, probe, cfg, optimizer=opt)
            if rep:
                times[name].append(res.train_time_s / steps)
    return {a: statistics.median(t) for a, t in times.items()}
