"""The cumulative (flat, content-dependent) connection against a dense float64 per-pair reference.

phi_i = sum_{t <= i} omega_t (p_t - p_{t-1}) with p_{-1} = 0 and P_{j->i} = R(phi_i) R(phi_j)^T. The
reference below builds the phases by an explicit sum and one dense d x d transport per pair
(block_rotation_matrix), and computes scores, weights and outputs from the definition; the package
moves every object to one common frame and calls the ordinary operator (SDPA, blockwise, dense with
weights), which must agree in values and gradients.
"""
import pytest
import torch

import riemannian_ref as rr
from riemannian_ref.analysis import bundle
from riemannian_ref.geometry import transport as cx

DT = torch.float64
SIDES = ("key", "query", "mean")


def _inputs(gen, B=2, h=3, n=7, d=6, r=2, dtype=DT):
    q, k, v = (torch.randn(B, h, n, d, generator=gen, dtype=DT) for _ in range(3))
    U_q, U_k = (0.5 * torch.randn(B, h, n, d, r, generator=gen, dtype=DT) for _ in range(2))
    lam = 0.5 + torch.rand(h, generator=gen, dtype=DT)
    rates = 0.8 * torch.rand(B, h, n, d // 2, generator=gen, dtype=DT)
    return tuple(t.to(dtype) for t in (q, k, v, U_q, U_k, lam, rates))


def _factors(side, U_q, U_k):
    return (U_q if side in ("query", "mean") else None, U_k if side in ("key", "mean") else None)


def _phases_ref(rates, pos):
    """phi_i = sum_{t <= i} omega_t (p_t - p_{t-1}), p_{-1} = 0, by an explicit sum over t (the definition)."""
    n = rates.shape[-2]
    pos = pos.expand(*rates.shape[:-1])
    prev = torch.cat([torch.zeros_like(pos[..., :1]), pos[..., :-1]], -1)
    inc = (pos - prev).unsqueeze(-1) * rates  # omega_t (p_t - p_{t-1})   (..., n, d/2)
    return torch.stack([inc[..., : i + 1, :].sum(-2) for i in range(n)], -2)


def _dense(q, k, v, U_q, U_k, lam, side, rates, pos, *, scores="metric", mask=None, causal=False,
           transport_values=True, scale=None):
    """Scores, weights and outputs from one dense transport matrix P_{j->i} per pair."""
    n, d = q.shape[-2], q.shape[-1]
    phi = _phases_ref(rates, pos)  # (..., n, d/2)
    P = cx.block_rotation_matrix(phi.unsqueeze(-2) - phi.unsqueeze(-3))  # P_{j->i}   (..., i, j, d, d)
    s = d ** -0.5 if scale is None else scale
    kt = (P @ k.unsqueeze(-3).unsqueeze(-1)).squeeze(-1)  # P_{j->i} k_j            (..., i, j, d)
    if scores == "dot":
        S = s * (q.unsqueeze(-2) * kt).sum(-1)
    else:
        eye = torch.eye(d, dtype=q.dtype)
        lam4 = lam.view(-1, 1, 1, 1)
        Gk = lam4 * eye + U_k @ U_k.transpose(-1, -2) if U_k is not None else None  # (B, h, j, d, d)
        Gq = lam4 * eye + U_q @ U_q.transpose(-1, -2) if U_q is not None else None
        if side == "key":
            Gbar = P @ Gk.unsqueeze(-4) @ P.transpose(-1, -2)  # P G_j P^T
        elif side == "query":
            Gbar = Gq.unsqueeze(-3).expand_as(P)
        else:
            Gbar = 0.5 * (P @ Gk.unsqueeze(-4) @ P.transpose(-1, -2) + Gq.unsqueeze(-3))
        delta = q.unsqueeze(-2) - kt
        S = -0.5 * s * (delta.unsqueeze(-2) @ Gbar @ delta.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    M = torch.zeros(n, n, dtype=q.dtype)
    if mask is not None:
        M = M + (torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
                 if mask.dtype == torch.bool else mask)
    if causal:
        M = M.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    A = rr.attention.reference.masked_softmax(S + M)
    if transport_values:
        vt = (P @ v.unsqueeze(-3).unsqueeze(-1)).squeeze(-1)  # P_{j->i} v_j
        out = (A.unsqueeze(-1) * vt).sum(-2)
    else:
        out = A @ v
    return out, A


# --------------------------------------------------------------------------- the phases
def test_phases_are_the_cumulative_sum_and_constant_rates_give_the_rotary_angles(gen):
    rates = torch.rand(2, 3, 9, 4, generator=gen, dtype=DT)
    pos = torch.randn(9, generator=gen, dtype=DT).cumsum(0)
    torch.testing.assert_close(cx.cumulative_phases(rates, pos), _phases_ref(rates, pos), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(cx.cumulative_phases(rates), _phases_ref(rates, torch.arange(9, dtype=DT)))
    # constant rates: exactly theta * p_i, the angles of the flat connection, whatever the positions
    theta = cx.rotary_frequencies(8, base=30.0, dtype=DT)
    for p in (torch.arange(9, dtype=DT), pos):
        assert torch.equal(cx.cumulative_phases(theta.expand(9, 4), p), p[:, None] * theta)
    # transport_angles with the cumulative rule: phi_i - phi_j, inverse-consistent bit for bit
    ang = cx.transport_angles(rates, pos, "cumulative")
    phi = cx.cumulative_phases(rates, pos)
    assert torch.equal(ang, phi.unsqueeze(-2) - phi.unsqueeze(-3))
    assert torch.equal(ang, -ang.transpose(-2, -3))
    # positions broadcast against the batch: per-sequence positions [B, 1, n]
    pos_b = torch.stack([pos, pos + 3.0]).unsqueeze(1)  # (2, 1, 9)
    torch.testing.assert_close(cx.cumulative_phases(rates, pos_b), _phases_ref(rates, pos_b))


def test_phases_gradient_gradcheck(gen):
    rates = torch.rand(2, 5, 3, generator=gen, dtype=DT, requires_grad=True)
    pos = torch.tensor([0.0, 1.0, 3.0, 3.5, 7.0], dtype=DT)
    assert torch.autograd.gradcheck(lambda r: cx.cumulative_phases(r, pos), (rates,))


# --------------------------------------------------------------------------- attention against the reference
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transport_values", [True, False])
def test_metric_scores_match_the_dense_reference(gen, side, causal, transport_values):
    q, k, v, U_q, U_k, lam, rates = _inputs(gen)
    Uq, Uk = _factors(side, U_q, U_k)
    pos = torch.arange(7, dtype=DT) * 1.5 + 2.0
    kw = dict(U_q=Uq, U_k=Uk, lam=lam, metric_side=side, connection="cumulative", rates=rates, positions=pos,
              is_causal=causal, transport_values=transport_values)
    ref_out, ref_A = _dense(q, k, v, Uq, Uk, lam, side, rates, pos, causal=causal,
                            transport_values=transport_values)
    out = rr.connection_attention(q, k, v, **kw)  # the operator (blockwise: per-token factors)
    torch.testing.assert_close(out, ref_out)
    out_w, A = rr.connection_attention(q, k, v, **kw, return_weights=True)  # the dense path with weights
    torch.testing.assert_close(A, ref_A)
    torch.testing.assert_close(out_w, ref_out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transport_values", [True, False])
def test_dot_scores_match_the_dense_reference(gen, causal, transport_values):
    q, k, v, _, _, _, rates = _inputs(gen)
    ref_out, ref_A = _dense(q, k, v, None, None, None, "key", rates, torch.arange(7, dtype=DT), scores="dot",
                            causal=causal, transport_values=transport_values)
    kw = dict(scores="dot", connection="cumulative", rates=rates, is_causal=causal,
              transport_values=transport_values)
    torch.testing.assert_close(rr.connection_attention(q, k, v, **kw), ref_out)  # SDPA in the common frame
    out, A = rr.connection_attention(q, k, v, **kw, return_weights=True)
    torch.testing.assert_close(A, ref_A)
    torch.testing.assert_close(out, ref_out)


def test_shared_metric_and_isotropic_metric_match_the_dense_reference(gen):
    """A factor shared by the tokens [B, h, d, r] becomes per-token in the common frame (R_j^T U); with
    lam I only (no factor) the call reaches SDPA's dot-product form."""
    q, k, v, _, _, lam, rates = _inputs(gen)
    U = 0.5 * torch.randn(2, 3, 6, 2, generator=gen, dtype=DT)
    ref, _ = _dense(q, k, v, None, U.unsqueeze(2).expand(2, 3, 7, 6, 2), lam, "key", rates,
                    torch.arange(7, dtype=DT), causal=True)
    out = rr.connection_attention(q, k, v, U_k=U, lam=lam, connection="cumulative", rates=rates, is_causal=True)
    torch.testing.assert_close(out, ref)
    U0 = torch.zeros(2, 3, 7, 6, 0, dtype=DT)
    ref0, _ = _dense(q, k, v, None, U0, lam, "key", rates, torch.arange(7, dtype=DT))
    out0 = rr.connection_attention(q, k, v, lam=lam, connection="cumulative", rates=rates)
    torch.testing.assert_close(out0, ref0)


@pytest.mark.parametrize("scores", ["metric", "dot"])
@pytest.mark.parametrize("kind", ["bool", "float", "padding", "padding+causal", "dead_row"])
def test_masks_match_the_dense_reference(gen, scores, kind):
    q, k, v, _, U_k, lam, rates = _inputs(gen)
    n = q.shape[-2]
    causal = kind == "padding+causal"
    if kind == "bool":
        mask = torch.rand(2, 1, n, n, generator=gen) > 0.3
        mask |= torch.eye(n, dtype=torch.bool)  # every row sees a key
    elif kind == "float":
        mask = torch.randn(2, 3, n, n, generator=gen, dtype=DT)
    elif kind == "dead_row":
        mask = torch.ones(2, 1, n, n, dtype=torch.bool)
        mask[0, :, 3] = False  # query 3 of the first sequence sees no key: its output is 0
    else:
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
        mask[1, ..., :3] = False  # the second sequence is left-padded by three tokens
    Uk = U_k if scores == "metric" else None
    ref, _ = _dense(q, k, v, None, Uk, lam, "key", rates, torch.arange(n, dtype=DT), scores=scores, mask=mask,
                    causal=causal)
    out = rr.connection_attention(q, k, v, mask, U_k=Uk, lam=lam, scores=scores, connection="cumulative",
                                  rates=rates, is_causal=causal)
    if causal:  # rows of the padded sequence that see only pads: no key at all, zero output on both sides
        assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
    if kind == "dead_row":
        assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    torch.testing.assert_close(out, ref)


def test_rates_and_positions_broadcast_against_the_batch(gen):
    q, k, v, _, U_k, lam, _ = _inputs(gen)
    rates_h = 0.8 * torch.rand(3, 7, 3, generator=gen, dtype=DT)  # one set per head, shared by the batch
    pos = torch.stack([torch.arange(7.0, dtype=DT), 2.0 * torch.arange(7.0, dtype=DT)]).unsqueeze(1)  # (B, 1, n)
    out = rr.connection_attention(q, k, v, U_k=U_k, lam=lam, connection="cumulative", rates=rates_h, positions=pos)
    full = rr.connection_attention(q, k, v, U_k=U_k, lam=lam, connection="cumulative",
                                   rates=rates_h.expand(2, 3, 7, 3), positions=pos)
    assert torch.equal(out, full)
    ref, _ = _dense(q, k, v, None, U_k, lam, "key", rates_h.expand(2, 3, 7, 3), pos)
    torch.testing.assert_close(out, ref)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("scores", ["metric", "dot"])
def test_gradients_match_the_dense_reference(gen, side, scores):
    q, k, v, U_q, U_k, lam, rates = _inputs(gen, n=5)
    Uq, Uk = _factors(side, U_q, U_k) if scores == "metric" else (None, None)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, rates)]
    pos = torch.arange(5, dtype=DT) * 0.7
    grads = []
    for fn in ("ours", "dense"):
        qq, kk, vv, rr_ = leaves
        if fn == "ours":
            out = rr.connection_attention(qq, kk, vv, U_q=Uq, U_k=Uk, lam=lam, metric_side=side, scores=scores,
                                          connection="cumulative", rates=rr_, positions=pos, is_causal=True)
        else:
            out, _ = _dense(qq, kk, vv, Uq, Uk, lam, side, rr_, pos, scores=scores, causal=True)
        w = torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out)
        grads.append(torch.autograd.grad((out * w).sum(), leaves))
    for ours, dense in zip(*grads):
        torch.testing.assert_close(ours, dense)
    assert grads[0][3].abs().sum() > 0  # the rates learn


def test_gradcheck_tiny_case(gen):
    q, k, v, _, U_k, lam, rates = (t.requires_grad_(True) if t.dim() > 1 else t
                                   for t in _inputs(gen, B=1, h=1, n=4, d=4, r=1))

    def f(q, k, v, U_k, rates):
        return rr.connection_attention(q, k, v, U_k=U_k, lam=lam, connection="cumulative", rates=rates,
                                       is_causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v, U_k, rates))
    assert torch.autograd.gradcheck(
        lambda q, k, v, r: rr.connection_attention(q, k, v, scores="dot", connection="cumulative", rates=r),
        (q, k, v, rates))


def test_gradcheck_broadcast_rates_and_shared_factors(gen):
    """The hand-written backward of the per-token rotations: rates shared by the batch (their gradient
    summed over it), one factor for both sides (metric_side="mean" in self-attention), a factor shared by
    the tokens, values left alone."""
    q, k, v = (torch.randn(2, 2, 4, 4, generator=gen, dtype=DT, requires_grad=True) for _ in range(3))
    U = (0.5 * torch.randn(2, 2, 4, 4, 1, generator=gen, dtype=DT)).requires_grad_(True)
    U_shared = (0.5 * torch.randn(1, 2, 4, 1, generator=gen, dtype=DT)).requires_grad_(True)
    rates = torch.rand(2, 4, 2, generator=gen, dtype=DT, requires_grad=True)  # [h, n, d/2]
    lam = torch.tensor([0.7, 1.1], dtype=DT)

    def f(q, k, v, U, r):
        return rr.connection_attention(q, k, v, U_q=U, U_k=U, lam=lam, metric_side="mean",
                                       connection="cumulative", rates=r, is_causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v, U, rates))
    assert torch.autograd.gradcheck(
        lambda q, k, v, U, r: rr.connection_attention(q, k, v, U_k=U, lam=lam, connection="cumulative", rates=r,
                                                      transport_values=False),
        (q, k, v, U_shared, rates))


def test_learned_and_fixed_rates_give_the_same_forward(gen):
    """Rates that require grad take the autograd Function; its forward is the plain rotation, bit for bit."""
    q, k, v, U_q, U_k, lam, rates = _inputs(gen)
    kw = dict(U_q=U_q, U_k=U_k, lam=lam, metric_side="mean", connection="cumulative", is_causal=True)
    fixed = rr.connection_attention(q, k, v, rates=rates, **kw)
    learned = rr.connection_attention(q, k, v, rates=rates.clone().requires_grad_(True), **kw)
    assert torch.equal(fixed, learned.detach())


# --------------------------------------------------------------------------- identities and causality
@pytest.mark.parametrize("scores", ["metric", "dot"])
@pytest.mark.parametrize("transport_values", [True, False])
def test_constant_rates_are_the_flat_connection(gen, scores, transport_values):
    q, k, v, _, U_k, lam, _ = _inputs(gen)
    theta = cx.rotary_frequencies(6, base=50.0, dtype=DT)
    kw = dict(U_k=U_k if scores == "metric" else None, lam=lam, scores=scores, is_causal=True,
              transport_values=transport_values)
    flat = rr.connection_attention(q, k, v, connection="flat", rates=theta, **kw)
    cum = rr.connection_attention(q, k, v, connection="cumulative", rates=theta.expand(7, 3), **kw)
    assert torch.equal(cum, flat)  # the same angles, bit for bit, and the same route


@pytest.mark.parametrize("scores", ["metric", "dot"])
def test_causal_outputs_do_not_read_later_tokens(gen, scores):
    """Changing token n-1 (its query, key, value, factor and rates) leaves the outputs at < n-1 unchanged,
    and their gradients do not reach it."""
    q, k, v, _, U_k, lam, rates = _inputs(gen)
    Uk = U_k if scores == "metric" else None
    kw = dict(lam=lam, scores=scores, connection="cumulative", is_causal=True)
    out = rr.connection_attention(q, k, v, U_k=Uk, rates=rates, **kw)
    q2, k2, v2, r2 = q.clone(), k.clone(), v.clone(), rates.clone()
    q2[..., -1, :] += 1.0
    k2[..., -1, :] += 3.0
    v2[..., -1, :] -= 2.0
    r2[..., -1, :] += 1.0
    Uk2 = None if Uk is None else Uk.clone()
    if Uk2 is not None:
        Uk2[..., -1, :, :] *= -4.0
    out2 = rr.connection_attention(q2, k2, v2, U_k=Uk2, rates=r2, **kw)
    assert torch.equal(out2[..., :-1, :], out[..., :-1, :])
    assert (out2[..., -1, :] - out[..., -1, :]).abs().max() > 1e-3
    r = rates.clone().requires_grad_(True)
    o = rr.connection_attention(q, k, v, U_k=Uk, rates=r, **kw)
    (g,) = torch.autograd.grad(o[..., :-1, :].square().sum(), r)
    assert torch.equal(g[..., -1, :], torch.zeros_like(g[..., -1, :]))
    assert g[..., :-1, :].abs().sum() > 0


@pytest.mark.parametrize("restart", [False, True])
def test_left_padding_leaves_the_real_tokens_alone(gen, restart):
    """A left-padded sequence gives the outputs of the unpadded one at its real tokens: the pads' rates and
    positions never lie between two real tokens (default positions count the pads; restart=True gives
    the real tokens positions 0, 1, ... and the pads anything)."""
    q, k, v, _, U_k, lam, rates = _inputs(gen, B=1)
    n_pad = 3
    pads = [torch.randn(1, 3, n_pad, *t.shape[3:], generator=gen, dtype=DT) for t in (q, k, v, U_k)]
    pad_rates = 5.0 * torch.rand(1, 3, n_pad, 3, generator=gen, dtype=DT)
    qp, kp, vp, Ukp = (torch.cat([p, t], 2) for p, t in zip(pads, (q, k, v, U_k)))
    rp = torch.cat([pad_rates, rates], 2)
    keep = torch.ones(1, 1, 1, 7 + n_pad, dtype=torch.bool)
    keep[..., :n_pad] = False
    pos = None
    if restart:
        pos = torch.cat([torch.tensor([-9.0, 4.0, 0.5], dtype=DT), torch.arange(7, dtype=DT)])
    kw = dict(lam=lam, connection="cumulative", is_causal=True)
    alone = rr.connection_attention(q, k, v, U_k=U_k, rates=rates, **kw)
    padded = rr.connection_attention(qp, kp, vp, keep, U_k=Ukp, rates=rp, positions=pos, **kw)
    torch.testing.assert_close(padded[..., n_pad:, :], alone, rtol=1e-12, atol=1e-12)


def test_padding_between_real_tokens_is_skipped_by_repeating_the_position(gen):
    """Pads inside a sequence lie on the path between real tokens; with zero increments (the previous
    position repeated) their rates drop out, and the real tokens get the outputs of the unpadded call."""
    q, k, v, _, U_k, lam, rates = _inputs(gen, B=1)
    at = 4  # two pads before real token 4

    def pad(t, fill):
        return torch.cat([t[:, :, :at], fill, t[:, :, at:]], 2)
    qp, kp, vp, Ukp = (pad(t, torch.randn(1, 3, 2, *t.shape[3:], generator=gen, dtype=DT)) for t in (q, k, v, U_k))
    rp = pad(rates, 5.0 * torch.rand(1, 3, 2, 3, generator=gen, dtype=DT))
    pos = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 3.0, 4.0, 5.0, 6.0], dtype=DT)  # the pads repeat position 3
    keep = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    keep[..., at:at + 2] = False
    real = torch.tensor([i for i in range(9) if not at <= i < at + 2])
    for causal in (False, True):
        kw = dict(lam=lam, connection="cumulative", is_causal=causal)
        alone = rr.connection_attention(q, k, v, U_k=U_k, rates=rates, **kw)
        padded = rr.connection_attention(qp, kp, vp, keep, U_k=Ukp, rates=rp, positions=pos, **kw)
        torch.testing.assert_close(padded[..., real, :], alone, rtol=1e-12, atol=1e-12)
    # with the default positions the pads' rates and steps enter the transports across them
    moved = rr.connection_attention(qp, kp, vp, keep, U_k=Ukp, rates=rp, **kw)  # causal, as `alone`
    assert (moved[..., real, :] - alone).abs().max() > 1e-3


# --------------------------------------------------------------------------- half precision and autocast
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scores", ["metric", "dot"])
def test_half_precision_inputs(gen, dtype, scores):
    """Phases and rotations in float32, the result and the gradients in the input dtype."""
    q, k, v, _, U_k, lam, rates = _inputs(gen, dtype=torch.float32, n=40)
    Uk = U_k if scores == "metric" else None
    kw = dict(scores=scores, connection="cumulative", is_causal=True)
    pos = torch.arange(40) + 3000  # positions where float16 cannot count by ones: the phases stay float32
    Uk, lam = (None if Uk is None else Uk.to(dtype)), lam.to(dtype)
    half = [t.to(dtype).requires_grad_(True) for t in (q, k, v, rates)]
    # the float32 computation on the same (rounded) inputs
    ref = rr.connection_attention(*(t.detach().float() for t in half[:3]), U_k=None if Uk is None else Uk.float(),
                                  lam=lam.float(), rates=half[3].detach().float(), positions=pos, **kw)
    out = rr.connection_attention(*half[:3], U_k=Uk, lam=lam, rates=half[3], positions=pos, **kw)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    # the rotated q, k, v and the output are each rounded once to the dtype (eps / 2 relative each);
    # phases computed in half precision would be off by whole radians at positions near 3000
    torch.testing.assert_close(out.float(), ref, atol=2 * eps * ref.abs().max(), rtol=0)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype and torch.isfinite(t.grad).all() for t in half)


def test_autocast(gen):
    q, k, v, _, U_k, lam, rates = _inputs(gen, dtype=torch.float32)
    ref = rr.connection_attention(q, k, v, U_k=U_k, lam=lam, connection="cumulative", rates=rates, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rr.connection_attention(q, k, v, U_k=U_k, lam=lam, connection="cumulative", rates=rates,
                                      is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2 * torch.finfo(torch.bfloat16).eps * ref.abs().max(), rtol=0)


# --------------------------------------------------------------------------- diagnostics
def test_holonomy_is_zero_up_to_round_off_and_matches_dense_loops(gen):
    n, d = 40, 8
    rates = torch.rand(2, n, d // 2, generator=gen, dtype=DT)
    pos = torch.arange(n, dtype=DT)
    tri = bundle.sample_triangles(n, 300, generator=gen)
    hol = rr.holonomy_defect(rates, tri, reduce=False, rule="cumulative")
    phi_max = cx.cumulative_phases(rates).abs().max()
    # three differences of phases below phi_max, each rounded: a few float64 epsilons times phi_max
    assert hol.max() < 8 * torch.finfo(DT).eps * phi_max * d
    content = rr.holonomy_defect(rates, tri, reduce=False, rule="mean")
    off = (tri[:, 0] != tri[:, 1]) & (tri[:, 1] != tri[:, 2]) & (tri[:, 0] != tri[:, 2])
    assert (content[:, off] > 1e-3).all()  # the same rates read pairwise: curved
    phi = _phases_ref(rates, pos)
    for t, (i, j, k) in enumerate(tri[:10].tolist()):
        P = lambda to, frm: cx.block_rotation_matrix(phi[:, to] - phi[:, frm])  # noqa: E731
        loop = P(i, k) @ P(k, j) @ P(j, i)
        torch.testing.assert_close(loop, torch.eye(d, dtype=DT).expand(2, d, d), rtol=0, atol=1e-12)


def test_closure_and_compatibility_use_the_cumulative_transport(gen):
    n, d, r = 9, 6, 2
    x = torch.randn(2, n, d, generator=gen, dtype=DT)
    U = torch.randn(2, n, d, r, generator=gen, dtype=DT)
    rates = torch.rand(2, n, d // 2, generator=gen, dtype=DT)
    tri = bundle.sample_triangles(n, 20, generator=gen)
    pairs = bundle.sample_pairs(n, 20, generator=gen)
    clo = rr.transport_closure_defect(x, rates, tri, reduce=False, rule="cumulative")
    comp = rr.metric_compatibility_defect(0.7, U, rates, pairs, reduce=False, rule="cumulative")
    phi = _phases_ref(rates, torch.arange(n, dtype=DT))
    G = rr.LowRankMetric(0.7, U).dense()
    for t, (i, j, k) in enumerate(tri.tolist()):
        P = cx.block_rotation_matrix(phi[:, i] - phi[:, j])
        e = x[:, k] - x[:, j]
        torch.testing.assert_close(clo[:, t], (e - (P @ e.unsqueeze(-1)).squeeze(-1)).norm(dim=-1))
    for t, (i, j) in enumerate(pairs.tolist()):
        P = cx.block_rotation_matrix(phi[:, i] - phi[:, j])
        torch.testing.assert_close(comp[:, t], (P.transpose(-1, -2) @ G[:, i] @ P - G[:, j]).flatten(-2).norm(dim=-1))


# --------------------------------------------------------------------------- module and model
def test_module_and_model_wiring(gen):
    cfg = rr.AttentionConfig(d_model=16, n_heads=2, connection="cumulative", causal=True)
    m = rr.RiemannianAttention(cfg).double()
    assert m.rates is not None  # the content connections' rate network
    x = torch.randn(2, 9, 16, generator=gen, dtype=DT)
    out, _ = m(x)
    q, k, v = m.project(x)
    lam, U_q, U_k, rates = m.geometry(x)
    assert rates.shape == (2, 2, 9, 4)
    o = rr.connection_attention(q, k, v, is_causal=True, U_q=U_q, U_k=U_k, lam=lam, connection="cumulative",
                                rates=rates)
    torch.testing.assert_close(out, m.out_proj(o.transpose(1, 2).reshape(2, 9, 16)))
    assert cx.edge_rule("cumulative") == "cumulative"

    mcfg = rr.FiberBundleConfig.tiny(mode="fiber_bundle", block_size=12, attention=dict(connection="cumulative"))
    assert not mcfg.uses_learned_positions  # the connection carries position
    torch.manual_seed(0)
    model = rr.FiberBundleTransformer(mcfg).double().eval()
    idx = torch.randint(0, mcfg.vocab_size, (2, 12), generator=gen)
    res = model(idx, return_diagnostics=True)
    hol = res.diagnostics["holonomy"]
    assert hol.shape == (mcfg.n_layers, mcfg.n_heads) and (hol < 1e-12).all()
    # causal model: changing the last token changes no earlier logit
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % mcfg.vocab_size
    torch.testing.assert_close(model(idx2).logits[:, :-1], res.logits[:, :-1], rtol=0, atol=1e-12)
    # with the rate modulation switched off at init the model is the flat one, parameter for parameter
    flat = rr.FiberBundleTransformer(mcfg.replace(attention=dict(connection="flat"))).double().eval()
    cum0 = rr.FiberBundleTransformer(mcfg.replace(attention=dict(content_rate_std=0.0))).double().eval()
    missing, unexpected = cum0.load_state_dict(flat.state_dict(), strict=False)
    assert not unexpected and missing and all(".attn.rates." in name for name in missing)
    torch.testing.assert_close(cum0(idx).logits, flat(idx).logits, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- errors
def test_bad_rates_and_positions_raise_naming_them(gen):
    q, k, v, _, U_k, lam, rates = _inputs(gen)
    kw = dict(U_k=U_k, lam=lam, connection="cumulative")
    with pytest.raises(ValueError, match="needs rates"):
        rr.connection_attention(q, k, v, **kw)
    for bad in (rates[..., :2], rates[..., :5, :], rates[0, 0, 0]):
        with pytest.raises(ValueError, match="rates"):
            rr.connection_attention(q, k, v, rates=bad, **kw)
    with pytest.raises(ValueError, match=r"rates.*\[\.\.\., n, d/2\] = \[\.\.\., 7, 3\]"):
        rr.connection_attention(q, k, v, rates=rates[..., :2], **kw)
    with pytest.raises(ValueError, match="rates"):  # batch dims that do not broadcast
        rr.connection_attention(q, k, v, rates=torch.rand(5, 3, 7, 3, dtype=DT), **kw)
    with pytest.raises(ValueError, match="rates has dtype"):
        rr.connection_attention(q, k, v, rates=rates.float(), **kw)
    with pytest.raises(ValueError, match="positions"):
        rr.connection_attention(q, k, v, rates=rates, positions=torch.arange(4), **kw)
    with pytest.raises(ValueError, match="positions"):
        rr.connection_attention(q, k, v, rates=rates, positions=torch.zeros(4, 1, 7), **kw)
    with pytest.raises(ValueError, match="rates"):
        cx.cumulative_phases(torch.zeros(3))
    with pytest.raises(ValueError, match="positions"):
        cx.cumulative_phases(rates, torch.arange(3))
    with pytest.raises(ValueError, match="connection must be one of"):
        rr.AttentionConfig(connection="cumulativ")
    with pytest.raises(ValueError, match="must be even"):
        rr.FiberBundleConfig.tiny(d_model=36, n_heads=4, attention=dict(connection="cumulative"))
