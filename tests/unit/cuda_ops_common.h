/* Shared harness of the CUDA-backend op tests (test_cuda_ops.c: memory, weights, dense;
 * test_cuda_moe.c: router, experts, combine; test_cuda_ops_misc.c: elementwise, mHC, Engram,
 * attention): the CUDA backend against the CPU reference backend, op by op, over every entry of
 * kernels/backend.h.
 *
 * Each case draws fresh seeded inputs shaped like the real thing (DeepSeek-V4.1-Flash per rank under
 * TP8, MODEL.md §1.2/§2: D 5120, 8 local heads of 512, q_lora 1280, one wo_a group of 1024 × 4096,
 * 4 local index heads of 128, 48 of 384 experts with inter 2304, top-6, hc 4, vocab slice 16160,
 * window 128 + index top-k 512) and at odd extents, runs the op on both backends and compares every
 * output with the bound of src/tolerances.h ("GPU (CUDA backend) vs CPU backend, per op"):
 *  - exact ops bit for bit;
 *  - ops with one output rounding as |gpu − cpu| <= atol + rtol·|cpu|, atol from Σ|terms| of the
 *    feeding sums computed here in double;
 *  - ops that round to bf16 in the middle (sparse_attn, index_scores, the experts, the Engram gate,
 *    compress_pool, the router's scores) by carrying each intermediate as the interval of values the
 *    two backends may produce; the CPU result must lie in the same interval (a check of this model).
 * GPU outputs are poisoned (NaN patterns) before each run, every device buffer carries sentinels
 * (0xBEEF) past its end, and outputs an op must not write (moe_experts' foreign slots, the row
 * padding of index_scores) must still hold the poison afterwards.
 * Batch invariance: for linear (FP8, FP4, BF16), sparse_attn, index_scores, moe_experts and head, a
 * row computed within T = 1 is bit-identical to the same row within T = 8 and 64 (and 300 for
 * linear: the prefill path).
 * Every case prints its deviation (print_message) and each program ends with a per-op summary.
 * DS_TEST_FILTER / DS_TEST_SKIP (glob patterns of test names) run or skip tests.
 * Without a GPU (built without DS_HAVE_CUDA, or no device) every test skips. With DS_CUDA_OPS_ON_CPU
 * set, a second CPU backend stands in for the GPU: every comparison is then trivially exact, but
 * every model above is checked against the oracle (the self-checks), on any machine.
 *
 * Every function here is static inline and every object static: the Makefile builds each
 * tests/unit/test_*.c alone into its own program, so each includes its own copy. */
#ifndef DS_TESTS_CUDA_OPS_COMMON_H
#define DS_TESTS_CUDA_OPS_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "formats.h"
#include "tolerances.h"
#include "xorshift.h"

#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define U TOL_FP32_U

/* The interval models below round both ends of an interval at every bf16 rounding point: exactly one
 * bf16 ulp of freedom there, which is what these entries state. */
_Static_assert(TOL_GPU_SPARSE_ATTN_P_FLIP_ULPS == 1 && TOL_GPU_SPARSE_ATTN_OUT_ULPS == 1 &&
                   TOL_GPU_INDEX_SCORES_FLIP_ULPS == 1 && TOL_GPU_MOE_FLIP_ULPS == 1 &&
                   TOL_GPU_ENGRAM_GATE_OUT_ULPS == 1 && TOL_GPU_COMPRESS_POOL_OUT_ULPS == 1,
               "the interval models allow one bf16 ulp per rounding point");
_Static_assert(TOL_GPU_DATA_EXACT == 0 && TOL_GPU_QDQ_EXACT == 0 && TOL_GPU_ELEMENTWISE_EXACT == 0,
               "these ops are compared bit for bit");

/* V4.1-Flash (MODEL.md §1.2), one rank of TP8 */
#define DIM 5120
#define HD 512
#define H_LOCAL 8       /* 64 heads / 8 */
#define Q_LORA 1280
#define O_LORA 1024     /* per group; 8 groups / 8 ranks: one group per rank */
#define O_GROUP_IN 4096 /* 8 heads · 512 */
#define IDX_H_LOCAL 4   /* 32 index heads / 8 */
#define IDX_HD 128
#define N_EXPERTS 384
#define E_LOCAL 48
#define TOPK 6
#define MOE_INTER 2304
#define HC 4
#define VOCAB 129280
#define VOCAB_LOCAL 16160
#define WINDOW 128
#define INDEX_TOPK 512
#define RANK 3

static struct backend cpu_be, gpu_be;
static int gpu_state; /* 0: no GPU (skip), 1: ready, 2: CPU stand-in, -1: a device but backend_cuda_init failed */

/* Every test begins with NEED_GPU(st): it skips without a GPU, fails where a device is present but its
 * backend did not start, and starts the list of live device buffers empty. */
#define NEED_GPU(st)                                                                                       \
    do {                                                                                                   \
        (void)(st);                                                                                        \
        if (gpu_state == 0) skip();                                                                        \
        if (gpu_state < 0) fail_msg("a CUDA device is present but backend_cuda_init failed");              \
        n_live = 0;                                                                                        \
    } while (0)

#define CPU (cpu_be.ops)
#define GPU (gpu_be.ops)

/* ---------------------------------------------------------------------------------------------
 * Seeded inputs (xorshift64) */

static uint64_t rng_s = 1;

static inline uint64_t rnd64(void) { return xorshift64(&rng_s); }

static inline void seed_tag(const char *tag) { /* FNV-1a of the case name: each case reproducible alone */
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = tag; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
    rng_s = h | 1;
    for (int i = 0; i < 8; i++) rnd64();
}

static inline double urand(void) { return (double)(rnd64() >> 11) * 0x1p-53; }
static inline int64_t irand(int64_t n) { return (int64_t)(urand() * (double)n); }

/* Unit gaussian, Irwin–Hall of four 16-bit uniforms (one draw per value; tails at ±3.46, the
 * outliers are added on purpose where they belong). */
static inline float gauss(void) {
    uint64_t r = rnd64();
    double s = (double)(r & 0xFFFF) + (double)((r >> 16) & 0xFFFF) + (double)((r >> 32) & 0xFFFF) + (double)(r >> 48);
    return (float)((s / 65536.0 - 2.0) * 1.7320508075688772);
}

static inline void fill_gauss_bf16(bf16_t *x, int64_t n, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = bf16_from_f32(gauss() * sd);
}

/* Activations: gaussian of RMS `rms` with about one channel in 64 an outlier 10–100× larger. */
static inline void fill_act(bf16_t *x, int64_t n, float rms) {
    for (int64_t i = 0; i < n; i++) {
        float v = gauss() * rms;
        if ((rnd64() & 63) == 0) v *= 10.0f + 90.0f * (float)urand();
        x[i] = bf16_from_f32(v);
    }
}

static inline void fill_f32(float *x, int64_t n, float mean, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = mean + gauss() * sd;
}

static inline void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}
#define NEW(type, n) ((type *)xmalloc(sizeof(type) * (size_t)(n)))

/* Whether x is among v[0, n): draws of distinct expert ids and index entries redraw while it is. */
static inline bool i32_in(const int32_t *v, int64_t n, int32_t x) {
    for (int64_t i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}

/* ---------------------------------------------------------------------------------------------
 * Rounding model: ulps, directed conversions, intervals */

/* One bf16 ulp at |v| (the spacing of the binade of v; subnormal spacing below 2^-126). */
static inline double ulp_bf16(double v) {
    v = fabs(v);
    if (!(v >= 0x1p-126)) return 0x1p-133;
    if (isinf(v)) return INFINITY;
    int e;
    frexp(v, &e);
    return ldexp(1.0, e - 8);
}

static inline float f32_dn(double x) {
    float f = (float)x;
    if ((double)f > x) f = nextafterf(f, -INFINITY);
    return f;
}
static inline float f32_up(double x) {
    float f = (float)x;
    if ((double)f < x) f = nextafterf(f, INFINITY);
    return f;
}

typedef struct {
    double lo, hi;
} iv_t;

static inline iv_t iv(double lo, double hi) {
    iv_t r = {lo, hi};
    return r;
}
static inline iv_t iv_pt(double v) { return iv(v, v); }
/* An fp32 operation's rounding (relative u, and an absolute 2^-149 for results in the subnormals). */
static inline iv_t iv_round(iv_t a) { return iv(a.lo - U * fabs(a.lo) - 0x1p-149, a.hi + U * fabs(a.hi) + 0x1p-149); }
static inline iv_t iv_widen_rel(iv_t a, double r) { return iv(a.lo - r * fabs(a.lo) - 0x1p-149, a.hi + r * fabs(a.hi) + 0x1p-149); }
static inline iv_t iv_widen(iv_t a, double e) { return iv(a.lo - e, a.hi + e); }
static inline iv_t iv_add(iv_t a, iv_t b) { return iv(a.lo + b.lo, a.hi + b.hi); }
static inline iv_t iv_mul(iv_t a, iv_t b) {
    double p[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
    iv_t r = iv(p[0], p[0]);
    for (int i = 1; i < 4; i++) {
        r.lo = fmin(r.lo, p[i]);
        r.hi = fmax(r.hi, p[i]);
    }
    return r;
}
static inline iv_t iv_div_pos(iv_t a, iv_t b) { /* b.lo > 0 */
    return iv(fmin(a.lo / b.lo, a.lo / b.hi), fmax(a.hi / b.lo, a.hi / b.hi));
}
/* bf16 RNE of an fp32 value known to lie in [lo, hi]: [bf16(fp32↓(lo)), bf16(fp32↑(hi))]. */
static inline iv_t iv_bf16(iv_t a) {
    return iv(bf16_to_f32(bf16_from_f32(f32_dn(a.lo))), bf16_to_f32(bf16_from_f32(f32_up(a.hi))));
}
/* A sum of n terms with Σ|t| = A, interval of the exact value widened by the larger (GPU) backend's
 * sum bound plus the double evaluation's own error. */
static inline double rad_sum(double n, double A) { return (TOL_GPU_SUM_U_PER_TERM * n * U + (n + 2) * 0x1p-53) * A; }
static inline iv_t iv_sum(double S_lo, double S_hi, double n, double A) {
    double r = rad_sum(n, A);
    return iv(S_lo - r, S_hi + r);
}
/* The GPU's expf (the larger error of the two libms), relative. */
#define EXP_REL (2.0 * TOL_GPU_LIBM_ULP * U)
/* A division a/b, which a kernel may take as a·(1/b): TOL_GPU_DIV_ROUNDINGS roundings. */
static inline iv_t iv_div_round(iv_t a, iv_t b) {
    iv_t r = iv_div_pos(a, b);
    for (int i = 0; i < TOL_GPU_DIV_ROUNDINGS; i++) r = iv_round(r);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * Comparison records: one per case, printed, merged into a per-op summary */

struct cmp {
    char op[32], what[200];
    double max_abs, max_rel, max_ratio, tol_rel_sum;
    long long n, ndiff, nbad, nself, tol_rel_n;
    char bad[400], self[400];
};

#define MAX_OPS 64
static struct {
    char op[32];
    double max_abs, max_rel, max_ratio;
    long long n, ndiff, cases;
} summary[MAX_OPS];
static int n_summary;

static inline void cmp_begin(struct cmp *c, const char *op, const char *fmt, ...) {
    memset(c, 0, sizeof *c);
    snprintf(c->op, sizeof c->op, "%s", op);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->what, sizeof c->what, fmt, ap);
    va_end(ap);
}

/* how loose the bound is: the allowed distance relative to |cpu| */
static inline void cmp_room(struct cmp *c, double r, double room) {
    if (r != 0.0 && isfinite(r) && isfinite(room)) {
        c->tol_rel_sum += room / fabs(r);
        c->tol_rel_n++;
    }
}

static inline void cmp_note(struct cmp *c, double g, double r) {
    c->n++;
    if (g == r || (isnan(g) && isnan(r))) return;
    c->ndiff++;
    double d = fabs(g - r);
    if (isnan(d)) return;
    double rel = r != 0.0 ? d / fabs(r) : d;
    if (d > c->max_abs) c->max_abs = d;
    if (rel > c->max_rel) c->max_rel = rel;
}

/* |g − r| <= tol */
static inline void cmp_tol(struct cmp *c, long long i, double g, double r, double tol) {
    cmp_note(c, g, r);
    cmp_room(c, r, tol);
    double d = g == r ? 0.0 : fabs(g - r);
    if (!(d <= tol)) {
        if (!c->nbad++)
            snprintf(c->bad, sizeof c->bad, "element %lld: gpu %.9g cpu %.9g |gpu-cpu| %.3g > tolerance %.3g", i, g, r,
                     d, tol);
    } else if (d > 0 && d / tol > c->max_ratio)
        c->max_ratio = d / tol;
}

/* r (the CPU) must satisfy the test's own derivation: |r − center| <= tol */
static inline void cmp_self(struct cmp *c, long long i, double r, double center, double tol) {
    double d = r == center ? 0.0 : fabs(r - center);
    if (!(d <= tol) && !c->nself++)
        snprintf(c->self, sizeof c->self, "element %lld: cpu %.9g, model %.9g ± %.3g", i, r, center, tol);
}

/* g and r in [lo, hi] */
static inline void cmp_iv(struct cmp *c, long long i, double g, double r, iv_t b) {
    cmp_note(c, g, r);
    cmp_room(c, r, fmax(b.hi - r, r - b.lo));
    if (!(g >= b.lo && g <= b.hi)) {
        if (!c->nbad++)
            snprintf(c->bad, sizeof c->bad, "element %lld: gpu %.9g outside [%.9g, %.9g] (cpu %.9g)", i, g, b.lo, b.hi, r);
    } else if (g != r) {
        double room = g > r ? b.hi - r : r - b.lo;
        if (room > 0 && fabs(g - r) / room > c->max_ratio) c->max_ratio = fabs(g - r) / room;
    }
    if (!(r >= b.lo && r <= b.hi) && !c->nself++)
        snprintf(c->self, sizeof c->self, "element %lld: cpu %.9g outside the model's [%.9g, %.9g]", i, r, b.lo, b.hi);
}

static inline void cmp_bits(struct cmp *c, long long i, uint64_t gb, uint64_t rb, double g, double r) {
    cmp_note(c, gb == rb ? r : g, r);
    if (gb != rb && !c->nbad++)
        snprintf(c->bad, sizeof c->bad, "element %lld: gpu bits %#llx (%.9g) cpu bits %#llx (%.9g), must be equal", i,
                 (unsigned long long)gb, g, (unsigned long long)rb, r);
}

static inline void cmp_bf16_exact(struct cmp *c, const bf16_t *g, const bf16_t *r, int64_t n) {
    for (int64_t i = 0; i < n; i++) cmp_bits(c, i, g[i], r[i], bf16_to_f32(g[i]), bf16_to_f32(r[i]));
}

static inline void cmp_f32_exact(struct cmp *c, const float *g, const float *r, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t a, b;
        memcpy(&a, g + i, 4);
        memcpy(&b, r + i, 4);
        cmp_bits(c, i, a, b, g[i], r[i]);
    }
}

static inline void cmp_fail(struct cmp *c, const char *fmt, ...) {
    if (c->nbad++) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->bad, sizeof c->bad, fmt, ap);
    va_end(ap);
}

static inline void cmp_end(struct cmp *c) {
    print_message("  %-15s %-46s n=%-9lld differ=%-8lld max|d|=%-10.3g max rel=%-10.3g max d/tol=%-9.3g tol/|cpu| %.2g\n",
                  c->op, c->what, c->n, c->ndiff, c->max_abs, c->max_rel, c->max_ratio,
                  c->tol_rel_n ? c->tol_rel_sum / (double)c->tol_rel_n : 0.0);
    int k;
    for (k = 0; k < n_summary; k++)
        if (!strcmp(summary[k].op, c->op)) break;
    if (k == n_summary && n_summary < MAX_OPS) {
        memset(&summary[k], 0, sizeof summary[k]);
        snprintf(summary[k].op, sizeof summary[k].op, "%s", c->op);
        n_summary++;
    }
    if (k < MAX_OPS) {
        summary[k].cases++;
        summary[k].n += c->n;
        summary[k].ndiff += c->ndiff;
        summary[k].max_abs = fmax(summary[k].max_abs, c->max_abs);
        summary[k].max_rel = fmax(summary[k].max_rel, c->max_rel);
        summary[k].max_ratio = fmax(summary[k].max_ratio, c->max_ratio);
    }
    if (c->nself)
        fail_msg("%s %s: the CPU result violates the test's own rounding model in %lld elements (a bug in this test "
                 "or in the CPU backend, not the GPU); first: %s",
                 c->op, c->what, c->nself, c->self);
    if (c->nbad) fail_msg("%s %s: %lld of %lld outputs out of tolerance; first: %s", c->op, c->what, c->nbad, c->n, c->bad);
}

/* ---------------------------------------------------------------------------------------------
 * Device harness: every buffer carries SENT_BYTES of 0xBEEF past its end, checked when freed;
 * outputs are poisoned with NaN patterns before each run. */

#define SENT_BYTES 64
#define SENTINEL16 0xBEEFu
#define POISON16 0xFFBEu       /* a bf16 NaN */
#define POISON32F 0xFFBEBEEFu  /* an fp32 NaN */
#define POISON32I 0xBEEFBEEFu  /* a negative int32: never a valid index */
enum pz { PZ_16, PZ_32F, PZ_32I };

#define MAX_LIVE 1024
static struct {
    uint8_t *p;
    size_t bytes;
} live[MAX_LIVE];
static int n_live;

static inline void g_sync(void) { GPU->sync(&gpu_be); }

static inline void *g_alloc(size_t bytes) {
    uint8_t *p = GPU->alloc(&gpu_be, bytes + SENT_BYTES);
    assert_non_null(p);
    uint16_t s[SENT_BYTES / 2];
    for (int i = 0; i < SENT_BYTES / 2; i++) s[i] = SENTINEL16;
    GPU->upload(&gpu_be, p + bytes, s, SENT_BYTES);
    g_sync();
    assert_true(n_live < MAX_LIVE);
    live[n_live].p = p;
    live[n_live].bytes = bytes;
    n_live++;
    return p;
}

static inline void g_put(void *d, const void *h, size_t bytes) {
    if (!bytes) return;
    GPU->upload(&gpu_be, d, h, bytes);
    g_sync();
}

static inline void *g_in(const void *h, size_t bytes) {
    void *d = g_alloc(bytes);
    g_put(d, h, bytes);
    return d;
}

static inline void poison_host(void *h, size_t bytes, enum pz kind) {
    if (kind == PZ_16) {
        uint16_t *p = h;
        for (size_t i = 0; i < bytes / 2; i++) p[i] = POISON16;
    } else {
        uint32_t v = kind == PZ_32F ? POISON32F : POISON32I, *p = h;
        for (size_t i = 0; i < bytes / 4; i++) p[i] = v;
    }
}

static inline void *g_out(size_t bytes, enum pz kind) {
    void *d = g_alloc(bytes);
    void *h = xmalloc(bytes);
    poison_host(h, bytes, kind);
    g_put(d, h, bytes);
    free(h);
    return d;
}

static inline void g_get(void *h, const void *d, size_t bytes) {
    g_sync();
    if (bytes) GPU->download(&gpu_be, h, d, bytes);
    g_sync();
}

static inline void g_free(void *d) {
    int i;
    for (i = n_live - 1; i >= 0; i--)
        if (live[i].p == d) break;
    assert_true(i >= 0);
    size_t bytes = live[i].bytes;
    live[i] = live[--n_live];
    uint16_t s[SENT_BYTES / 2];
    g_get(s, (uint8_t *)d + bytes, SENT_BYTES);
    GPU->free(&gpu_be, d);
    for (int j = 0; j < SENT_BYTES / 2; j++)
        if (s[j] != SENTINEL16)
            fail_msg("device buffer of %zu bytes: sentinel %d past its end overwritten (%#x)", bytes, j, s[j]);
}

static inline const void *g_tensor(const void *h, size_t bytes, bool resident) {
    const void *p = GPU->tensor_prepare(&gpu_be, h, bytes, resident);
    assert_non_null(p);
    return p;
}

/* ---------------------------------------------------------------------------------------------
 * Batch invariance: run(ctx, r0, T, out) computes rows [r0, r0 + T) on the GPU into out (host,
 * T·row_bytes). Rows of the smaller batches must equal the same rows of the larger ones, and each
 * probe row computed alone (T = 1) must equal it within every batch that holds it. */

typedef void (*rows_fn)(void *ctx, int64_t r0, int64_t T, void *out);

static inline void batch_invariance(const char *op, const char *what, rows_fn run, void *ctx, size_t row_bytes,
                             const int64_t *Ts, int nT, const int64_t *probes, int np) {
    uint8_t **outs = NEW(uint8_t *, nT);
    for (int i = 0; i < nT; i++) {
        outs[i] = NEW(uint8_t, (size_t)Ts[i] * row_bytes);
        run(ctx, 0, Ts[i], outs[i]);
    }
    long long bad = 0, checked = 0;
    char msg[300] = "";
    for (int i = 0; i < nT; i++)
        for (int j = i + 1; j < nT; j++) {
            int64_t m = Ts[i] < Ts[j] ? Ts[i] : Ts[j];
            for (int64_t r = 0; r < m; r++, checked++)
                if (memcmp(outs[i] + r * row_bytes, outs[j] + r * row_bytes, row_bytes) && !bad++)
                    snprintf(msg, sizeof msg, "row %lld differs between T=%lld and T=%lld", (long long)r,
                             (long long)Ts[i], (long long)Ts[j]);
        }
    uint8_t *one = NEW(uint8_t, row_bytes);
    for (int p = 0; p < np; p++) {
        run(ctx, probes[p], 1, one);
        for (int i = 0; i < nT; i++) {
            if (probes[p] >= Ts[i]) continue;
            checked++;
            if (memcmp(one, outs[i] + probes[p] * row_bytes, row_bytes) && !bad++)
                snprintf(msg, sizeof msg, "row %lld computed alone (T=1) differs from the same row within T=%lld",
                         (long long)probes[p], (long long)Ts[i]);
        }
    }
    char ts[80] = "";
    for (int i = 0; i < nT; i++) snprintf(ts + strlen(ts), sizeof ts - strlen(ts), "%s%lld", i ? "/" : "", (long long)Ts[i]);
    print_message("  %-15s %-46s batch invariance T=1 vs T=%s: %lld row pairs, %lld differ\n", op, what, ts, checked, bad);
    for (int i = 0; i < nT; i++) free(outs[i]);
    free(outs);
    free(one);
    if (bad) fail_msg("%s %s: batch invariance broken in %lld row pairs; first: %s", op, what, bad, msg);
}

/* The logistic function (the router's softplus bound, hc_mixes, the Engram gate). */
static inline double sig(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Batch sizes: decode-like T (real shapes), odd T (odd shapes), batch-invariance T and probe rows */
static const int64_t T_REAL[] = {1, 8, 17};
static const int64_t T_ODD[] = {1, 3, 8, 17, 64};
#define NT_REAL 3
#define NT_ODD 5
static const int64_t BI_T[] = {8, 64}, BI_PROBES[] = {0, 5, 7, 63};

/* ---------------------------------------------------------------------------------------------
 * Host weights, shaped and quantized like the checkpoint's (FP4 experts: test_cuda_ops.c), and
 * their GPU copies */

struct hw {
    struct qweight q;
    void *data;
    uint8_t *scale;
};

static inline struct qweight qw(enum wfmt fmt, int64_t n, int64_t k, int64_t ld, int64_t s_ld, const void *w,
                         const uint8_t *s) {
    struct qweight q = {.fmt = fmt, .n = n, .k = k, .ld = ld, .s_ld = s_ld, .w = w, .s = s, .be_priv = NULL};
    return q;
}

/* FP8 [n, kfull] quantized from a gaussian of sd `sigma` (per-row spread ×0.5..2) in 32x32 tiles;
 * the weight is the column slice [k0, k0 + k) (a row-parallel TP slice when k < kfull). */
static inline struct hw hw_fp8(int64_t n, int64_t kfull, int64_t k0, int64_t k, float sigma) {
    struct hw h;
    int64_t s_ld = (kfull + 31) / 32, srows = (n + 31) / 32;
    uint8_t *d = NEW(uint8_t, n * kfull), *s = NEW(uint8_t, srows * s_ld);
    float *band = NEW(float, 32 * kfull);
    for (int64_t r0 = 0; r0 < n; r0 += 32) {
        int64_t nr = n - r0 < 32 ? n - r0 : 32;
        for (int64_t r = 0; r < nr; r++) {
            float rs = sigma * (0.5f + 1.5f * (float)urand());
            for (int64_t i = 0; i < kfull; i++) band[r * kfull + i] = gauss() * rs;
        }
        quant_fp8_tiles(band, nr, kfull, d + r0 * kfull, s + (r0 / 32) * s_ld);
    }
    free(band);
    h.data = d;
    h.scale = s;
    h.q = qw(WF_FP8, n, k, kfull, s_ld, d + k0, s + k0 / 32);
    return h;
}

static inline struct hw hw_bf16(int64_t n, int64_t k, float sigma) {
    struct hw h;
    bf16_t *d = NEW(bf16_t, n * k);
    fill_gauss_bf16(d, n * k, sigma);
    h.data = d;
    h.scale = NULL;
    h.q = qw(WF_BF16, n, k, k, 0, d, NULL);
    return h;
}

static inline struct hw hw_f32(int64_t n, int64_t k, float sigma) {
    struct hw h;
    float *d = NEW(float, n * k);
    fill_f32(d, n * k, 0.0f, sigma);
    h.data = d;
    h.scale = NULL;
    h.q = qw(WF_F32, n, k, k, 0, d, NULL);
    return h;
}

static inline void hw_free(struct hw *h) {
    free(h->data);
    free(h->scale);
    h->data = NULL;
    h->scale = NULL;
}

/* The GPU backend's copy of a host weight (weight_prepare; dequant: to bf16, as for wo_a). */
static inline struct qweight g_weight(const struct qweight *h, bool dequant) {
    struct qweight w = *h;
    w.be_priv = NULL;
    assert_int_equal(GPU->weight_prepare(&gpu_be, &w, dequant), 0);
    return w;
}

/* ---------------------------------------------------------------------------------------------
 * Group setup and teardown, test selection */

/* The CPU backend (the oracle) and the GPU's: the CUDA backend, or with DS_CUDA_OPS_ON_CPU a second
 * CPU backend; no device (or no DS_HAVE_CUDA) leaves gpu_state 0 and every test skips. */
static inline int cuda_ops_group_setup(void **st) {
    (void)st;
    gpu_state = 0;
    if (getenv("DS_CUDA_OPS_ON_CPU")) { /* a check of this test itself: the oracle in the GPU's place */
        assert_int_equal(backend_cpu_init(&cpu_be), 0);
        assert_int_equal(backend_cpu_init(&gpu_be), 0);
        print_message("DS_CUDA_OPS_ON_CPU: the CPU backend runs in the GPU's place (checks the test's models)\n");
        gpu_state = 2;
        return 0;
    }
#ifdef DS_HAVE_CUDA
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        print_message("no CUDA device (%s): every test skips\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 0;
    }
    assert_int_equal(backend_cpu_init(&cpu_be), 0);
    if (backend_cuda_init(&gpu_be, 0) != 0) {
        gpu_state = -1;
        return 0;
    }
    gpu_state = 1;
#else
    print_message("built without DS_HAVE_CUDA: every test skips\n");
#endif
    return 0;
}

/* The per-op summary of this program's cases, then the backends. */
static inline int cuda_ops_group_teardown(void **st) {
    (void)st;
    if (n_summary) {
        print_message("per-op deviation, GPU vs CPU (all cases):\n");
        for (int i = 0; i < n_summary; i++)
            print_message("  %-15s cases=%-4lld n=%-11lld differ=%-10lld max|d|=%-10.3g max rel=%-10.3g max d/tol=%.3g\n",
                          summary[i].op, summary[i].cases, summary[i].n, summary[i].ndiff, summary[i].max_abs,
                          summary[i].max_rel, summary[i].max_ratio);
    }
#ifdef DS_HAVE_CUDA
    if (gpu_state == 1) backend_cuda_free(&gpu_be);
#endif
    if (gpu_state == 2) backend_cpu_free(&gpu_be);
    if (gpu_state >= 1) backend_cpu_free(&cpu_be);
    return 0;
}

/* The CUDA backend's tensor-core switch (backend_cuda_set_mma); nothing on the CPU stand-in. */
static inline void mma_switch(bool on) {
#ifdef DS_HAVE_CUDA
    if (gpu_state == 1) backend_cuda_set_mma(&gpu_be, on);
#else
    (void)on;
#endif
}

/* fp32 frequency table of MODEL.md §3.5 (fp32 pow and reciprocal; YaRN ramp when asked) */
static inline void make_freqs(float *f, int64_t half, double theta, bool yarn) {
    int64_t rd = 2 * half;
    for (int64_t i = 0; i < half; i++) f[i] = 1.0f / powf((float)theta, (float)(2 * i) / (float)rd);
    if (!yarn) return;
    double lt = log(theta);
    double lo = floor((double)rd * log(65536.0 / (2 * M_PI * 32)) / (2 * lt)), hi = ceil((double)rd * log(65536.0 / (2 * M_PI)) / (2 * lt));
    lo = fmax(lo, 0.0);
    hi = fmin(hi, (double)rd - 1);
    for (int64_t i = 0; i < half; i++) {
        double ramp = hi > lo ? fmin(fmax(((double)i - lo) / (hi - lo), 0.0), 1.0) : 0.0;
        f[i] = f[i] / 16.0f * (float)ramp + f[i] * (float)(1.0 - ramp);
    }
}

/* bring-up aids: run or skip tests by glob pattern (a crashed CUDA context ends the process) */
static inline void cuda_ops_test_filters(void) {
    if (getenv("DS_TEST_FILTER")) cmocka_set_test_filter(getenv("DS_TEST_FILTER"));
    if (getenv("DS_TEST_SKIP")) cmocka_set_skip_filter(getenv("DS_TEST_SKIP"));
}

#endif /* DS_TESTS_CUDA_OPS_COMMON_H */
