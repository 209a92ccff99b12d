"""The sweep with and without a causal mask (experiments/rank_collapse_causal.py).

Tiny runs: what is checked is that the mask reaches the stacks, that every
variant is calibrated to the dot product's entropy *under its own mask*, that the
file records what chapter 9 reads, and that bad arguments are refused. The
one-layer statements themselves (linear with the mask, cubic without) are checked
against the package here too, on small float64 layers.
"""
import json
import math
from argparse import Namespace

import pytest
import torch

from _helpers import experiment_script
from riemannian_ref.analysis import token_radius

TINY = ["--seeds", "2", "--tune-seeds", "1", "--depth", "3", "--n", "8", "--d-model", "8", "--batch", "1",
        "--bisect-steps", "10", "--eps-points", "3"]


@pytest.fixture(scope="module")
def script():
    return experiment_script("rank_collapse_causal.py")


@pytest.fixture(scope="module")
def result(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("causal") / "causal.json"
    script.main([*TINY, "--ref-gains", "1", "4", "--variants", "euclidean", "l2", "hetero-key",
                 "--certify", "euclidean", "hetero-key", "--out", str(out)])
    return json.loads(out.read_text())


def test_the_file_has_both_masks_every_gain_and_every_seed(result):
    meta = result["meta"]
    assert meta["masks"] == ["none", "causal"] and meta["ref_gains"] == [1.0, 4.0]
    assert meta["command"].startswith("python experiments/rank_collapse_causal.py")
    for mask in ("none", "causal"):
        for g in ("1", "4"):
            curves = result["sweep"][mask][g]
            assert set(curves) == {"euclidean", "l2", "hetero-key"}
            assert all(len(c) == 2 and all(len(s) == 4 for s in c) for c in curves.values())
        assert set(result["certificates"][mask]) == {"euclidean", "hetero-key"}


def test_each_mask_is_calibrated_to_its_own_dot_product(result):
    """The targets differ between masks (a causal row sees fewer keys), and each variant meets its mask's."""
    H = result["meta"]["target_entropy"]
    assert H["causal"]["4"] < H["none"]["4"] and H["causal"]["1"] < H["none"]["1"]
    for mask in ("none", "causal"):
        for g in ("1", "4"):
            for name, c in result["calibration"][mask][g].items():
                assert abs(c["entropy"] - H[mask][g]) < 0.02, (mask, g, name)


def test_certificates_linear_with_the_mask_cubic_without(result):
    certs = result["certificates"]
    for name in ("euclidean", "hetero-key"):
        for r in certs["causal"][name]:
            assert abs(r["exponent"] - 1) < 0.1 and r["bound_power"] is None  # the bound assumes no mask
        for r in certs["none"]["euclidean"]:
            assert abs(r["exponent"] - 3) < 0.1 and r["bound_power"] == 3


def test_the_mask_reaches_the_attention(script):
    args = Namespace(d_model=8, heads=2, depth=1, n=8, causal=True)
    upper = torch.ones(8, 8, dtype=torch.bool).triu(1)
    attn = script.rcc.build("hetero-key", 0, 0.5, args).blocks[0].attn
    _, A = attn(torch.randn(1, 8, 8, dtype=torch.float64), return_weights=True)
    assert torch.all(A[0][:, upper] == 0)
    # without the field: bidirectional, as every stored result of rank_collapse_controlled.py
    attn = script.rcc.build("hetero-key", 0, 0.5, Namespace(d_model=8, heads=2, depth=1, n=8)).blocks[0].attn
    _, A = attn(torch.randn(1, 8, 8, dtype=torch.float64), return_weights=True)
    assert torch.all(A[0][:, upper] > 0)


def test_identical_tokens_give_the_prefix_average(script):
    """A^0 of a causal layer is the prefix average for every score computed from the tokens."""
    n = 8
    A0 = torch.tril(torch.ones(n, n, dtype=torch.float64)) / torch.arange(1, n + 1, dtype=torch.float64).view(-1, 1)
    for name in ("euclidean", "l2", "shared", "hetero-mean"):
        attn = script.rcc.build(name, 0, 4.0, Namespace(d_model=8, heads=2, depth=1, n=n, causal=True)).blocks[0].attn
        _, A = attn(torch.randn(8, dtype=torch.float64).repeat(1, n, 1), return_weights=True)
        assert torch.allclose(A[0], A0.expand_as(A[0]), atol=1e-14), name


def test_causal_layer_minus_its_linearisation_is_second_order(script):
    n, D = 8, 8
    attn = script.rcc.build("hetero-key", 0, 2.0, Namespace(d_model=D, heads=2, depth=1, n=n, causal=True)).blocks[0].attn
    A0 = torch.tril(torch.ones(n, n, dtype=torch.float64)) / torch.arange(1, n + 1, dtype=torch.float64).view(-1, 1)
    g = torch.Generator().manual_seed(0)
    xbar, R = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(n, D, generator=g, dtype=torch.float64)
    R = (R - R.mean(0)) / token_radius(R - R.mean(0))
    rest = []
    for eps in (1e-3, 1e-4):
        X = (xbar + eps * R).unsqueeze(0)
        lin = attn.out_proj(A0 @ attn.v_proj(X))
        rest.append(token_radius(attn(X)[0] - lin).item())
    assert 1.8 < math.log10(rest[0] / rest[1]) < 2.2


@pytest.mark.parametrize("bad, match", [(["--variants", "l2"], "--variants must include euclidean"),
                                        (["--ref-gains", "0"], "--ref-gains must be positive")])
def test_bad_arguments_are_refused(script, tmp_path, bad, match, capsys):
    with pytest.raises(SystemExit):
        script.main([*TINY, *bad, "--out", str(tmp_path / "x.json")])
    assert match in capsys.readouterr().err
