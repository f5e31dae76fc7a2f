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
 * The same library holds the methods' feature pipeline at exponent 1/2 (poodle_power_half,
 * poodle_pemne) and protoLP's label propagation (poodle_propagate), each an episode at a time.
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

/* the libm function of each precision, by suffix */
static inline float sqrt__f32(float v) { return sqrtf(v); }
static inline double sqrt__f64(double v) { return sqrt(v); }
static inline float fabs__f32(float v) { return fabsf(v); }
static inline double fabs__f64(double v) { return fabs(v); }
static inline float copysign__f32(float a, float b) { return copysignf(a, b); }
static inline double copysign__f64(double a, double b) { return copysign(a, b); }

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

/* The feature pipeline of PT-MAP, PEMnE-BMS and protoLP at exponent 1/2 (pt_map.preprocess,
 * bms.peme, the first steps of proto_lp.preprocess), each episode's rows in two passes that keep
 * them in cache instead of the six or seven passes of the torch formulation over the whole chunk:
 * pass one takes each row's power transform (as poodle_power_half), divides it by its norm
 * (floored at 1e-12, F.normalize) and adds it to its group's sum; pass two subtracts the group's
 * mean and divides by the new norm. The parts x[p] ([E, rows[p], D], strides in elements, rows
 * contiguous) are stacked along the rows of out [E, sum rows, D]. centre: 0 none (one pass),
 * 1 every row on the mean of all, 2 each part's rows on their own mean. keep [E, sum rows] (bytes,
 * or NULL: all) marks the real rows: a padded one is zero and enters no mean. Norms and means are
 * sums in a different order from torch's, so features agree with the torch formulation to float
 * rounding. Returns 0; -1 when a buffer cannot be allocated; -3 for an unknown dtype or bad
 * sizes. */
int poodle_pemne(int32_t dtype, int64_t E, int64_t D, int32_t n_parts, const int64_t *rows, const void *const *x,
                 const int64_t *x_es, const int64_t *x_rs, void *out, int64_t o_es, int64_t o_rs, double zero_value,
                 int32_t centre, const uint8_t *keep, int64_t k_es) {
    if (n_parts < 1 || centre < 0 || centre > 2 || E < 0 || D < 1 || !rows || !x || !x_es || !x_rs || !out) return -3;
    for (int32_t p = 0; p < n_parts; p++)
        if (rows[p] < 0 || !x[p]) return -3;
    if (dtype == 0)
        return pemne_f32(E, D, n_parts, rows, x, x_es, x_rs, (float *)out, o_es, o_rs, (float)zero_value, centre, keep,
                         k_es);
    if (dtype == 1)
        return pemne_f64(E, D, n_parts, rows, x, x_es, x_rs, (double *)out, o_es, o_rs, zero_value, centre, keep, k_es);
    return -3;
}

/* protoLP's label propagation over the prototype graph (proto_lp.propagate), each episode's in
 * one pass over its K x N assignments z (classes first, the support samples' rows their labels):
 * delta_k = max(sum_n z_kn, 1e-30), W = z (z / delta)^T, the Cholesky factor of the symmetric matrix
 * whose lower triangle is M = yty + gamma (I - W) (what LAPACK's potrf reads of torch's), the solve
 * M A = yty, and out = A^T z. z, out [E, K, N] and yty [E, K, K] contiguous. Where M is not positive
 * definite (a pivot not above zero, as potrf's info), bad[e] = 1 and out is left for the caller
 * (torch's pseudo-inverse), else bad[e] = 0. The sums run in another order than torch's products
 * and LAPACK's, so results agree to float rounding. Returns the number of such episodes; -1 when a
 * buffer cannot be allocated; -3 for an unknown dtype or bad sizes. */
int poodle_propagate(int32_t dtype, int64_t E, int32_t K, int32_t N, const void *z, const void *yty, double gamma,
                     void *out, int32_t *bad) {
    if (E < 0 || K < 1 || N < 0 || !z || !yty || !out || !bad) return -3;
    if (dtype == 0)
        return propagate_f32(E, K, N, (const float *)z, (const float *)yty, (float)gamma, (float *)out, bad, NULL);
    if (dtype == 1)
        return propagate_f64(E, K, N, (const double *)z, (const double *)yty, gamma, (double *)out, bad, NULL);
    return -3;
}

/* protoLP's whole step after its assignments' kernel: plan [E, K, N - n_reset] holds
 * exp(-lam cost) of the queries (overwritten: balanced as pt_map.sinkhorn balances it, each plan
 * divided by its total, samples to 1, classes to plan_target[e], to plan_tol, over ways[e] classes
 * and plan_cols[e] samples or all), z [E, K, N] receives [reset | plan] (the step's assignments),
 * then poodle_propagate's propagation, where the system was positive definite the balanced sweeps
 * of proto_lp.lp_normalise (samples to 1, classes to target[e], the first n_reset samples reset
 * after each, to tol; cols[e] samples or all) and the mask clamp(mix P + keep z, 0, 1) (keep =
 * 1 - mix) into out. One call a step for what the torch formulation does in about 30 operations
 * and two LAPACK calls per episode. Returns the number of episodes whose system was not positive
 * definite (bad[e] = 1: their z is written, their out left to the caller), or poodle_propagate's
 * error codes. sweeps (or NULL): each episode's sweeps of both loops are added to sweeps[e]. */
int poodle_lp_assign_step(int32_t dtype, int64_t E, int32_t K, int32_t N, void *plan, const double *plan_target,
                          double plan_tol, const int64_t *plan_cols, void *z, const void *yty, double gamma, double mix,
                          double keep, const void *reset, int32_t n_reset, const double *target, double tol,
                          int32_t max_iter, const int64_t *ways, const int64_t *cols, void *out, int32_t *bad,
                          int32_t *sweeps) {
    if (E < 0 || K < 1 || N < 0 || !z || !yty || !out || !bad || !target || n_reset < 0 || n_reset > N ||
        (n_reset > 0 && !reset) || max_iter < 0 || !plan || !plan_target)
        return -3;
    if (dtype == 0) {
        struct lp_f32 lp = {(float)mix, (float)keep, (const float *)reset, n_reset, target, tol, max_iter, ways, cols,
                            (float *)plan, N - n_reset, plan_target, plan_tol, plan_cols, sweeps};
        return propagate_f32(E, K, N, (const float *)z, (const float *)yty, (float)gamma, (float *)out, bad, &lp);
    }
    if (dtype == 1) {
        struct lp_f64 lp = {mix, keep, (const double *)reset, n_reset, target, tol, max_iter, ways, cols,
                            (double *)plan, N - n_reset, plan_target, plan_tol, plan_cols, sweeps};
        return propagate_f64(E, K, N, (const double *)z, (const double *)yty, gamma, (double *)out, bad, &lp);
    }
    return -3;
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

/* sum of row[d]^2 for d < D, in vector lanes */
static inline REAL CAT(sqsum, SUF)(const REAL *row, int64_t D) {
    V acc = {0};
    int64_t d = 0;
    for (; d + VL <= D; d += VL) {
        V v = CAT(load, SUF)(row + d);
        acc += v * v;
    }
    REAL s = CAT(hsum, SUF)(acc);
    for (; d < D; d++) s += row[d] * row[d];
    return s;
}

/* row /= max(||row||, 1e-12) (F.normalize's floor) */
static inline void CAT(unit, SUF)(REAL *row, int64_t D) {
    REAL n = CAT(sqrt_, SUF)(CAT(sqsum, SUF)(row, D));
    if (n < (REAL)1e-12) n = (REAL)1e-12;
    for (int64_t d = 0; d < D; d++) row[d] /= n;
}

/* poodle_pemne for one REAL: rows of the parts [first, last) of one episode form one group */
static int CAT(pemne, SUF)(int64_t E, int64_t D, int n_parts, const int64_t *rows, const void *const *x,
                           const int64_t *x_es, const int64_t *x_rs, REAL *out, int64_t o_es, int64_t o_rs,
                           REAL zero_value, int centre, const uint8_t *keep, int64_t k_es) {
    REAL *mean = NULL;
    if (centre && !(mean = malloc(sizeof(REAL) * (size_t)D))) return -1;
    for (int64_t e = 0; e < E; e++) {
        int64_t r0 = 0; /* first row of the group in out */
        for (int first = 0; first < n_parts;) {
            int last = centre == 1 ? n_parts : first + 1;
            int64_t n_real = 0, r = r0;
            if (centre) memset(mean, 0, sizeof(REAL) * (size_t)D);
            for (int p = first; p < last; p++)
                for (int64_t i = 0; i < rows[p]; i++, r++) {
                    const REAL *restrict a = (const REAL *)x[p] + e * x_es[p] + i * x_rs[p];
                    REAL *restrict b = out + e * o_es + r * o_rs;
                    if (keep && !keep[e * k_es + r]) {
                        memset(b, 0, sizeof(REAL) * (size_t)D);
                        continue;
                    }
                    /* two loops, as poodle_power_half: GCC vectorizes neither the select nor the
                     * copysign in the loop that takes the sqrt */
                    for (int64_t d = 0; d < D; d++) b[d] = CAT(sqrt_, SUF)(CAT(fabs_, SUF)(a[d]) + (REAL)1e-6);
                    for (int64_t d = 0; d < D; d++) b[d] = a[d] == (REAL)0 ? zero_value : CAT(copysign_, SUF)(b[d], a[d]);
                    CAT(unit, SUF)(b, D);
                    if (centre) {
                        for (int64_t d = 0; d < D; d++) mean[d] += b[d];
                        n_real++;
                    }
                }
            if (centre) {
                /* torch: the mean of the rows, or over the real ones (at least one) */
                REAL count = (REAL)(keep ? (n_real > 0 ? n_real : 1) : r - r0);
                for (int64_t d = 0; d < D; d++) mean[d] /= count;
                for (int64_t q = r0; q < r; q++) {
                    if (keep && !keep[e * k_es + q]) continue;
                    REAL *b = out + e * o_es + q * o_rs;
                    for (int64_t d = 0; d < D; d++) b[d] -= mean[d];
                    CAT(unit, SUF)(b, D);
                }
            }
            r0 = r;
            first = last;
        }
    }
    free(mean);
    return 0;
}

/* protoLP's propagation of one episode (poodle_propagate): o = A^T z, or 0 (o untouched) where the
 * system is not positive definite; zd [K, N], m and a [K, K], delta [K] are the caller's buffers */
static int CAT(propagate_one, SUF)(const REAL *ze, const REAL *y, int K, int N, REAL gamma, REAL *o, REAL *zd,
                                   REAL *m, REAL *a, REAL *delta) {
    for (int k = 0; k < K; k++) {
        REAL s = 0;
        for (int n = 0; n < N; n++) s += ze[k * N + n];
        delta[k] = s < (REAL)TINY_MASS ? (REAL)TINY_MASS : s;
        for (int n = 0; n < N; n++) zd[k * N + n] = ze[k * N + n] / delta[k];
    }
    /* the lower triangle of M = yty + gamma (I - W), W_ij = <z_i, zd_j>; then its Cholesky factor
     * in place (lower), as potrf */
    for (int i = 0; i < K; i++)
        for (int j = 0; j <= i; j++) {
            V acc = {0};
            int n = 0;
            for (; n + VL <= N; n += VL) acc += CAT(load, SUF)(ze + i * N + n) * CAT(load, SUF)(zd + j * N + n);
            REAL w = CAT(hsum, SUF)(acc);
            for (; n < N; n++) w += ze[i * N + n] * zd[j * N + n];
            m[i * K + j] = y[i * K + j] + gamma * ((i == j ? (REAL)1 : (REAL)0) - w);
        }
    for (int j = 0; j < K; j++) {
        REAL d = m[j * K + j];
        for (int k = 0; k < j; k++) d -= m[j * K + k] * m[j * K + k];
        if (!(d > 0)) return 0;
        d = CAT(sqrt_, SUF)(d);
        m[j * K + j] = d;
        for (int i = j + 1; i < K; i++) {
            REAL t = m[i * K + j];
            for (int k = 0; k < j; k++) t -= m[i * K + k] * m[j * K + k];
            m[i * K + j] = t / d;
        }
    }
    /* L L^T A = yty, column by column: L y = b, then L^T a = y */
    for (int c = 0; c < K; c++) {
        for (int i = 0; i < K; i++) {
            REAL t = y[i * K + c];
            for (int k = 0; k < i; k++) t -= m[i * K + k] * a[k * K + c];
            a[i * K + c] = t / m[i * K + i];
        }
        for (int i = K - 1; i >= 0; i--) {
            REAL t = a[i * K + c];
            for (int k = i + 1; k < K; k++) t -= m[k * K + i] * a[k * K + c];
            a[i * K + c] = t / m[i * K + i];
        }
    }
    /* o_k = sum_i A_ik z_i */
    for (int k = 0; k < K; k++) {
        REAL *row = o + k * N;
        for (int n = 0; n < N; n++) row[n] = 0;
        for (int i = 0; i < K; i++) {
            const REAL c = a[i * K + k], *zi = ze + i * N;
            for (int n = 0; n < N; n++) row[n] += c * zi[n];
        }
    }
    return 1;
}

/* poodle_propagate for one REAL; with lp (protoLP's step, poodle_lp_assign_step),
 * each propagated plan then goes through the balanced sweeps (the first n_reset samples reset to
 * reset after each) and becomes its mask clamp(mix P + (1 - mix) z, 0, 1) */
struct CAT(lp, SUF) {
    REAL mix, keep;
    const REAL *reset;
    int n_reset;
    const double *target;
    double tol;
    int max_iter;
    const int64_t *ways, *cols;
    /* with plan (poodle_lp_assign_step): the assignments' exp(-lam cost) [E, K, n_plan], balanced
     * first (each plan divided by its total, samples to 1, classes to plan_target[e], to plan_tol;
     * plan_cols[e] samples or all), then z = [reset | plan] is written to the caller's z */
    REAL *plan;
    int n_plan;
    const double *plan_target;
    double plan_tol;
    const int64_t *plan_cols;
    int32_t *sweeps; /* [E] or NULL: each episode's sweeps of both loops are added to it */
};

static int CAT(propagate, SUF)(int64_t E, int K, int N, const REAL *z, const REAL *yty, REAL gamma, REAL *out,
                               int32_t *bad, const struct CAT(lp, SUF) *lp) {
    size_t kk = (size_t)K * (size_t)K, kn = (size_t)K * (size_t)(N > 0 ? N : 1), n1 = (size_t)(N > 0 ? N : 1);
    REAL *buf = malloc(sizeof(REAL) * (kn + 2 * kk + (size_t)K + 3 * n1));
    if (!buf) return -1;
    REAL *zd = buf, *m = zd + kn, *a = m + kk, *delta = a + kk, *rows = delta + K, *inv = rows + n1, *u = inv + n1;
    int rc = 0;
    for (int64_t e = 0; e < E; e++) {
        const REAL *ze = z + e * (int64_t)K * N;
        REAL *o = out + e * (int64_t)K * N;
        if (lp && lp->plan) {
            int k = lp->ways ? (int)lp->ways[e] : K, n = lp->plan_cols ? (int)lp->plan_cols[e] : lp->n_plan;
            if (k < 0 || k > K || n < 0 || n > lp->n_plan) {
                rc = -3;
                break;
            }
            REAL *q = lp->plan + e * (int64_t)K * lp->n_plan, *zw = (REAL *)ze;
            int it = CAT(balanced, SUF)(q, lp->n_plan, k, n, NULL, 0, (REAL)lp->plan_target[e], lp->plan_tol,
                                        lp->max_iter, 1, rows, inv, u);
            if (lp->sweeps) lp->sweeps[e] += it;
            for (int c = 0; c < K; c++) {
                memcpy(zw + c * N, lp->reset + (e * K + c) * (int64_t)lp->n_reset, sizeof(REAL) * (size_t)lp->n_reset);
                memcpy(zw + c * N + lp->n_reset, q + c * lp->n_plan, sizeof(REAL) * (size_t)lp->n_plan);
            }
        }
        bad[e] = !CAT(propagate_one, SUF)(ze, yty + e * (int64_t)kk, K, N, gamma, o, zd, m, a, delta);
        if (bad[e] || !lp) continue;
        int k = lp->ways ? (int)lp->ways[e] : K, n = lp->cols ? (int)lp->cols[e] : N;
        if (k < 0 || k > K || n < lp->n_reset || n > N) {
            rc = -3;
            break;
        }
        int it = CAT(balanced, SUF)(o, N, k, n, lp->reset + e * (int64_t)K * lp->n_reset, lp->n_reset,
                                    (REAL)lp->target[e], lp->tol, lp->max_iter, 0, rows, inv, u);
        if (lp->sweeps) lp->sweeps[e] += it;
        for (int64_t j = 0; j < (int64_t)K * N; j++) {
            REAL v = lp->mix * o[j] + lp->keep * ze[j];
            o[j] = v < 0 ? 0 : v > 1 ? 1 : v;
        }
    }
    free(buf);
    if (rc < 0) return rc;
    int n_bad = 0;
    for (int64_t e = 0; e < E; e++) n_bad += bad[e] != 0;
    return n_bad;
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
