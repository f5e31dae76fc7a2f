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

int wd_kernel_version(void) { return 1; }

#define REAL float
#define SUF _f32
#define EXPR expf
#define SQRTR sqrtf
#include __FILE__
#undef REAL
#undef SUF
#undef EXPR
#undef SQRTR
#define REAL double
#define SUF _f64
#define EXPR exp
#define SQRTR sqrt
#include __FILE__
#undef REAL
#undef SUF
#undef EXPR
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
                REAL gk = g[b * ldg + k];
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
            for (int b = 0; b < nb; b++) a += g[b * ldg + k] * xr[b][d];
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
    REAL *colsum = calloc((size_t)Kp, sizeof(REAL));
    REAL *S = calloc((size_t)RB * Kp, sizeof(REAL));
    REAL *P = calloc((size_t)K, sizeof(REAL));
    REAL *L = calloc((size_t)K, sizeof(REAL));
    REAL *Z = calloc((size_t)K, sizeof(REAL));
    int ok = Wp && GX && m && v && grad && w2 && colsum && S && P && L && Z;
    const REAL omb1 = (REAL)(1.0 - b1), rb2 = (REAL)b2, omb2 = (REAL)(1.0 - b2), reps = (REAL)eps;
    for (int e = 0; ok && e < E; e++) {
        const REAL *xe = x + (long)e * n * D, *te = targets + e * t_es, *re = r + e * r_es;
        const REAL *fe = free_ ? free_ + e * f_es : NULL;
        REAL *We = Wout + (long)e * F;
        REAL gamma = gamma_out[e];
        for (int k = 0; k < K; k++) memcpy(Wp + (long)k * D, We + (long)k * D, sizeof(REAL) * D);
        memset(m, 0, sizeof(REAL) * (F + 1));
        memset(v, 0, sizeof(REAL) * (F + 1));
        for (int step = 1; step <= steps; step++) {
            for (int k = 0; k < K; k++) {
                REAL s = 0;
                for (int d = 0; d < D; d++) s += Wp[(long)k * D + d] * Wp[(long)k * D + d];
                w2[k] = s;
            }
            memset(GX, 0, sizeof(REAL) * Kp * D);
            memset(colsum, 0, sizeof(REAL) * Kp);
            REAL gg = 0;
            for (int i0 = 0; i0 < n; i0 += RB) {
                int nb = n - i0 < RB ? n - i0 : RB;
                const REAL *xr[RB];
                for (int b = 0; b < nb; b++) xr[b] = xe + (long)(i0 + b) * D;
                for (int b = 0; b < nb; b += 2) {
                    const REAL *x1 = b + 1 < nb ? xr[b + 1] : xr[b];
                    for (int kg = 0; kg < Kp; kg += KB) {
                        REAL out[2][KB];
                        CAT(dots, SUF)(xr[b], x1, Wp + (long)kg * D, D, D, out);
                        for (int k = 0; k < KB; k++) {
                            S[b * Kp + kg + k] = out[0][k];
                            if (b + 1 < nb) S[(b + 1) * Kp + kg + k] = out[1][k];
                        }
                    }
                }
                /* per row: logits, softmax over classes, dL/dlogits (written over S) */
                for (int b = 0; b < nb; b++) {
                    int i = i0 + b;
                    REAL *s = S + b * Kp, mx;
                    for (int k = 0; k < K; k++) {
                        Z[k] = s[k] - (REAL)0.5 * w2[k];
                        L[k] = Z[k] * gamma;
                    }
                    mx = L[0];
                    for (int k = 1; k < K; k++) mx = L[k] > mx ? L[k] : mx;
                    REAL sum = 0;
                    for (int k = 0; k < K; k++) sum += (P[k] = EXPR(L[k] - mx));
                    for (int k = 0; k < K; k++) P[k] /= sum;
                    REAL lbar = 0;
                    if (fe)
                        for (int k = 0; k < K; k++) lbar += P[k] * L[k];
                    for (int k = 0; k < K; k++) {
                        REAL gk = P[k] * re[i] - te[(long)k * n + i];
                        if (fe) gk += (P[k] * (L[k] - lbar)) * fe[i];
                        s[k] = gk;
                        gg += gk * Z[k];
                        colsum[k] += gk;
                    }
                    for (int k = K; k < Kp; k++) s[k] = 0;
                }
                for (int kg = 0; kg < Kp; kg += KB) CAT(accum, SUF)(xr, nb, S + kg, Kp, GX + (long)kg * D, D, D);
            }
            for (int k = 0; k < K; k++)
                for (int d = 0; d < D; d++) {
                    long j = (long)k * D + d;
                    grad[j] = (GX[j] - Wp[j] * colsum[k]) * gamma;
                }
            grad[F] = learn_scale ? gg - c0[e] : 0;
            /* torch.optim.Adam, single-tensor path, operation for operation */
            double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
            REAL step_size = (REAL)(lr / bc1), bc2s = (REAL)sqrt(bc2);
            Adam(m, v, grad, Wp, F, omb1, rb2, omb2, bc2s, reps, step_size);
            if (learn_scale) {
                REAL g1 = gamma;
                Adam(m + F, v + F, grad + F, &g1, 1, omb1, rb2, omb2, bc2s, reps, step_size);
                gamma = g1;
            }
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
    free(colsum);
    free(S);
    free(P);
    free(L);
    free(Z);
    return ok ? 0 : -1;
}
#undef V
#undef VL
#undef Adam
#endif
