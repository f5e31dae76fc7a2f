/* The Sinkhorn loops of PT-MAP, protoLP (balanced) and PEMnE-BMS (min-size), one episode at a time
 * and every sweep of it in one C loop: the plan of an episode (a few classes by up to a few hundred
 * samples) stays in L1 from its first sweep to its last, the vector sums are written out, each
 * sample's column takes one reciprocal, and an episode stops when it has converged, whatever the
 * others of its chunk do. The torch formulation (poodle/solvers/pt_map.py: balance, bms.py:
 * min_size_sinkhorn) is 15 to 20 batched operations a sweep, each a few microseconds of dispatch
 * for a few hundred numbers; it stays what CUDA runs.
 *
 * The arithmetic is the torch formulation's, sweep for sweep (same formulas, same order of the
 * operations on each element, the same convergence test); only the summation order of the sums
 * over samples and the reciprocal-times-multiply in place of a division are this file's, so plans
 * agree with the torch formulation to float rounding.
 *
 * Each episode says its own sizes: ways[e] classes and cols[e] samples (the first ones of its
 * rows), so a padded chunk's episode runs exactly the loop it runs alone (the same bits); entries
 * outside them are never read or written. A zero sample (a padded one inside cols[e]) stays zero.
 *
 * One entry point, poodle_sinkhorn, takes one struct poodle_sinkhorn_args (declared again, as a
 * ctypes.Structure, in _sinkhorn_native.py: SinkhornArgs); its version and size fields are checked.
 * The library says its interface (poodle_sinkhorn_interface) and the hash of the source it was
 * built from (poodle_sinkhorn_source), checked before any call. Compiled at first use (plain C99 +
 * GCC/Clang vector extensions) by _sinkhorn_native.py with _native.py's machinery; the body is
 * compiled twice (float and double) by including this file. */
#ifndef REAL
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bump with any change of struct poodle_sinkhorn_args or of a field's meaning (and
 * SINKHORN_INTERFACE in _sinkhorn_native.py with it). */
#define POODLE_SINKHORN_INTERFACE 2
#ifndef POODLE_KERNEL_SOURCE
#define POODLE_KERNEL_SOURCE "unknown"
#endif

enum { MODE_BALANCED = 0, MODE_MIN_SIZE = 1, N_MODES = 2 };

/* One call: E plans p [E, K, N], classes first, each class's N samples contiguous. */
struct poodle_sinkhorn_args {
    int32_t version; /* POODLE_SINKHORN_INTERFACE of the caller */
    int32_t size;    /* sizeof(struct poodle_sinkhorn_args) of the caller */
    int32_t dtype;   /* 0: float, 1: double (p and reset) */
    int32_t mode;    /* MODE_* */
    int32_t E, K, N;
    /* balanced: at most this many sweeps; min-size: exactly this many */
    int32_t max_iter;
    /* balanced: the first n_reset samples are set back to reset after every sweep (0: none) */
    int32_t n_reset;
    /* balanced: 1 to divide each plan by its total first (pt_map.sinkhorn), 0 not (balance) */
    int32_t normalise;
    int64_t p_es;      /* elements between episodes of p (K * N for a contiguous p) */
    int64_t r_es;      /* elements between episodes of reset (0: one shared) */
    void *p;           /* [E, K, N]: in the start, out the plan */
    const void *reset; /* [E, K, n_reset] or NULL */
    const int64_t *ways; /* [E] classes of each episode (the first ways[e]), or NULL: all K */
    const int64_t *cols; /* [E] samples of each episode (the first cols[e]), or NULL: all N */
    /* [E] balanced: each class's mass; min-size: the smallest class mass */
    const double *target;
    int32_t *iters; /* [E] out: the sweeps each episode ran, or NULL */
    int32_t reserved;
    double tol; /* balanced: stop once no sample's mass moved by more than this in one sweep */
};

int poodle_sinkhorn_interface(void) { return POODLE_SINKHORN_INTERFACE; }
const char *poodle_sinkhorn_source(void) { return POODLE_KERNEL_SOURCE; }

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
/* the smallest mass a division sees (pt_map's TINY) */
#define TINY_MASS 1e-30
/* the authors' guard of the min-size rescaling (bms.min_size_sinkhorn) */
#define GUARD 1e-20

#define REAL float
#define SUF _f32
#include __FILE__
#undef REAL
#undef SUF
#define REAL double
#define SUF _f64
#include __FILE__
#undef REAL
#undef SUF

/* The power transform at exponent 1/2 of PT-MAP, PEMnE-BMS and protoLP (pt_map.power_transform) in
 * one pass: out = sign(x) sqrt(|x| + 1e-6), an exact zero (either sign) to zero_value, for x and
 * out [E, n, D] (strides in elements, each row contiguous). C's sqrt is correctly rounded; ATen's
 * vectorised one (its pow at exponent 1/2) is not always (float32: within one unit in the last
 * place, on about a fifth of the entries), so features agree with the torch formulation's to 1 ulp.
 * Returns 0; -3 for an unknown dtype. */
int poodle_power_half(int32_t dtype, int64_t E, int64_t n, int64_t D, const void *x, int64_t x_es, int64_t x_rs,
                      void *out, int64_t o_es, int64_t o_rs, double zero_value) {
    if (dtype != 0 && dtype != 1) return -3;
    /* two loops over a row (it stays in L1): GCC vectorizes neither the select nor the copysign in
     * the loop that takes the sqrt */
    for (int64_t e = 0; e < E; e++)
        for (int64_t i = 0; i < n; i++) {
            if (dtype == 0) {
                const float *restrict a = (const float *)x + e * x_es + i * x_rs;
                float *restrict b = (float *)out + e * o_es + i * o_rs;
                const float z = (float)zero_value;
                for (int64_t d = 0; d < D; d++) b[d] = sqrtf(fabsf(a[d]) + 1e-6f);
                for (int64_t d = 0; d < D; d++) b[d] = a[d] == 0.0f ? z : copysignf(b[d], a[d]);
            } else {
                const double *restrict a = (const double *)x + e * x_es + i * x_rs;
                double *restrict b = (double *)out + e * o_es + i * o_rs;
                for (int64_t d = 0; d < D; d++) b[d] = sqrt(fabs(a[d]) + 1e-6);
                for (int64_t d = 0; d < D; d++) b[d] = a[d] == 0.0 ? zero_value : copysign(b[d], a[d]);
            }
        }
    return 0;
}

/* Run a->E episodes in place (a->p, a->iters). Returns 0; -1 when a buffer cannot be allocated;
 * -2 when the caller's interface (version or struct size) is not this library's; -3 for an
 * unknown dtype or mode or bad sizes. */
int poodle_sinkhorn(const struct poodle_sinkhorn_args *a) {
    if (!a || a->version != POODLE_SINKHORN_INTERFACE || a->size != (int32_t)sizeof *a) return -2;
    if (a->mode < 0 || a->mode >= N_MODES || a->E < 0 || a->K < 1 || a->N < 0 || a->max_iter < 0) return -3;
    if (a->n_reset < 0 || a->n_reset > a->N || (a->n_reset > 0 && !a->reset) || !a->target) return -3;
    return a->dtype == 0 ? sinkhorn_f32(a) : a->dtype == 1 ? sinkhorn_f64(a) : -3;
}

#else /* the body, once per REAL */

#define V CAT(vec, SUF)
#define VL ((int)(32 / sizeof(REAL)))
typedef REAL V __attribute__((vector_size(32)));

static inline V CAT(load, SUF)(const REAL *x) {
    V v;
    memcpy(&v, x, sizeof v);
    return v;
}

static inline void CAT(store, SUF)(REAL *x, V v) { memcpy(x, &v, sizeof v); }

static inline REAL CAT(hsum, SUF)(V v) {
    REAL s = 0;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* row[n] *= by[n] for n < n_cols; returns the new row's sum (and, with guard, the sum of
 * row[n] + GUARD into *guarded) */
static inline REAL CAT(scale_sum, SUF)(REAL *row, const REAL *by, int n_cols, int guard, REAL *guarded) {
    V acc = {0}, gacc = {0};
    const V g = (V){0} + (REAL)GUARD;
    int n = 0;
    for (; n + VL <= n_cols; n += VL) {
        V x = CAT(load, SUF)(row + n) * CAT(load, SUF)(by + n);
        CAT(store, SUF)(row + n, x);
        acc += x;
        if (guard) gacc += x + g;
    }
    REAL s = CAT(hsum, SUF)(acc), gs = CAT(hsum, SUF)(gacc);
    for (; n < n_cols; n++) {
        row[n] *= by[n];
        s += row[n];
        gs += row[n] + (REAL)GUARD;
    }
    if (guard) *guarded = gs;
    return s;
}

/* row[n] *= c and acc[n] += row[n] for n < n_cols */
static inline void CAT(scale_acc, SUF)(REAL *restrict row, REAL c, REAL *restrict acc, int n_cols) {
    for (int n = 0; n < n_cols; n++) {
        row[n] *= c;
        acc[n] += row[n];
    }
}

/* inv[j] = 1 / max(rows[j], TINY_MASS): in two loops, which GCC vectorizes (not a select before a
 * division) */
static inline void CAT(reciprocals, SUF)(const REAL *restrict rows, REAL *restrict inv, int n) {
    for (int j = 0; j < n; j++) inv[j] = rows[j] < (REAL)TINY_MASS ? (REAL)TINY_MASS : rows[j];
    for (int j = 0; j < n; j++) inv[j] = (REAL)1 / inv[j];
}

/* The balanced sweeps of one episode (pt_map.balance): k classes of n samples, class stride ld. */
static int CAT(balanced, SUF)(REAL *p, int64_t ld, int k, int n, const REAL *reset, int n_reset, REAL mass,
                              double tol, int max_iter, int normalise, REAL *rows, REAL *inv, REAL *u) {
    if (normalise) {
        REAL total = 0;
        for (int c = 0; c < k; c++) {
            V acc = {0};
            const REAL *row = p + c * ld;
            int j = 0;
            for (; j + VL <= n; j += VL) acc += CAT(load, SUF)(row + j);
            REAL s = CAT(hsum, SUF)(acc);
            for (; j < n; j++) s += row[j];
            total += s;
        }
        if (total < (REAL)TINY_MASS) total = (REAL)TINY_MASS;
        for (int c = 0; c < k; c++)
            for (int j = 0; j < n; j++) p[c * ld + j] /= total;
    }
    memset(rows, 0, sizeof(REAL) * (size_t)n);
    memset(u, 0, sizeof(REAL) * (size_t)n);
    for (int c = 0; c < k; c++)
        for (int j = 0; j < n; j++) rows[j] += p[c * ld + j];
    int it = 0;
    const REAL t = (REAL)tol; /* torch compares the float32 amax with the tolerance in float32 */
    for (; it < max_iter; it++) {
        int moved = 0;
        for (int j = 0; j < n; j++) {
            REAL d = u[j] - rows[j];
            moved |= (d > t) | (-d > t);
        }
        if (!moved) break;
        CAT(reciprocals, SUF)(rows, inv, n);
        memcpy(u, rows, sizeof(REAL) * (size_t)n);
        memset(rows, 0, sizeof(REAL) * (size_t)n);
        for (int c = 0; c < k; c++) {
            REAL *row = p + c * ld;
            REAL s = CAT(scale_sum, SUF)(row, inv, n, 0, NULL);
            REAL cm = ((REAL)1 / (s < (REAL)TINY_MASS ? (REAL)TINY_MASS : s)) * mass;
            if (n_reset > 0) {
                memcpy(row, reset + c * (int64_t)n_reset, sizeof(REAL) * (size_t)n_reset);
                for (int j = 0; j < n_reset; j++) rows[j] += row[j];
                CAT(scale_acc, SUF)(row + n_reset, cm, rows + n_reset, n - n_reset);
            } else {
                CAT(scale_acc, SUF)(row, cm, rows, n);
            }
        }
    }
    return it;
}

/* The min-size sweeps of one episode (bms.min_size_sinkhorn): samples to 1, then every class of
 * mass below target rescaled to it (its mass taken with the authors' guard), n_iter times. */
static void CAT(min_size, SUF)(REAL *p, int64_t ld, int k, int n, REAL target, int n_iter, REAL *rows, REAL *inv) {
    memset(rows, 0, sizeof(REAL) * (size_t)n);
    for (int c = 0; c < k; c++)
        for (int j = 0; j < n; j++) rows[j] += p[c * ld + j];
    for (int it = 0; it < n_iter; it++) {
        /* a sample's mass is positive (a softmax); the floor keeps a zero one zero */
        CAT(reciprocals, SUF)(rows, inv, n);
        memset(rows, 0, sizeof(REAL) * (size_t)n);
        for (int c = 0; c < k; c++) {
            REAL *row = p + c * ld, guarded = 0;
            REAL s = CAT(scale_sum, SUF)(row, inv, n, 1, &guarded);
            REAL cm = s < target ? (REAL)1 / (guarded / target) : (REAL)1;
            if (cm == (REAL)1) {
                for (int j = 0; j < n; j++) rows[j] += row[j];
            } else {
                CAT(scale_acc, SUF)(row, cm, rows, n);
            }
        }
    }
}

static int CAT(sinkhorn, SUF)(const struct poodle_sinkhorn_args *a) {
    size_t n_buf = (size_t)(a->N > 0 ? a->N : 1);
    REAL *buf = malloc(sizeof(REAL) * 3 * n_buf);
    if (!buf) return -1;
    REAL *rows = buf, *inv = buf + n_buf, *u = buf + 2 * n_buf;
    int rc = 0;
    for (int e = 0; e < a->E; e++) {
        int k = a->ways ? (int)a->ways[e] : a->K;
        int n = a->cols ? (int)a->cols[e] : a->N;
        if (k < 0 || k > a->K || n < 0 || n > a->N || (a->mode == MODE_BALANCED && a->n_reset > n)) {
            rc = -3;
            break;
        }
        REAL *p = (REAL *)a->p + e * a->p_es;
        int it = a->max_iter;
        if (a->mode == MODE_BALANCED) {
            const REAL *reset = a->n_reset > 0 ? (const REAL *)a->reset + e * a->r_es : NULL;
            it = CAT(balanced, SUF)(p, a->N, k, n, reset, a->n_reset, (REAL)a->target[e], a->tol, a->max_iter,
                                    a->normalise, rows, inv, u);
        } else {
            CAT(min_size, SUF)(p, a->N, k, n, (REAL)a->target[e], a->max_iter, rows, inv);
        }
        if (a->iters) a->iters[e] = it;
    }
    free(buf);
    return rc;
}

#undef V
#undef VL
#endif
