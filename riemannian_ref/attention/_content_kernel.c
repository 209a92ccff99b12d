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
 * Nothing pairwise is stored: a row keeps cos/sin of its angles [H][np], its
 * scores and probabilities [np]; the backward recomputes them from the inputs.
 * Memory O(n (H + r)) per thread.
 *
 * Layout: the keys are padded with zeros to np, a multiple of LANES, so the
 * loops over keys run on whole vectors of LANES keys with no scalar tail.  The
 * key-side arrays KW [B][np/LANES][1+rk][H][2][LANES], VT [B][np/LANES][H][2][LANES]
 * (or [B][np/LANES][dv][LANES]) and ratesT [B][np/LANES][H][LANES] (and their
 * gradients, and the row buffers CS, SN) are block-major: everything one
 * block of LANES keys needs is contiguous, and a key block is the outer loop,
 * the pairs m the inner one, so the rank products of a block stay in
 * registers.  kk, cK, pos are [.., np].  Keys past the row's last (causal,
 * padding) get probability 0.
 *
 * Portable results: no fast-math and no FP contraction (the build passes
 * -ffp-contract=off), vectors of LANES numbers whatever the CPU's width (gcc
 * and clang split them into the registers it has: the same IEEE operations on
 * every machine), sums over keys kept in the LANES lanes and added in a fixed
 * order, and sin/cos as the polynomials below.
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
typedef real V __attribute__((vector_size(LANES * sizeof(real))));

/* The largest metric rank per side (the caller checks it). */
#define RR_MAXR 16

#define FLAG_CAUSAL 1
#define FLAG_SOURCE 2
#define FLAG_DOT 4
#define FLAG_TV 8

static inline V vld(const real *p) {
    V v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vst(real *p, V v) { memcpy(p, &v, sizeof v); }
static inline V vset(real x) {
    V v = {0};
    return v + x;
}
static inline real vsum(V v) { /* the lanes in a fixed order */
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

#ifdef RR_DOUBLE
static inline void vsincos(V x, V *s, V *c) {
    for (int l = 0; l < LANES; l++) {
        (*s)[l] = sin(x[l]);
        (*c)[l] = cos(x[l]);
    }
}
static inline real rr_exp(real x) { return exp(x); }
#else
typedef int32_t VI __attribute__((vector_size(LANES * sizeof(int32_t))));
/* sin and cos of floats: reduction by pi/2 in three parts (Cody and Waite),
 * minimax polynomials on [-pi/4, pi/4] (the coefficients of Cephes' sinf and
 * cosf), the quadrant chosen by products with 0 and 1 (exact).  About 1e-7
 * absolute error for |x| < 2^13 (angles up to n times the largest rate). */
static inline void vsincos(V x, V *s, V *c) {
    const V shifter = vset(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    V k = (x * 0.636619772367581343f + shifter) - shifter;
    V r = x - k * 1.5703125f;
    r = r - k * 4.837512969970703125e-4f;
    r = r - k * 7.54978995489188216e-8f;
    V z = r * r;
    V sp = ((z * -1.9515295891e-4f + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
    V cp = ((z * 2.443315711809948e-5f - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z
           - z * 0.5f + 1.0f;
    VI qd = __builtin_convertvector(k, VI);
    V swap = __builtin_convertvector(qd & 1, V);
    V keep = 1.0f - swap;
    V sgn_s = 1.0f - 2.0f * __builtin_convertvector((qd >> 1) & 1, V);
    V sgn_c = 1.0f - 2.0f * __builtin_convertvector(((qd + 1) >> 1) & 1, V);
    *s = sgn_s * (swap * cp + keep * sp);
    *c = sgn_c * (swap * sp + keep * cp);
}
static inline real rr_exp(real x) { return expf(x); }
#endif

typedef struct {
    int64_t n, np, H, rk, rq, dv;
    const real *q, *KW, *Uq, *VT, *rates, *ratesT, *pos, *lam, *qq, *kk, *cK, *eQ, *mask;
    const int64_t *mask_id;
    int64_t mask_rows;
    real scale, wk, wq;
    int flags;
} args_t;

typedef struct {
    real *CS, *SN, *X, *Y, *S, *P, *DP, *G, *Hh;
    V *acc; /* per-row vector accumulators */
} bufs_t;

static int alloc_bufs(bufs_t *w, const args_t *a) {
    const int64_t np = a->np, H = a->H, rk = a->rk, rq = a->rq;
    size_t total = (size_t)np * (size_t)(2 * H + 2 * (1 + rk) + 2 * rq + 3);
    size_t nacc = (size_t)(3 * H + 2 * rq * H + a->dv + 2);
    real *base = (real *)calloc(total, sizeof(real));
    V *acc = (V *)aligned_alloc(64, ((nacc * sizeof(V) + 63) / 64) * 64);
    if (!base || !acc) {
        free(base);
        free(acc);
        return -1;
    }
    w->CS = base;
    w->SN = w->CS + H * np;
    w->X = w->SN + H * np;
    w->Y = w->X + (1 + rk) * np;
    w->S = w->Y + rq * np;
    w->P = w->S + np;
    w->DP = w->P + np;
    w->G = w->DP + np;
    w->Hh = w->G + (1 + rk) * np;
    w->acc = acc;
    return 0;
}

static void free_bufs(bufs_t *w) {
    free(w->CS);
    free(w->acc);
}

/* The angles' cos/sin into CS, SN [np/LANES][H][LANES] and the rank products X [(1+rk)][np], Y [rq][np]
 * of row i over keys [0, jv); with dout, also DP [np] = dO_i . (P v_j) (transported values). */
static inline __attribute__((always_inline)) void row_pass_impl(const args_t *a, int64_t b, int64_t i, int64_t jv,
                                                                 bufs_t *w, const real *doi, const int64_t rk,
                                                                 const int64_t rq) {
    const int64_t np = a->np, H = a->H, d = 2 * H;
    const real pi = a->pos[b * np + i];
    const real *pj = a->pos + b * np;
    const real *qi = a->q + (b * a->n + i) * d;
    const real *wi_row = a->rates + (b * a->n + i) * H;
    const real *rT = a->ratesT + b * H * np;
    const real *KWb = a->KW + b * (a->rk + 1) * H * 2 * np;
    const real *VT = a->VT + b * H * 2 * np;
    const real *Uqi = rq ? a->Uq + (b * a->n + i) * rq * d : NULL;
    const int source = a->flags & FLAG_SOURCE;
    const int dp_tv = doi && (a->flags & FLAG_TV);
    V xa[RR_MAXR + 1], ya[RR_MAXR > 0 ? RR_MAXR : 1];
    for (int64_t j0 = 0; j0 < jv; j0 += LANES) {
        const int64_t jb = j0 / LANES;
        const real *KW = KWb + jb * (a->rk + 1) * H * 2 * LANES; /* this key block: [1+rk][H][2][LANES] */
        const V dp = pi - vld(pj + j0);
        for (int64_t t = 0; t <= rk; t++) xa[t] = vset(0);
        for (int64_t s = 0; s < rq; s++) ya[s] = vset(0);
        V dpa = vset(0);
        for (int64_t m = 0; m < H; m++) {
            const V wj = vld(rT + (jb * H + m) * LANES);
            const V phi = source ? dp * wj : dp * ((wi_row[m] + wj) * (real)0.5);
            V c, s;
            vsincos(phi, &s, &c);
            vst(w->CS + (jb * H + m) * LANES, c);
            vst(w->SN + (jb * H + m) * LANES, s);
            const real ar = qi[2 * m], ai = qi[2 * m + 1];
            const V qr = ar * c + ai * s, qim = ar * s - ai * c;
            for (int64_t t = 0; t <= rk; t++) {
                const real *wr = KW + ((t * H + m) * 2) * LANES;
                xa[t] += qr * vld(wr) - qim * vld(wr + LANES);
            }
            if (rq) {
                const V kr = vld(KW + (m * 2) * LANES), ki = vld(KW + (m * 2 + 1) * LANES);
                for (int64_t u = 0; u < rq; u++) {
                    const real ur = Uqi[u * d + 2 * m], ui = Uqi[u * d + 2 * m + 1];
                    const V sr = ur * c + ui * s, si = ur * s - ui * c;
                    ya[u] += sr * kr - si * ki;
                }
            }
            if (dp_tv) {
                const real dr = doi[2 * m], di = doi[2 * m + 1];
                const V er = dr * c + di * s, ei = dr * s - di * c;
                const real *vp = VT + ((jb * H + m) * 2) * LANES;
                dpa += er * vld(vp) - ei * vld(vp + LANES);
            }
        }
        for (int64_t t = 0; t <= rk; t++) vst(w->X + t * np + j0, xa[t]);
        for (int64_t s = 0; s < rq; s++) vst(w->Y + s * np + j0, ya[s]);
        if (dp_tv) vst(w->DP + j0, dpa);
    }
}

/* row_pass_impl with the ranks as constants for the usual ranks (its accumulators then live in
 * registers), or as variables (up to RR_MAXR) otherwise. */
static void row_pass(const args_t *a, int64_t b, int64_t i, int64_t jv, bufs_t *w, const real *doi) {
#define RR_RANKS(RK, RQ) \
    if (a->rk == RK && a->rq == RQ) return row_pass_impl(a, b, i, jv, w, doi, RK, RQ);
    RR_RANKS(0, 0) RR_RANKS(1, 0) RR_RANKS(2, 0) RR_RANKS(3, 0) RR_RANKS(4, 0)
    RR_RANKS(0, 1) RR_RANKS(0, 2) RR_RANKS(0, 4) RR_RANKS(1, 1) RR_RANKS(2, 2) RR_RANKS(4, 4)
#undef RR_RANKS
    row_pass_impl(a, b, i, jv, w, doi, a->rk, a->rq);
}

/* Scores of row i into S (keys < jn; -inf for [jn, jv)). */
static void row_scores(const args_t *a, int64_t b, int64_t i, int64_t jn, int64_t jv, bufs_t *w) {
    const int64_t np = a->np, rk = a->rk, rq = a->rq;
    real *S = w->S;
    const real *X = w->X, *Y = w->Y;
    if (a->flags & FLAG_DOT) {
        for (int64_t j = 0; j < jn; j++) S[j] = a->scale * X[j];
    } else {
        const real lam = a->lam[b], qq = a->qq[b * a->n + i];
        const real *kk = a->kk + b * np;
        for (int64_t j = 0; j < jn; j++) S[j] = lam * ((qq + kk[j]) - (real)2 * X[j]);
        for (int64_t t = 1; t <= rk; t++) {
            const real *x = X + t * np, *c = a->cK + (b * rk + t - 1) * np;
            for (int64_t j = 0; j < jn; j++) {
                real u = x[j] - c[j];
                S[j] += a->wk * (u * u);
            }
        }
        for (int64_t s = 0; s < rq; s++) {
            const real *y = Y + s * np;
            const real e = a->eQ[(b * a->n + i) * rq + s];
            for (int64_t j = 0; j < jn; j++) {
                real u = e - y[j];
                S[j] += a->wq * (u * u);
            }
        }
        const real h = (real)-0.5 * a->scale;
        for (int64_t j = 0; j < jn; j++) S[j] = h * S[j];
    }
    if (a->mask) {
        const real *mrow = a->mask + (a->mask_id[b] * a->mask_rows + (a->mask_rows > 1 ? i : 0)) * a->n;
        for (int64_t j = 0; j < jn; j++) S[j] += mrow[j];
    }
    for (int64_t j = jn; j < jv; j++) S[j] = -INFINITY;
}

/* Softmax of S into P over [0, jv) (0 past jn); returns the row maximum (-inf: the row sees no key). */
static real row_softmax(int64_t jn, int64_t jv, bufs_t *w) {
    real mx = -INFINITY;
    for (int64_t j = 0; j < jn; j++) mx = w->S[j] > mx ? w->S[j] : mx;
    if (mx == -INFINITY) return mx;
    V acc = vset(0);
    for (int64_t j0 = 0; j0 < jv; j0 += LANES) {
        V p;
        for (int l = 0; l < LANES; l++) p[l] = j0 + l < jn ? rr_exp(w->S[j0 + l] - mx) : (real)0;
        vst(w->P + j0, p);
        acc += p;
    }
    const real inv = (real)1 / vsum(acc);
    for (int64_t j0 = 0; j0 < jv; j0 += LANES) vst(w->P + j0, vld(w->P + j0) * inv);
    return mx;
}

static int64_t padded(int64_t jn) { return (jn + LANES - 1) / LANES * LANES; }

/* The gradients of one row that run over its keys (all but the products' and the scores'): the key
 * side's accumulated into dKW, dVT, dratesT, the query side's into the lane accumulators aq [H][2],
 * au [rq][H][2] and ar [H]; from the row buffers (CS, SN, G, Hh, P) that the caller filled. */
static inline __attribute__((always_inline)) void row_grads_impl(
        const args_t *a, const bufs_t *w, int64_t b, int64_t jv, const int64_t tmax, const int64_t qside, real pi,
        const real *qi, const real *doi, const real *Uqi, V *aq, V *au, V *ar, real *dKWb, real *dVTb, real *dRT) {
    const int64_t np = a->np, H = a->H, rk = a->rk, d = 2 * H;
    const int tv = a->flags & FLAG_TV, source = a->flags & FLAG_SOURCE;
    const real *KWb = a->KW + b * (1 + rk) * H * 2 * np;
    const real *VTb = a->VT + b * (tv ? H * 2 : a->dv) * np;
    const real *pj = a->pos + b * np;
    V gt[RR_MAXR + 1], hs[RR_MAXR];
    for (int64_t j0 = 0; j0 < jv; j0 += LANES) {
        for (int64_t t = 0; t <= tmax; t++) gt[t] = vld(w->G + t * np + j0);
        for (int64_t s = 0; s < qside; s++) hs[s] = vld(w->Hh + s * np + j0);
        const V p = vld(w->P + j0), dp = pi - vld(pj + j0);
        const int64_t jb = j0 / LANES;
        const real *KWj = KWb + jb * (1 + rk) * H * 2 * LANES;
        real *dKWj = dKWb + jb * (1 + rk) * H * 2 * LANES;
        for (int64_t m = 0; m < H; m++) {
            const V c = vld(w->CS + (jb * H + m) * LANES), s = vld(w->SN + (jb * H + m) * LANES);
            const real qr0 = qi[2 * m], qi0 = qi[2 * m + 1];
            const V qr = qr0 * c + qi0 * s, qim = qr0 * s - qi0 * c;
            V GR = vset(0), GI = vset(0), dphi = vset(0);
            for (int64_t t = 0; t <= tmax; t++) {
                const real *wrp = KWj + ((t * H + m) * 2) * LANES;
                real *dwp = dKWj + ((t * H + m) * 2) * LANES;
                const V wr = vld(wrp), wim = vld(wrp + LANES), g = gt[t];
                GR += g * wr;
                GI += g * wim;
                dphi -= g * (qr * wim + qim * wr);
                V dwr = g * qr, dwi = g * qim;
                if (t == 0 && qside) { /* the query side's terms in the key */
                    for (int64_t u = 0; u < qside; u++) {
                        const real ur = Uqi[u * d + 2 * m], ui = Uqi[u * d + 2 * m + 1];
                        const V sr = ur * c + ui * s, si = ur * s - ui * c, h = hs[u];
                        dwr += h * sr;
                        dwi += h * si;
                        dphi -= h * (sr * wim + si * wr);
                        au[(u * H + m) * 2] += h * (wr * c - wim * s);
                        au[(u * H + m) * 2 + 1] += h * (wr * s + wim * c);
                    }
                }
                vst(dwp, vld(dwp) + dwr);
                vst(dwp + LANES, vld(dwp + LANES) - dwi);
            }
            aq[2 * m] += GR * c - GI * s;
            aq[2 * m + 1] += GR * s + GI * c;
            if (tv) {
                const real dr = doi[2 * m], di = doi[2 * m + 1];
                const V er = dr * c + di * s, ei = dr * s - di * c;
                const real *vp = VTb + ((jb * H + m) * 2) * LANES;
                real *dvp = dVTb + ((jb * H + m) * 2) * LANES;
                const V vr = vld(vp), vi = vld(vp + LANES);
                dphi -= p * (er * vi + ei * vr);
                vst(dvp, vld(dvp) + p * er);
                vst(dvp + LANES, vld(dvp + LANES) - p * ei);
            }
            real *dw = dRT + (jb * H + m) * LANES;
            if (source) {
                vst(dw, vld(dw) + dp * dphi);
            } else {
                const V f = (dp * dphi) * (real)0.5;
                vst(dw, vld(dw) + f);
                ar[m] += f;
            }
        }
    }
}

static void row_grads(const args_t *a, const bufs_t *w, int64_t b, int64_t jv, int64_t tmax, int64_t qside, real pi,
                      const real *qi, const real *doi, const real *Uqi, V *aq, V *au, V *ar, real *dKWb, real *dVTb,
                      real *dRT) {
#define RR_RANKS(T, Q) \
    if (tmax == T && qside == Q) return row_grads_impl(a, w, b, jv, T, Q, pi, qi, doi, Uqi, aq, au, ar, dKWb, dVTb, dRT);
    RR_RANKS(0, 0) RR_RANKS(1, 0) RR_RANKS(2, 0) RR_RANKS(3, 0) RR_RANKS(4, 0)
    RR_RANKS(0, 1) RR_RANKS(0, 2) RR_RANKS(0, 4) RR_RANKS(1, 1) RR_RANKS(2, 2) RR_RANKS(4, 4)
#undef RR_RANKS
    row_grads_impl(a, w, b, jv, tmax, qside, pi, qi, doi, Uqi, aq, au, ar, dKWb, dVTb, dRT);
}

/* Rows [b0, b1) of the batch.  out [B, n, dv]; seen [B, n] = 1 where the row sees a key (its
 * output is 0 otherwise).  Returns 0, or -1 when out of memory. */
int rr_content_forward(int64_t b0, int64_t b1, int64_t n, int64_t np, int64_t H, int64_t rk, int64_t rq,
                       int64_t dv, const real *q, const real *KW, const real *Uq, const real *VT,
                       const real *rates, const real *ratesT, const real *pos, const real *lam, const real *qq,
                       const real *kk, const real *cK, const real *eQ, const real *mask, const int64_t *mask_id,
                       int64_t mask_rows, double scale, double wk, double wq, int flags, real *out, real *seen) {
    args_t a = {n, np, H, rk, rq, dv, q, KW, Uq, VT, rates, ratesT, pos, lam, qq, kk, cK, eQ, mask, mask_id,
                mask_rows, (real)scale, (real)wk, (real)wq, flags};
    bufs_t w;
    if (alloc_bufs(&w, &a)) return -1;
    const int tv = flags & FLAG_TV;
    for (int64_t b = b0; b < b1; b++) {
        const real *VTb = VT + b * (tv ? H * 2 : dv) * np;
        for (int64_t i = 0; i < n; i++) {
            const int64_t jn = (flags & FLAG_CAUSAL) ? i + 1 : n, jv = padded(jn);
            real *o = out + (b * n + i) * dv;
            row_pass(&a, b, i, jv, &w, NULL);
            row_scores(&a, b, i, jn, jv, &w);
            if (row_softmax(jn, jv, &w) == -INFINITY) { /* sees no key */
                seen[b * n + i] = 0;
                memset(o, 0, sizeof(real) * (size_t)dv);
                continue;
            }
            seen[b * n + i] = 1;
            if (tv) {
                V *acc = w.acc; /* [H][2], in L1 */
                for (int64_t m = 0; m < 2 * H; m++) acc[m] = vset(0);
                for (int64_t j0 = 0; j0 < jv; j0 += LANES) { /* block by block: contiguous reads */
                    const int64_t jb = j0 / LANES;
                    const V p = vld(w.P + j0);
                    const real *cs = w.CS + jb * H * LANES, *sn = w.SN + jb * H * LANES;
                    const real *vb = VTb + jb * H * 2 * LANES;
                    for (int64_t m = 0; m < H; m++) {
                        const V c = vld(cs + m * LANES), s = vld(sn + m * LANES);
                        const V r = vld(vb + 2 * m * LANES), im = vld(vb + (2 * m + 1) * LANES);
                        acc[2 * m] += p * (c * r - s * im);
                        acc[2 * m + 1] += p * (s * r + c * im);
                    }
                }
                for (int64_t m = 0; m < 2 * H; m++) o[m] = vsum(acc[m]);
            } else {
                V *acc = w.acc; /* [dv], in L1; block by block: contiguous reads */
                for (int64_t c = 0; c < dv; c++) acc[c] = vset(0);
                for (int64_t j0 = 0; j0 < jv; j0 += LANES) {
                    const V p = vld(w.P + j0);
                    const real *vb = VTb + (j0 / LANES) * dv * LANES;
                    for (int64_t c = 0; c < dv; c++) acc[c] += p * vld(vb + c * LANES);
                }
                for (int64_t c = 0; c < dv; c++) o[c] = vsum(acc[c]);
            }
        }
    }
    free_bufs(&w);
    return 0;
}

/* Gradients of rows [b0, b1), accumulated into the zero-initialised outputs:
 * dq [B, n, d], dKW (layout of KW), dUq [B, n, rq, d], dVT (layout of VT),
 * drates [B, n, H] (the query's rate), dratesT (layout of ratesT: the key's rate),
 * dlam [B], dqq [B, n], dkk [B, np], dcK [B, rk, np], deQ [B, n, rq]. */
int rr_content_backward(int64_t b0, int64_t b1, int64_t n, int64_t np, int64_t H, int64_t rk, int64_t rq,
                        int64_t dv, const real *q, const real *KW, const real *Uq, const real *VT,
                        const real *rates, const real *ratesT, const real *pos, const real *lam, const real *qq,
                        const real *kk, const real *cK, const real *eQ, const real *mask,
                        const int64_t *mask_id, int64_t mask_rows, double scale, double wk, double wq, int flags,
                        const real *out, const real *seen, const real *dout, real *dq, real *dKW, real *dUq,
                        real *dVT, real *drates, real *dratesT, real *dlam, real *dqq, real *dkk, real *dcK,
                        real *deQ) {
    args_t a = {n, np, H, rk, rq, dv, q, KW, Uq, VT, rates, ratesT, pos, lam, qq, kk, cK, eQ, mask, mask_id,
                mask_rows, (real)scale, (real)wk, (real)wq, flags};
    bufs_t w;
    if (alloc_bufs(&w, &a)) return -1;
    const int tv = flags & FLAG_TV, dot = flags & FLAG_DOT, source = flags & FLAG_SOURCE;
    const int64_t d = 2 * H, tmax = dot ? 0 : rk, qside = dot ? 0 : rq;
    for (int64_t b = b0; b < b1; b++) {
        real *dKWb = dKW + b * (1 + rk) * H * 2 * np;
        const real *VTb = VT + b * (tv ? H * 2 : dv) * np;
        real *dVTb = dVT + b * (tv ? H * 2 : dv) * np;
        real *dRT = dratesT + b * H * np;
        real dlam_b = 0;
        for (int64_t i = 0; i < n; i++) {
            if (seen[b * n + i] == 0) continue; /* a row that sees no key: no gradient */
            const int64_t jn = (flags & FLAG_CAUSAL) ? i + 1 : n, jv = padded(jn);
            const real *qi = q + (b * n + i) * d, *doi = dout + (b * n + i) * dv, *oi = out + (b * n + i) * dv;
            const real *Uqi = rq ? Uq + (b * n + i) * rq * d : NULL;
            const real pi = pos[b * np + i];
            real Dsum = 0;
            for (int64_t c = 0; c < dv; c++) Dsum += doi[c] * oi[c];
            row_pass(&a, b, i, jv, &w, doi);
            if (!tv) { /* dP_ij = dO_i . v_j */
                for (int64_t j0 = 0; j0 < jv; j0 += LANES) {
                    V acc = vset(0);
                    for (int64_t c = 0; c < dv; c++) acc += doi[c] * vld(VTb + ((j0 / LANES) * dv + c) * LANES);
                    vst(w.DP + j0, acc);
                }
            }
            row_scores(&a, b, i, jn, jv, &w);
            row_softmax(jn, jv, &w); /* the probabilities exactly as the forward made them */
            real *dS = w.S;
            for (int64_t j = 0; j < jv; j++) dS[j] = w.P[j] * (w.DP[j] - Dsum); /* 0 past jn */
            if (dot) {
                for (int64_t j = 0; j < jv; j++) w.G[j] = a.scale * dS[j];
            } else {
                const real lm = lam[b], qqi = qq[b * n + i], h = (real)-0.5 * a.scale;
                const real *kkb = kk + b * np;
                real *dkkb = dkk + b * np;
                real dqq_i = 0;
                for (int64_t j = 0; j < jv; j++) {
                    real dd = h * dS[j]; /* the gradient of dist2 */
                    dS[j] = dd;
                    w.G[j] = (real)-2 * lm * dd;
                }
                for (int64_t j = 0; j < jn; j++) {
                    dlam_b += dS[j] * ((qqi + kkb[j]) - (real)2 * w.X[j]);
                    dqq_i += lm * dS[j];
                    dkkb[j] += lm * dS[j];
                }
                dqq[b * n + i] += dqq_i;
                for (int64_t t = 1; t <= rk; t++) {
                    const real *x = w.X + t * np, *c = cK + (b * rk + t - 1) * np;
                    real *g = w.G + t * np, *dc = dcK + (b * rk + t - 1) * np;
                    for (int64_t j = 0; j < jv; j++) {
                        g[j] = (real)2 * a.wk * (x[j] - c[j]) * dS[j];
                        dc[j] -= g[j];
                    }
                }
                for (int64_t s = 0; s < rq; s++) {
                    const real *y = w.Y + s * np;
                    const real e = eQ[(b * n + i) * rq + s];
                    real *hs = w.Hh + s * np;
                    real de = 0;
                    for (int64_t j = 0; j < jv; j++) {
                        hs[j] = (real)-2 * a.wq * (e - y[j]) * dS[j];
                        de -= hs[j];
                    }
                    deQ[(b * n + i) * rq + s] += de;
                }
            }
            if (!tv) { /* dv_j += A_ij dO_i */
                for (int64_t j0 = 0; j0 < jv; j0 += LANES) {
                    const V p = vld(w.P + j0);
                    real *dvb = dVTb + (j0 / LANES) * dv * LANES;
                    for (int64_t c = 0; c < dv; c++) vst(dvb + c * LANES, vld(dvb + c * LANES) + p * doi[c]);
                }
            }
            /* accumulators over keys: dq [H][2], dUq [rq][H][2], the query's rate [H] */
            V *aq = w.acc, *au = aq + 2 * H, *ar = au + 2 * rq * H;
            for (int64_t m = 0; m < 3 * H + 2 * rq * H; m++) aq[m] = vset(0);
            row_grads(&a, &w, b, jv, tmax, qside, pi, qi, doi, Uqi, aq, au, ar, dKWb, dVTb, dRT);
            for (int64_t m = 0; m < d; m++) dq[(b * n + i) * d + m] += vsum(aq[m]);
            for (int64_t u = 0; u < qside; u++)
                for (int64_t m = 0; m < d; m++) dUq[((b * n + i) * rq + u) * d + m] += vsum(au[u * d + m]);
            if (!source)
                for (int64_t m = 0; m < H; m++) drates[(b * n + i) * H + m] += vsum(ar[m]);
        }
        dlam[b] += dlam_b;
    }
    free_bufs(&w);
    return 0;
}
