/* The indexer's selection on the GPU (index_topk, cand_mask) and sparse_attn's index lists
 * (attn_index) and window ring (ring_store), so a forward never brings the scores back to the host
 * for the top-k (it did: one device wait per index layer, and the host then built the lists), nor
 * builds a list or a copy list a layer.
 *
 * The selection itself is kernels/topk_core.h, the very code the CPU backend runs: libstdc++'s
 * introselect in torch's tie order, written so that each Hoare partition's scan is spread over the
 * block's threads with the same swaps (topk_par_select), and the selected positions come out in
 * order through a scan instead of a sort. Pivot choice, the rare depth-limit heap select and the
 * partial sort for k·64 <= n stay on one thread. The work space (pairs, stopper lists, counts: 16
 * bytes an entry) sits in shared memory when the widest row fits the 48 KB a CTA may take without
 * opt-in (about 2,900 entries), else in a stream-ordered scratch. Rows where every entry is
 * selected (a context under index_topk · ratio) skip the selection, the common decode case.
 *
 * Grid: one block of IDX_THREADS per row. Results are bit-identical to the CPU backend: there is no
 * arithmetic, only comparisons and moves. */
#include "cuda_internal.h"
#include "attn_index_core.h"
#include "topk_core.h"

#define IDX_THREADS 128
#define IDX_SMEM_BYTES (48 * 1024)
#define IDX_CNT (2 * IDX_THREADS + 2)

/* Work space of a row's selection (topk_core.h): the (value, index) pairs, two int32 arrays of
 * n + 1 and the per-thread counts; in shared memory when the widest row fits, else one slice per
 * row of a scratch buffer. */
static size_t idx_row_bytes(int64_t n) {
    return (size_t)n * sizeof(struct topk_elem) + 2 * (size_t)(n + 1) * sizeof(int32_t) + IDX_CNT * sizeof(int32_t) + 16;
}

__device__ __forceinline__ void idx_carve(unsigned char *base, int64_t n, struct topk_elem **q, int32_t **wl,
                                          int32_t **wr, int32_t **cnt) {
    *q = (struct topk_elem *)base;
    *wl = (int32_t *)(base + (size_t)n * sizeof(struct topk_elem));
    *wr = *wl + (n + 1);
    *cnt = *wr + (n + 1);
}

/* no __launch_bounds__: with it ptxas cut this kernel to 40 registers and spilled (build check) */
__global__ void index_topk_kernel(int32_t *top, int64_t ld_top, const float *S, int64_t ld_s, const int32_t *p,
                                  const uint8_t *mask, int64_t ld_m, unsigned char *scratch, size_t row_bytes) {
    extern __shared__ __align__(16) unsigned char idx_smem[];
    __shared__ struct topk_blk st;
    int64_t r = blockIdx.x;
    const int32_t *pr = p + r * TOPK_P_COUNT;
    int64_t n = pr[TOPK_P_N], nv = pr[TOPK_P_VALID];
    struct topk_elem *q;
    int32_t *wl, *wr, *cnt;
    idx_carve(scratch ? scratch + (size_t)r * row_bytes : idx_smem, ld_s, &q, &wl, &wr, &cnt);
    const float *row = S + r * ld_s;
    const uint8_t *mr = mask ? mask + r * ld_m : NULL;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        struct topk_elem e;
        e.v = topk_entry(row, j, nv, mr, ld_m);
        e.i = (int32_t)j;
        q[j] = e;
    }
    __syncthreads();
    topk_par_row(top + r * ld_top, ld_top, pr, q, wl, wr, cnt, &st, (int)threadIdx.x, (int)blockDim.x);
}

__global__ void __launch_bounds__(IDX_THREADS)
cand_mask_kernel(uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s, const int32_t *p, int64_t topk_blocks,
                 int64_t bs, int64_t nb_max, unsigned char *scratch, size_t row_bytes) {
    extern __shared__ __align__(16) unsigned char idx_smem[];
    __shared__ struct topk_blk st;
    int64_t r = blockIdx.x;
    const int32_t *pr = p + r * TOPK_P_COUNT;
    int64_t n = pr[TOPK_P_N], nv = pr[TOPK_P_VALID], vis = pr[TOPK_P_VISIBLE], nb = (n + bs - 1) / bs;
    unsigned char *base = scratch ? scratch + (size_t)r * row_bytes : idx_smem;
    struct topk_elem *q;
    int32_t *wl, *wr, *cnt;
    idx_carve(base, nb_max, &q, &wl, &wr, &cnt);
    uint8_t *keep = (uint8_t *)(cnt + IDX_CNT);
    const float *row = S + r * ld_s;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
        struct topk_elem e;
        e.v = topk_block_max(row, b, bs, n, nv);
        e.i = (int32_t)b;
        q[b] = e;
        keep[b] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0 && vis > 0 && (vis - 1) / bs < nb) q[(vis - 1) / bs].v = __int_as_float(0x7f800000);
    __syncthreads();
    topk_par_cand(keep, nb, topk_blocks, q, wl, wr, cnt, &st, (int)threadIdx.x, (int)blockDim.x);
    uint8_t *out = mask + r * ld_m;
    for (int64_t j = threadIdx.x; j < ld_m; j += blockDim.x) out[j] = j < n ? keep[j / bs] : 0;
}

/* one thread an entry: the row's geometry and top-k row are read by every thread of the row, from L1 */
__global__ void attn_index_kernel(int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T, int64_t W,
                                  int64_t ring0, const int32_t *src, int64_t ld_src, int64_t k, int64_t src0,
                                  int64_t cap) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * n_idx) return;
    const int64_t r = i / n_idx, j = i % n_idx;
    dst[i] = attn_index_entry(geo + r * AIX_COLS, j, W, ring0, k ? src + r * ld_src : NULL, k, src0, cap);
}

void cuda_op_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                        const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T) {
    if (T <= 0) return;
    /* n <= ld_s on every row (a row holds at most its stride of entries) */
    size_t row_bytes = (idx_row_bytes(ld_s) + 15) & ~(size_t)15;
    bool smem = row_bytes <= IDX_SMEM_BYTES;
    unsigned char *scratch = smem ? NULL : (unsigned char *)cuda_be_scratch_raw(be, row_bytes * (size_t)T);
    index_topk_kernel<<<(unsigned)T, IDX_THREADS, smem ? row_bytes : 0, cuda_be_stream(be)>>>(
        top, ld_top, S, ld_s, p, mask, ld_m, scratch, row_bytes);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, scratch);
}

void cuda_op_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                       const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs) {
    if (T <= 0) return;
    int64_t nb_max = (ld_s + bs - 1) / bs + 1;
    size_t row_bytes = (idx_row_bytes(nb_max) + (size_t)nb_max + 15) & ~(size_t)15; /* + keep [nb_max] */
    bool smem = row_bytes <= IDX_SMEM_BYTES;
    unsigned char *scratch = smem ? NULL : (unsigned char *)cuda_be_scratch_raw(be, row_bytes * (size_t)T);
    cand_mask_kernel<<<(unsigned)T, IDX_THREADS, smem ? row_bytes : 0, cuda_be_stream(be)>>>(
        mask, ld_m, S, ld_s, p, topk_blocks, bs, nb_max, scratch, row_bytes);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, scratch);
}

/* a block a row, 16 bytes a thread (hd·2 is a multiple of 16: checked by the caller) */
__global__ void ring_store_kernel(uint4 *ring, const uint4 *kv, const int32_t *geo, int64_t W, int64_t n16) {
    const int64_t r = blockIdx.x, q = ring_store_row(geo + r * AIX_COLS, W);
    if (q < 0) return;
    for (int64_t c = threadIdx.x; c < n16; c += blockDim.x) ring[q * n16 + c] = kv[r * n16 + c];
}

void cuda_op_ring_store(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W,
                        int64_t hd) {
    if (T <= 0 || hd <= 0) return;
    if ((hd * 2) % 16 || ((uintptr_t)ring & 15) || ((uintptr_t)kv & 15) || T > 0x7fffffff)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "ring_store", "rows of a multiple of 16 bytes, 16-byte aligned");
    const int64_t n16 = hd * 2 / 16;
    ring_store_kernel<<<(unsigned)T, (unsigned)(n16 < 128 ? n16 : 128), 0, cuda_be_stream(be)>>>(
        (uint4 *)ring, (const uint4 *)kv, geo, W, n16);
    KERNEL_CHECK();
}

void cuda_op_attn_index(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T,
                        const struct attn_index_par *par) {
    const int64_t n = T * n_idx;
    if (n <= 0) return;
    attn_index_kernel<<<(unsigned)((n + 255) / 256), 256, 0, cuda_be_stream(be)>>>(
        dst, n_idx, geo, T, par->W, par->ring0, par->src, par->ld_src, par->k, par->src0, par->cap);
    KERNEL_CHECK();
}
