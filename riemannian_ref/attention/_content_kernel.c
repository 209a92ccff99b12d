/*
 * Attention along a content connection, fused per query row (CPU).
 *
 * Private to riemannian_ref: compiled on first use by _content_cpu.py (once per
 * precision: -DRR_REAL=float or double) and called through ctypes, which
 * releases the GIL, so the package's thread pool runs batch chunks in parallel.
 *
 * For one batch element and one query row i, key j and pair m (d = 2H):
 *
 *     phi_ijm = (p_i - p_j) * w_ijm,   w_ijm = (w_im + w_jm) / 2  (mean rule)
 *                                            or w_jm              (source rule)
 *
 * and a pair is a complex number, so P_{j->i}^T a_i . w_j = Re(conj(a) w e^{i phi})
 * summed over m.  The score of the key-side metric G_j = lam I + U_j U_j^T is
 *
 *     dist2 = lam (|q_i|^2 + |k_j|^2 - 2 x_0) + wk sum_t (x_t - c_jt)^2
 *             + wq sum_s (e_is - y_s)^2,     S_ij = -scale/2 dist2 (+ mask)
 *
 * with x_t = (P^T q_i) . W_jt (W_j0 = k_j, W_jt = U_{k,j,t}), c_jt = U_{k,j,t} . k_j,
 * y_s = (P^T U_{q,i,s}) . k_j and e_is = U_{q,i,s} . q_i (the query side).  With
 * dot scores S_ij = scale x_0.  Outputs o_i = sum_j A_ij P_{j->i} v_j (transported
 * values) or sum_j A_ij v_j.  |q|^2, |k|^2, c and e are inputs here (the caller
 * computes them with autograd), so this file only differentiates what depends
 * on the angles.
 *
 * Nothing pairwise is stored: a row keeps cos/sin of its angles [H][n], its
 * scores and probabilities [n]; the backward recomputes them from the inputs
 * and the row's maximum and sum.  Memory O(n (H + r)) per thread.
 *
 * Portable results: no fast-math and no FP contraction (the build passes
 * -ffp-contract=off), every reduction over keys runs in LANES fixed lanes
 * summed in a fixed order, and sin/cos are the polynomials below, so the
 * result does not depend on the vector width the compiler picks for the CPU.
 * Vectorised loops run over keys j (contiguous in every key-side array).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef RR_REAL
#define RR_REAL float
#endif
typedef RR_REAL real;

#define LANES 8
/* The loops over keys write arrays that never overlap their inputs: say so, or
 * gcc keeps the backward's loops scalar (too many pointers to check at run time). */
#if defined(__GNUC__) && !defined(__clang__)
#define RR_IVDEP _Pragma("GCC ivdep")
#elif defined(__clang__)
#define RR_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#else
#define RR_IVDEP
#endif
#define FLAG_CAUSAL 1
#define FLAG_SOURCE 2
#define FLAG_DOT 4
#define FLAG_TV 8

#ifdef RR_DOUBLE
static inline void rr_sincos(real x, real *s, real *c) {
    *s = sin(x);
    *c = cos(x);
}
static inline real rr_exp(real x) { return exp(x); }
static inline real rr_log(real x) { return log(x); }
#else
/* sin and cos of a float: reduction by pi/2 in three parts (Cody and Waite),
 * minimax polynomials on [-pi/4, pi/4] (the coefficients of Cephes' sinf and
 * cosf), quadrant by arithmetic selects.  About 1e-7 absolute error for
 * |x| < 2^13 (angles up to n * max rate), written so that gcc vectorises it. */
static inline void rr_sincos(float x, float *s, float *c) {
    const float two_over_pi = 0.636619772367581343f;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float k = (x * two_over_pi + shifter) - shifter;
    float r = x - k * 1.5703125f;
    r = r - k * 4.837512969970703125e-4f;
    r = r - k * 7.54978995489188216e-8f;
    float z = r * r;
    float sp = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
    float cp = ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z
               - 0.5f * z + 1.0f;
    int32_t qd = (int32_t)k;
    float swap = (float)(qd & 1); /* 0 or 1: selects by products, which gcc vectorises (exact: x*0 + y*1 = y) */
    float keep = 1.0f - swap;
    float sgn_s = 1.0f - 2.0f * (float)((qd >> 1) & 1);
    float sgn_c = 1.0f - 2.0f * (float)(((qd + 1) >> 1) & 1);
    *s = sgn_s * (swap * cp + keep * sp);
    *c = sgn_c * (swap * sp + keep * cp);
}
static inline real rr_exp(real x) { return expf(x); }
static inline real rr_log(real x) { return logf(x); }
#endif

/* Sum of f over [0, n) in LANES lanes added in a fixed order. */
static inline real lane_total(const real *acc) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

typedef struct {
    int64_t n, H, rk, rq, dv;
    const real *q, *KW, *Uq, *VT, *rates, *ratesT, *pos, *lam, *qq, *kk, *cK, *eQ, *mask;
    const int64_t *mask_id;
    int64_t mask_rows;
    real scale, wk, wq;
    int flags;
} args_t;

/* cos/sin of the row's angles into CS, SN [H][n] (keys 0..jn). */
static void row_angles(const args_t *a, int64_t b, int64_t i, int64_t jn, real *CS, real *SN) {
    const int64_t n = a->n, H = a->H;
    const real pi = a->pos[b * n + i];
    const real *pj = a->pos + b * n;
    const int source = a->flags & FLAG_SOURCE;
    for (int64_t m = 0; m < H; m++) {
        const real wi = a->rates[(b * n + i) * H + m];
        const real *wj = a->ratesT + (b * H + m) * n;
        real *cs = CS + m * n, *sn = SN + m * n;
        if (source) {
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) {
                real phi = (pi - pj[j]) * wj[j];
                rr_sincos(phi, &sn[j], &cs[j]);
            }
        } else {
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) {
                real phi = (pi - pj[j]) * ((real)0.5 * (wi + wj[j]));
                rr_sincos(phi, &sn[j], &cs[j]);
            }
        }
    }
}

/* The rank products of one row: X [(1+rk)][n], Y [rq][n]; QR, QI scratch [n]. */
static void row_products(const args_t *a, int64_t b, int64_t i, int64_t jn, const real *CS, const real *SN,
                         real *X, real *Y, real *QR, real *QI) {
    const int64_t n = a->n, H = a->H, rk = a->rk, rq = a->rq, d = 2 * H;
    const real *qi = a->q + (b * n + i) * d;
    const real *KW = a->KW + b * (1 + rk) * H * 2 * n;
    memset(X, 0, sizeof(real) * (size_t)((1 + rk) * n));
    if (rq) memset(Y, 0, sizeof(real) * (size_t)(rq * n));
    for (int64_t m = 0; m < H; m++) {
        const real *cs = CS + m * n, *sn = SN + m * n;
        const real ar = qi[2 * m], ai = qi[2 * m + 1];
        RR_IVDEP
        for (int64_t j = 0; j < jn; j++) {
            QR[j] = ar * cs[j] + ai * sn[j];
            QI[j] = ar * sn[j] - ai * cs[j];
        }
        for (int64_t t = 0; t <= rk; t++) {
            const real *wr = KW + ((t * H + m) * 2) * n, *wi = wr + n;
            real *x = X + t * n;
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) x[j] += QR[j] * wr[j] - QI[j] * wi[j];
        }
        if (rq) {
            const real *kr = KW + (m * 2) * n, *ki = kr + n;
            for (int64_t s = 0; s < rq; s++) {
                const real *u = a->Uq + ((b * n + i) * rq + s) * d;
                const real ur = u[2 * m], ui = u[2 * m + 1];
                real *y = Y + s * n;
                RR_IVDEP
                for (int64_t j = 0; j < jn; j++) {
                    real qr = ur * cs[j] + ui * sn[j], qim = ur * sn[j] - ui * cs[j];
                    y[j] += qr * kr[j] - qim * ki[j];
                }
            }
        }
    }
}

/* Scores of one row into S [n] (keys 0..jn), from the products. */
static void row_scores(const args_t *a, int64_t b, int64_t i, int64_t jn, const real *X, const real *Y, real *S) {
    const int64_t n = a->n, rk = a->rk, rq = a->rq;
    if (a->flags & FLAG_DOT) {
        RR_IVDEP
        for (int64_t j = 0; j < jn; j++) S[j] = a->scale * X[j];
    } else {
        const real lam = a->lam[b], qq = a->qq[b * n + i];
        const real *kk = a->kk + b * n;
        RR_IVDEP
        for (int64_t j = 0; j < jn; j++) S[j] = lam * ((qq + kk[j]) - (real)2 * X[j]);
        for (int64_t t = 1; t <= rk; t++) {
            const real *x = X + t * n, *c = a->cK + (b * rk + t - 1) * n;
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) {
                real u = x[j] - c[j];
                S[j] += a->wk * (u * u);
            }
        }
        for (int64_t s = 0; s < rq; s++) {
            const real *y = Y + s * n;
            const real e = a->eQ[(b * n + i) * rq + s];
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) {
                real u = e - y[j];
                S[j] += a->wq * (u * u);
            }
        }
        const real h = (real)-0.5 * a->scale;
        RR_IVDEP
        for (int64_t j = 0; j < jn; j++) S[j] = h * S[j];
    }
    if (a->mask) {
        const real *mrow = a->mask + (a->mask_id[b] * a->mask_rows + (a->mask_rows > 1 ? i : 0)) * n;
        RR_IVDEP
        for (int64_t j = 0; j < jn; j++) S[j] += mrow[j];
    }
}

typedef struct {
    real *CS, *SN, *X, *Y, *QR, *QI, *S, *P, *DP, *G, *Hh, *GR, *GI, *DPHI;
} bufs_t;

static int alloc_bufs(bufs_t *w, int64_t n, int64_t H, int64_t rk, int64_t rq) {
    size_t total = (size_t)n * (size_t)(2 * H + 2 * (1 + rk) + 2 * rq + 9);
    real *base = (real *)calloc(total, sizeof(real));
    if (!base) return -1;
    w->CS = base;
    w->SN = w->CS + H * n;
    w->X = w->SN + H * n;
    w->Y = w->X + (1 + rk) * n;
    w->QR = w->Y + rq * n;
    w->QI = w->QR + n;
    w->S = w->QI + n;
    w->P = w->S + n;
    w->DP = w->P + n;
    w->G = w->DP + n;
    w->Hh = w->G + (1 + rk) * n;
    w->GR = w->Hh + rq * n;
    w->GI = w->GR + n;
    w->DPHI = w->GI + n;
    return 0;
}

/* Rows [b0, b1) of the batch.  out [B, n, dv], lse [B, n] (natural log; +inf
 * for a row that sees no key, whose output is 0).  Returns 0, or -1 when out
 * of memory. */
int rr_content_forward(int64_t b0, int64_t b1, int64_t n, int64_t H, int64_t rk, int64_t rq, int64_t dv,
                       const real *q, const real *KW, const real *Uq, const real *VT, const real *rates,
                       const real *ratesT, const real *pos, const real *lam, const real *qq, const real *kk,
                       const real *cK, const real *eQ, const real *mask, const int64_t *mask_id, int64_t mask_rows,
                       double scale, double wk, double wq, int flags, real *out, real *lse) {
    args_t a = {n, H, rk, rq, dv, q, KW, Uq, VT, rates, ratesT, pos, lam, qq, kk, cK, eQ, mask, mask_id,
                mask_rows, (real)scale, (real)wk, (real)wq, flags};
    bufs_t w;
    if (alloc_bufs(&w, n, H, rk, rq)) return -1;
    const int tv = flags & FLAG_TV;
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t jn = (flags & FLAG_CAUSAL) ? i + 1 : n;
            real *o = out + (b * n + i) * dv;
            row_angles(&a, b, i, jn, w.CS, w.SN);
            row_products(&a, b, i, jn, w.CS, w.SN, w.X, w.Y, w.QR, w.QI);
            row_scores(&a, b, i, jn, w.X, w.Y, w.S);
            real mx = -INFINITY;
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) mx = w.S[j] > mx ? w.S[j] : mx;
            if (mx == -INFINITY) { /* sees no key */
                lse[b * n + i] = INFINITY;
                memset(o, 0, sizeof(real) * (size_t)dv);
                continue;
            }
            real acc[LANES] = {0};
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) {
                real p = rr_exp(w.S[j] - mx);
                w.P[j] = p;
                acc[j % LANES] += p;
            }
            const real sum = lane_total(acc);
            lse[b * n + i] = mx + rr_log(sum);
            const real inv = (real)1 / sum;
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) w.P[j] *= inv;
            if (tv) {
                for (int64_t m = 0; m < H; m++) {
                    const real *cs = w.CS + m * n, *sn = w.SN + m * n;
                    const real *vr = VT + ((b * H + m) * 2) * n, *vi = vr + n;
                    real ar[LANES] = {0}, ai[LANES] = {0};
                    int64_t j = 0;
                    RR_IVDEP
                    for (; j + LANES <= jn; j += LANES)
                        for (int l = 0; l < LANES; l++) {
                            real p = w.P[j + l], c = cs[j + l], s = sn[j + l];
                            ar[l] += p * (c * vr[j + l] - s * vi[j + l]);
                            ai[l] += p * (s * vr[j + l] + c * vi[j + l]);
                        }
                    for (int l = 0; j < jn; j++, l++) {
                        real p = w.P[j], c = cs[j], s = sn[j];
                        ar[l] += p * (c * vr[j] - s * vi[j]);
                        ai[l] += p * (s * vr[j] + c * vi[j]);
                    }
                    o[2 * m] = lane_total(ar);
                    o[2 * m + 1] = lane_total(ai);
                }
            } else {
                for (int64_t cidx = 0; cidx < dv; cidx++) {
                    const real *vc = VT + (b * dv + cidx) * n;
                    real ac[LANES] = {0};
                    int64_t j = 0;
                    RR_IVDEP
                    for (; j + LANES <= jn; j += LANES)
                        for (int l = 0; l < LANES; l++) ac[l] += w.P[j + l] * vc[j + l];
                    for (int l = 0; j < jn; j++, l++) ac[l] += w.P[j] * vc[j];
                    o[cidx] = lane_total(ac);
                }
            }
        }
    }
    free(w.CS);
    return 0;
}

/* Gradients of rows [b0, b1), accumulated into the zero-initialised outputs:
 * dq [B, n, d], dKW [B, 1+rk, H, 2, n], dUq [B, n, rq, d], dVT (layout of VT),
 * drates [B, n, H] (the query's rate), dratesT [B, H, n] (the key's rate),
 * dlam [B], dqq, dkk [B, n], dcK [B, rk, n], deQ [B, n, rq]. */
int rr_content_backward(int64_t b0, int64_t b1, int64_t n, int64_t H, int64_t rk, int64_t rq, int64_t dv,
                        const real *q, const real *KW, const real *Uq, const real *VT, const real *rates,
                        const real *ratesT, const real *pos, const real *lam, const real *qq, const real *kk,
                        const real *cK, const real *eQ, const real *mask, const int64_t *mask_id,
                        int64_t mask_rows, double scale, double wk, double wq, int flags, const real *out,
                        const real *lse, const real *dout, real *dq, real *dKW, real *dUq, real *dVT,
                        real *drates, real *dratesT, real *dlam, real *dqq, real *dkk, real *dcK, real *deQ) {
    args_t a = {n, H, rk, rq, dv, q, KW, Uq, VT, rates, ratesT, pos, lam, qq, kk, cK, eQ, mask, mask_id,
                mask_rows, (real)scale, (real)wk, (real)wq, flags};
    bufs_t w;
    if (alloc_bufs(&w, n, H, rk, rq)) return -1;
    const int tv = flags & FLAG_TV, dot = flags & FLAG_DOT, source = flags & FLAG_SOURCE;
    const int64_t d = 2 * H;
    for (int64_t b = b0; b < b1; b++) {
        const real *KWb = KW + b * (1 + rk) * H * 2 * n;
        real *dKWb = dKW + b * (1 + rk) * H * 2 * n;
        const real *pj = pos + b * n;
        real dlam_b = 0;
        for (int64_t i = 0; i < n; i++) {
            const real L = lse[b * n + i];
            if (L == INFINITY) continue; /* a row that sees no key: no gradient */
            const int64_t jn = (flags & FLAG_CAUSAL) ? i + 1 : n;
            const real *qi = q + (b * n + i) * d, *doi = dout + (b * n + i) * dv, *oi = out + (b * n + i) * dv;
            real Dsum = 0;
            for (int64_t c = 0; c < dv; c++) Dsum += doi[c] * oi[c];
            row_angles(&a, b, i, jn, w.CS, w.SN);
            row_products(&a, b, i, jn, w.CS, w.SN, w.X, w.Y, w.QR, w.QI);
            row_scores(&a, b, i, jn, w.X, w.Y, w.S);
            /* dP_ij = dO_i . (P v_j) or dO_i . v_j */
            memset(w.DP, 0, sizeof(real) * (size_t)n);
            if (tv) {
                for (int64_t m = 0; m < H; m++) {
                    const real *cs = w.CS + m * n, *sn = w.SN + m * n;
                    const real *vr = VT + ((b * H + m) * 2) * n, *vi = vr + n;
                    const real dr = doi[2 * m], di = doi[2 * m + 1];
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) {
                        real er = dr * cs[j] + di * sn[j], ei = dr * sn[j] - di * cs[j];
                        w.DP[j] += er * vr[j] - ei * vi[j];
                    }
                }
            } else {
                for (int64_t c = 0; c < dv; c++) {
                    const real *vc = VT + (b * dv + c) * n;
                    const real g = doi[c];
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) w.DP[j] += g * vc[j];
                }
            }
            /* The row's probabilities exactly as the forward made them (its maximum and sum again, not
             * exp(S - lse): next to a mask of -1e308 the log-sum-exp has no digit left for log(sum)),
             * then dS and the gradients of the products. */
            real mx = -INFINITY;
            for (int64_t j = 0; j < jn; j++) mx = w.S[j] > mx ? w.S[j] : mx;
            real acc[LANES] = {0};
            for (int64_t j = 0; j < jn; j++) {
                real p = rr_exp(w.S[j] - mx);
                w.P[j] = p;
                acc[j % LANES] += p;
            }
            const real inv = (real)1 / lane_total(acc);
            RR_IVDEP
            for (int64_t j = 0; j < jn; j++) {
                real p = w.P[j] * inv;
                w.P[j] = p;
                w.S[j] = p * (w.DP[j] - Dsum); /* S now holds dS */
            }
            if (dot) {
                RR_IVDEP
                for (int64_t j = 0; j < jn; j++) w.G[j] = a.scale * w.S[j];
            } else {
                const real lm = lam[b], qqi = qq[b * n + i], h = (real)-0.5 * a.scale;
                const real *kkb = kk + b * n;
                real *dkkb = dkk + b * n;
                real dqq_i = 0;
                RR_IVDEP
                for (int64_t j = 0; j < jn; j++) {
                    real dd = h * w.S[j]; /* gradient of dist2 */
                    w.S[j] = dd;
                    w.G[j] = (real)-2 * lm * dd;
                    dlam_b += dd * ((qqi + kkb[j]) - (real)2 * w.X[j]);
                    dqq_i += lm * dd;
                    dkkb[j] += lm * dd;
                }
                dqq[b * n + i] += dqq_i;
                for (int64_t t = 1; t <= rk; t++) {
                    const real *x = w.X + t * n, *c = cK + (b * rk + t - 1) * n;
                    real *g = w.G + t * n, *dc = dcK + (b * rk + t - 1) * n;
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) {
                        g[j] = (real)2 * a.wk * (x[j] - c[j]) * w.S[j];
                        dc[j] -= g[j];
                    }
                }
                for (int64_t s = 0; s < rq; s++) {
                    const real *y = w.Y + s * n;
                    const real e = eQ[(b * n + i) * rq + s];
                    real *hs = w.Hh + s * n;
                    real de = 0;
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) {
                        hs[j] = (real)-2 * a.wq * (e - y[j]) * w.S[j];
                        de -= hs[j];
                    }
                    deQ[(b * n + i) * rq + s] += de;
                }
            }
            const int64_t tmax = dot ? 0 : rk;
            if (!tv) { /* plain values: dv_j += A_ij dO_i */
                for (int64_t c = 0; c < dv; c++) {
                    real *dvc = dVT + (b * dv + c) * n;
                    const real g = doi[c];
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) dvc[j] += w.P[j] * g;
                }
            }
            for (int64_t m = 0; m < H; m++) {
                const real *cs = w.CS + m * n, *sn = w.SN + m * n;
                const real ar = qi[2 * m], ai = qi[2 * m + 1];
                RR_IVDEP
                for (int64_t j = 0; j < jn; j++) {
                    w.QR[j] = ar * cs[j] + ai * sn[j];
                    w.QI[j] = ar * sn[j] - ai * cs[j];
                    w.GR[j] = 0;
                    w.GI[j] = 0;
                    w.DPHI[j] = 0;
                }
                for (int64_t t = 0; t <= tmax; t++) {
                    const real *wr = KWb + ((t * H + m) * 2) * n, *wi = wr + n;
                    real *dwr = dKWb + ((t * H + m) * 2) * n, *dwi = dwr + n;
                    const real *g = w.G + t * n;
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) {
                        w.GR[j] += g[j] * wr[j];
                        w.GI[j] += g[j] * wi[j];
                        w.DPHI[j] -= g[j] * (w.QR[j] * wi[j] + w.QI[j] * wr[j]);
                        dwr[j] += g[j] * w.QR[j];
                        dwi[j] -= g[j] * w.QI[j];
                    }
                }
                { /* the query: d/d(ar, ai) of sum_t g_t Re(conj(q) W_t e^{i phi}) */
                    real accr[LANES] = {0}, acci[LANES] = {0};
                    int64_t j = 0;
                    RR_IVDEP
                    for (; j + LANES <= jn; j += LANES)
                        for (int l = 0; l < LANES; l++) {
                            real c = cs[j + l], s = sn[j + l], gr = w.GR[j + l], gi = w.GI[j + l];
                            accr[l] += gr * c - gi * s;
                            acci[l] += gr * s + gi * c;
                        }
                    for (int l = 0; j < jn; j++, l++) {
                        real c = cs[j], s = sn[j], gr = w.GR[j], gi = w.GI[j];
                        accr[l] += gr * c - gi * s;
                        acci[l] += gr * s + gi * c;
                    }
                    dq[(b * n + i) * d + 2 * m] += lane_total(accr);
                    dq[(b * n + i) * d + 2 * m + 1] += lane_total(acci);
                }
                if (rq && !dot) { /* the query side: y_s = Re(conj(U_is) k_j e^{i phi}) */
                    const real *kr = KWb + (m * 2) * n, *ki = kr + n;
                    real *dkr = dKWb + (m * 2) * n, *dki = dkr + n;
                    for (int64_t s = 0; s < rq; s++) {
                        const real *u = Uq + ((b * n + i) * rq + s) * d;
                        const real ur = u[2 * m], ui = u[2 * m + 1];
                        const real *hs = w.Hh + s * n;
                        real accr[LANES] = {0}, acci[LANES] = {0};
                        int64_t j = 0;
                        for (; j < jn; j++) {
                            real c = cs[j], sv = sn[j], h = hs[j];
                            real qr = ur * c + ui * sv, qim = ur * sv - ui * c;
                            dkr[j] += h * qr;
                            dki[j] -= h * qim;
                            w.DPHI[j] -= h * (qr * ki[j] + qim * kr[j]);
                            accr[j % LANES] += h * (kr[j] * c - ki[j] * sv);
                            acci[j % LANES] += h * (kr[j] * sv + ki[j] * c);
                        }
                        dUq[((b * n + i) * rq + s) * d + 2 * m] += lane_total(accr);
                        dUq[((b * n + i) * rq + s) * d + 2 * m + 1] += lane_total(acci);
                    }
                }
                if (tv) { /* values: o_i = sum_j A_ij v_j e^{i phi} */
                    const real *vr = VT + ((b * H + m) * 2) * n, *vi = vr + n;
                    real *dvr = dVT + ((b * H + m) * 2) * n, *dvi = dvr + n;
                    const real dr = doi[2 * m], di = doi[2 * m + 1];
                    RR_IVDEP
                    for (int64_t j = 0; j < jn; j++) {
                        real er = dr * cs[j] + di * sn[j], ei = dr * sn[j] - di * cs[j], p = w.P[j];
                        w.DPHI[j] -= p * (er * vi[j] + ei * vr[j]);
                        dvr[j] += p * er;
                        dvi[j] -= p * ei;
                    }
                }
                { /* the rates: phi = (p_i - p_j) w_ij */
                    const real pi = pos[b * n + i];
                    real *dwj = dratesT + (b * H + m) * n;
                    if (source) {
                        RR_IVDEP
                        for (int64_t j = 0; j < jn; j++) dwj[j] += (pi - pj[j]) * w.DPHI[j];
                    } else {
                        real acc[LANES] = {0};
                        int64_t j = 0;
                        RR_IVDEP
                        for (; j + LANES <= jn; j += LANES)
                            for (int l = 0; l < LANES; l++) {
                                real f = (real)0.5 * ((pi - pj[j + l]) * w.DPHI[j + l]);
                                dwj[j + l] += f;
                                acc[l] += f;
                            }
                        for (int l = 0; j < jn; j++, l++) {
                            real f = (real)0.5 * ((pi - pj[j]) * w.DPHI[j]);
                            dwj[j] += f;
                            acc[l] += f;
                        }
                        drates[(b * n + i) * H + m] += lane_total(acc);
                    }
                }
            }
        }
        dlam[b] += dlam_b;
    }
    free(w.CS);
    return 0;
}
