/* The SM80 backend's op table, its init/free, memory ops and weight preparation.
 *
 * One backend = one device and one stream; every op enqueues on that stream and nothing here
 * waits except download and sync, so the host runs ahead of the GPU until the model needs a value.
 * Activations come from the stream-ordered pool (cudaMallocAsync with an unbounded release
 * threshold): the forward allocates and frees its temporaries per layer, and the pool turns that
 * into a free list without a device synchronization per free. Weights are copied once, compactly,
 * into device memory by weight_prepare (TP slices arrive as strided views into the checkpoint
 * mapping); the original description is parked in be_priv so release restores it exactly.
 * Host-resident tensors (Engram tables: 100 GB in the release, larger than a GPU) are registered
 * as mapped pinned memory and read by the kernels over the bus. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "formats.h"

extern "C" void *ds_malloc(size_t n);
extern "C" void *ds_calloc(size_t n, size_t m);

/* A prepared tensor: what release must undo. */
enum prep_kind { PREP_DEVICE, PREP_REGISTERED, PREP_PINNED_COPY };
struct prep {
    const void *dptr;  /* what the ops see */
    void *base;        /* device allocation, registered host range, or pinned copy */
    enum prep_kind kind;
    struct prep *next;
};

struct cuda_be {
    int device, sms;
    bool mma;
    cudaStream_t stream;
    struct prep *preps;
};

static struct cuda_be *cb(struct backend *be) { return (struct cuda_be *)be->priv; }

cudaStream_t cuda_be_stream(struct backend *be) { return cb(be)->stream; }
int cuda_be_sms(struct backend *be) { return cb(be)->sms; }
bool cuda_be_mma(struct backend *be) { return cb(be)->mma; }

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

void *cuda_be_scratch(struct backend *be, size_t bytes) {
    void *p = NULL;
    if (!bytes) bytes = 16;
    cudaError_t e = cudaMallocAsync(&p, bytes, cb(be)->stream);
    if (e == cudaErrorMemoryAllocation)
        out_of_memory(be, "activations and caches", bytes, "lower --max-seqs, --max-seq-len or --chunk, or use more ranks");
    CUDA_CHECK(e);
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cb(be)->stream));
    return p;
}

void cuda_be_scratch_free(struct backend *be, void *p) {
    if (p) CUDA_CHECK(cudaFreeAsync(p, cb(be)->stream));
}

static void *cu_alloc(struct backend *be, size_t bytes) { return cuda_be_scratch(be, bytes); }
static void cu_free(struct backend *be, void *p) { cuda_be_scratch_free(be, p); }

/* From pageable host memory the copy is staged before the call returns, so the caller may reuse
 * its buffer at once (the model uploads from short-lived host arrays). */
static void cu_upload(struct backend *be, void *dst, const void *src_host, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, cb(be)->stream));
}

static void cu_download(struct backend *be, void *dst_host, const void *src, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, cb(be)->stream));
    CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream));
}

static void cu_copy(struct backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cb(be)->stream));
}

static void cu_sync(struct backend *be) { CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream)); }

/* Copy `rows` rows of `row_bytes` (source stride `ld_bytes`) into a compact device array. */
static void *upload_rows(struct backend *be, const void *src, int64_t rows, size_t row_bytes, size_t ld_bytes) {
    void *d = NULL;
    size_t total = (size_t)rows * row_bytes;
    cudaError_t e = cudaMalloc(&d, total ? total : 16);
    if (e == cudaErrorMemoryAllocation)
        out_of_memory(be, "this rank's weights", total, "the rank's slice is larger than the GPU: use a larger --tp or --pp");
    CUDA_CHECK(e);
    if (total)
        CUDA_CHECK(cudaMemcpy2DAsync(d, row_bytes, src, ld_bytes, row_bytes, (size_t)rows, cudaMemcpyHostToDevice,
                                     cb(be)->stream));
    return d;
}

static int cu_weight_prepare(struct backend *be, struct qweight *w, bool dequant_bf16) {
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
    struct cuda_be *c = cb(be);
    struct prep *p = (struct prep *)ds_calloc(1, sizeof *p);
    if (!host_resident) {
        p->kind = PREP_DEVICE;
        /* upload_rows reports running out of memory itself */
        p->base = upload_rows(be, host, 1, bytes, bytes);
        p->dptr = p->base;
    } else {
        /* register the pages in place (the checkpoint mapping or the node's Engram service);
         * where that is refused (a range already registered, a file mapping the driver will not
         * pin) fall back to a pinned copy */
        long pg = sysconf(_SC_PAGESIZE);
        uintptr_t a = (uintptr_t)host & ~(uintptr_t)(pg - 1);
        size_t len = (((uintptr_t)host + bytes + (size_t)pg - 1) & ~(uintptr_t)(pg - 1)) - a;
        void *dp = NULL;
        cudaError_t e = cudaHostRegister((void *)a, len, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
        if (e == cudaSuccess && cudaHostGetDevicePointer(&dp, (void *)host, 0) == cudaSuccess) {
            p->kind = PREP_REGISTERED;
            p->base = (void *)a;
            p->dptr = dp;
        } else {
            if (e == cudaSuccess) CUDA_CHECK(cudaHostUnregister((void *)a));
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
    switch (p->kind) {
    case PREP_DEVICE: CUDA_CHECK(cudaFree(p->base)); break;
    case PREP_REGISTERED: CUDA_CHECK(cudaHostUnregister(p->base)); break;
    case PREP_PINNED_COPY: CUDA_CHECK(cudaFreeHost(p->base)); break;
    }
    free(p);
}

static void cu_tensor_release(struct backend *be, const void *dptr) {
    if (!dptr) return;
    struct cuda_be *c = cb(be);
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    for (struct prep **pp = &c->preps; *pp; pp = &(*pp)->next)
        if ((*pp)->dptr == dptr) {
            struct prep *p = *pp;
            *pp = p->next;
            prep_undo(p);
            return;
        }
}

static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .download = cu_download,
    .copy = cu_copy,
    .sync = cu_sync,
    .weight_prepare = cu_weight_prepare,
    .weight_release = cu_weight_release,
    .tensor_prepare = cu_tensor_prepare,
    .tensor_release = cu_tensor_release,
    .linear = cuda_op_linear,
    .linear_f32 = cuda_op_linear_f32,
    .grouped_linear = cuda_op_grouped_linear,
    .head = cuda_op_head,
    .rmsnorm = cuda_op_rmsnorm,
    .rope = cuda_op_rope,
    .qdq_fp8_32 = cuda_op_qdq_fp8_32,
    .qdq_fp4_32 = cuda_op_qdq_fp4_32,
    .qdq_fp4_16 = cuda_op_qdq_fp4_16,
    .hc_mixes = cuda_op_hc_mixes,
    .hc_collapse = cuda_op_hc_collapse,
    .hc_expand = cuda_op_hc_expand,
    .hc_init = cuda_op_hc_init,
    .embed = cuda_op_embed,
    .engram_gather = cuda_op_engram_gather,
    .engram_gate = cuda_op_engram_gate,
    .sparse_attn = cuda_op_sparse_attn,
    .compress_pool = cuda_op_compress_pool,
    .index_scores = cuda_op_index_scores,
    .router = cuda_op_router,
    .moe_experts = cuda_op_moe_experts,
    .moe_combine = cuda_op_moe_combine,
    .shared_expert = cuda_op_shared_expert,
    .add_f32_bf16 = cuda_op_add_f32_bf16,
    .interleave = cuda_op_interleave,
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
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
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
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    while (c->preps) {
        struct prep *p = c->preps;
        c->preps = p->next;
        prep_undo(p);
    }
    CUDA_CHECK(cudaStreamDestroy(c->stream));
    free(c);
    be->ops = NULL;
    be->priv = NULL;
}

extern "C" void *backend_cuda_stream(struct backend *be) { return (void *)cb(be)->stream; }
