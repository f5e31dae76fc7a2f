/* The fused CPU step of poodle.solvers._optim.fit_weighted_distance: every Adam step of one
 * episode reads each of its rows once (logits, softmax, loss weights and the gradient accumulation
 * of a block of rows while the block sits in L1), instead of two batched matmuls that each stream
 * all rows and that BLAS runs at a third of its large-GEMM rate for 5-row operands.
 *
 * The arithmetic is the one documented in _optim.py (same formulas, same Adam, same order of the
 * per-row operations); only the summation order of the dot products differs from BLAS, so results
 * agree with the torch path to float rounding. Episodes are solved one after another, each with
 * its own buffers, so an episode's numbers never depend on the chunk it came in.
 *
 * Compiled at first use by poodle/solvers/_native.py (plain C99 + GCC/Clang vector extensions, no
 * Python or torch headers) and called through ctypes, which releases the GIL: the chunk workers
 * run it in parallel. This file is compiled twice over (float and double) by including itself. */
#ifndef REAL
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define KB 5 /* classes per register block */
#define RB 8 /* rows per block: 8 rows of D = 640 floats stay in L1 between the two passes */
#define GB 2 /* blocks per G X pass: each pass loads and stores GX once, so 2 blocks halve that traffic
                (5-7% faster per step measured; 3-6 blocks gained nothing more) */
#define SMALL_D 256 /* up to this D, dot products from the transposed rows (dots_t) */

int wd_kernel_version(void) { return 1; }

#define REAL float
#define SUF _f32
#define EXPR expf
#define IS_FLOAT 1
#define SQRTR sqrtf
#include __FILE__
#undef REAL
#undef SUF
#undef EXPR
#undef IS_FLOAT
#undef SQRTR
#define REAL double
#define SUF _f64
#define EXPR exp
#define IS_FLOAT 0
#define SQRTR sqrt
#include __FILE__
#undef REAL
#undef SUF
#undef EXPR
#undef IS_FLOAT
#undef SQRTR

#else /* the body, once per REAL */

#define V CAT(vec, SUF)
#define VL ((int)(32 / sizeof(REAL)))
typedef REAL V __attribute__((vector_size(32)));

static inline V CAT(ld, SUF)(const REAL *p) {
    V v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void CAT(st, SUF)(REAL *p, V v) { memcpy(p, &v, sizeof v); }
static inline REAL CAT(hsum, SUF)(V v) {
    REAL s = 0;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* out[r][k] = x_r . w_k for two rows and KB classes (W rows ldw apart, zero-padded to KB). */
static void CAT(dots, SUF)(const REAL *x0, const REAL *x1, const REAL *W, long ldw, int D, REAL out[2][KB]) {
    V acc0[KB], acc1[KB];
    for (int k = 0; k < KB; k++) acc0[k] = acc1[k] = (V){0};
    int Dv = D - D % VL;
    for (int d = 0; d < Dv; d += VL) {
        V a = CAT(ld, SUF)(x0 + d), b = CAT(ld, SUF)(x1 + d);
#pragma GCC unroll 8
        for (int k = 0; k < KB; k++) {
            V w = CAT(ld, SUF)(W + k * ldw + d);
            acc0[k] += w * a;
            acc1[k] += w * b;
        }
    }
    for (int k = 0; k < KB; k++) {
        REAL s0 = CAT(hsum, SUF)(acc0[k]), s1 = CAT(hsum, SUF)(acc1[k]);
        for (int d = Dv; d < D; d++) {
            s0 += W[k * ldw + d] * x0[d];
            s1 += W[k * ldw + d] * x1[d];
        }
        out[0][k] = s0;
        out[1][k] = s1;
    }
}

/* out[k][0..nr) = x_r . w_k for nr rows (a multiple of RB) and KB classes, from the rows stored
 * transposed (xt[d * ldx + r]): lanes are rows, so no horizontal sums. For small D, where the
 * horizontal sums of the row-major version cost as much as the products. Two vectors of rows per
 * pass: with one, the KB accumulators are fewer than the FMAs in flight (latency-bound) and every
 * broadcast of W serves one FMA; the sums themselves (over d, in order, per lane) are the same. */
static void CAT(dots_t, SUF)(const REAL *xt, long ldx, const REAL *W, long ldw, int D, REAL *out, long ldo, long nr) {
    long l = 0;
    for (; l + 2 * VL <= nr; l += 2 * VL) {
        V acc0[KB], acc1[KB];
        for (int k = 0; k < KB; k++) acc0[k] = acc1[k] = (V){0};
        for (int d = 0; d < D; d++) {
            V x0 = CAT(ld, SUF)(xt + (long)d * ldx + l), x1 = CAT(ld, SUF)(xt + (long)d * ldx + l + VL);
#pragma GCC unroll 8
            for (int k = 0; k < KB; k++) {
                REAL w = W[k * ldw + d];
                acc0[k] += w * x0;
                acc1[k] += w * x1;
            }
        }
        for (int k = 0; k < KB; k++) {
            CAT(st, SUF)(out + k * ldo + l, acc0[k]);
            CAT(st, SUF)(out + k * ldo + l + VL, acc1[k]);
        }
    }
    for (; l < nr; l += VL) {
        V acc[KB];
        for (int k = 0; k < KB; k++) acc[k] = (V){0};
        for (int d = 0; d < D; d++) {
            V xv = CAT(ld, SUF)(xt + (long)d * ldx + l);
#pragma GCC unroll 8
            for (int k = 0; k < KB; k++) acc[k] += W[k * ldw + d] * xv;
        }
        for (int k = 0; k < KB; k++) CAT(st, SUF)(out + k * ldo + l, acc[k]);
    }
}

/* GX[k] += sum_b g[b][k] x_b for nb rows and KB classes starting at class kg (GX rows ldw apart). */
static void CAT(accum, SUF)(const REAL *const *xr, int nb, const REAL *g, int ldg, REAL *GX, long ldw, int D) {
    int d = 0;
    for (; d + 2 * VL <= D; d += 2 * VL) {
        V a0[KB], a1[KB];
        for (int k = 0; k < KB; k++) {
            a0[k] = CAT(ld, SUF)(GX + k * ldw + d);
            a1[k] = CAT(ld, SUF)(GX + k * ldw + d + VL);
        }
        for (int b = 0; b < nb; b++) {
            V x0 = CAT(ld, SUF)(xr[b] + d), x1 = CAT(ld, SUF)(xr[b] + d + VL);
#pragma GCC unroll 8
            for (int k = 0; k < KB; k++) {
                REAL gk = g[k * ldg + b];
                a0[k] += gk * x0;
                a1[k] += gk * x1;
            }
        }
        for (int k = 0; k < KB; k++) {
            CAT(st, SUF)(GX + k * ldw + d, a0[k]);
            CAT(st, SUF)(GX + k * ldw + d + VL, a1[k]);
        }
    }
    for (; d < D; d++)
        for (int k = 0; k < KB; k++) {
            REAL a = GX[k * ldw + d];
            for (int b = 0; b < nb; b++) a += g[k * ldg + b] * xr[b][d];
            GX[k * ldw + d] = a;
        }
}

/* torch.optim.Adam (its single-tensor path), operation for operation, on p[0..N). */
static void CAT(adam, SUF)(REAL *restrict m, REAL *restrict v, const REAL *restrict grad, REAL *restrict p, long N,
                           REAL omb1, REAL b2, REAL omb2, REAL bc2s, REAL eps, REAL step_size) {
    for (long j = 0; j < N; j++) {
        REAL g = grad[j];
        m[j] = m[j] + omb1 * (g - m[j]);
        v[j] = v[j] * b2 + omb2 * g * g;
        REAL den = SQRTR(v[j]) / bc2s + eps;
        p[j] += -step_size * (m[j] / den);
    }
}
#define Adam CAT(adam, SUF)

/* Adam step number ``step`` (from 1) on the F prototype values W and, with learn_scale, the scale
 * (the moments' and the gradient's element F), as torch.optim.Adam with both as parameters. */
static void CAT(adam_step, SUF)(REAL *m, REAL *v, const REAL *grad, REAL *W, REAL *gamma, long F, int step, double lr,
                                double b1, double b2, double eps, int learn_scale) {
    const REAL omb1 = (REAL)(1.0 - b1), rb2 = (REAL)b2, omb2 = (REAL)(1.0 - b2), reps = (REAL)eps;
    double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
    REAL step_size = (REAL)(lr / bc1), bc2s = (REAL)sqrt(bc2);
    Adam(m, v, grad, W, F, omb1, rb2, omb2, bc2s, reps, step_size);
    if (learn_scale) {
        REAL g1 = *gamma;
        Adam(m + F, v + F, grad + F, &g1, 1, omb1, rb2, omb2, bc2s, reps, step_size);
        *gamma = g1;
    }
}

/* lane-wise max(a, b) (C has no vector ?:) */
static inline V CAT(vmax, SUF)(V a, V b) {
#if IS_FLOAT
    typedef int VM __attribute__((vector_size(32)));
#else
    typedef long long VM __attribute__((vector_size(32)));
#endif
    VM mask = a > b, ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

#if IS_FLOAT
/* exp of 8 floats at once: Cephes' expf (range reduction by ln 2, degree-6 polynomial, 2^n put in
 * the exponent bits), within 2 ulp of expf; arguments here are <= 0 (logits minus their maximum). */
static inline V CAT(vexp, SUF)(V x) {
    typedef int VI __attribute__((vector_size(32)));
    const V lo = (V){0} - (REAL)87.3f;
    x = CAT(vmax, SUF)(x, lo);
    V fx = x * (REAL)1.44269504088896341f + (REAL)0.5f;
    VI i = __builtin_convertvector(fx, VI);
    V fi = __builtin_convertvector(i, V);
    VI gt = fi > fx; /* -1 where truncation rounded up: floor */
    i += gt;
    fi = __builtin_convertvector(i, V);
    V r = x - fi * (REAL)0.693359375f;
    r = r - fi * (REAL)-2.12194440e-4f;
    V p = (V){0} + (REAL)1.9875691500E-4f;
    p = p * r + (REAL)1.3981999507E-3f;
    p = p * r + (REAL)8.3334519073E-3f;
    p = p * r + (REAL)4.1665795894E-2f;
    p = p * r + (REAL)1.6666665459E-1f;
    p = p * r + (REAL)5.0000001201E-1f;
    V y = p * r * r + r + (REAL)1.0f;
    VI bits = (i + 127) << 23;
    V scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}
#else
static inline V CAT(vexp, SUF)(V x) {
    for (int l = 0; l < VL; l++) x[l] = exp(x[l]);
    return x;
}
#endif

#if IS_FLOAT
/* log of 8 positive normal floats: Cephes' logf (x = m 2^e with m in [sqrt(1/2), sqrt(2)), a
 * degree-9 polynomial in m - 1), within 1-2 ulp of logf. */
static inline V CAT(vlog, SUF)(V x) {
    typedef int VI __attribute__((vector_size(32)));
    const V one = (V){0} + (REAL)1.0f;
    VI bits;
    memcpy(&bits, &x, sizeof x);
    VI e = ((bits >> 23) & 0xff) - 126;
    bits = (bits & 0x807fffff) | 0x3f000000;
    V mant; /* in [0.5, 1) */
    memcpy(&mant, &bits, sizeof mant);
    VI low = mant < (V){0} + (REAL)0.707106781186547524f; /* -1 there: use 2m, e - 1 */
    e += low;
    VI mb;
    memcpy(&mb, &mant, sizeof mb);
    mb &= low;
    V extra;
    memcpy(&extra, &mb, sizeof extra);
    V f = mant - one + extra;
    V fe = __builtin_convertvector(e, V);
    V z = f * f;
    V y = (V){0} + (REAL)7.0376836292E-2f;
    y = y * f - (REAL)1.1514610310E-1f;
    y = y * f + (REAL)1.1676998740E-1f;
    y = y * f - (REAL)1.2420140846E-1f;
    y = y * f + (REAL)1.4249322787E-1f;
    y = y * f - (REAL)1.6668057665E-1f;
    y = y * f + (REAL)2.0000714765E-1f;
    y = y * f - (REAL)2.4999993993E-1f;
    y = y * f + (REAL)3.3333331174E-1f;
    y = y * f * z;
    y += fe * (REAL)-2.12194440e-4f;
    y += z * (REAL)-0.5f;
    f = f + y;
    f += fe * (REAL)0.693359375f;
    return f;
}
#else
static inline V CAT(vlog, SUF)(V x) {
    for (int l = 0; l < VL; l++) x[l] = log(x[l]);
    return x;
}
#endif

/* Fit E episodes; see fit_weighted_distance in _optim.py for the loss and the argument shapes.
 * x [E, n, D]; targets [E, K, n] (or shared: estride 0); r, free [E, n] (free may be NULL);
 * c0 [E]; W [E, K, D] in: w0, out: fitted; gamma [E] in: gamma0, out: fitted.
 * Returns 0, or -1 when a buffer cannot be allocated. */
int CAT(wd_fit, SUF)(int E, int n, int D, int K, const REAL *x, const REAL *targets, long t_es, const REAL *r,
                     long r_es, const REAL *free_, long f_es, const REAL *c0, REAL *Wout, REAL *gamma_out,
                     int steps, double lr, double b1, double b2, double eps, int learn_scale) {
    int Kp = (K + KB - 1) / KB * KB;
    long F = (long)K * D;
    /* padded prototypes, their gradient accumulator, Adam moments (K*D + 1 each: the scale last) */
    REAL *Wp = calloc((size_t)Kp * D, sizeof(REAL));
    REAL *GX = calloc((size_t)Kp * D, sizeof(REAL));
    REAL *m = calloc((size_t)F + 1, sizeof(REAL));
    REAL *v = calloc((size_t)F + 1, sizeof(REAL));
    REAL *grad = calloc((size_t)F + 1, sizeof(REAL));
    REAL *w2 = calloc((size_t)Kp, sizeof(REAL));
    /* one block of rows, class-major ([class][row]) so that the per-row work runs across rows in
     * vector lanes: x.w (then dL/dlogits), x.w - |w|^2/2, logits, targets */
    REAL *ST = calloc((size_t)Kp * RB, sizeof(REAL));
    REAL *ZT = calloc((size_t)Kp * RB, sizeof(REAL));
    REAL *LT = calloc((size_t)Kp * RB, sizeof(REAL));
    REAL *TT = calloc((size_t)Kp * RB, sizeof(REAL));
    /* per-lane partial sums over rows: column sums of dL/dlogits [class][lane], then dL/dgamma */
    REAL *acc = calloc((size_t)(Kp + 1) * RB, sizeof(REAL));
    /* dL/dlogits of GB consecutive blocks, class-major ([class][row]), for one G X pass */
    REAL *G2 = calloc((size_t)Kp * GB * RB, sizeof(REAL));
    /* small D: the episode's rows also stored transposed, padded to whole blocks (read by dots_t) */
    int small = D <= SMALL_D;
    long np = (long)(n + RB - 1) / RB * RB;
    REAL *XT = small ? calloc((size_t)np * D, sizeof(REAL)) : NULL;
    /* small D: x.w of all the episode's rows, computed before the block loop ([class][row]) */
    REAL *SA = small ? calloc((size_t)Kp * np, sizeof(REAL)) : NULL;
    REAL rr[RB], ff[RB];
    int ok = Wp && GX && m && v && grad && w2 && ST && ZT && LT && TT && acc && G2 && (!small || (XT && SA));
    for (int e = 0; ok && e < E; e++) {
        const REAL *xe = x + (long)e * n * D, *te = targets + e * t_es, *re = r + e * r_es;
        const REAL *fe = free_ ? free_ + e * f_es : NULL;
        REAL *We = Wout + (long)e * F;
        REAL gamma = gamma_out[e];
        if (small)
            for (int i = 0; i < n; i++)
                for (int d = 0; d < D; d++) XT[(long)d * np + i] = xe[(long)i * D + d];
        for (int k = 0; k < K; k++) memcpy(Wp + (long)k * D, We + (long)k * D, sizeof(REAL) * D);
        memset(m, 0, sizeof(REAL) * (F + 1));
        memset(v, 0, sizeof(REAL) * (F + 1));
        for (int step = 1; step <= steps; step++) {
            for (int k = 0; k < K; k++) {
                REAL o[2][KB];
                CAT(dots, SUF)(Wp + (long)k * D, Wp + (long)k * D, Wp + (long)k * D, 0, D, o);
                w2[k] = o[0][0];
            }
            memset(GX, 0, sizeof(REAL) * Kp * D);
            if (small)
                for (int kg = 0; kg < Kp; kg += KB)
                    CAT(dots_t, SUF)(XT, np, Wp + (long)kg * D, D, D, SA + (long)kg * np, np, np);
            memset(acc, 0, sizeof(REAL) * (Kp + 1) * RB);
            int nb2 = 0; /* rows gathered for the next G X pass */
            const REAL *xr2[GB * RB];
            for (int i0 = 0; i0 < n; i0 += RB) {
                int nb = n - i0 < RB ? n - i0 : RB;
                const REAL *xr[RB];
                for (int b = 0; b < RB; b++) xr[b] = xe + (long)(i0 + (b < nb ? b : nb - 1)) * D;
                if (small)
                    for (int k = 0; k < Kp; k++) memcpy(ST + k * RB, SA + (long)k * np + i0, sizeof(REAL) * RB);
                else
                for (int b = 0; b < nb; b += 2)
                    for (int kg = 0; kg < Kp; kg += KB) {
                        REAL o[2][KB];
                        CAT(dots, SUF)(xr[b], xr[b + 1 < nb ? b + 1 : b], Wp + (long)kg * D, D, D, o);
                        for (int k = 0; k < KB; k++) {
                            ST[(kg + k) * RB + b] = o[0][k];
                            ST[(kg + k) * RB + b + 1] = o[1][k]; /* b + 1 < RB: RB is even */
                        }
                    }
                /* rows past the end of the episode carry zero weights: they add nothing */
                for (int b = 0; b < RB; b++) {
                    int ok_row = b < nb;
                    rr[b] = ok_row ? re[i0 + b] : 0;
                    ff[b] = ok_row && fe ? fe[i0 + b] : 0;
                    for (int k = 0; k < K; k++) {
                        TT[k * RB + b] = ok_row ? te[(long)k * n + i0 + b] : 0;
                        if (!ok_row) ST[k * RB + b] = 0;
                    }
                }
                /* logits, softmax over classes and dL/dlogits, VL rows at a time */
                for (int l = 0; l < RB; l += VL) {
#define AT(buf, k) CAT(ld, SUF)((buf) + (k) * RB + l)
                    V mx, sum = (V){0}, lbar = (V){0}, rv = CAT(ld, SUF)(rr + l), fv = CAT(ld, SUF)(ff + l);
                    for (int k = 0; k < K; k++) {
                        V z = AT(ST, k) - (REAL)0.5 * w2[k];
                        V lg = z * gamma;
                        CAT(st, SUF)(ZT + k * RB + l, z);
                        CAT(st, SUF)(LT + k * RB + l, lg);
                        mx = k == 0 ? lg : CAT(vmax, SUF)(lg, mx);
                    }
                    for (int k = 0; k < K; k++) {
                        V p = CAT(vexp, SUF)(AT(LT, k) - mx);
                        sum += p;
                        CAT(st, SUF)(ST + k * RB + l, p);
                    }
                    for (int k = 0; k < K; k++) {
                        V p = AT(ST, k) / sum;
                        CAT(st, SUF)(ST + k * RB + l, p);
                        if (fe) lbar += p * AT(LT, k);
                    }
                    V gg = CAT(ld, SUF)(acc + Kp * RB + l);
                    for (int k = 0; k < K; k++) {
                        V p = AT(ST, k);
                        V g = p * rv - AT(TT, k);
                        if (fe) g += (p * (AT(LT, k) - lbar)) * fv;
                        CAT(st, SUF)(ST + k * RB + l, g);
                        gg += g * AT(ZT, k);
                        CAT(st, SUF)(acc + k * RB + l, AT(acc, k) + g);
                    }
                    CAT(st, SUF)(acc + Kp * RB + l, gg);
#undef AT
                }
                for (int k = K; k < Kp; k++) memset(ST + k * RB, 0, sizeof(REAL) * RB);
                /* G X every GB blocks: the same products added in the same row order as block by block,
                 * so the result is bit for bit the same */
                int slot = (i0 / RB) % GB;
                for (int k = 0; k < Kp; k++) memcpy(G2 + k * GB * RB + slot * RB, ST + k * RB, sizeof(REAL) * RB);
                for (int b = 0; b < RB; b++) xr2[slot * RB + b] = xr[b];
                nb2 += nb;
                if (slot == GB - 1 || i0 + RB >= n) {
                    for (int kg = 0; kg < Kp; kg += KB)
                        CAT(accum, SUF)(xr2, nb2, G2 + kg * GB * RB, GB * RB, GX + (long)kg * D, D, D);
                    nb2 = 0;
                }
            }
            REAL gg = 0;
            for (int b = 0; b < RB; b++) gg += acc[Kp * RB + b];
            for (int k = 0; k < K; k++) {
                REAL colsum = 0;
                for (int b = 0; b < RB; b++) colsum += acc[k * RB + b];
                for (int d = 0; d < D; d++) {
                    long j = (long)k * D + d;
                    grad[j] = (GX[j] - Wp[j] * colsum) * gamma;
                }
            }
            grad[F] = learn_scale ? gg - c0[e] : 0;
            CAT(adam_step, SUF)(m, v, grad, Wp, &gamma, F, step, lr, b1, b2, eps, learn_scale);
        }
        memcpy(We, Wp, sizeof(REAL) * F);
        gamma_out[e] = gamma;
    }
    free(Wp);
    free(GX);
    free(m);
    free(v);
    free(grad);
    free(w2);
    free(ST);
    free(ZT);
    free(LT);
    free(TT);
    free(acc);
    free(G2);
    free(XT);
    free(SA);
    return ok ? 0 : -1;
}
/* The logit losses of poodle.solvers._optim.fit_logit_loss (TIM-GD, entropy minimisation): Adam on
 * the prototypes (and the scale) of E episodes for a loss of the logits l_ik = gamma (x_i.w_k -
 * |w_k|^2/2) of the Ns support rows and the n - Ns query rows. The support rows carry w_ce times
 * their mean cross-entropy; the query rows, for loss 0 (TIM), -(w_2 H(mean_q p) - w_3 mean_q H(p))
 * with H(p) taken of p + 1e-12 and the marginal's log of max(p, 1e-30) (tim_gd.grad_logits), for
 * loss 1 (entropy minimisation), w_2 mean_q H(p) with log p from log-softmax (entropy_min).
 *
 * An episode is small (80-100 rows of D = 64 at 5 classes: 25 KiB), so one step handles all of it
 * at once: the logits of every row ([class][row], rows in vector lanes), the probabilities, the
 * marginal over the queries, dL/dlogits, then G X. The formulas are those of the torch
 * formulation; the summation orders (dot products, sums over rows) and exp/log are this file's,
 * so results agree with it to float rounding.
 * x [E, n, D]; yt [E, K, Ns] one-hot support targets; W [E, K, D] in: w0, out: fitted; gamma [E]
 * in: gamma0, out: fitted. Returns 0, or -1 when a buffer cannot be allocated. */
int CAT(lf_fit, SUF)(int E, int Ns, int n, int D, int K, const REAL *x, const REAL *yt, REAL *Wout, REAL *gamma_out,
                     int steps, double lr, double b1, double b2, double eps, int learn_scale, int loss, double w_ce,
                     double w_2, double w_3) {
    int Kp = (K + KB - 1) / KB * KB, Nq = n - Ns;
    long F = (long)K * D, np = (long)(n + RB - 1) / RB * RB;
    REAL *Wp = calloc((size_t)Kp * D, sizeof(REAL));
    REAL *GX = calloc((size_t)Kp * D, sizeof(REAL));
    REAL *m = calloc((size_t)F + 1, sizeof(REAL));
    REAL *v = calloc((size_t)F + 1, sizeof(REAL));
    REAL *grad = calloc((size_t)F + 1, sizeof(REAL));
    REAL *w2 = calloc((size_t)Kp, sizeof(REAL));
    REAL *XT = calloc((size_t)np * D, sizeof(REAL)); /* the rows transposed, zero past n */
    REAL *SA = calloc((size_t)Kp * np, sizeof(REAL)); /* x.w, then p */
    REAL *ZA = calloc((size_t)Kp * np, sizeof(REAL)); /* x.w - |w|^2/2 */
    REAL *LA = calloc((size_t)Kp * np, sizeof(REAL)); /* logits, then (loss 1) log p */
    REAL *GA = calloc((size_t)Kp * np, sizeof(REAL)); /* dL/dlogits, zero for padded classes and rows */
    REAL *u = calloc((size_t)Kp, sizeof(REAL));
    const REAL **xr = calloc((size_t)n + 1, sizeof(REAL *));
    int ok = Wp && GX && m && v && grad && w2 && XT && SA && ZA && LA && GA && u && xr;
    const REAL ce_s = (REAL)(w_ce / Ns), rw2 = (REAL)w_2, rw3 = (REAL)w_3, rNq = (REAL)Nq;
    const REAL tiny = (REAL)1e-30, ceps = (REAL)1e-12;
    for (int e = 0; ok && e < E; e++) {
        const REAL *xe = x + (long)e * n * D, *ye = yt + (long)e * K * Ns;
        REAL *We = Wout + (long)e * F;
        REAL gamma = gamma_out[e];
        for (int i = 0; i < n; i++) {
            xr[i] = xe + (long)i * D;
            for (int d = 0; d < D; d++) XT[(long)d * np + i] = xe[(long)i * D + d];
        }
        for (int k = 0; k < K; k++) memcpy(Wp + (long)k * D, We + (long)k * D, sizeof(REAL) * D);
        memset(m, 0, sizeof(REAL) * (F + 1));
        memset(v, 0, sizeof(REAL) * (F + 1));
        for (int step = 1; step <= steps; step++) {
            for (int k = 0; k < K; k++) {
                REAL o[2][KB];
                CAT(dots, SUF)(Wp + (long)k * D, Wp + (long)k * D, Wp + (long)k * D, 0, D, o);
                w2[k] = o[0][0];
            }
            for (int kg = 0; kg < Kp; kg += KB)
                CAT(dots_t, SUF)(XT, np, Wp + (long)kg * D, D, D, SA + (long)kg * np, np, np);
            /* logits and softmax over classes, VL rows at a time */
            for (long l = 0; l < np; l += VL) {
#define AT(buf, k) CAT(ld, SUF)((buf) + (long)(k) * np + l)
#define PUT(buf, k, val) CAT(st, SUF)((buf) + (long)(k) * np + l, (val))
                V mx, sum = (V){0};
                for (int k = 0; k < K; k++) {
                    V z = AT(SA, k) - (REAL)0.5 * w2[k];
                    V lg = z * gamma;
                    PUT(ZA, k, z);
                    PUT(LA, k, lg);
                    mx = k == 0 ? lg : CAT(vmax, SUF)(lg, mx);
                }
                for (int k = 0; k < K; k++) {
                    V q = CAT(vexp, SUF)(AT(LA, k) - mx);
                    sum += q;
                    PUT(SA, k, q);
                }
                for (int k = 0; k < K; k++) PUT(SA, k, AT(SA, k) / sum);
                if (loss == 1) {
                    V ls = CAT(vlog, SUF)(sum);
                    for (int k = 0; k < K; k++) PUT(LA, k, (AT(LA, k) - mx) - ls);
                }
            }
            /* dL/dlogits of the query rows (computed on every lane; support and padding fixed below) */
            if (loss == 0) {
                /* d(-w_2 H(marg))/d marg = w_2 (log marg + 1), the clamp's zero gradient included */
                for (int k = 0; k < K; k++) {
                    REAL s = 0;
                    for (int i = Ns; i < n; i++) s += SA[(long)k * np + i];
                    REAL mg = s / rNq;
                    u[k] = ((mg > tiny ? (REAL)log(mg) : (REAL)log(tiny)) + (mg >= tiny ? 1 : 0)) * rw2;
                }
                for (long l = 0; l < np; l += VL) {
                    V s = (V){0};
                    for (int k = 0; k < K; k++) {
                        V q = AT(SA, k), qe = q + ceps;
                        /* dL/dp: (u - w_3 (log(p + 1e-12) + p / (p + 1e-12))) / Nq */
                        V du = (u[k] - rw3 * (CAT(vlog, SUF)(qe) + q / qe)) / rNq;
                        PUT(GA, k, du);
                        s += q * du;
                    }
                    for (int k = 0; k < K; k++) PUT(GA, k, AT(SA, k) * (AT(GA, k) - s));
                }
            } else {
                const REAL c = -rw2 / rNq; /* dL/dl_j = -(w_2 / Nq) p_j (log p_j - sum_k p_k log p_k) */
                for (long l = 0; l < np; l += VL) {
                    V s = (V){0};
                    for (int k = 0; k < K; k++) s += AT(SA, k) * AT(LA, k);
                    for (int k = 0; k < K; k++) PUT(GA, k, (AT(SA, k) * (AT(LA, k) - s)) * c);
                }
            }
#undef AT
#undef PUT
            for (int k = 0; k < K; k++) {
                REAL *g = GA + (long)k * np;
                const REAL *q = SA + (long)k * np;
                for (int i = 0; i < Ns; i++) g[i] = (q[i] - ye[(long)k * Ns + i]) * ce_s;
                for (long i = n; i < np; i++) g[i] = 0;
            }
            /* column sums, dL/dgamma = sum G Z, G X */
            REAL gg = 0;
            for (int k = 0; k < K; k++) {
                REAL colsum = 0;
                const REAL *g = GA + (long)k * np, *z = ZA + (long)k * np;
                for (int i = 0; i < n; i++) {
                    colsum += g[i];
                    gg += g[i] * z[i];
                }
                u[k] = colsum;
            }
            memset(GX, 0, sizeof(REAL) * Kp * D);
            for (int kg = 0; kg < Kp; kg += KB)
                CAT(accum, SUF)(xr, n, GA + (long)kg * np, (int)np, GX + (long)kg * D, D, D);
            for (int k = 0; k < K; k++)
                for (int d = 0; d < D; d++) {
                    long j = (long)k * D + d;
                    grad[j] = (GX[j] - Wp[j] * u[k]) * gamma;
                }
            grad[F] = learn_scale ? gg : 0;
            CAT(adam_step, SUF)(m, v, grad, Wp, &gamma, F, step, lr, b1, b2, eps, learn_scale);
        }
        memcpy(We, Wp, sizeof(REAL) * F);
        gamma_out[e] = gamma;
    }
    free(Wp);
    free(GX);
    free(m);
    free(v);
    free(grad);
    free(w2);
    free(XT);
    free(SA);
    free(ZA);
    free(LA);
    free(GA);
    free(u);
    free((void *)xr);
    return ok ? 0 : -1;
}
#undef V
#undef VL
#undef Adam
#endif
