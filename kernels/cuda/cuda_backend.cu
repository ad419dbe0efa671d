/* The SM80 backend's op table, its init/free, memory ops and weight preparation.
 *
 * One backend = one device and one stream; every op enqueues on that stream and nothing here
 * waits except download and sync, so the host runs ahead of the GPU until the model needs a value.
 * A branch (backend.h) moves the ops issued between branch_begin and branch_end to a side stream
 * (one per branch open at once), forked from and joined back into the main one by events:
 * c->stream is always the lane ops issue on now, so the kernels (cuda_be_stream) follow without
 * knowing.
 * Activations come from the stream-ordered pool (cudaMallocAsync with an unbounded release
 * threshold) through a host-side free list by size (cuda_be_scratch): the forward allocates and
 * frees its temporaries per layer, and a reused block costs no CUDA call at all. Weights are
 * copied once, compactly, into device memory by weight_prepare (TP slices arrive as strided
 * views into the checkpoint mapping; FP4 codes are then permuted within each 32-bit word into
 * the kernels' layout, fp4_layout.h); the original description is parked in be_priv so release
 * restores it exactly.
 * Host-resident tensors (Engram tables: 100 GB in the release, larger than a GPU) are registered
 * as mapped pinned memory and read by the kernels over the bus.
 * While a graph segment records (cuda_graph.cu), temporaries come from the recordings' own arena
 * (or the graph's allocation nodes where it is short: cuda_be_garena_grow), never blocks of the
 * free list (a replay must not write a block the host has since handed to someone else), and the
 * host-side ops (upload, download, copy_segs, sync, preparation) refuse. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "linear_mma.h"
#include "cuda_linear.h"
#include "formats.h"

#include <cuda_profiler_api.h>

extern "C" void *ds_malloc(size_t n);
extern "C" void *ds_calloc(size_t n, size_t m);
extern "C" void *ds_realloc(void *p, size_t n);
extern "C" void log_warn(const char *fmt, ...);

/* A prepared tensor: what release must undo. */
enum prep_kind { PREP_DEVICE, PREP_REGISTERED, PREP_PINNED_COPY };
struct prep {
    const void *dptr;  /* what the ops see */
    void *base;        /* device allocation, registered host range, or pinned copy */
    enum prep_kind kind;
    void *derived;     /* a device form an op prepared from it once (cuda_be_prep_set_derived), or NULL */
    struct prep *next;
    struct prep *next_derived; /* the preps with a derived form, apart: ops look theirs up every call */
};

/* the upload ring (stage_upload): RING_CHUNKS chunks of RING_CHUNK bytes, pinned */
#define RING_BYTES ((size_t)32 << 20)
#define RING_CHUNKS 32
#define RING_CHUNK (RING_BYTES / RING_CHUNKS)

/* Scratch blocks kept for reuse (see cuda_be_scratch): free lists by rounded size, and the rounded
 * size of every block handed out. */
struct scratch_class {
    size_t bytes;
    void **free; /* [n_free] */
    int n_free, cap_free;
};
struct scratch_live {
    void *p;      /* NULL: empty slot */
    size_t bytes; /* rounded size, or 0: allocated outside the classes */
};

/* where a branch stands (backend.h: branch_begin / branch_end / branch_join) */
enum cuda_branch { BRANCH_NONE, BRANCH_ON_SIDE, BRANCH_ENDED };
#define CUDA_SIDES BE_MAX_BRANCHES /* side lanes: one per branch open at once */
struct deferred_free {
    void *p;
    size_t bytes; /* the live table's rounded size (0: exact, LIVE_GRAPH: a recording's) */
};

struct cuda_be {
    int device, sms;
    bool mma;
    cudaStream_t stream;                /* the lane ops issue on now: main, or a side inside a branch */
    cudaStream_t main, side[CUDA_SIDES]; /* the lanes: branch i since the last join issues on side[i] */
    cudaEvent_t fork_ev[CUDA_SIDES], join_ev[CUDA_SIDES];
    enum cuda_branch branch;
    int n_open; /* branches begun since the last join */
    /* frees issued between branch_begin and branch_join, done at the join (see cuda_be_scratch_free) */
    struct deferred_free *deferred;
    int n_deferred, cap_deferred;
    struct prep *preps;
    struct prep *derived; /* the preps with a derived form (next_derived), tens where preps are thousands */
    struct scratch_class *cls; /* [n_cls] */
    int n_cls;
    struct scratch_live *live; /* open-addressing table [cap_live], power of two */
    size_t cap_live, n_live;
    /* pinned staging ring for uploads (see stage_upload) */
    uint8_t *ring;
    size_t ring_head;
    int ring_chunk;
    cudaEvent_t ring_ev[RING_CHUNKS];
    bool ring_pending[RING_CHUNKS];
    /* graph segments (cuda_graph.cu): the recorded graphs, whether the stream is recording one now,
     * and how many of that recording's own allocations are still unfreed */
    struct cuda_graphs *graphs;
    bool capturing;
    long graph_allocs;
    /* the recordings' temporaries (cuda_be_scratch_raw while capturing): one arena that every
     * recording takes from the start, [garena, garena + garena_cap), bumped by garena_off; what a
     * recording wanted past it (it got allocation nodes then) is garena_need */
    uint8_t *garena;
    size_t garena_cap, garena_off, garena_need;
    /* profiling marks (backend_cuda_mark): timing events, reused after a reset */
    cudaEvent_t *marks;
    int n_marks, cap_marks;
};

static struct cuda_be *cb(struct backend *be) { return (struct cuda_be *)be->priv; }

cudaStream_t cuda_be_stream(struct backend *be) { return cb(be)->stream; }
int cuda_be_sms(struct backend *be) { return cb(be)->sms; }
bool cuda_be_mma(struct backend *be) { return cb(be)->mma; }
struct cuda_graphs **cuda_be_graphs(struct backend *be) { return &cb(be)->graphs; }

void cuda_be_set_capturing(struct backend *be, bool on) {
    struct cuda_be *c = cb(be);
    if (!on && c->graph_allocs)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "graph_end",
                 "a graph segment ends with buffers it allocated still live (the caller's promise, backend.h)");
    c->capturing = on;
    c->garena_off = 0;
}

/* The ops that cannot be part of a recorded graph: their host-side work would not be repeated by a
 * replay (the staged bytes of an upload, a copy list, a download's wait). */
static void not_in_segment(struct backend *be, const char *what) {
    if (cb(be)->capturing)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", what,
                 "called inside a graph segment (only device ops may be recorded, backend.h)");
    if (cb(be)->branch != BRANCH_NONE)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", what,
                 "called between branch_begin and branch_join (only device ops may run in a branch, backend.h)");
}

bool cuda_be_branch_open(struct backend *be) { return cb(be)->branch != BRANCH_NONE; }

extern "C" void backend_cuda_set_mma(struct backend *be, bool on) { cb(be)->mma = on; }

/* Out of device memory is the user's sizing, not a fault: say what was being placed, how much, and
 * what to change, then end the whole job (one rank cannot continue without the others). */
static void __attribute__((noreturn)) out_of_memory(struct backend *be, const char *what, size_t bytes,
                                                    const char *advice) {
    size_t free_b = 0, total_b = 0;
    (void)cudaGetLastError();
    (void)cudaMemGetInfo(&free_b, &total_b);
    char msg[512];
    snprintf(msg, sizeof msg,
             "not enough GPU memory on device %d for %s: %zu MiB asked, %zu MiB free of %zu MiB (%s)", cb(be)->device,
             what, bytes >> 20, free_b >> 20, total_b >> 20, advice);
    ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "cudaMalloc", msg);
    abort(); /* ds_fatal does not return */
}

/* Temporaries: the forward allocates and frees the same sizes layer after layer, a few dozen a
 * layer, and each cudaMallocAsync/cudaFreeAsync is host time on the step's critical path. So freed
 * blocks go on a host free list of their rounded size (four sizes per power of two: at most 25 %
 * slack) and the next request of that size takes one back with no CUDA call. This is safe
 * without events because every user of a block is on the backend's one stream: work enqueued
 * after the free runs after the work enqueued before it. Blocks over SCRATCH_CLASS_MAX (caches,
 * whole-prompt buffers) are allocated exactly, outside the classes. cuda_be_scratch adds the
 * zero fill (alloc's contract); cuda_be_scratch_raw (the scratch op) leaves it out. */
#define SCRATCH_CLASS_MAX ((size_t)1 << 30)
/* live-table marks of a block a graph segment's recording allocated: an allocation node, or a
 * piece of the recordings' arena (cuda_be_garena_grow) */
#define LIVE_GRAPH SIZE_MAX
#define LIVE_ARENA (SIZE_MAX - 1)

static size_t scratch_round(size_t bytes) {
    if (bytes <= 256) return 256;
    int e = 63 - __builtin_clzll((unsigned long long)(bytes - 1)); /* 2^e < bytes <= 2^(e+1) */
    size_t step = (size_t)1 << (e - 2);                            /* quarters of 2^e */
    return (bytes + step - 1) / step * step;
}

static size_t live_slot(const struct cuda_be *c, const void *p) {
    uintptr_t h = (uintptr_t)p;
    h ^= h >> 17;
    h *= (uintptr_t)0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 20) & (c->cap_live - 1);
}

static void live_put(struct cuda_be *c, void *p, size_t bytes);

static void live_grow(struct cuda_be *c) {
    struct scratch_live *old = c->live;
    size_t oc = c->cap_live;
    c->cap_live = oc ? 2 * oc : 1024;
    c->live = (struct scratch_live *)ds_calloc(c->cap_live, sizeof *c->live);
    c->n_live = 0;
    for (size_t i = 0; i < oc; i++)
        if (old[i].p) live_put(c, old[i].p, old[i].bytes);
    free(old);
}

static void live_put(struct cuda_be *c, void *p, size_t bytes) {
    if (2 * (c->n_live + 1) > c->cap_live) live_grow(c);
    size_t i = live_slot(c, p);
    while (c->live[i].p) i = (i + 1) & (c->cap_live - 1);
    c->live[i].p = p;
    c->live[i].bytes = bytes;
    c->n_live++;
}

/* Removes p from the table; returns its rounded size (0: an exact allocation). */
static size_t live_take(struct cuda_be *c, void *p) {
    size_t i = c->cap_live ? live_slot(c, p) : 0;
    while (c->cap_live && c->live[i].p && c->live[i].p != p) i = (i + 1) & (c->cap_live - 1);
    if (!c->cap_live || c->live[i].p != p)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "cuda_be_scratch_free", "pointer was not handed out by this backend");
    size_t bytes = c->live[i].bytes;
    c->live[i].p = NULL;
    c->n_live--;
    /* close the gap: re-insert the rest of the probe run */
    for (size_t j = (i + 1) & (c->cap_live - 1); c->live[j].p; j = (j + 1) & (c->cap_live - 1)) {
        struct scratch_live e = c->live[j];
        c->live[j].p = NULL;
        c->n_live--;
        live_put(c, e.p, e.bytes);
    }
    return bytes;
}

static struct scratch_class *scratch_class_of(struct cuda_be *c, size_t bytes) {
    for (int i = 0; i < c->n_cls; i++)
        if (c->cls[i].bytes == bytes) return &c->cls[i];
    c->cls = (struct scratch_class *)ds_realloc(c->cls, sizeof *c->cls * (size_t)(c->n_cls + 1));
    struct scratch_class *k = &c->cls[c->n_cls++];
    *k = (struct scratch_class){bytes, NULL, 0, 0};
    return k;
}

/* Hands every kept block back to the stream-ordered pool (where a new request can use it). */
static void scratch_release_kept(struct cuda_be *c) {
    for (int i = 0; i < c->n_cls; i++) {
        for (int j = 0; j < c->cls[i].n_free; j++) CUDA_CHECK(cudaFreeAsync(c->cls[i].free[j], c->stream));
        free(c->cls[i].free);
    }
    free(c->cls);
    c->cls = NULL;
    c->n_cls = 0;
}

/* Device memory from the stream-ordered pool (async) or cudaMalloc; out of memory, the kept
 * scratch blocks may be what is missing: they go back and the call is tried once more, and a second
 * failure is the out-of-memory error naming `what` and the `hint`. */
static void *dev_malloc(struct backend *be, size_t bytes, bool async, const char *what, const char *hint) {
    struct cuda_be *c = cb(be);
    void *p = NULL;
    for (int tried = 0;; tried++) {
        cudaError_t e = async ? cudaMallocAsync(&p, bytes, c->stream) : cudaMalloc(&p, bytes);
        if (e != cudaErrorMemoryAllocation) {
            CUDA_CHECK(e);
            return p;
        }
        if (tried) out_of_memory(be, what, bytes, hint);
        (void)cudaGetLastError();
        scratch_release_kept(c);
    }
}

static void *scratch_malloc(struct backend *be, size_t bytes) {
    return dev_malloc(be, bytes, true, "activations and caches",
                      "lower --max-seqs, --max-seq-len or --chunk, or use more ranks");
}

/* Graph segments run one at a time on the backend's stream and free every temporary they take
 * before they end (cuda_be_set_capturing checks), so all recordings can take theirs from one
 * arena, each from its start: the recorded kernels' addresses stay valid for as long as the arena
 * does. As graph allocation nodes instead (cudaMallocAsync while capturing), every recording's
 * temporaries were virtual ranges of their own, backed by the one physical pool that graphs
 * launched into one stream share. Before a recording: where an earlier one wanted more than the
 * arena holds (it got allocation nodes for the rest), a larger arena replaces it, and the caller
 * drops every recorded graph first (they point into the old one). Returns whether it did.
 * H100, bench_step decode ms at batch 1 / 8 / 64 / 128 / 256, two runs alternated with cde5498:
 * 3.78 3.80 / 5.02 5.01 / 10.36 10.33 / 13.71 13.77 / 17.79 17.79 -> 3.76 3.70 / 4.97 4.98 / 10.27
 * 10.31 / 13.67 13.68 / 17.66 17.69; the idle before the segment that opens with the attention's
 * index lists 70 -> 53 µs a step at batch 1 (timelines of cde5498, b0601a4). The arena is 64 MiB
 * at least (the graph pool's own high-water mark stays beside it, from the recordings made before
 * it existed). */
bool cuda_be_garena_grow(struct backend *be) {
    struct cuda_be *c = cb(be);
    if (c->garena_need <= c->garena_cap) return false;
    size_t cap = c->garena_need + c->garena_need / 2;
    cap = cap < ((size_t)64 << 20) ? ((size_t)64 << 20) : (cap + 0xFFFFF) & ~(size_t)0xFFFFF;
    CUDA_CHECK(cudaStreamSynchronize(c->stream)); /* the graphs in flight read the old one */
    if (c->garena) CUDA_CHECK(cudaFree(c->garena));
    c->garena = (uint8_t *)dev_malloc(be, cap, false, "the decode step's graph temporaries",
                                      "lower --max-seqs, or run with --eager");
    c->garena_cap = cap;
    return true;
}

size_t cuda_be_garena_bytes(struct backend *be) { return cb(be)->garena_cap; }
size_t cuda_be_garena_need(struct backend *be) { return cb(be)->garena_need; }

void *cuda_be_scratch_raw(struct backend *be, size_t bytes) {
    struct cuda_be *c = cb(be);
    if (!bytes) bytes = 16;
    if (c->capturing) {
        const size_t at = (c->garena_off + 255) & ~(size_t)255, end = at + ((bytes + 255) & ~(size_t)255);
        if (end > c->garena_need) c->garena_need = end;
        if (end <= c->garena_cap) { /* freed by the recording's end (cuda_be_set_capturing) */
            c->garena_off = end;
            live_put(c, c->garena + at, LIVE_ARENA);
            return c->garena + at;
        }
        void *g = NULL;
        CUDA_CHECK(cudaMallocAsync(&g, bytes, c->stream)); /* recorded: the graph's allocation node */
        live_put(c, g, LIVE_GRAPH);
        c->graph_allocs++;
        return g;
    }
    size_t rb = bytes <= SCRATCH_CLASS_MAX ? scratch_round(bytes) : 0;
    void *p = NULL;
    if (rb) {
        struct scratch_class *k = scratch_class_of(c, rb);
        p = k->n_free ? k->free[--k->n_free] : scratch_malloc(be, rb);
    } else {
        p = scratch_malloc(be, bytes);
    }
    live_put(c, p, rb);
    return p;
}

void *cuda_be_scratch(struct backend *be, size_t bytes) {
    void *p = cuda_be_scratch_raw(be, bytes);
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 16, cb(be)->stream));
    return p;
}

/* The free itself, on the main lane (outside a branch, or at its join). */
static void scratch_release(struct cuda_be *c, void *p, size_t rb) {
    if (rb == LIVE_ARENA) return; /* the arena is the next recording's from its start */
    if (rb == LIVE_GRAPH) {
        CUDA_CHECK(cudaFreeAsync(p, c->stream)); /* recorded: the graph's free node */
        c->graph_allocs--;
        return;
    }
    if (!rb) {
        CUDA_CHECK(cudaFreeAsync(p, c->stream));
        return;
    }
    struct scratch_class *k = scratch_class_of(c, rb);
    if (k->n_free == k->cap_free)
        k->free = (void **)ds_realloc(k->free, sizeof *k->free * (size_t)(k->cap_free = k->cap_free ? 2 * k->cap_free : 8));
    k->free[k->n_free++] = p;
}

/* Between branch_begin and branch_join two or three lanes run at once, and the free list's safety
 * argument (one stream: later work runs after earlier) no longer holds: a block one lane frees
 * could be handed to another lane's next op while the first still reads it. So every free in that
 * span waits for the join, where the main lane has waited for them all. A block taken from the
 * free list inside the span was freed before the first fork, so every lane runs after its last
 * use. */
void cuda_be_scratch_free(struct backend *be, void *p) {
    if (!p) return;
    struct cuda_be *c = cb(be);
    size_t rb = live_take(c, p);
    const bool recorded = rb == LIVE_GRAPH || rb == LIVE_ARENA;
    if (recorded != c->capturing)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "cuda_be_scratch_free",
                 recorded ? "a buffer a graph segment allocated is freed outside it"
                          : "a graph segment frees a buffer allocated before it (backend.h)");
    if (c->branch != BRANCH_NONE) {
        if (c->n_deferred == c->cap_deferred)
            c->deferred = (struct deferred_free *)ds_realloc(
                c->deferred, sizeof *c->deferred * (size_t)(c->cap_deferred = c->cap_deferred ? 2 * c->cap_deferred : 64));
        c->deferred[c->n_deferred++] = (struct deferred_free){p, rb};
        return;
    }
    scratch_release(c, p, rb);
}

static void cu_branch_begin(struct backend *be) {
    struct cuda_be *c = cb(be);
    if (c->branch == BRANCH_ON_SIDE)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "branch_begin", "a branch begins before the last one ended");
    if (c->n_open == CUDA_SIDES)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "branch_begin", "more branches open at once than BE_MAX_BRANCHES");
    const int i = c->n_open;
    CUDA_CHECK(cudaEventRecord(c->fork_ev[i], c->main));
    CUDA_CHECK(cudaStreamWaitEvent(c->side[i], c->fork_ev[i], 0));
    c->stream = c->side[i];
    c->branch = BRANCH_ON_SIDE;
}

static void cu_branch_end(struct backend *be) {
    struct cuda_be *c = cb(be);
    if (c->branch != BRANCH_ON_SIDE)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "branch_end", "no branch is issuing");
    CUDA_CHECK(cudaEventRecord(c->join_ev[c->n_open], c->side[c->n_open]));
    c->n_open++;
    c->stream = c->main;
    c->branch = BRANCH_ENDED;
}

static void cu_branch_join(struct backend *be) {
    struct cuda_be *c = cb(be);
    if (c->branch != BRANCH_ENDED)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "branch_join", "no ended branch to join (branch_end first)");
    for (int i = 0; i < c->n_open; i++) CUDA_CHECK(cudaStreamWaitEvent(c->main, c->join_ev[i], 0));
    c->n_open = 0;
    c->branch = BRANCH_NONE;
    for (int i = 0; i < c->n_deferred; i++) scratch_release(c, c->deferred[i].p, c->deferred[i].bytes);
    c->n_deferred = 0;
}

/* n device copies in one launch: each copy is cut into pieces of at most COPY_PIECE bytes (so a
 * long cache range spreads over many blocks) and each block copies pieces, in 16-byte words where
 * the piece is aligned to them. Up to COPY_INLINE copies (a decode step's cache rows and TP
 * gathers) travel whole in the kernel's parameters, with the index of each one's first piece, and
 * a block finds its piece's copy there; more copies go up as a list of pieces in one upload first.
 * The parameters save that host-to-device copy ahead of the kernel, ~90 of them a decode step;
 * counting pieces rather than copies against COPY_INLINE, as before 2026-12-07, sent a few long
 * copies through the upload (the bench's MoE exchange stand-in at batch 256: 8 copies of 2 MB, 240
 * pieces, the GPU idle ~13 µs before each of 20 launches a step: H100 timeline of 302a171). */
#define COPY_PIECE (64 * 1024)
#define COPY_INLINE BE_COPY_SEGS_GRAPH /* 64 x 24 + 65 x 4 bytes: within the classic 4 KB of kernel parameters */
struct copy_piece {
    uint8_t *dst;
    const uint8_t *src;
    uint64_t bytes;
};
struct copy_inline {
    struct copy_piece pc[COPY_INLINE]; /* whole copies */
    uint32_t first[COPY_INLINE + 1];   /* copy j's pieces are [first[j], first[j + 1]) */
};

static void cu_upload(struct backend *be, void *dst, const void *src_host, size_t bytes);

/* one piece by the block's threads; four 16-byte words in flight a thread (a loop of single
 * words left one load in flight: the compiler cannot tell dst from src) */
static __device__ __forceinline__ void copy_piece_block(struct copy_piece c) {
    if ((((uintptr_t)c.dst | (uintptr_t)c.src | (uintptr_t)c.bytes) & 15) == 0) {
        uint4 *d = (uint4 *)c.dst;
        const uint4 *s = (const uint4 *)c.src;
        const uint64_t nw = c.bytes / 16;
        uint64_t j = threadIdx.x;
        for (; j + 3 * blockDim.x < nw; j += 4 * blockDim.x) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = s[j + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < 4; u++) d[j + u * blockDim.x] = v[u];
        }
        for (; j < nw; j += blockDim.x) d[j] = s[j];
    } else {
        for (uint64_t j = threadIdx.x; j < c.bytes; j += blockDim.x) c.dst[j] = c.src[j];
    }
}

__global__ void copy_segs_kernel(const struct copy_piece *pc, int64_t n) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) copy_piece_block(pc[i]);
}

__global__ void copy_segs_inline_kernel(const struct copy_inline p, int n) {
    const uint32_t np = p.first[n];
    int j = 0; /* the pieces a block takes increase, so its copy index only moves forward */
    for (uint32_t i = blockIdx.x; i < np; i += gridDim.x) {
        while (p.first[j + 1] <= i) j++;
        const uint64_t off = (uint64_t)(i - p.first[j]) * COPY_PIECE, left = p.pc[j].bytes - off;
        const uint64_t bytes = left < COPY_PIECE ? left : COPY_PIECE;
        copy_piece_block((struct copy_piece){p.pc[j].dst + off, p.pc[j].src + off, bytes});
    }
}

static void cu_copy_segs(struct backend *be, const struct copy_seg *segs, int64_t n) {
    /* the inline form is all device work, its list in the launch's parameters: a recording may
     * hold it (backend.h, BE_COPY_SEGS_GRAPH); never a branch (backend.h) */
    if (n > COPY_INLINE || cb(be)->branch != BRANCH_NONE) not_in_segment(be, "copy_segs");
    int64_t np = 0;
    for (int64_t i = 0; i < n; i++) np += (int64_t)((segs[i].bytes + COPY_PIECE - 1) / COPY_PIECE);
    if (!np) return;
    if (n <= COPY_INLINE && np <= 0x7fffffff) {
        struct copy_inline in;
        int m = 0; /* the copies with bytes (an empty one would own no piece) */
        in.first[0] = 0;
        for (int64_t i = 0; i < n; i++) {
            if (!segs[i].bytes) continue;
            in.pc[m] = (struct copy_piece){(uint8_t *)segs[i].dst, (const uint8_t *)segs[i].src, segs[i].bytes};
            in.first[m + 1] = in.first[m] + (uint32_t)((segs[i].bytes + COPY_PIECE - 1) / COPY_PIECE);
            m++;
        }
        copy_segs_inline_kernel<<<(unsigned)(np < 65535 ? np : 65535), 256, 0, cb(be)->stream>>>(in, m);
        KERNEL_CHECK();
        return;
    }
    struct copy_piece *h = (struct copy_piece *)ds_malloc(sizeof *h * (size_t)np);
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++)
        for (size_t o = 0; o < segs[i].bytes; o += COPY_PIECE)
            h[at++] = (struct copy_piece){(uint8_t *)segs[i].dst + o, (const uint8_t *)segs[i].src + o,
                                          segs[i].bytes - o < COPY_PIECE ? segs[i].bytes - o : COPY_PIECE};
    struct copy_piece *d = (struct copy_piece *)cuda_be_scratch_raw(be, sizeof *h * (size_t)np);
    cu_upload(be, d, h, sizeof *h * (size_t)np);
    free(h);
    int64_t grid = np < 65535 ? np : 65535;
    copy_segs_kernel<<<(unsigned)grid, 256, 0, cb(be)->stream>>>(d, np);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, d);
}

static void *cu_alloc(struct backend *be, size_t bytes) { return cuda_be_scratch(be, bytes); }

/* A download into pageable memory goes through the driver's staging copies (a fraction of the
 * link's rate); page-locked memory takes the DMA directly. When the system will not lock that
 * much, pageable memory still works, only slower (said once). */
static void *cu_host_alloc(struct backend *be, size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e == cudaSuccess) return p;
    (void)cudaGetLastError();
    static int said;
    if (!said++)
        log_warn("cudaHostAlloc of %zu bytes failed (%s): downloads (logits, the pipeline's stream) go to pageable "
                 "memory (slower)",
                 bytes, cudaGetErrorString(e));
    return ds_malloc(bytes);
}

static void cu_host_free(struct backend *be, void *p) {
    if (!p) return;
    unsigned int flags = 0;
    if (cudaHostGetFlags(&flags, p) == cudaSuccess) { /* ours from cudaHostAlloc */
        CUDA_CHECK(cudaFreeHost(p));
        return;
    }
    (void)cudaGetLastError();
    free(p);
}
static void *cu_scratch(struct backend *be, size_t bytes) { return cuda_be_scratch_raw(be, bytes); }
static void cu_free(struct backend *be, void *p) { cuda_be_scratch_free(be, p); }

/* Uploads during a forward (positions, index lists, per-row parameters, copy lists: a few small
 * arrays per layer) go through a pinned ring, because a cudaMemcpyAsync from pageable memory may
 * wait for the stream before it stages the bytes (the runtime's API synchronization rules), which
 * would make the host wait for the device at every upload. The ring is cut into RING_CHUNKS
 * chunks; an upload never straddles two; leaving a chunk records an event, and entering it again
 * waits for that event (the copies out of it were enqueued a whole ring ago, so this almost never
 * blocks). Larger uploads (weights at load) go straight from pageable memory. */

static const void *stage_upload(struct backend *be, const void *src, size_t bytes) {
    struct cuda_be *c = cb(be);
    size_t need = (bytes + 15) & ~(size_t)15;
    if (!c->ring || need > RING_CHUNK) return src;
    if (c->ring_head + need > (size_t)(c->ring_chunk + 1) * RING_CHUNK) {
        CUDA_CHECK(cudaEventRecord(c->ring_ev[c->ring_chunk], c->stream));
        c->ring_pending[c->ring_chunk] = true;
        c->ring_chunk = (c->ring_chunk + 1) % RING_CHUNKS;
        c->ring_head = (size_t)c->ring_chunk * RING_CHUNK;
        if (c->ring_pending[c->ring_chunk]) {
            CUDA_CHECK(cudaEventSynchronize(c->ring_ev[c->ring_chunk]));
            c->ring_pending[c->ring_chunk] = false;
        }
    }
    uint8_t *p = c->ring + c->ring_head;
    c->ring_head += need;
    memcpy(p, src, bytes);
    return p;
}

/* The caller may reuse its buffer as soon as this returns (the model uploads from short-lived host
 * arrays): the bytes are in the ring by then, or staged by the runtime for a large pageable copy. */
static void cu_upload(struct backend *be, void *dst, const void *src_host, size_t bytes) {
    not_in_segment(be, "upload");
    if (bytes)
        CUDA_CHECK(cudaMemcpyAsync(dst, stage_upload(be, src_host, bytes), bytes, cudaMemcpyHostToDevice,
                                   cb(be)->stream));
}

static void cu_download(struct backend *be, void *dst_host, const void *src, size_t bytes) {
    not_in_segment(be, "download");
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, cb(be)->stream));
    CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream));
}

static void cu_copy(struct backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cb(be)->stream));
}

static void cu_sync(struct backend *be) {
    not_in_segment(be, "sync");
    CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream));
}

/* Copy `rows` rows of `row_bytes` (source stride `ld_bytes`) into a compact device array. */
static void *upload_rows(struct backend *be, const void *src, int64_t rows, size_t row_bytes, size_t ld_bytes) {
    size_t total = (size_t)rows * row_bytes;
    void *d = dev_malloc(be, total ? total : 16, false, "this rank's weights",
                         "the rank's slice is larger than the GPU: use a larger --tp or --pp");
    if (total)
        CUDA_CHECK(cudaMemcpy2DAsync(d, row_bytes, src, ld_bytes, row_bytes, (size_t)rows, cudaMemcpyHostToDevice,
                                     cb(be)->stream));
    return d;
}

static int cu_weight_prepare(struct backend *be, struct qweight *w, bool dequant_bf16) {
    not_in_segment(be, "weight_prepare");
    if (w->be_priv) {
        ds_err_set("cuda weight_prepare: weight is already prepared");
        return -1;
    }
    struct qweight *orig = (struct qweight *)ds_malloc(sizeof *orig);
    *orig = *w;
    int64_t n = w->n, k = w->k;
    if (dequant_bf16 && w->fmt == WF_FP8) {
        /* wo_a: the reference dequantizes to bf16 at load (formats.c, as the CPU backend) */
        bf16_t *copy = (bf16_t *)ds_malloc((size_t)(n * k) * sizeof(bf16_t));
        dequant_fp8_tiles_bf16((const uint8_t *)w->w, w->s, n, k, w->ld, w->s_ld, copy);
        w->w = upload_rows(be, copy, n, (size_t)k * 2, (size_t)k * 2);
        CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream));
        free(copy);
        w->fmt = WF_BF16;
        w->ld = k;
        w->s = NULL;
        w->s_ld = 0;
    } else if (dequant_bf16 && w->fmt != WF_BF16) {
        free(orig);
        ds_err_set("cuda weight_prepare: a bf16 copy was asked of a weight in format %d (only FP8 converts)",
                   (int)w->fmt);
        return -1;
    } else {
        switch (w->fmt) {
        case WF_BF16:
            w->w = upload_rows(be, w->w, n, (size_t)k * 2, (size_t)w->ld * 2);
            w->ld = k;
            break;
        case WF_F32:
            w->w = upload_rows(be, w->w, n, (size_t)k * 4, (size_t)w->ld * 4);
            w->ld = k;
            break;
        case WF_FP8: {
            int64_t sc = (k + 31) / 32;
            w->w = upload_rows(be, w->w, n, (size_t)k, (size_t)w->ld);
            w->s = (const uint8_t *)upload_rows(be, w->s, (n + 31) / 32, (size_t)sc, (size_t)w->s_ld);
            w->ld = k;
            w->s_ld = sc;
            break;
        }
        case WF_FP4: {
            int64_t sc = k / 32;
            w->w = upload_rows(be, w->w, n, (size_t)k / 2, (size_t)w->ld);
            cuda_fp4_pack((uint8_t *)w->w, n * (k / 2), cb(be)->stream); /* the kernels' layout (fp4_layout.h) */
            w->s = (const uint8_t *)upload_rows(be, w->s, n, (size_t)sc, (size_t)w->s_ld);
            w->ld = k / 2;
            w->s_ld = sc;
            break;
        }
        }
    }
    w->be_priv = orig;
    return 0;
}

static void cu_weight_release(struct backend *be, struct qweight *w) {
    struct qweight *orig = (struct qweight *)w->be_priv;
    if (!orig) return;
    CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream));
    CUDA_CHECK(cudaFree((void *)w->w));
    if (w->s) CUDA_CHECK(cudaFree((void *)w->s));
    *w = *orig;
    w->be_priv = NULL;
    free(orig);
}

static const void *cu_tensor_prepare(struct backend *be, const void *host, size_t bytes, bool host_resident) {
    if (!host) return NULL;
    not_in_segment(be, "tensor_prepare");
    struct cuda_be *c = cb(be);
    struct prep *p = (struct prep *)ds_calloc(1, sizeof *p);
    if (!host_resident) {
        p->kind = PREP_DEVICE;
        /* upload_rows reports running out of memory itself */
        p->base = upload_rows(be, host, 1, bytes, bytes);
        p->dptr = p->base;
    } else {
        /* register the bytes in place (the checkpoint mapping or the node's Engram service);
         * where that is refused (a range already registered, a file mapping the driver will not
         * pin) fall back to a pinned copy. Exactly [host, host + bytes) is registered, not the
         * covering pages: the driver refuses a copy whose range is partly registered (invalid
         * argument), and the first and last page may hold other buffers, the caller's or the
         * neighbouring tensors of the checkpoint mapping. Read-only registration is only tried
         * for pages that are read-only anyway (a PROT_READ mapping refuses the plain form). */
        void *dp = NULL;
        cudaError_t e = cudaHostRegister((void *)host, bytes, cudaHostRegisterMapped);
        if (e != cudaSuccess && e != cudaErrorHostMemoryAlreadyRegistered) {
            (void)cudaGetLastError();
            e = cudaHostRegister((void *)host, bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
        }
        if (e == cudaSuccess && cudaHostGetDevicePointer(&dp, (void *)host, 0) == cudaSuccess) {
            p->kind = PREP_REGISTERED;
            p->base = (void *)host;
            p->dptr = dp;
        } else {
            if (e == cudaSuccess) CUDA_CHECK(cudaHostUnregister((void *)host));
            (void)cudaGetLastError(); /* the refusal is handled; do not leave it for KERNEL_CHECK */
            void *pin = NULL;
            CUDA_CHECK(cudaHostAlloc(&pin, bytes ? bytes : 16, cudaHostAllocMapped));
            memcpy(pin, host, bytes);
            CUDA_CHECK(cudaHostGetDevicePointer(&dp, pin, 0));
            p->kind = PREP_PINNED_COPY;
            p->base = pin;
            p->dptr = dp;
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    p->next = c->preps;
    c->preps = p;
    return p->dptr;
}

static void prep_undo(struct prep *p) {
    if (p->derived) CUDA_CHECK(cudaFree(p->derived));
    switch (p->kind) {
    case PREP_DEVICE: CUDA_CHECK(cudaFree(p->base)); break;
    case PREP_REGISTERED: CUDA_CHECK(cudaHostUnregister(p->base)); break;
    case PREP_PINNED_COPY: CUDA_CHECK(cudaFreeHost(p->base)); break;
    }
    free(p);
}

bool cuda_be_prep_set_derived(struct backend *be, const void *dptr, void *derived) {
    struct cuda_be *c = cb(be);
    for (struct prep *p = c->preps; p; p = p->next)
        if (p->dptr == dptr && !p->derived) {
            p->derived = derived;
            p->next_derived = c->derived;
            c->derived = p;
            return true;
        }
    return false;
}

const void *cuda_be_prep_derived(struct backend *be, const void *dptr) {
    for (struct prep *p = cb(be)->derived; p; p = p->next_derived)
        if (p->dptr == dptr) return p->derived;
    return NULL;
}

static void cu_tensor_release(struct backend *be, const void *dptr) {
    if (!dptr) return;
    struct cuda_be *c = cb(be);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (struct prep **pp = &c->preps; *pp; pp = &(*pp)->next)
        if ((*pp)->dptr == dptr) {
            struct prep *p = *pp;
            *pp = p->next;
            if (p->derived)
                for (struct prep **dp = &c->derived; *dp; dp = &(*dp)->next_derived)
                    if (*dp == p) {
                        *dp = p->next_derived;
                        break;
                    }
            prep_undo(p);
            return;
        }
}

/* The tensor-core linears' activation form (linear_mma.h), none for the exact ones. */
static size_t cu_act_bytes(struct backend *be, int64_t T, int64_t k) {
    return cb(be)->mma && T > 0 && k % 32 == 0 ? cuda_linear_mma_act_bytes(T, k) : 0;
}

static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .alloc = cu_alloc,
    .free = cu_free,
    .scratch = cu_scratch,
    .upload = cu_upload,
    .download = cu_download,
    .copy = cu_copy,
    .copy_segs = cu_copy_segs,
    .sync = cu_sync,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .weight_prepare = cu_weight_prepare,
    .weight_release = cu_weight_release,
    .tensor_prepare = cu_tensor_prepare,
    .tensor_release = cu_tensor_release,
    .linear = cuda_op_linear,
    .linear_post = cuda_op_linear_post,
    .linear_post_pair = cuda_op_linear_post_pair,
    .linear_f32 = cuda_op_linear_f32,
    .grouped_linear = cuda_op_grouped_linear,
    .head = cuda_op_head,
    .argmax = cuda_op_argmax,
    .row_lse = cuda_op_row_lse,
    .row_topk = cuda_op_row_topk,
    .rmsnorm = cuda_op_rmsnorm,
    .rope = cuda_op_rope,
    .qdq_fp8_32 = cuda_op_qdq_fp8_32,
    .qdq_fp4_32 = cuda_op_qdq_fp4_32,
    .qdq_fp4_16 = cuda_op_qdq_fp4_16,
    .hc_mixes = cuda_op_hc_mixes,
    .hc_prepare = cuda_op_hc_prepare,
    .hc_collapse = cuda_op_hc_collapse,
    .act_bytes = cu_act_bytes,
    .hc_collapse_act = cuda_op_hc_collapse_act,
    .hc_expand = cuda_op_hc_expand,
    .hc_expand_collapse = cuda_op_hc_expand_collapse,
    .hc_init = cuda_op_hc_init,
    .embed = cuda_op_embed,
    .engram_gather = cuda_op_engram_gather,
    .engram_gate = cuda_op_engram_gate,
    .sparse_attn = cuda_op_sparse_attn,
    .sparse_attn_rope = cuda_op_sparse_attn_rope,
    .compress_pool = cuda_op_compress_pool,
    .index_scores = cuda_op_index_scores,
    .index_topk = cuda_op_index_topk,
    .cand_mask = cuda_op_cand_mask,
    .attn_index = cuda_op_attn_index,
    .sparse_attn_index = cuda_op_sparse_attn_index,
    .ring_store = cuda_op_ring_store,
    .router = cuda_op_router,
    .moe_experts = cuda_op_moe_experts,
    .moe_combine = cuda_op_moe_combine,
    .shared_expert = cuda_op_shared_expert,
    .shared_expert_act = cuda_op_shared_expert_act,
    .interleave = cuda_op_interleave,
    .linear_cols = cuda_op_linear_cols,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .branch_begin = cu_branch_begin,
    .branch_end = cu_branch_end,
    .branch_join = cu_branch_join,
};

extern "C" int backend_cuda_init(struct backend *be, int device) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        ds_err_set("--backend cuda: no CUDA device is visible to this process");
        return -1;
    }
    if (device < 0 || device >= n) {
        ds_err_set("--backend cuda: device %d does not exist (%d visible)", device, n);
        return -1;
    }
    struct cuda_be *c = (struct cuda_be *)ds_calloc(1, sizeof *c);
    c->device = device;
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device));
    /* The main lane has the higher priority: where both lanes have CTAs waiting, the block
     * scheduler starts the main lane's (the model puts the longer chain there) and the branch fills
     * the SMs it leaves idle. Measured on the H200 (bench_step, ms at batch 1 / 8 / 64 / 256):
     * equal priorities 6.68 / 9.68 / 21.33 / 33.14, these 6.61 / 9.49 / 20.18 / 33.45. */
    int prio_low = 0, prio_high = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&prio_low, &prio_high));
    CUDA_CHECK(cudaStreamCreateWithPriority(&c->main, cudaStreamNonBlocking, prio_high));
    for (int i = 0; i < CUDA_SIDES; i++) {
        CUDA_CHECK(cudaStreamCreateWithPriority(&c->side[i], cudaStreamNonBlocking, prio_low));
        CUDA_CHECK(cudaEventCreateWithFlags(&c->fork_ev[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&c->join_ev[i], cudaEventDisableTiming));
    }
    c->stream = c->main;
    /* without pinned memory to spare the uploads stay direct (slower, as correct) */
    if (cudaHostAlloc((void **)&c->ring, RING_BYTES, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        c->ring = NULL;
    }
    for (int i = 0; i < RING_CHUNKS; i++) CUDA_CHECK(cudaEventCreateWithFlags(&c->ring_ev[i], cudaEventDisableTiming));
    /* keep freed activations in the pool: a forward frees and reallocates the same sizes */
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    be->ops = &cuda_ops;
    be->priv = c;
    return 0;
}

extern "C" void backend_cuda_free(struct backend *be) {
    struct cuda_be *c = cb(be);
    if (!c) return;
    cuda_graphs_free(be);
    if (c->garena) CUDA_CHECK(cudaFree(c->garena));
    scratch_release_kept(c);
    for (int i = 0; i < c->cap_marks; i++) CUDA_CHECK(cudaEventDestroy(c->marks[i]));
    free(c->marks);
    free(c->live);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (int i = 0; i < RING_CHUNKS; i++) CUDA_CHECK(cudaEventDestroy(c->ring_ev[i]));
    if (c->ring) CUDA_CHECK(cudaFreeHost(c->ring));
    c->derived = NULL;
    while (c->preps) {
        struct prep *p = c->preps;
        c->preps = p->next;
        prep_undo(p);
    }
    for (int i = 0; i < CUDA_SIDES; i++) {
        CUDA_CHECK(cudaStreamSynchronize(c->side[i]));
        CUDA_CHECK(cudaEventDestroy(c->fork_ev[i]));
        CUDA_CHECK(cudaEventDestroy(c->join_ev[i]));
        CUDA_CHECK(cudaStreamDestroy(c->side[i]));
    }
    CUDA_CHECK(cudaStreamDestroy(c->main));
    free(c->deferred);
    free(c);
    be->ops = NULL;
    be->priv = NULL;
}

extern "C" void *backend_cuda_stream(struct backend *be) { return (void *)cb(be)->main; }

extern "C" int backend_cuda_mark(struct backend *be) {
    struct cuda_be *c = cb(be);
    not_in_segment(be, "backend_cuda_mark");
    if (c->n_marks == c->cap_marks) {
        int cap = c->cap_marks ? 2 * c->cap_marks : 4096;
        c->marks = (cudaEvent_t *)ds_realloc(c->marks, sizeof *c->marks * (size_t)cap);
        for (int i = c->cap_marks; i < cap; i++) CUDA_CHECK(cudaEventCreate(&c->marks[i]));
        c->cap_marks = cap;
    }
    CUDA_CHECK(cudaEventRecord(c->marks[c->n_marks], c->stream));
    return c->n_marks++;
}

extern "C" double backend_cuda_mark_ms(struct backend *be, int a, int b) {
    struct cuda_be *c = cb(be);
    if (a < 0 || b < 0 || a >= c->n_marks || b >= c->n_marks)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "backend_cuda_mark_ms", "no such mark");
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, c->marks[a], c->marks[b]));
    return ms;
}

extern "C" void backend_cuda_marks_reset(struct backend *be) { cb(be)->n_marks = 0; }

extern "C" void backend_cuda_profiler_range(struct backend *be, bool on) {
    CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream)); /* the range holds exactly what runs inside it */
    CUDA_CHECK(on ? cudaProfilerStart() : cudaProfilerStop());
}
