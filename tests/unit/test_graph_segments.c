/* The model's graph segments keep backend.h's promise, checked on the CPU: a decorator backend
 * (over the CPU backend) offers graph_begin / graph_end, always asks the model to issue the ops,
 * and digests what each segment issues — every op, its scalars and its buffer addresses, where an
 * address inside a buffer the segment allocated itself is taken relative to that allocation (a
 * GPU recording owns those). A key seen before must bring the same digest: a replay of the CUDA
 * backend's graph would otherwise compute something else than the ops the model meant. It also
 * fails host-side ops inside a segment (upload, download, copy_segs, sync and every op the model
 * keeps outside segments), frees of buffers allocated before the segment, and buffers a segment
 * leaves allocated. The run moves the segment-edge buffers on purpose, all at once (a larger batch
 * grows them) and then one at a time before a step each, so a buffer missing from a key shows as
 * a changed digest under an old key.
 * And the persistent buffers of the graph path change no number: logits equal those of the same
 * steps with graphs off, bit for bit.
 * The same holds for TP rank 0 of 8 over a stand-in comm whose collectives are the backend's own
 * copy_segs (bench_step's): with the comm stream_ordered, the model records the collectives inside
 * its segments (model_tp_between), as copy_segs calls the backend contract lets a segment hold;
 * without, none falls inside one.
 * The decorator also offers backend.h's branch ops and checks their promise: begin, end and join
 * in that order (up to BE_MAX_BRANCHES begun before one join, each after the last one's end),
 * joined inside the segment the branches began in, no host-side op (nor any op this file does not
 * track) between the first begin and the join, and the chains that run at once independent: no
 * buffer one of them writes is read or written by another — a branch against every other branch
 * and against the main lane's ops issued after its begin (by base address: the model's buffers are
 * distinct allocations, and a chain writing into the middle of another's buffer would be a bug of
 * the same kind as writing its base). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_fixture.h"
#include "model.h"
#include "comm.h"
#include "model_internal.h"

#define MAX_KEYS 4096
#define MAX_ALLOCS 256

static const struct backend_ops *g_cpu; /* the decorated CPU table */
static struct backend *g_inner;
static bool g_open;
static uint64_t g_digest;
static uint64_t g_key[GRAPH_KEY_MAX];
static int g_key_n;
static struct {
    const uint8_t *p;
    size_t bytes;
} g_alloc[MAX_ALLOCS];
static int g_n_alloc;
static struct {
    uint64_t key[GRAPH_KEY_MAX];
    int n;
    uint64_t digest;
} g_seen[MAX_KEYS];
static int g_n_seen;
static long g_hits, g_recorded, g_violations, g_segment_ops, g_segment_copy_segs, g_segment_gathers;

static void violation(const char *what) {
    g_violations++;
    printf("violation: %s\n", what);
}

/* ---- branches ---- */
enum { BR_NONE, BR_SIDE, BR_MAIN }; /* no branch; issuing a branch; issuing the main lane's part */
#define MAX_TOUCH 512
static int g_br;
static int g_nbr;        /* branches begun since the last join: the one issuing now is number g_nbr */
static bool g_br_in_seg; /* the first of them began inside a segment */
static struct {
    const void *p;
    bool write;
    int lane; /* 0: the main lane; i: branch i (from 1) */
    int after; /* the main lane's: how many branches had begun when it was issued */
} g_touch[MAX_TOUCH];
static int g_n_touch;
static long g_branches;

static void touch(const void *p, bool write) {
    if (g_br == BR_NONE || !p) return;
    assert_true(g_n_touch < MAX_TOUCH);
    g_touch[g_n_touch].p = p;
    g_touch[g_n_touch].write = write;
    g_touch[g_n_touch].lane = g_br == BR_SIDE ? g_nbr : 0;
    g_touch[g_n_touch].after = g_nbr;
    g_n_touch++;
}
#define RD(p) touch((p), false)
#define WR(p) touch((p), true)

static void mix(uint64_t v) {
    g_digest ^= v;
    g_digest *= 0x100000001b3ull;
    g_digest ^= g_digest >> 31;
}

/* An address: relative to the segment's own allocation it falls in, else as it is. */
static void mix_ptr(const void *p) {
    for (int i = 0; i < g_n_alloc; i++)
        if ((const uint8_t *)p >= g_alloc[i].p && (const uint8_t *)p < g_alloc[i].p + g_alloc[i].bytes) {
            mix(0xA110C000u + (uint64_t)i);
            mix((uint64_t)((const uint8_t *)p - g_alloc[i].p));
            return;
        }
    mix((uint64_t)(uintptr_t)p);
}

static void mix_f(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    mix(u);
}

static void op(int id) {
    if (!g_open) return;
    g_segment_ops++;
    mix(0x0B000000u + (uint64_t)id);
}

static void outside(const char *name) {
    char msg[96];
    if (g_br != BR_NONE) {
        snprintf(msg, sizeof msg, "%s inside a branch", name);
        violation(msg);
    }
    if (!g_open) return;
    snprintf(msg, sizeof msg, "%s inside a graph segment", name);
    violation(msg);
}

static void chk_branch_begin(struct backend *be) {
    (void)be;
    if (g_br == BR_SIDE) violation("branch_begin while a branch is issuing (branch_end first)");
    if (g_nbr == BE_MAX_BRANCHES) violation("more than BE_MAX_BRANCHES branches begun before a join");
    if (g_br == BR_NONE) {
        g_br_in_seg = g_open;
        g_n_touch = 0;
    } else if (g_br_in_seg != g_open) {
        violation("a branch begun outside the segment the branches before it began in");
    }
    g_nbr++;
    g_br = BR_SIDE;
    op(14);
}
static void chk_branch_end(struct backend *be) {
    (void)be;
    if (g_br != BR_SIDE) violation("branch_end without branch_begin");
    g_br = BR_MAIN;
    op(15);
}
static void chk_branch_join(struct backend *be) {
    (void)be;
    if (g_br != BR_MAIN) violation("branch_join without branch_end");
    if (g_br_in_seg != g_open) violation("a branch joined outside the segment it began in");
    /* i on a branch against j on another branch, or on the main lane issued after i's begin */
    for (int i = 0; i < g_n_touch; i++)
        for (int j = 0; j < g_n_touch; j++) {
            const int li = g_touch[i].lane, lj = g_touch[j].lane;
            if (!li || li == lj || g_touch[i].p != g_touch[j].p || !(g_touch[i].write || g_touch[j].write)) continue;
            if (lj) {
                if (li < lj) violation("two branches touch a buffer one of them writes");
            } else if (g_touch[j].after >= li) {
                violation(g_touch[i].write ? "the main lane touches a buffer the branch writes"
                                           : "the main lane writes a buffer the branch reads");
            }
        }
    g_br = BR_NONE;
    g_nbr = 0;
    g_branches++;
    op(16);
}

#define IN (g_inner)

static bool chk_graph_begin(struct backend *be, const uint64_t *key, int n) {
    (void)be;
    if (g_open) violation("graph_begin inside a segment");
    assert_true(n <= GRAPH_KEY_MAX);
    memcpy(g_key, key, sizeof *key * (size_t)n);
    g_key_n = n;
    g_open = true;
    g_digest = 0xcbf29ce484222325ull;
    g_n_alloc = 0;
    return true;
}

static void chk_graph_end(struct backend *be) {
    (void)be;
    if (!g_open) violation("graph_end without graph_begin");
    if (g_br != BR_NONE && g_br_in_seg) violation("a segment ends with its branch not joined");
    if (g_n_alloc) violation("a segment ends with buffers it allocated still live");
    g_open = false;
    for (int i = 0; i < g_n_seen; i++)
        if (g_seen[i].n == g_key_n && !memcmp(g_seen[i].key, g_key, sizeof *g_key * (size_t)g_key_n)) {
            g_hits++;
            if (g_seen[i].digest != g_digest) {
                char msg[96];
                snprintf(msg, sizeof msg, "segment %llu of layer %llu, %llu rows: same key, other ops",
                         (unsigned long long)g_key[0], (unsigned long long)g_key[1], (unsigned long long)g_key[2]);
                violation(msg);
            }
            return;
        }
    assert_true(g_n_seen < MAX_KEYS);
    memcpy(g_seen[g_n_seen].key, g_key, sizeof *g_key * (size_t)g_key_n);
    g_seen[g_n_seen].n = g_key_n;
    g_seen[g_n_seen].digest = g_digest;
    g_n_seen++;
    g_recorded++;
}

/* ---- memory ---- */
static void note_alloc(void *p, size_t bytes) {
    if (!g_open) return;
    assert_true(g_n_alloc < MAX_ALLOCS);
    g_alloc[g_n_alloc].p = p;
    g_alloc[g_n_alloc].bytes = bytes ? bytes : 1;
    g_n_alloc++;
    mix(0xA1100000u);
    mix(bytes);
}
static void *chk_alloc(struct backend *be, size_t bytes) {
    (void)be;
    void *p = g_cpu->alloc(IN, bytes);
    note_alloc(p, bytes);
    return p;
}
static void *chk_scratch(struct backend *be, size_t bytes) {
    (void)be;
    void *p = g_cpu->scratch(IN, bytes);
    note_alloc(p, bytes);
    return p;
}
static void chk_free(struct backend *be, void *p) {
    (void)be;
    if (g_open && p) {
        int i = 0;
        while (i < g_n_alloc && g_alloc[i].p != p) i++;
        if (i == g_n_alloc) {
            violation("a segment frees a buffer allocated before it");
        } else {
            mix(0xF4EE0000u + (uint64_t)i);
            g_alloc[i] = g_alloc[--g_n_alloc];
        }
    }
    g_cpu->free(IN, p);
}
static void chk_copy(struct backend *be, void *d, const void *s, size_t n) {
    (void)be;
    op(1);
    WR(d), RD(s);
    if (g_open) mix_ptr(d), mix_ptr(s), mix(n);
    g_cpu->copy(IN, d, s, n);
}
static void chk_upload(struct backend *be, void *d, const void *s, size_t n) {
    (void)be;
    outside("upload");
    g_cpu->upload(IN, d, s, n);
}
static void chk_download(struct backend *be, void *d, const void *s, size_t n) {
    (void)be;
    outside("download");
    g_cpu->download(IN, d, s, n);
}
/* inside a segment only as backend.h allows: at most BE_COPY_SEGS_GRAPH copies, never in a branch */
static void chk_copy_segs(struct backend *be, const struct copy_seg *s, int64_t n) {
    (void)be;
    if (g_br != BR_NONE || n > BE_COPY_SEGS_GRAPH) outside("copy_segs");
    if (g_open) {
        g_segment_copy_segs++;
        op(21);
        mix((uint64_t)n);
        for (int64_t i = 0; i < n; i++) mix_ptr(s[i].dst), mix_ptr(s[i].src), mix(s[i].bytes);
    }
    g_cpu->copy_segs(IN, s, n);
}
static void chk_sync(struct backend *be) {
    (void)be;
    outside("sync");
    g_cpu->sync(IN);
}

/* ---- the ops a segment may hold: digested ---- */
static void mix_w(const struct qweight *w) {
    mix_ptr(w);
    mix_ptr(w->w);
}
static void chk_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    (void)be;
    op(2);
    WR(y), RD(x);
    if (g_open) mix_ptr(y), mix_ptr(x), mix((uint64_t)T), mix_w(W);
    g_cpu->linear(IN, y, x, T, W);
}
static void chk_rmsnorm(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n,
                        float eps, const struct norm_post *post) {
    (void)be;
    op(3);
    WR(y), RD(x);
    if (post) RD(post->pos);
    if (g_open) {
        mix_ptr(y), mix_ptr(x), mix_ptr(w), mix((uint64_t)T), mix((uint64_t)n), mix_f(eps);
        if (post) mix((uint64_t)post->off), mix((uint64_t)post->rd), mix_ptr(post->pos), mix_ptr(post->freqs),
            mix((uint64_t)post->qdq);
    }
    g_cpu->rmsnorm(IN, y, x, w, T, n, eps, post);
}
static void chk_rope(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head,
                     int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse) {
    (void)be;
    op(4);
    WR(x), RD(pos);
    if (g_open) {
        mix_ptr(x), mix_ptr(pos), mix_ptr(freqs);
        int64_t v[] = {T, nh, ld_row, ld_head, off, rd, inverse};
        for (size_t i = 0; i < sizeof v / sizeof *v; i++) mix((uint64_t)v[i]);
    }
    g_cpu->rope(IN, x, T, nh, ld_row, ld_head, off, rd, pos, freqs, inverse);
}
static void chk_qdq_fp8_32(struct backend *be, bf16_t *x, int64_t n) {
    (void)be;
    op(5);
    WR(x);
    if (g_open) mix_ptr(x), mix((uint64_t)n);
    g_cpu->qdq_fp8_32(IN, x, n);
}
static void chk_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                         int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters,
                         float ne, float he) {
    (void)be;
    op(6);
    WR(pre), WR(post), WR(comb), RD(X);
    if (g_open) {
        const void *p[] = {pre, post, comb, X, fn, scale, base};
        for (size_t i = 0; i < sizeof p / sizeof *p; i++) mix_ptr(p[i]);
        mix((uint64_t)T), mix((uint64_t)hc), mix((uint64_t)D), mix((uint64_t)iters), mix_f(ne), mix_f(he);
    }
    g_cpu->hc_mixes(IN, pre, post, comb, X, T, hc, D, fn, scale, base, iters, ne, he);
}
static void chk_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                            int64_t D, const bf16_t *norm_w, float eps) {
    (void)be;
    op(7);
    WR(y), RD(X), RD(p);
    if (g_open) {
        mix_ptr(y), mix_ptr(X), mix_ptr(p), mix_ptr(norm_w);
        mix((uint64_t)T), mix((uint64_t)hc), mix((uint64_t)D), mix_f(eps);
    }
    g_cpu->hc_collapse(IN, y, X, p, T, hc, D, norm_w, eps);
}
static void chk_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                          const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks) {
    (void)be;
    op(8);
    WR(Xo), RD(y), RD(X), RD(post), RD(comb);
    if (g_open) {
        mix_ptr(Xo), mix_ptr(y), mix_ptr(X), mix_ptr(post), mix_ptr(comb);
        mix((uint64_t)T), mix((uint64_t)hc), mix((uint64_t)D), mix((uint64_t)y_blocks);
    }
    g_cpu->hc_expand(IN, Xo, y, X, post, comb, T, hc, D, y_blocks);
}
static void chk_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                       const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm, float rs) {
    (void)be;
    op(9);
    WR(idx), WR(wts), RD(x);
    if (g_open) {
        mix_ptr(idx), mix_ptr(wts), mix_ptr(x), mix_w(gate), mix_ptr(bias);
        mix((uint64_t)T), mix((uint64_t)k), mix_f(temp), mix(norm), mix_f(rs);
    }
    g_cpu->router(IN, idx, wts, x, T, gate, bias, k, temp, norm, rs);
}
static void chk_moe_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                            int64_t T, int64_t k, int64_t e0, int64_t nl, const struct qweight *w1,
                            const struct qweight *w3, const struct qweight *w2, float limit) {
    (void)be;
    op(10);
    WR(y), RD(x), RD(idx), RD(wts);
    if (g_open) {
        mix_ptr(y), mix_ptr(x), mix_ptr(idx), mix_ptr(wts), mix_ptr(w1), mix_ptr(w3), mix_ptr(w2);
        mix((uint64_t)T), mix((uint64_t)k), mix((uint64_t)e0), mix((uint64_t)nl), mix_f(limit);
    }
    g_cpu->moe_experts(IN, y, x, idx, wts, T, k, e0, nl, w1, w3, w2, limit);
}
static void chk_moe_combine(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh,
                            int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P) {
    (void)be;
    op(11);
    WR(out), RD(y), RD(idx), RD(sh);
    if (g_open) {
        mix_ptr(out), mix_ptr(y), mix_ptr(idx), mix_ptr(sh), mix((uint64_t)ld_sh);
        mix((uint64_t)T), mix((uint64_t)k), mix((uint64_t)D), mix((uint64_t)per_part), mix((uint64_t)P);
    }
    g_cpu->moe_combine(IN, out, y, idx, sh, ld_sh, T, k, D, per_part, P);
}
static void chk_shared_expert(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1,
                              const struct qweight *w3, const struct qweight *w2, float limit) {
    (void)be;
    op(12);
    WR(y), RD(x);
    if (g_open) mix_ptr(y), mix_ptr(x), mix((uint64_t)T), mix_w(w1), mix_w(w3), mix_w(w2), mix_f(limit);
    g_cpu->shared_expert(IN, y, x, T, w1, w3, w2, limit);
}
static void chk_grouped_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G,
                               const struct qweight *W) {
    (void)be;
    op(13);
    WR(y), RD(x);
    if (g_open) mix_ptr(y), mix_ptr(x), mix((uint64_t)T), mix((uint64_t)G), mix_w(W);
    g_cpu->grouped_linear(IN, y, x, T, G, W);
}
/* the attention's index lists and the attention: in the attention output's segment, at widths
 * rounded up so that the key holds across steps (MODEL_GRAPH_WIDTH_STEP) */
static void chk_attn_index(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T,
                           const struct attn_index_par *par) {
    (void)be;
    op(19);
    WR(dst), RD(geo);
    if (par->src) RD(par->src);
    if (g_open) {
        mix_ptr(dst), mix_ptr(geo), mix((uint64_t)n_idx), mix((uint64_t)T), mix((uint64_t)par->W);
        mix((uint64_t)par->ring0), mix_ptr(par->src), mix((uint64_t)par->ld_src), mix((uint64_t)par->k);
        mix((uint64_t)par->src0), mix((uint64_t)par->cap);
    }
    g_cpu->attn_index(IN, dst, n_idx, geo, T, par);
}
static void chk_sparse_attn(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                            int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale) {
    (void)be;
    op(20);
    WR(o), RD(q), RD(kv), RD(idx);
    if (g_open) {
        mix_ptr(o), mix_ptr(q), mix_ptr(kv), mix_ptr(idx), mix((uint64_t)T), mix((uint64_t)H), mix((uint64_t)hd);
        mix((uint64_t)n_idx), mix_ptr(sink), mix_f(scale);
    }
    g_cpu->sparse_attn(IN, o, q, kv, idx, T, H, hd, n_idx, sink, scale);
}
/* the window rings' update: the first op of the attention output's segment (its shapes are the
 * step's T, its rows come from the batch geometry on the backend) */
static void chk_ring_store(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W,
                           int64_t hd) {
    (void)be;
    op(17);
    WR(ring), RD(kv), RD(geo);
    if (g_open) mix_ptr(ring), mix_ptr(kv), mix_ptr(geo), mix((uint64_t)T), mix((uint64_t)W), mix((uint64_t)hd);
    g_cpu->ring_store(IN, ring, kv, geo, T, W, hd);
}
/* the attention groups' interleave opens wo_b's segment, the MoE owner exchange's packing ends the
 * FFN's */
static void chk_interleave(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes) {
    (void)be;
    op(18);
    WR(dst), RD(src);
    if (g_open) mix_ptr(dst), mix_ptr(src), mix((uint64_t)S), mix((uint64_t)T), mix((uint64_t)bytes);
    g_cpu->interleave(IN, dst, src, S, T, bytes);
}

/* ---- the ops the model keeps outside segments (their arguments follow the step's context) ---- */
static void chk_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    (void)be;
    outside("linear_f32");
    g_cpu->linear_f32(IN, y, x, T, W);
}
static void chk_head(struct backend *be, float *lg, const bf16_t *x, int64_t T, const struct qweight *W) {
    (void)be;
    outside("head");
    g_cpu->head(IN, lg, x, T, W);
}
static void chk_qdq_fp4_32(struct backend *be, bf16_t *x, int64_t n) {
    (void)be;
    outside("qdq_fp4_32");
    g_cpu->qdq_fp4_32(IN, x, n);
}
static void chk_qdq_fp4_16(struct backend *be, bf16_t *x, int64_t n) {
    (void)be;
    outside("qdq_fp4_16");
    g_cpu->qdq_fp4_16(IN, x, n);
}
static void chk_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc, int64_t D) {
    (void)be;
    outside("hc_init");
    g_cpu->hc_init(IN, X, pre, e, T, hc, D);
}
static void chk_embed(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table, int64_t r0,
                      int64_t nr, int64_t D) {
    (void)be;
    outside("embed");
    g_cpu->embed(IN, e, ids, T, table, r0, nr, D);
}
/* a segment op: the gathers ride the first FFN segment's branch (model.c, engram_plan) */
static void chk_engram_gather(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C,
                              const uint8_t *table, const uint8_t *scale, int64_t r0, int64_t nr, int64_t hd) {
    (void)be;
    op(22);
    if (g_open && g_br == BR_SIDE) g_segment_gathers++;
    WR(rows), RD(ids), RD(table), RD(scale);
    if (g_open) mix_ptr(rows), mix_ptr(ids), mix_ptr(table), mix_ptr(scale), mix(T), mix(C), mix(r0), mix(nr), mix(hd);
    g_cpu->engram_gather(IN, rows, ids, T, C, table, scale, r0, nr, hd);
}
static void chk_engram_gate(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T, int64_t hc,
                            int64_t D, float eps) {
    (void)be;
    outside("engram_gate");
    g_cpu->engram_gate(IN, X, kv, w, T, hc, D, eps);
}
static void chk_compress_pool(struct backend *be, bf16_t *lat, const float *kv, const float *sc, int64_t G, int64_t r,
                              int64_t n) {
    (void)be;
    outside("compress_pool");
    g_cpu->compress_pool(IN, lat, kv, sc, G, r, n);
}
static void chk_index_scores(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q,
                             const bf16_t *K, const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w,
                             float w_scale, const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk) {
    (void)be;
    outside("index_scores");
    g_cpu->index_scores(IN, S, ld_s, q, ld_q, K, K_rows, nk_rows, w, w_scale, visible, T, nh, d, nk);
}
static void chk_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                           const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T) {
    (void)be;
    outside("index_topk");
    g_cpu->index_topk(IN, top, ld_top, S, ld_s, p, mask, ld_m, T);
}
static void chk_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                          const int32_t *p, int64_t T, int64_t tb, int64_t bs) {
    (void)be;
    outside("cand_mask");
    g_cpu->cand_mask(IN, mask, ld_m, S, ld_s, p, T, tb, bs);
}

static struct backend_ops checker_ops(const struct backend_ops *cpu) {
    struct backend_ops o = *cpu; /* memory preparation passes straight through */
    o.name = "graph-checker";
    o.alloc = chk_alloc, o.scratch = chk_scratch, o.free = chk_free, o.copy = chk_copy;
    o.upload = chk_upload, o.download = chk_download, o.copy_segs = chk_copy_segs, o.sync = chk_sync;
    o.linear = chk_linear, o.rmsnorm = chk_rmsnorm, o.rope = chk_rope, o.qdq_fp8_32 = chk_qdq_fp8_32;
    o.hc_mixes = chk_hc_mixes, o.hc_collapse = chk_hc_collapse, o.hc_expand = chk_hc_expand;
    o.router = chk_router, o.moe_experts = chk_moe_experts, o.moe_combine = chk_moe_combine;
    o.shared_expert = chk_shared_expert;
    o.linear_f32 = chk_linear_f32, o.grouped_linear = chk_grouped_linear, o.head = chk_head;
    o.qdq_fp4_32 = chk_qdq_fp4_32, o.qdq_fp4_16 = chk_qdq_fp4_16, o.hc_init = chk_hc_init, o.embed = chk_embed;
    o.engram_gather = chk_engram_gather, o.engram_gate = chk_engram_gate, o.sparse_attn = chk_sparse_attn;
    o.compress_pool = chk_compress_pool, o.index_scores = chk_index_scores, o.index_topk = chk_index_topk;
    o.cand_mask = chk_cand_mask, o.attn_index = chk_attn_index, o.ring_store = chk_ring_store, o.interleave = chk_interleave;
    o.graph_begin = chk_graph_begin, o.graph_end = chk_graph_end;
    o.branch_begin = chk_branch_begin, o.branch_end = chk_branch_end, o.branch_join = chk_branch_join;
    return o;
}

/* Every slot fed prompt 0 one token per forward, then decode steps of batch 1, 3 (growing every
 * segment-edge buffer) and 1 again, then one step of batch 1 after each buffer moved alone (graphs
 * on; with graphs off there are no such buffers and the steps are the same); each step's logits
 * into lg (rows in step order). */
#define NB 3
static const int g_batches[] = {1, 1, NB, NB, 1, 1};
#define N_SCHED (int)(sizeof g_batches / sizeof *g_batches)
#define N_STEPS (N_SCHED + FB_N)

/* A new address for segment-edge buffer i (contents need not survive: every forward writes its
 * buffers before reading them). */
static void move_fbuf(struct model *m, int i) {
    struct fbuf *f = &m->fb[i];
    if (!f->p) return;
    void *p = m->be->ops->alloc(m->be, f->cap);
    m->be->ops->free(m->be, f->p);
    f->p = p;
}

/* tp NULL: the whole model; else its rank's slice, the experts exchanged by x. */
static void run(const char *spec, bool graphs, struct backend *be, float *lg, int64_t V, struct comm *tp,
                enum moe_exchange x) {
    struct golden_case g;
    golden_case_open(&g, spec);
    struct loaded_model lm;
    assert_int_equal(loader_open_config(&lm, g.dir), 0);
    struct bind_opts bo = bind_opts_single(&lm.cfg);
    if (tp) bo.tp_rank = tp->rank, bo.tp_size = tp->size;
    assert_int_equal(loader_bind(&lm, &bo), 0);
    struct engine_opts eo = engine_opts_default(&lm.cfg);
    eo.max_seqs = NB;
    eo.graphs = graphs;
    eo.tp = tp;
    eo.moe_exchange = x;
    assert_int_equal(lm.cfg.vocab_size, V);
    struct model *m = model_new(&lm.cfg, &lm.w, be, &lm.ec, &eo);
    float *tmp = malloc(sizeof(float) * (size_t)(V * NB));
    /* token by token: every buffer is sized for one row until the first step of NB rows */
    for (int q = 0; q < NB; q++)
        for (int64_t t = 0; t < g.S; t++) {
            struct fwd_seq p = {.slot = q, .start = t, .len = 1, .tokens = g.prompt + t};
            assert_int_equal(model_forward(m, &p, 1, tmp, NULL), 0);
        }
    size_t at = 0;
    for (int st = 0; st < N_STEPS; st++) {
        int nb = st < N_SCHED ? g_batches[st] : 1;
        if (st >= N_SCHED) move_fbuf(m, st - N_SCHED);
        struct fwd_seq s[NB];
        int32_t tok[NB];
        for (int q = 0; q < nb; q++) {
            tok[q] = (int32_t)((7 + 13 * st + 5 * q) % V);
            s[q] = (struct fwd_seq){.slot = q, .start = model_slot_len(m, q), .len = 1, .tokens = &tok[q]};
        }
        assert_int_equal(model_forward(m, s, nb, lg + at, NULL), 0);
        at += (size_t)nb * (size_t)V;
    }
    free(tmp);
    model_free(m);
    loader_close(&lm);
    st_close(&g.f);
}

/* The checker over a fresh CPU backend (cpu), its counts and state reset. */
static void checker_init(struct backend *cpu, struct backend *chk) {
    assert_int_equal(backend_cpu_init(cpu), 0);
    static struct backend_ops ops;
    ops = checker_ops(cpu->ops);
    g_cpu = cpu->ops;
    g_inner = cpu;
    chk->ops = &ops;
    chk->priv = NULL;
    g_n_seen = 0;
    g_hits = g_recorded = g_violations = g_segment_ops = g_segment_copy_segs = g_segment_gathers = g_branches = 0;
    g_br = BR_NONE;
    g_nbr = 0;
    g_open = false;
}

/* The fixture's vocabulary and the logits rows run() writes for it. */
static int64_t spec_rows(const char *spec, size_t *rows) {
    struct golden_case g;
    golden_case_open(&g, spec);
    struct loaded_model lm;
    assert_int_equal(loader_open_config(&lm, g.dir), 0);
    int64_t V = lm.cfg.vocab_size;
    loader_close(&lm);
    st_close(&g.f);
    *rows = 0;
    for (int st = 0; st < N_STEPS; st++) *rows += st < N_SCHED ? (size_t)g_batches[st] : 1;
    return V;
}

/* gathers_on_branch: the fixture's first layer is not an Engram layer, so the Engram gathers ride
 * its FFN segment's branch (model.c, engram_plan); else they run before it, outside any segment */
static void check_spec(const char *spec, bool gathers_on_branch) {
    struct backend cpu, chk;
    checker_init(&cpu, &chk);
    size_t rows;
    const int64_t V = spec_rows(spec, &rows);
    float *with = malloc(sizeof(float) * rows * (size_t)V), *without = malloc(sizeof(float) * rows * (size_t)V);

    run(spec, true, &chk, with, V, NULL, MOE_EXCHANGE_AUTO);
    printf("%s: %ld segments recorded, %ld repeated, %ld ops inside them, %ld branches, %ld violations\n", spec,
           g_recorded, g_hits, g_segment_ops, g_branches, g_violations);
    assert_int_equal(g_violations, 0);
    assert_true(g_recorded > 0);
    assert_true(g_hits > 0);
    assert_true(g_branches > 0); /* the branch checks above saw branches to check */
    if (gathers_on_branch) assert_true(g_segment_gathers > 0);
    else assert_int_equal(g_segment_gathers, 0);
    long seg_ops = g_segment_ops, branches = g_branches;
    run(spec, false, &chk, without, V, NULL, MOE_EXCHANGE_AUTO); /* graphs off: the checker sees no segment at all */
    assert_int_equal(g_segment_ops, seg_ops);
    assert_int_equal(g_violations, 0);
    assert_int_equal(g_branches, 2 * branches); /* the same branches without graphs */
    assert_memory_equal(with, without, sizeof(float) * rows * (size_t)V);
    free(with);
    free(without);
    backend_cpu_free(&cpu);
}

/* ---- a TP stand-in: bench_step's, its collectives one copy_segs call each on the backend ---- */
static void sc_allgather(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    (void)what;
    struct backend *be = c->priv;
    struct copy_seg segs[8];
    assert_true(c->size <= 8);
    for (int r = 0; r < c->size; r++) segs[r] = (struct copy_seg){(uint8_t *)recv + (size_t)r * bytes, send, bytes};
    be->ops->copy_segs(be, segs, c->size);
}
static void sc_alltoall(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    sc_allgather(c, send, recv, bytes, what); /* the bytes of an all-to-all, as if every rank held these slots */
}
static void sc_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, const char *what) {
    (void)c, (void)buf, (void)count, (void)dt, (void)what; /* the other ranks' shares: zeros */
}
static void sc_bcast(struct comm *c, void *buf, size_t bytes, int root, const char *what) {
    (void)c, (void)buf, (void)bytes, (void)root, (void)what;
}
static const struct comm_ops sc_ops = {.name = "segments-standin", .allgather = sc_allgather, .alltoall = sc_alltoall,
                                       .allreduce_sum = sc_allreduce, .bcast = sc_bcast};

/* tp8pp2 as TP rank 0 of 8 with graphs, the experts exchanged by x: the collectives between the
 * segments, then recorded inside them (stream_ordered), each run under the checker; the same
 * logits both ways. (Not against graphs off: the stand-in hands back this rank's own slots for
 * the other ranks', which hold what earlier layers left in the persistent buffers with graphs and
 * zeros without.) */
static void check_tp(enum moe_exchange x) {
    struct backend cpu, chk;
    checker_init(&cpu, &chk);
    size_t rows;
    const int64_t V = spec_rows("tp8pp2", &rows);
    float *lg[2] = {malloc(sizeof(float) * rows * (size_t)V), malloc(sizeof(float) * rows * (size_t)V)};
    for (int so = 0; so < 2; so++) {
        struct comm tp = {.ops = &sc_ops, .rank = 0, .size = 8, .priv = &chk, .stream_ordered = so == 1};
        g_segment_copy_segs = g_violations = g_recorded = g_hits = 0;
        run("tp8pp2", true, &chk, lg[so], V, &tp, x);
        printf("tp8pp2 TP8 %s, %s: %ld segments recorded, %ld repeated, %ld copy_segs inside them, %ld violations\n",
               x == MOE_EXCHANGE_OWNER ? "owner" : "gather", so ? "stream-ordered" : "blocking", g_recorded, g_hits,
               g_segment_copy_segs, g_violations);
        assert_int_equal(g_violations, 0);
        assert_true(g_recorded > 0 && g_hits > 0);
        if (so) assert_true(g_segment_copy_segs > 0);
        else assert_int_equal(g_segment_copy_segs, 0);
    }
    assert_memory_equal(lg[0], lg[1], sizeof(float) * rows * (size_t)V);
    free(lg[0]);
    free(lg[1]);
    backend_cpu_free(&cpu);
}

static void test_segments_tp_collectives(void **s) {
    (void)s;
    check_tp(MOE_EXCHANGE_GATHER);
    check_tp(MOE_EXCHANGE_OWNER);
}

static void test_segments_keep_their_promise_small6(void **s) {
    (void)s;
    check_spec("small6", false); /* Engram layers 0 and 1 */
}

static void test_segments_keep_their_promise_tp8pp2(void **s) {
    (void)s;
    check_spec("tp8pp2", true); /* Engram layers 1 and 3 */
}

/* The branch checks can fail: a main lane that reads what the branch writes, one that writes what
 * the branch reads, and a host-side op inside a branch are each reported; with two branches open,
 * one reading what the other writes, the main lane after the second's begin reading what that one
 * writes, and a third branch before the join too — but not the main lane's ops issued before the
 * second branch began, which run before it. */
static void test_branch_checker_catches_shared_buffers(void **s) {
    (void)s;
    struct backend cpu, chk;
    checker_init(&cpu, &chk);
    const struct backend_ops *ops = chk.ops;
    char a[16] = {0}, b[16] = {0}, c[16] = {0};
    ops->branch_begin(&chk), ops->copy(&chk, a, b, 16), ops->branch_end(&chk), ops->copy(&chk, c, b, 16), ops->branch_join(&chk);
    assert_int_equal(g_violations, 0); /* both only read b */
    ops->branch_begin(&chk), ops->copy(&chk, a, b, 16), ops->branch_end(&chk), ops->copy(&chk, c, a, 16), ops->branch_join(&chk);
    assert_int_equal(g_violations, 1);
    ops->branch_begin(&chk), ops->copy(&chk, a, b, 16), ops->branch_end(&chk), ops->copy(&chk, b, c, 16), ops->branch_join(&chk);
    assert_int_equal(g_violations, 2);
    ops->branch_begin(&chk), ops->sync(&chk), ops->branch_end(&chk), ops->branch_join(&chk);
    assert_int_equal(g_violations, 3);
    ops->branch_end(&chk);
    assert_int_equal(g_violations, 4);
    g_br = BR_NONE;
    char d[16] = {0}, e[16] = {0};
    /* branch 1 writes a, the main lane then reads d, branch 2 writes d, the main lane reads e */
    ops->branch_begin(&chk), ops->copy(&chk, a, b, 16), ops->branch_end(&chk), ops->copy(&chk, c, d, 16);
    ops->branch_begin(&chk), ops->copy(&chk, d, e, 16), ops->branch_end(&chk), ops->copy(&chk, c, e, 16);
    ops->branch_join(&chk);
    assert_int_equal(g_violations, 4);
    ops->branch_begin(&chk), ops->copy(&chk, a, b, 16), ops->branch_end(&chk);
    ops->branch_begin(&chk), ops->copy(&chk, d, a, 16), ops->branch_end(&chk), ops->branch_join(&chk);
    assert_int_equal(g_violations, 5); /* branch 2 reads what branch 1 writes */
    ops->branch_begin(&chk), ops->copy(&chk, a, b, 16), ops->branch_end(&chk);
    ops->branch_begin(&chk), ops->copy(&chk, d, e, 16), ops->branch_end(&chk), ops->copy(&chk, c, d, 16);
    ops->branch_join(&chk);
    assert_int_equal(g_violations, 6); /* the main lane reads what branch 2 writes, after its begin */
    ops->branch_begin(&chk), ops->branch_end(&chk), ops->branch_begin(&chk), ops->branch_end(&chk);
    ops->branch_begin(&chk);
    assert_int_equal(g_violations, 7); /* a third before the join */
    g_br = BR_NONE;
    g_nbr = 0;
    backend_cpu_free(&cpu);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_branch_checker_catches_shared_buffers),
                                       cmocka_unit_test(test_segments_keep_their_promise_small6),
                                       cmocka_unit_test(test_segments_keep_their_promise_tp8pp2),
                                       cmocka_unit_test(test_segments_tp_collectives)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
