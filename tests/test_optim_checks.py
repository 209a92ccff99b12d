"""StiefelAdam and LowRankAdam: one validation path for every group (constructor, add_param_group,
load_state_dict), factor ranks, weight decay on frames, and the dtypes frames may have."""
import copy

import pytest
import torch
from torch import nn

import riemannian_ref as rr

F64 = torch.float64
ST = rr.Stiefel()


def _frame(*shape, seed=0, dtype=F64):
    return nn.Parameter(ST.random(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _randn(*shape, seed=0, dtype=F64):
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict()), [[p.detach().clone() for p in g["params"]] for g in opt.param_groups]


def _assert_unchanged(opt, snap):
    sd, values = snap
    now = opt.state_dict()
    assert now["param_groups"] == sd["param_groups"]
    assert now["state"].keys() == sd["state"].keys()
    assert len(opt.param_groups) == len(values)
    for g, vs in zip(opt.param_groups, values):
        assert all(torch.equal(p, v) for p, v in zip(g["params"], vs))


# ------------------------------------------------------------------ D4
def _stiefel_opt():
    return rr.StiefelAdam([{"params": [_frame(6, 3)], "stiefel": True}], lr=1e-2)


def _low_rank_opt():
    return rr.LowRankAdam([{"params": [_randn(5, 2, seed=1), _randn(4, 2, seed=2)], "geometry": "embedded"}],
                          lr=1e-2)


_STIEFEL_BAD = [
    # the probe's lines, then each range and flag
    (lambda: {"params": [nn.Parameter(3 * torch.randn(6, 3, dtype=F64))], "stiefel": True},
     r"param group 1: parameter 0 .*not a stack of orthonormal frames"),
    (lambda: {"params": [_randn(3)], "lr": -0.5, "betas": (1.5, 0.9)}, r"param group 1: lr"),
    (lambda: {"params": [_randn(3)], "betas": (1.5, 0.9)}, r"param group 1: betas\[0\]"),
    (lambda: {"params": [_randn(3)], "betas": (0.9, 1.0)}, r"param group 1: betas\[1\]"),
    (lambda: {"params": [_randn(3)], "betas": 0.9}, r"param group 1: betas"),
    (lambda: {"params": [_randn(3)], "eps": -1e-8}, r"param group 1: eps"),
    (lambda: {"params": [_randn(3)], "weight_decay": -0.1}, r"param group 1: weight_decay"),
    (lambda: {"params": [_randn(3)], "weight_decay": float("nan")}, r"param group 1: weight_decay"),
    (lambda: {"params": [_randn(3)], "trust_radius": 0.0}, r"param group 1: trust_radius"),
    (lambda: {"params": [_randn(3)], "stiefel": "yes"}, r"param group 1: stiefel must be a bool"),
    (lambda: {"params": [_randn(3)], "geometry": "embedded"}, r"param group 1: .*geometry.*LowRankAdam"),
    (lambda: {"params": [_randn(5, 6)], "stiefel": True}, r"param group 1: parameter 0 .*n >= p"),
    (lambda: {"params": [_randn(5)], "stiefel": True}, r"param group 1: parameter 0 .*\[\.\.\., n, p\]"),
]


_LOW_RANK_BAD = [
    (lambda: {"params": [_randn(5, 2), _randn(4, 2, seed=1), _randn(3, 2, seed=2)], "geometry": "embeded"},
     r"param group 1: geometry must be one of"),
    (lambda: {"params": [_randn(5, 2), _randn(4, 2, seed=1), _randn(3, 2, seed=2)], "geometry": "embedded"},
     r"param group 1: .*pairs .*got 3 tensors"),
    (lambda: {"params": [_randn(5, 2), _randn(4, 2, seed=1)], "geometry": "Embedded"},
     r"param group 1: geometry must be one of"),
    (lambda: {"params": [_randn(5, 2), _randn(4, 3, seed=1)], "geometry": "factored"},
     r"param group 1: pair 0: .*agreeing in batch and rank"),
    (lambda: {"params": [_randn(5, 2), nn.Parameter(torch.zeros(4, 2, dtype=F64))], "geometry": "factored"},
     r"param group 1: .*factor B of pair 0 .*rank below r = 2"),
    (lambda: {"params": [_randn(3)], "lr": -0.5}, r"param group 1: lr"),
    (lambda: {"params": [_randn(3)], "betas": (0.9, 1.5)}, r"param group 1: betas\[1\]"),
    (lambda: {"params": [_randn(3)], "stiefel": True}, r"param group 1: .*stiefel.*StiefelAdam"),
]


@pytest.mark.parametrize("kind,case", [("stiefel", i) for i in range(len(_STIEFEL_BAD))]
                         + [("low_rank", i) for i in range(len(_LOW_RANK_BAD))])
def test_d4_add_param_group_runs_the_constructors_checks(kind, case):
    # D4: add_param_group checked nothing; now it refuses what the constructor refuses, changing nothing
    make, match = (_STIEFEL_BAD if kind == "stiefel" else _LOW_RANK_BAD)[case]
    opt = _stiefel_opt() if kind == "stiefel" else _low_rank_opt()
    snap = _snapshot(opt)
    group = make()
    with pytest.raises(ValueError, match=match):
        opt.add_param_group(group)
    _assert_unchanged(opt, snap)
    # the constructor refuses the same group, naming the same place
    first = ({"params": [_frame(6, 3, seed=3)], "stiefel": True} if kind == "stiefel" else
             {"params": [_randn(5, 2, seed=7), _randn(4, 2, seed=8)], "geometry": "embedded"})
    with pytest.raises(ValueError, match=match):
        type(opt)([first, make()], lr=1e-2)
    # a step after the refused add leaves the group's tensors as they were and gives them no state
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    for p in group["params"]:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in group["params"]]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(group["params"], before))
    assert not any(id(p) in {id(q) for q in opt.state} for p in group["params"])


@pytest.mark.parametrize("cls", ["stiefel", "low_rank"])
def test_d4_duplicates_are_refused_naming_both_groups(cls):
    # D4
    opt = _stiefel_opt() if cls == "stiefel" else _low_rank_opt()
    p0 = opt.param_groups[0]["params"][0]
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 1: parameter 1 .*already in param group 0"):
        opt.add_param_group({"params": [_randn(3), p0]})
    x = _randn(3)
    with pytest.raises(ValueError, match=r"param group 1: parameters 0 and 1 are the same tensor"):
        opt.add_param_group({"params": [x, x]})
    _assert_unchanged(opt, snap)
    if cls == "low_rank":  # a pair of one tensor with itself
        A = _randn(4, 2)
        with pytest.raises(ValueError, match=r"param group 1: parameters 0 and 1 are the same tensor"):
            opt.add_param_group({"params": [A, A], "geometry": "factored"})


def test_d4_good_groups_are_added_and_stepped():
    # D4: the checks do not refuse legal groups, which then step as the constructor's would
    opt = _stiefel_opt()
    W, b = _frame(7, 2, seed=5), _randn(4, seed=6)
    opt.add_param_group({"params": W, "stiefel": True, "lr": 0.05, "trust_radius": 0.1})
    opt.add_param_group({"params": (q for q in [b]), "weight_decay": 0.1, "betas": [0.8, 0.9]})
    assert opt.param_groups[2]["betas"] == (0.8, 0.9) and opt.param_groups[1]["params"] == [W]
    twin = rr.StiefelAdam([{"params": [_frame(6, 3)], "stiefel": True},
                           {"params": [_frame(7, 2, seed=5)], "stiefel": True, "lr": 0.05, "trust_radius": 0.1},
                           {"params": [_randn(4, seed=6)], "weight_decay": 0.1, "betas": (0.8, 0.9)}], lr=1e-2)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        for o in (opt, twin):
            for grp in o.param_groups:
                for p in grp["params"]:
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64)
            o.step()
    for ga, gb in zip(opt.param_groups, twin.param_groups):
        assert all(torch.equal(p, q) for p, q in zip(ga["params"], gb["params"]))
    del g
    lo = _low_rank_opt()
    lo.add_param_group({"params": [_randn(6, 3, seed=3), _randn(5, 3, seed=4)], "geometry": "factored"})
    assert lo.param_groups[1]["geometry"] == "factored"


@pytest.mark.parametrize("cls", ["stiefel", "low_rank"])
def test_d4_groups_edited_by_hand_are_refused_before_any_change(cls):
    # D4: `_group_step` never reads an unknown geometry as factored; a hand-edited group raises in step
    opt = _stiefel_opt() if cls == "stiefel" else _low_rank_opt()
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    key, bad = ("geometry", "embeded") if cls == "low_rank" else ("stiefel", 1)
    snap = _snapshot(opt)
    opt.param_groups[0][key] = bad
    with pytest.raises(ValueError, match=f"param group 0: {key}"):
        opt.step()
    opt.param_groups[0][key] = "embedded" if cls == "low_rank" else True
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="param group 0: lr"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    _assert_unchanged(opt, snap)


# ------------------------------------------------------------------ D15
@pytest.mark.parametrize("geometry", ["embedded", "factored"])
def test_d15_low_rank_refuses_r_above_the_rows_of_a_factor(geometry):
    # D15
    A, B = _randn(2, 3), _randn(4, 3, seed=1)  # rank(A B^T) <= 2 < r = 3
    with pytest.raises(ValueError, match=r"param group 0: factor A of pair 0 .*3 columns .*2 rows.*r <= min\(m, n\)"):
        rr.LowRankAdam([{"params": [A, B], "geometry": geometry}])
    with pytest.raises(ValueError, match=r"param group 0: factor B of pair 1 .*3 columns .*2 rows"):
        rr.LowRankAdam([{"params": [_randn(5, 3, seed=2), _randn(4, 3, seed=3),
                                    _randn(4, 3, seed=4), _randn(2, 3, seed=5)], "geometry": geometry}])
    opt = _low_rank_opt()
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 1: factor A of pair 0 .*3 columns .*2 rows"):
        opt.add_param_group({"params": [A, B], "geometry": geometry})
    _assert_unchanged(opt, snap)
    # r = min(m, n) is legal and steps
    A2, B2 = _randn(3, 3, seed=6), _randn(4, 3, seed=7)
    opt.add_param_group({"params": [A2, B2], "geometry": geometry})
    (A2 @ B2.T).square().sum().backward()
    opt.step()
    assert torch.isfinite(A2).all() and torch.linalg.matrix_rank(A2.detach() @ B2.detach().T) == 3


# ------------------------------------------------------------------ D16
def _trajectory(dtype, wd, grads, lr=1e-2, eps=0.0, plain=False):
    W = _frame(16, 4, dtype=dtype)
    groups = [{"params": [W], "stiefel": True, "weight_decay": wd}]
    b = _randn(8, dtype=dtype) if plain else None
    if plain:
        groups.append({"params": [b], "weight_decay": wd})
    opt = rr.StiefelAdam(groups, lr=lr, eps=eps)
    out = []
    for g in grads:
        W.grad = g.to(dtype)
        if plain:
            b.grad = torch.zeros_like(b)
        opt.step()
        out.append(W.detach().clone())
    return out, b


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("eps", [0.0, 1e-8])
@pytest.mark.parametrize("n_steps", [10, 100])
def test_d16_weight_decay_has_exactly_no_effect_on_frames(dtype, eps, n_steps):
    # D16: zero gradients; with weight_decay = 1 the frame moved by 3e-3 in 10 steps before
    zeros = [torch.zeros(16, 4, dtype=F64)] * n_steps
    a, _ = _trajectory(dtype, 0.0, zeros, eps=eps)
    b, _ = _trajectory(dtype, 1.0, zeros, eps=eps)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (b[-1] - _frame(16, 4, dtype=dtype).detach()).norm() < (1e-5 if dtype == torch.float32 else 1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("scale", [1e-6, 1.0])
def test_d16_weight_decay_leaves_the_trajectory_bitwise_unchanged(dtype, scale):
    # D16: with gradients of size 1e-6 the wd = 0 and wd = 1 trajectories differed by 7.8e-3 after 20 steps
    g = torch.Generator().manual_seed(3)
    grads = [scale * torch.randn(16, 4, generator=g, dtype=F64) for _ in range(40)]
    a, _ = _trajectory(dtype, 0.0, grads, eps=0.0)
    b, _ = _trajectory(dtype, 1.0, grads, eps=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (a[-1] - a[0]).norm() > 0.03  # it did move


def test_d16_ordinary_groups_of_stiefel_adam_still_decay_as_adamw():
    # D16: only frames skip the decay; an ordinary group in the same optimiser is AdamW's decoupled decay
    _, b = _trajectory(F64, 0.5, [torch.zeros(16, 4, dtype=F64)] * 10, lr=1e-2, eps=1e-8, plain=True)
    ref = _randn(8)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.5, eps=1e-8)
    for _ in range(10):
        ref.grad = torch.zeros_like(ref)
        opt.step()
    torch.testing.assert_close(b.detach(), ref.detach(), atol=1e-15, rtol=0)
    assert (b.detach() - _randn(8).detach()).abs().max() > 1e-3  # it did decay, by (1 - lr wd)^10


@pytest.mark.parametrize("geometry", ["embedded", "factored"])
def test_d16_low_rank_weight_decay_only_shrinks_w(geometry):
    # D16 (LowRankAdam's documented decay): with zero gradient it shrinks W = A B^T along itself and does
    # not turn its singular vectors; Adam's normalisation must not amplify round-off into a rotation
    A, B = _randn(9, 3, seed=1), _randn(7, 3, seed=2)
    W0 = (A @ B.T).detach().clone()
    opt = rr.LowRankAdam([{"params": [A, B], "geometry": geometry, "weight_decay": 1.0}], lr=1e-2, eps=0.0)
    for _ in range(100):
        A.grad, B.grad = torch.zeros_like(A), torch.zeros_like(B)
        opt.step()
    W = (A @ B.T).detach()
    assert W.norm() < 0.95 * W0.norm()  # it shrank
    direction_change = (W / W.norm() - W0 / W0.norm()).abs().max().item()
    assert direction_change < 1e-12
    # and with weight_decay = 0 and zero gradients nothing moves beyond round-off
    A2, B2 = _randn(9, 3, seed=1), _randn(7, 3, seed=2)
    opt = rr.LowRankAdam([{"params": [A2, B2], "geometry": geometry}], lr=1e-2, eps=0.0)
    for _ in range(100):
        A2.grad, B2.grad = torch.zeros_like(A2), torch.zeros_like(B2)
        opt.step()
    assert (A2 @ B2.T - W0).abs().max() < 1e-12


# ------------------------------------------------------------------ D19
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", ["stiefel", "low_rank"])
def test_d19_half_precision_frames_and_factors_are_refused_with_the_reason(dtype, cls):
    # D19: a Stiefel.random(...).bfloat16() frame was refused as "not orthonormal; use Stiefel.random"
    if cls == "stiefel":
        W = nn.Parameter(ST.random(16, 4, generator=torch.Generator().manual_seed(0)).to(dtype))
        with pytest.raises(ValueError, match=r"param group 0: parameter 0 .*half precision.*float32"):
            rr.StiefelAdam([{"params": [W], "stiefel": True}])
        opt = _stiefel_opt()
        with pytest.raises(ValueError, match=r"param group 1: parameter 0 .*half precision.*float32"):
            opt.add_param_group({"params": [W], "stiefel": True})
        rr.StiefelAdam([nn.Parameter(torch.zeros(3, dtype=dtype))])  # ordinary groups: AdamW, any float dtype
    else:
        A, B = nn.Parameter(torch.randn(5, 2).to(dtype)), nn.Parameter(torch.randn(4, 2).to(dtype))
        with pytest.raises(ValueError, match=r"param group 0: factor A of pair 0 .*half precision.*float32"):
            rr.LowRankAdam([{"params": [A, B], "geometry": "embedded"}])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_d19_frame_tolerance_follows_the_dtype(dtype):
    # D19: a frame made in float32 and cast is accepted in float32; in float64 it must be re-projected
    W32 = ST.random(64, 8, generator=torch.Generator().manual_seed(0))
    W = nn.Parameter(W32.to(dtype))
    if dtype == torch.float32:
        rr.StiefelAdam([{"params": [W], "stiefel": True}])
    else:
        with pytest.raises(ValueError, match=r"max \|x\^T x - I\| = .* > atol = 1\.0e-08.*float32 frame.*polar"):
            rr.StiefelAdam([{"params": [W], "stiefel": True}])
        rr.StiefelAdam([{"params": [nn.Parameter(ST.projx(W.detach()))], "stiefel": True}])


# ------------------------------------------------------------------ state_dict
def _stiefel_pair():
    W, b = _frame(6, 3), _randn(4, seed=1)
    opt = rr.StiefelAdam([{"params": [W], "stiefel": True}, {"params": [b]}], lr=1e-2)
    W.grad, b.grad = torch.ones_like(W), torch.ones_like(b)
    opt.step()
    return opt


def _low_rank_stepped():
    opt = _low_rank_opt()
    A, B = opt.param_groups[0]["params"]
    A.grad, B.grad = torch.ones_like(A), torch.ones_like(B)
    opt.step()
    return opt


@pytest.mark.parametrize("kind,edit,match", [
    ("stiefel", lambda sd: sd["param_groups"][0].update(lr=-1.0), r"load_state_dict: param group 0: lr"),
    ("stiefel", lambda sd: sd["param_groups"][1].update(betas=(0.9, 1.0)),
     r"load_state_dict: param group 1: betas\[1\]"),
    ("stiefel", lambda sd: sd["param_groups"][1].update(weight_decay=-1.0), r"param group 1: weight_decay"),
    ("stiefel", lambda sd: sd["param_groups"][1].update(stiefel=True),
     r"param group 1: parameter 0 .*\[\.\.\., n, p\]"),
    ("stiefel", lambda sd: sd["param_groups"][0].update(stiefel="True"), r"param group 0: stiefel must be a bool"),
    ("stiefel", lambda sd: sd["state"][0].update(exp_avg_sq=torch.zeros(6, 3)),
     r"load_state_dict: param group 0: state of parameter 0: exp_avg_sq has shape \[6, 3\], expected \[\]"),
    ("stiefel", lambda sd: sd["state"][1].pop("exp_avg"), r"param group 1: state of parameter 0: .*exp_avg"),
    ("stiefel", lambda sd: sd["state"][1].update(step=-3), r"param group 1: state of parameter 0: step must be an int"),
    ("stiefel", lambda sd: sd["param_groups"][0].pop("trust_radius"),
     r"load_state_dict: param group 0 lacks trust_radius"),
    ("stiefel", lambda sd: sd["param_groups"][1].pop("stiefel"), r"load_state_dict: param group 1 lacks stiefel"),
    ("stiefel", lambda sd: sd["state"][0]["exp_avg"].fill_(float("nan")), r"param group 0: .*exp_avg has non-finite"),
    ("low_rank", lambda sd: sd["param_groups"][0].update(geometry="embeded"),
     r"param group 0: geometry must be one of"),
    ("low_rank", lambda sd: sd["param_groups"][0].update(geometry="factored"),
     r"param group 0: state of pair 0: exp_avg holds 1 tensors, expected 2"),
    ("low_rank", lambda sd: sd["param_groups"][0].update(eps=float("inf")), r"param group 0: eps"),
])
def test_load_state_dict_runs_the_same_checks(kind, edit, match):
    # D4: a state dict brings in groups and state; they pass the same checks, changing nothing if refused
    opt = _stiefel_pair() if kind == "stiefel" else _low_rank_stepped()
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    _assert_unchanged(opt, snap)
    opt.load_state_dict(copy.deepcopy(snap[0]))  # an untouched one still loads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d19_stiefel_check_point_tolerance_follows_the_dtype(dtype):
    # D19: Stiefel.random(...).bfloat16() has max |W^T W - I| = 3.9e-3 and was "not a point" at atol 1e-4
    for n, p in [(16, 4), (256, 64), (512, 512)]:
        W = ST.random(n, p, generator=torch.Generator().manual_seed(n)).to(dtype)
        ok, why = ST.check_point(W)
        assert ok, why
    ok, why = ST.check_point((3 * torch.randn(16, 4)).to(dtype))
    assert not ok and "atol" in why
    ok, _ = ST.check_point(ST.random(16, 4).to(dtype), atol=1e-4)  # an explicit tolerance still rules
    assert not ok


def test_d4_named_parameters_are_checked_too():
    # D4: torch's named parameter groups ((name, tensor) pairs) go through the same checks
    model = nn.Linear(3, 2).double()
    opt = rr.StiefelAdam(model.named_parameters(), lr=1e-2)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    W = nn.Parameter(3 * torch.randn(6, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"param group 1: parameter 0 .*not a stack of orthonormal frames"):
        opt.add_param_group({"params": [("W", W)], "stiefel": True})
    with pytest.raises(ValueError, match=r"param group 1: parameter 0 is already in param group 0"):
        opt.add_param_group({"params": [("w", model.weight)]})
    opt.add_param_group({"params": [("F", _frame(6, 3))], "stiefel": True})
    assert opt.param_groups[1]["param_names"] == ["F"] and len(opt.param_groups) == 2


@pytest.mark.parametrize("cls,key", [("StiefelAdam", "stifel"), ("StiefelAdam", "weight_decy"),
                                     ("LowRankAdam", "geometri")])
def test_a_misspelled_group_key_is_refused_and_a_label_is_not(cls, key):  # D4: a typo would be ignored
    W = nn.Parameter(rr.Stiefel().random(6, 3, generator=torch.Generator().manual_seed(0)))
    opt_cls = getattr(rr, cls)
    with pytest.raises(ValueError, match=rf"param group 0: unknown key '{key}' \(did you mean"):
        opt_cls([{"params": [W], key: True}])
    opt = opt_cls([{"params": [W], "name": "frames"}])  # an unrelated key is a label, as in torch
    assert opt.param_groups[0]["name"] == "frames"
