/* The fused CPU fits of poodle.solvers._optim (poodle, ce, naive-ood: the weighted-distance loss;
 * tim-gd, entropy-min, alpha-tim: logit losses of the queries) and TIM-ADM's closed-form
 * iterations (tim_adm.py: LOSS_ADM, adm_step): Adam on the prototypes and the scale of each
 * episode, every step reading an episode's rows once (logits, softmax, dL/dlogits and the gradient
 * accumulation G^T x of a block of rows while it sits in L1), instead of two batched matmuls that
 * each stream all rows and that BLAS runs at a third of its large-GEMM rate for 5-row operands.
 *
 * The arithmetic is the one documented in _optim.py (same formulas, same Adam, same order of the
 * per-row operations); only the summation order of the dot products and of the sums over rows, and
 * exp/log, are this file's, so results agree with the torch formulation to float rounding.
 * Episodes are solved one after another in one set of buffers, so an episode's numbers never depend
 * on the chunk it came in.
 *
 * One entry point, poodle_fit, takes one struct poodle_fit_args (declared again, as a
 * ctypes.Structure, in _native.py: FitArgs); its version and size fields are checked, so a caller
 * and a library of different interfaces never exchange misread arguments. The library says its
 * interface (poodle_kernel_interface) and the hash of the source it was built from
 * (poodle_kernel_source, set by _native.py with -DPOODLE_KERNEL_SOURCE), checked before any call.
 *
 * One step of an episode (fit below): ||w_k||^2, x.w of every row (small D), then the loss's pass
 * over the rows (wd_rows or lf_rows: G X, the column sums of G and sum G Z), then the gradient and
 * Adam, common to all losses. A new loss of the logits plugs into lf_rows (its dL/dlogits of the
 * query rows in query_grad, a LOSS_ constant here and in _native.py's LOSSES).
 *
 * Compiled at first use by poodle/solvers/_native.py (plain C99 + GCC/Clang vector extensions, no
 * Python or torch headers) and called through ctypes, which releases the GIL: the chunk workers
 * run it in parallel. The body is compiled twice (float and double) by including this file. */
#ifndef REAL
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bump with any change of struct poodle_fit_args or of a field's meaning (and FIT_INTERFACE in
 * _native.py with it). */
#define POODLE_FIT_INTERFACE 3
#ifndef POODLE_KERNEL_SOURCE
#define POODLE_KERNEL_SOURCE "unknown"
#endif

enum { LOSS_WD = 0, LOSS_TIM = 1, LOSS_ENTROPY = 2, LOSS_ALPHA = 3, LOSS_ADM = 4, N_LOSSES = 5 };

/* One call: E episodes of n rows of D values, K classes. Strides are in elements; the last axis of
 * every array is contiguous; a stride of 0 between episodes shares one array among them.
 *
 * Ragged chunks (episodes of different shapes padded to the largest): ways, rows and support_rows
 * give each episode's own number of classes (its first ways[e] of the K), real rows (its first
 * rows[e] of the n, every array of rows laid out the same) and, for the logit losses, real support
 * rows (the first support_rows[e] of its real rows, its queries the rest). Every loop of an
 * episode runs over its own sizes, so an episode computes in a padded chunk exactly what it
 * computes alone, and a padded class or row is never read. NULL: every episode has K, n and
 * n_support (fixed chunks: the same loops, the same bits). */
struct poodle_fit_args {
    int32_t version; /* POODLE_FIT_INTERFACE of the caller */
    int32_t size;    /* sizeof(struct poodle_fit_args) of the caller */
    int32_t dtype;   /* 0: float, 1: double (every array) */
    int32_t loss;    /* LOSS_* */
    int32_t E, n, D, K;
    int32_t n_support; /* logit losses: the support rows, first among the n */
    int32_t steps;
    int32_t learn_scale;
    int32_t reserved;
    int64_t x_es, x_rs; /* x [E, n, D]: between episodes, between rows */
    int64_t t_es, t_ks; /* targets: between episodes, between classes */
    int64_t r_es, f_es; /* r, free: between episodes */
    /* weighted distance (see fit_weighted_distance in _optim.py): targets [E, K, n] (already
     * multiplied by each row's CE weight), r [E, n] = ce + coef, free [E, n] or NULL, c0 [E];
     * logit losses: targets [E, K, n_support] one-hot support labels, r, free, c0 unused */
    const void *x, *targets, *r, *free_, *c0;
    void *W;     /* [E, K, D] contiguous; in: the initial prototypes, out: the fitted ones */
    void *gamma; /* [E]; in: the initial scale, out: the fitted one */
    double lr, beta1, beta2, eps;
    /* logit losses: the support CE weight and the query loss's weights (LOSS_TIM: marginal and
     * conditional entropy, LOSS_ENTROPY: the entropy, unused) */
    double weights[3];
    double alpha; /* LOSS_ALPHA: the alpha-entropy order (not 1) */
    const int32_t *ways, *rows, *support_rows; /* [E] each episode's own sizes, or NULL (above) */
    /* LOSS_ADM (TIM-ADM's closed-form updates, not Adam; weights: c_s, the power 1 + l_cond, the
     * marginal's exponent l_marg / (l_marg + 1); alpha: the damping; gamma: the fixed temperature):
     * out, the last assignments Q [E, K, n - n_support] (an episode's real queries first) */
    void *Q;
};

int poodle_kernel_interface(void) { return POODLE_FIT_INTERFACE; }
const char *poodle_kernel_source(void) { return POODLE_KERNEL_SOURCE; }

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define KB 5 /* classes per register block */
#define RB 8 /* rows per block: 8 rows of D = 640 floats stay in L1 between the two passes */
#define GB 2 /* blocks per G X pass: each pass loads and stores GX once, so 2 blocks halve that traffic
                (5-7% faster per step measured; 3-6 blocks gained nothing more) */
#define SMALL_D 256 /* up to this D, dot products from the transposed rows (dots_t) */
#define MAX_BUFFERS 24

#define REAL float
#define SUF _f32
#define EXPR expf
#define IS_FLOAT 1
#define SQRTR sqrtf
#define FMA fmaf
#include __FILE__
#undef REAL
#undef SUF
#undef EXPR
#undef IS_FLOAT
#undef SQRTR
#undef FMA
#define REAL double
#define SUF _f64
#define EXPR exp
#define IS_FLOAT 0
#define SQRTR sqrt
#define FMA fma
#include __FILE__
#undef REAL
#undef SUF
#undef EXPR
#undef IS_FLOAT
#undef SQRTR
#undef FMA

/* Whether every episode's own sizes are within the chunk's (and a logit loss has support and
 * query rows). */
static int sizes_ok(const struct poodle_fit_args *a) {
    int wd = a->loss == LOSS_WD;
    if (a->K < 1 || a->n < 1 || (!wd && (a->n_support < 1 || a->n_support >= a->n))) return 0;
    for (int e = 0; e < a->E; e++) {
        int K = a->ways ? a->ways[e] : a->K, n = a->rows ? a->rows[e] : a->n;
        int ns = a->support_rows ? a->support_rows[e] : a->n_support;
        if (K < 1 || K > a->K || n < 1 || n > a->n || (!wd && (ns < 1 || ns >= n))) return 0;
    }
    return 1;
}

/* Fit a->E episodes in place (a->W, a->gamma). Returns 0; -1 when a buffer cannot be allocated;
 * -2 when the caller's interface (version or struct size) is not this library's; -3 for an
 * unknown dtype or loss (or alpha-entropy order 1); -4 for an episode's sizes outside the chunk's. */
int poodle_fit(const struct poodle_fit_args *a) {
    if (!a || a->version != POODLE_FIT_INTERFACE || a->size != (int32_t)sizeof *a) return -2;
    if (a->loss < 0 || a->loss >= N_LOSSES || (a->loss == LOSS_ALPHA && a->alpha == 1.0)) return -3;
    if (a->loss == LOSS_ADM && (!a->Q || a->steps < 1)) return -3;
    if (a->E > 0 && !sizes_ok(a)) return -4;
    return a->dtype == 0 ? fit_f32(a) : a->dtype == 1 ? fit_f64(a) : -3;
}

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
/* Not inlined: inside the row pass GCC's register allocation reloaded W between the two rows'
 * multiply-adds (measured 15-20% slower than the same loop alone); a call per pair of rows costs nothing. */
static __attribute__((noinline)) void CAT(dots, SUF)(const REAL *x0, const REAL *x1, const REAL *W, long ldw, int D, REAL out[2][KB]) {
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

/* ||w||^2 of a row of D values, summed as dots sums x.w: VL lanes accumulating over d, then the lanes
 * in order, then the tail. Which multiply-adds are fused is written out (the lanes' fused, the tail's
 * fused in double only, as GCC's contraction made them when w2 came from dots): left to the
 * compiler, they were fused differently depending on where this was inlined (results changed in
 * the last bit). */
static REAL CAT(sqnorm, SUF)(const REAL *w, int D) {
    V acc = (V){0};
    int Dv = D - D % VL;
    for (int d = 0; d < Dv; d += VL) {
        V a = CAT(ld, SUF)(w + d);
        for (int l = 0; l < VL; l++) acc[l] = FMA(a[l], a[l], acc[l]);
    }
    REAL s = CAT(hsum, SUF)(acc);
    for (int d = Dv; d < D; d++) {
#if IS_FLOAT
        volatile REAL sq = w[d] * w[d]; /* rounded, then added */
        s += sq;
#else
        s = FMA(w[d], w[d], s);
#endif
    }
    return s;
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
/* Not inlined, as dots (one call per GB blocks of rows). */
static __attribute__((noinline)) void CAT(accum, SUF)(const REAL *const *xr, int nb, const REAL *g, int ldg, REAL *GX, long ldw, int D) {
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

/* The buffers of one call, reused for each of its episodes, and the episode being fitted. */
#define Work CAT(work, SUF)
typedef struct {
    const struct poodle_fit_args *a;
    int Kp, transposed; /* classes padded to KB; whether rows are also stored transposed (XT, SA) */
    long F, np;         /* K*D parameters; rows padded to whole blocks (the buffers' layout) */
    /* the episode's own sizes (a ragged chunk's; else the chunk's): classes, classes padded to KB,
     * real rows, support rows (logit losses), rows padded to whole blocks, parameters K*D */
    int Ke, Kpe, ne, nse;
    long npe, Fe;
    /* common: padded prototypes, G X, Adam moments and gradient (K*D + 1: the scale last), ||w||^2,
     * column sums of dL/dlogits, the episode's rows (n + 1 pointers) */
    REAL *Wp, *GX, *m, *v, *grad, *w2, *colsum;
    const REAL **xr;
    /* the rows transposed, zero past n, and x.w of all rows ([class][row]; logit losses: then p) */
    REAL *XT, *SA;
    /* weighted distance, one block of rows, class-major ([class][row]) so that the per-row work runs
     * across rows in vector lanes: x.w (then dL/dlogits), x.w - |w|^2/2, logits, targets; per-lane
     * partial sums over rows (column sums of dL/dlogits [class][lane], then dL/dgamma); dL/dlogits
     * of GB consecutive blocks for one G X pass */
    REAL *ST, *ZT, *LT, *TT, *acc, *G2;
    /* logit losses, every row: x.w - |w|^2/2, logits (then, entropy, log p), dL/dlogits (zero for
     * padded classes and rows); per class: the marginal's weight */
    REAL *ZA, *LA, *GA, *u;
    /* TIM-ADM: c_s Y_s^T x_s, per class: the support and query sums of p and of Q, the support counts */
    REAL *base, *ps, *pq, *qs, *ysum;
    int e; /* the episode */
    void *owned[MAX_BUFFERS];
    int n_owned, failed;
} Work;

static void *CAT(alloc, SUF)(Work *w, size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size);
    if (p && w->n_owned < MAX_BUFFERS)
        w->owned[w->n_owned++] = p;
    else {
        free(p);
        w->failed = 1;
    }
    return p;
}

static void CAT(work_init, SUF)(Work *w, const struct poodle_fit_args *a) {
    memset(w, 0, sizeof *w);
    w->a = a;
    int K = a->K, D = a->D, wd = a->loss == LOSS_WD;
    size_t Kp = (size_t)((K + KB - 1) / KB * KB);
    w->Kp = (int)Kp;
    w->F = (long)K * D;
    w->np = (long)(a->n + RB - 1) / RB * RB;
    w->transposed = !wd || D <= SMALL_D;
    size_t np = (size_t)w->np, F1 = (size_t)w->F + 1, R = sizeof(REAL);
    w->Wp = CAT(alloc, SUF)(w, Kp * D, R);
    w->GX = CAT(alloc, SUF)(w, Kp * D, R);
    w->m = CAT(alloc, SUF)(w, F1, R);
    w->v = CAT(alloc, SUF)(w, F1, R);
    w->grad = CAT(alloc, SUF)(w, F1, R);
    w->w2 = CAT(alloc, SUF)(w, Kp, R);
    w->colsum = CAT(alloc, SUF)(w, Kp, R);
    w->xr = CAT(alloc, SUF)(w, (size_t)a->n + 1, sizeof(REAL *));
    if (w->transposed) {
        w->XT = CAT(alloc, SUF)(w, np * D, R);
        w->SA = CAT(alloc, SUF)(w, Kp * np, R);
    }
    if (wd) {
        w->ST = CAT(alloc, SUF)(w, Kp * RB, R);
        w->ZT = CAT(alloc, SUF)(w, Kp * RB, R);
        w->LT = CAT(alloc, SUF)(w, Kp * RB, R);
        w->TT = CAT(alloc, SUF)(w, Kp * RB, R);
        w->acc = CAT(alloc, SUF)(w, (Kp + 1) * RB, R);
        w->G2 = CAT(alloc, SUF)(w, Kp * GB * RB, R);
    } else {
        w->ZA = CAT(alloc, SUF)(w, Kp * np, R);
        w->LA = CAT(alloc, SUF)(w, Kp * np, R);
        w->GA = CAT(alloc, SUF)(w, Kp * np, R);
        w->u = CAT(alloc, SUF)(w, Kp, R);
        if (a->loss == LOSS_ADM) {
            w->base = CAT(alloc, SUF)(w, Kp * D, R);
            w->ps = CAT(alloc, SUF)(w, Kp, R);
            w->pq = CAT(alloc, SUF)(w, Kp, R);
            w->qs = CAT(alloc, SUF)(w, Kp, R);
            w->ysum = CAT(alloc, SUF)(w, Kp, R);
        }
    }
}

static void CAT(work_free, SUF)(Work *w) {
    for (int i = 0; i < w->n_owned; i++) free(w->owned[i]);
    w->n_owned = 0;
}

/* The weighted-distance loss on one block of RB rows (x.w in ST, [class][row]), VL rows at a time:
 * logits, softmax over classes and dL/dlogits = p r - t [+ p (l - lbar) free] into ST; the column
 * sums of dL/dlogits and sum G Z accumulate per lane in acc. */
static inline void CAT(wd_block, SUF)(Work *w, REAL gamma, const REAL *rr, const REAL *ff, int fe) {
    const int K = w->Ke, Kp = w->Kp;
    REAL *ST = w->ST, *ZT = w->ZT, *LT = w->LT, *acc = w->acc;
    const REAL *TT = w->TT, *w2 = w->w2;
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
}

/* The weighted-distance loss's pass over the rows of episode w->e (see fit_weighted_distance in
 * _optim.py), in blocks of RB rows: logits, softmax, dL/dlogits = p r - t [+ p (l - lbar) free],
 * and G X every GB blocks. Fills GX and colsum; returns sum_ik G_ik Z_ik (dL/dgamma before the
 * constant c0). */
static REAL CAT(wd_rows, SUF)(Work *w, REAL gamma) {
    const struct poodle_fit_args *a = w->a;
    const int n = w->ne, D = a->D, K = w->Ke, Kp = w->Kp, Kpe = w->Kpe, small = w->transposed;
    const long np = w->np, e = w->e;
    const REAL *te = (const REAL *)a->targets + e * a->t_es, *re = (const REAL *)a->r + e * a->r_es;
    const REAL *fe = a->free_ ? (const REAL *)a->free_ + e * a->f_es : NULL;
    const long tks = a->t_ks;
    REAL *ST = w->ST, *TT = w->TT, *acc = w->acc, *G2 = w->G2, *GX = w->GX;
    REAL rr[RB], ff[RB];
    memset(GX, 0, sizeof(REAL) * Kpe * D);
    memset(acc, 0, sizeof(REAL) * (Kp + 1) * RB);
    int nb2 = 0; /* rows gathered for the next G X pass */
    const REAL *xr2[GB * RB];
    for (int i0 = 0; i0 < n; i0 += RB) {
        int nb = n - i0 < RB ? n - i0 : RB;
        const REAL *xr[RB];
        for (int b = 0; b < RB; b++) xr[b] = w->xr[i0 + (b < nb ? b : nb - 1)];
        if (small)
            for (int k = 0; k < Kpe; k++) memcpy(ST + k * RB, w->SA + (long)k * np + i0, sizeof(REAL) * RB);
        else
            for (int b = 0; b < nb; b += 2)
                for (int kg = 0; kg < Kpe; kg += KB) {
                    REAL o[2][KB];
                    CAT(dots, SUF)(xr[b], xr[b + 1 < nb ? b + 1 : b], w->Wp + (long)kg * D, D, D, o);
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
                TT[k * RB + b] = ok_row ? te[(long)k * tks + i0 + b] : 0;
                if (!ok_row) ST[k * RB + b] = 0;
            }
        }
        CAT(wd_block, SUF)(w, gamma, rr, ff, fe != NULL);
        for (int k = K; k < Kp; k++) memset(ST + k * RB, 0, sizeof(REAL) * RB);
        /* G X every GB blocks: the same products added in the same row order as block by block,
         * so the result is bit for bit the same */
        int slot = (i0 / RB) % GB;
        for (int k = 0; k < Kpe; k++) memcpy(G2 + k * GB * RB + slot * RB, ST + k * RB, sizeof(REAL) * RB);
        for (int b = 0; b < RB; b++) xr2[slot * RB + b] = xr[b];
        nb2 += nb;
        if (slot == GB - 1 || i0 + RB >= n) {
            for (int kg = 0; kg < Kpe; kg += KB)
                CAT(accum, SUF)(xr2, nb2, G2 + kg * GB * RB, GB * RB, GX + (long)kg * D, D, D);
            nb2 = 0;
        }
    }
    REAL gg = 0;
    for (int b = 0; b < RB; b++) gg += acc[Kp * RB + b];
    for (int k = 0; k < K; k++) {
        REAL colsum = 0;
        for (int b = 0; b < RB; b++) colsum += acc[k * RB + b];
        w->colsum[k] = colsum;
    }
    return gg;
}

/* dL/dp of the query rows of a logit loss, then dL/dlogits = p (dL/dp - sum_k p_k dL/dp_k), into
 * GA (computed on every lane: lf_rows fixes the support rows and the padding). p is in SA, the
 * logits in LA (LOSS_ENTROPY: log p). A new logit loss is one more case here. */
static void CAT(query_grad, SUF)(Work *w) {
    const struct poodle_fit_args *a = w->a;
    const int K = w->Ke, Ns = w->nse, n = w->ne;
    const long np = w->np, npe = w->npe;
    const REAL *SA = w->SA, *LA = w->LA;
    REAL *GA = w->GA, *u = w->u;
    const REAL rw2 = (REAL)a->weights[1], rw3 = (REAL)a->weights[2], rNq = (REAL)(n - Ns);
    const REAL tiny = (REAL)1e-30, ceps = (REAL)1e-12;
#define AT(buf, k) CAT(ld, SUF)((buf) + (long)(k) * np + l)
#define PUT(buf, k, val) CAT(st, SUF)((buf) + (long)(k) * np + l, (val))
    if (a->loss == LOSS_TIM) {
        /* -(w_2 H(mean_q p) - w_3 mean_q H(p)) with H(p) taken of p + 1e-12 and the marginal's log
         * of max(p, 1e-30) (tim_gd.grad_logits); d(-w_2 H(marg))/d marg = w_2 (log marg + 1), the
         * clamp's zero gradient included */
        for (int k = 0; k < K; k++) {
            REAL s = 0;
            for (int i = Ns; i < n; i++) s += SA[(long)k * np + i];
            REAL mg = s / rNq;
            u[k] = ((mg > tiny ? (REAL)log(mg) : (REAL)log(tiny)) + (mg >= tiny ? 1 : 0)) * rw2;
        }
        for (long l = 0; l < npe; l += VL) {
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
    } else if (a->loss == LOSS_ALPHA) {
        /* -(w_2 H_a(mean_q p) - w_3 mean_q H_a(p + 1e-12)), H_a(q) = (1 - sum_k q_k^a) / (a - 1)
         * (alpha_tim.grad_logits): dL/dp = (w_2 marg^(a-1) - w_3 (p + 1e-12)^(a-1)) a / ((a-1) Nq) */
        const double am1 = a->alpha - 1.0;
        const int pint = am1 == (int)am1 && am1 >= 1 && am1 <= 8 ? (int)am1 : 0;
        const REAL c = (REAL)(a->alpha / (am1 * (double)(n - Ns)));
        for (int k = 0; k < K; k++) {
            REAL s = 0;
            for (int i = Ns; i < n; i++) s += SA[(long)k * np + i];
            u[k] = (REAL)pow((double)(s / rNq), am1) * rw2;
        }
        for (long l = 0; l < npe; l += VL) {
            V s = (V){0};
            for (int k = 0; k < K; k++) {
                V q = AT(SA, k), qe = q + ceps, pw;
                if (pint) { /* an integer power by products, as the tuned orders 2, 5 and 7 give */
                    pw = qe;
                    for (int j = 1; j < pint; j++) pw *= qe;
                } else {
#if IS_FLOAT
                    pw = CAT(vexp, SUF)(CAT(vlog, SUF)(qe) * (REAL)am1); /* qe >= 1e-12: a normal float */
#else
                    for (int j = 0; j < VL; j++) pw[j] = pow(qe[j], am1);
#endif
                }
                V du = (u[k] - pw * rw3) * c;
                PUT(GA, k, du);
                s += q * du;
            }
            for (int k = 0; k < K; k++) PUT(GA, k, AT(SA, k) * (AT(GA, k) - s));
        }
    } else { /* LOSS_ENTROPY: w_2 mean_q H(p), log p from log-softmax (entropy_min) */
        const REAL c = -rw2 / rNq; /* dL/dl_j = -(w_2 / Nq) p_j (log p_j - sum_k p_k log p_k) */
        for (long l = 0; l < npe; l += VL) {
            V s = (V){0};
            for (int k = 0; k < K; k++) s += AT(SA, k) * AT(LA, k);
            for (int k = 0; k < K; k++) PUT(GA, k, (AT(SA, k) * (AT(LA, k) - s)) * c);
        }
    }
#undef AT
#undef PUT
}

/* A logit loss's pass over every row of episode w->e (TIM-GD, entropy minimisation; see
 * fit_logit_loss in _optim.py): an episode is small (80-100 rows of D = 64 at 5 classes: 25 KiB),
 * so one step handles all of it at once: the logits of every row ([class][row], rows in vector
 * lanes, x.w already in SA), the probabilities, dL/dlogits (the support rows carry w_ce times their
 * mean cross-entropy), then G X. Fills GX and colsum; returns sum_ik G_ik Z_ik. */
static REAL CAT(lf_rows, SUF)(Work *w, REAL gamma) {
    const struct poodle_fit_args *a = w->a;
    const int n = w->ne, D = a->D, K = w->Ke, Kpe = w->Kpe, Ns = w->nse;
    const long np = w->np, npe = w->npe;
    const REAL *ye = (const REAL *)a->targets + w->e * a->t_es;
    REAL *SA = w->SA, *ZA = w->ZA, *LA = w->LA, *GA = w->GA, *GX = w->GX;
    const REAL *w2 = w->w2;
    const REAL ce_s = (REAL)(a->weights[0] / Ns);
    /* logits and softmax over classes, VL rows at a time */
    for (long l = 0; l < npe; l += VL) {
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
        if (a->loss == LOSS_ENTROPY) {
            V ls = CAT(vlog, SUF)(sum);
            for (int k = 0; k < K; k++) PUT(LA, k, (AT(LA, k) - mx) - ls);
        }
#undef AT
#undef PUT
    }
    CAT(query_grad, SUF)(w);
    for (int k = 0; k < K; k++) {
        REAL *g = GA + (long)k * np;
        const REAL *q = SA + (long)k * np;
        for (int i = 0; i < Ns; i++) g[i] = (q[i] - ye[(long)k * a->t_ks + i]) * ce_s;
        for (long i = n; i < npe; i++) g[i] = 0;
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
        w->colsum[k] = colsum;
    }
    memset(GX, 0, sizeof(REAL) * Kpe * D);
    for (int kg = 0; kg < Kpe; kg += KB)
        CAT(accum, SUF)(w->xr, n, GA + (long)kg * np, (int)np, GX + (long)kg * D, D, D);
    return gg;
}

/* TIM-ADM's start (tim_adm.py): GA <- the one-hot support targets, base = c_s Y_s^T x_s, ysum. */
static void CAT(adm_start, SUF)(Work *w) {
    const struct poodle_fit_args *a = w->a;
    const int K = w->Ke, Kpe = w->Kpe, Ns = w->nse, D = a->D;
    const long np = w->np, npe = w->npe;
    const REAL *ye = (const REAL *)a->targets + w->e * a->t_es, cs = (REAL)a->weights[0];
    for (int k = 0; k < Kpe; k++) {
        REAL *g = w->GA + (long)k * np, c = 0;
        for (long i = 0; i < npe; i++) g[i] = k < K && i < Ns ? ye[(long)k * a->t_ks + i] : 0;
        for (int i = 0; i < Ns; i++) c += g[i];
        w->ysum[k] = c;
    }
    memset(w->base, 0, sizeof(REAL) * Kpe * D);
    for (int kg = 0; kg < Kpe; kg += KB)
        CAT(accum, SUF)(w->xr, Ns, w->GA + (long)kg * np, (int)np, w->base + (long)kg * D, D, D);
    for (long j = 0; j < (long)K * D; j++) w->base[j] *= cs;
}

/* One TIM-ADM step of episode w->e (tim_adm.py), x.w of every row in SA: p = softmax over classes,
 * Q = p_q^power / (sum_q p_q^power)^beta normalised over classes (into LA), G = [-c_s p_s,
 * c_q (Q - p_q)] (into GA), G X, then W <- W + alpha (num / den - W) with num = c_s Y_s^T x_s + G X
 * + W (c_s sum p_s + c_q sum p_q) and den = c_s |Y_s| + c_q sum Q (both floored at 1e-30). */
static void CAT(adm_step, SUF)(Work *w, REAL gamma) {
    const struct poodle_fit_args *a = w->a;
    const int n = w->ne, D = a->D, K = w->Ke, Kpe = w->Kpe, Ns = w->nse;
    const long np = w->np, npe = w->npe;
    REAL *SA = w->SA, *LA = w->LA, *GA = w->GA, *GX = w->GX, *Wp = w->Wp;
    const REAL *w2 = w->w2, tiny = (REAL)1e-30;
    const REAL cs = (REAL)a->weights[0], cq = (REAL)((double)Ns / (double)(n - Ns));
    const double power = a->weights[1], beta = a->weights[2];
    for (long l = 0; l < npe; l += VL) {
#define AT(buf, k) CAT(ld, SUF)((buf) + (long)(k) * np + l)
#define PUT(buf, k, val) CAT(st, SUF)((buf) + (long)(k) * np + l, (val))
        V mx, sum = (V){0};
        for (int k = 0; k < K; k++) {
            V lg = (AT(SA, k) - (REAL)0.5 * w2[k]) * gamma;
            PUT(LA, k, lg);
            mx = k == 0 ? lg : CAT(vmax, SUF)(lg, mx);
        }
        for (int k = 0; k < K; k++) {
            V q = CAT(vexp, SUF)(AT(LA, k) - mx);
            sum += q;
            PUT(SA, k, q);
        }
        for (int k = 0; k < K; k++) PUT(SA, k, AT(SA, k) / sum);
        /* the queries' p^power (the support's and padding's lanes are overwritten below) */
        for (int k = 0; k < K; k++) {
            V p = AT(SA, k), pw;
#if IS_FLOAT
            pw = CAT(vexp, SUF)(CAT(vlog, SUF)(p) * (REAL)power); /* p >= 1.2e-38: a normal float */
#else
            for (int j = 0; j < VL; j++) pw[j] = pow(p[j], power);
#endif
            PUT(LA, k, pw);
        }
#undef AT
#undef PUT
    }
    for (int k = 0; k < K; k++) {
        REAL *pw = LA + (long)k * np, s = 0, a_s = 0, a_q = 0;
        const REAL *p = SA + (long)k * np;
        for (int i = Ns; i < n; i++) s += pw[i];
        REAL den = (REAL)pow((double)(s > tiny ? s : tiny), beta);
        for (int i = Ns; i < n; i++) pw[i] = pw[i] / den;
        for (int i = 0; i < Ns; i++) a_s += p[i];
        for (int i = Ns; i < n; i++) a_q += p[i];
        w->ps[k] = a_s;
        w->pq[k] = a_q;
    }
    for (int i = Ns; i < n; i++) {
        REAL rs = 0;
        for (int k = 0; k < K; k++) rs += LA[(long)k * np + i];
        rs = rs > tiny ? rs : tiny;
        for (int k = 0; k < K; k++) LA[(long)k * np + i] /= rs;
    }
    for (int k = 0; k < K; k++) {
        REAL *g = GA + (long)k * np, qsum = 0;
        const REAL *p = SA + (long)k * np, *q = LA + (long)k * np;
        for (int i = 0; i < Ns; i++) g[i] = p[i] * -cs;
        for (int i = Ns; i < n; i++) {
            g[i] = (q[i] - p[i]) * cq;
            qsum += q[i];
        }
        for (long i = n; i < npe; i++) g[i] = 0;
        w->qs[k] = qsum;
    }
    memset(GX, 0, sizeof(REAL) * Kpe * D);
    for (int kg = 0; kg < Kpe; kg += KB)
        CAT(accum, SUF)(w->xr, n, GA + (long)kg * np, (int)np, GX + (long)kg * D, D, D);
    const REAL damp = (REAL)a->alpha;
    for (int k = 0; k < K; k++) {
        REAL fs = w->ps[k] * cs, fq = w->pq[k] * cq, den = w->ysum[k] * cs + w->qs[k] * cq;
        den = den > tiny ? den : tiny;
        for (int d = 0; d < D; d++) {
            long j = (long)k * D + d;
            REAL num = (w->base[j] + GX[j]) + Wp[j] * fs;
            num += Wp[j] * fq;
            Wp[j] = Wp[j] + damp * (num / den - Wp[j]);
        }
    }
}

/* The one step loop of every loss: per episode, its rows and start values, then per step
 * ||w_k||^2, x.w of all rows (when transposed), the loss's pass (G X, column sums, sum G Z), the
 * gradient dL/dw_k = gamma (G X - colsum_k w_k), dL/dgamma = sum G Z - c0, and Adam. */
static int CAT(fit, SUF)(const struct poodle_fit_args *a) {
    Work w;
    CAT(work_init, SUF)(&w, a);
    const int D = a->D, wd = a->loss == LOSS_WD, ragged = a->ways || a->rows || a->support_rows;
    const long np = w.np;
    const REAL *x = a->x, *c0 = a->c0;
    REAL *Wout = a->W, *gamma_out = a->gamma;
    REAL *Wp = w.Wp, *m = w.m, *v = w.v, *grad = w.grad, *w2 = w.w2;
    for (int e = 0; !w.failed && e < a->E; e++) {
        /* the episode's own sizes */
        const int K = a->ways ? a->ways[e] : a->K, n = a->rows ? a->rows[e] : a->n;
        w.Ke = K;
        w.Kpe = (K + KB - 1) / KB * KB;
        w.ne = n;
        w.nse = a->support_rows ? a->support_rows[e] : a->n_support;
        w.npe = (long)(n + RB - 1) / RB * RB;
        w.Fe = (long)K * D;
        const int Kpe = w.Kpe;
        const long F = w.Fe, npe = w.npe;
        const REAL *xe = x + e * a->x_es;
        REAL *We = Wout + (long)e * w.F;
        REAL gamma = gamma_out[e], c0e = wd ? c0[e] : 0;
        w.e = e;
        for (int i = 0; i < n; i++) {
            w.xr[i] = xe + i * a->x_rs;
            if (w.transposed)
                for (int d = 0; d < D; d++) w.XT[(long)d * np + i] = w.xr[i][d];
        }
        for (int k = 0; k < K; k++) memcpy(Wp + (long)k * D, We + (long)k * D, sizeof(REAL) * D);
        if (ragged) {
            /* what a larger episode before this one left past this one's rows and classes: the
             * block's padded classes must be zero prototypes with zero dL/dlogits, padded rows zero */
            memset(Wp + (long)K * D, 0, sizeof(REAL) * (size_t)(Kpe - K) * D);
            if (w.transposed)
                for (int d = 0; d < D; d++) memset(w.XT + (long)d * np + n, 0, sizeof(REAL) * (size_t)(npe - n));
            if (w.GA) memset(w.GA + (long)K * np, 0, sizeof(REAL) * (size_t)(Kpe - K) * np);
        }
        memset(m, 0, sizeof(REAL) * (F + 1));
        memset(v, 0, sizeof(REAL) * (F + 1));
        if (a->loss == LOSS_ADM) {
            CAT(adm_start, SUF)(&w);
            for (int step = 1; step <= a->steps; step++) {
                for (int k = 0; k < K; k++) w2[k] = CAT(sqnorm, SUF)(Wp + (long)k * D, D);
                for (int kg = 0; kg < Kpe; kg += KB)
                    CAT(dots_t, SUF)(w.XT, np, Wp + (long)kg * D, D, D, w.SA + (long)kg * np, np, npe);
                CAT(adm_step, SUF)(&w, gamma);
            }
            /* the last assignments, each class's real queries first */
            const long nql = a->n - a->n_support;
            REAL *Qe = (REAL *)a->Q + (long)e * a->K * nql;
            for (int k = 0; k < K; k++) memcpy(Qe + k * nql, w.LA + (long)k * np + w.nse, sizeof(REAL) * (n - w.nse));
            memcpy(We, Wp, sizeof(REAL) * F);
            continue;
        }
        for (int step = 1; step <= a->steps; step++) {
            for (int k = 0; k < K; k++) w2[k] = CAT(sqnorm, SUF)(Wp + (long)k * D, D);
            if (w.transposed)
                for (int kg = 0; kg < Kpe; kg += KB)
                    CAT(dots_t, SUF)(w.XT, np, Wp + (long)kg * D, D, D, w.SA + (long)kg * np, np, npe);
            REAL gg = wd ? CAT(wd_rows, SUF)(&w, gamma) : CAT(lf_rows, SUF)(&w, gamma);
            for (int k = 0; k < K; k++)
                for (int d = 0; d < D; d++) {
                    long j = (long)k * D + d;
                    grad[j] = (w.GX[j] - Wp[j] * w.colsum[k]) * gamma;
                }
            grad[F] = a->learn_scale ? gg - c0e : 0;
            CAT(adam_step, SUF)(m, v, grad, Wp, &gamma, F, step, a->lr, a->beta1, a->beta2, a->eps, a->learn_scale);
        }
        memcpy(We, Wp, sizeof(REAL) * F);
        gamma_out[e] = gamma;
    }
    int failed = w.failed;
    CAT(work_free, SUF)(&w);
    return failed ? -1 : 0;
}
#undef V
#undef VL
#undef Adam
#undef Work
#endif
