/* The indexer's selection on the GPU (index_topk, cand_mask) and the index-list remap, so a
 * forward never brings the scores back to the host for the top-k (it did: one device wait per
 * index layer, and the host then built the lists).
 *
 * The selection itself is kernels/topk_core.h, the very code the CPU backend runs: libstdc++'s
 * introselect in torch's tie order, which is sequential by nature, so one thread of the row's block
 * runs it while the block's other threads do the parallel parts (reading the row with its -inf
 * rules into (value, index) pairs, block maxima, padding, the mask). The pairs sit in shared memory
 * when the widest row fits the 48 KB a CTA may take without opt-in (6,144 entries), else in a
 * stream-ordered scratch. Rows where every entry is selected (a context under index_topk · ratio)
 * skip the selection (topk_core.h), which is the common decode case.
 *
 * Grid: one block of IDX_THREADS per row. Results are bit-identical to the CPU backend: there is no
 * arithmetic, only comparisons and moves. */
#include "cuda_internal.h"
#include "topk_core.h"

#define IDX_THREADS 128
#define IDX_SMEM_BYTES (48 * 1024)

__global__ void __launch_bounds__(IDX_THREADS)
index_topk_kernel(int32_t *top, int64_t ld_top, const float *S, int64_t ld_s, const int32_t *p, const uint8_t *mask,
                  int64_t ld_m, struct topk_elem *scratch) {
    extern __shared__ __align__(16) unsigned char idx_smem[];
    int64_t r = blockIdx.x;
    const int32_t *pr = p + r * TOPK_P_COUNT;
    int64_t n = pr[TOPK_P_N], nv = pr[TOPK_P_VALID];
    struct topk_elem *q = scratch ? scratch + r * ld_s : (struct topk_elem *)idx_smem;
    const float *row = S + r * ld_s;
    const uint8_t *mr = mask ? mask + r * ld_m : NULL;
    int32_t *out = top + r * ld_top;
    for (int64_t j = threadIdx.x; j < ld_top; j += blockDim.x) out[j] = -1;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        struct topk_elem e;
        e.v = topk_entry(row, j, nv, mr, ld_m);
        e.i = (int32_t)j;
        q[j] = e;
    }
    __syncthreads();
    if (threadIdx.x == 0) topk_row_finish(out, pr, q);
}

__global__ void __launch_bounds__(IDX_THREADS)
cand_mask_kernel(uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s, const int32_t *p, int64_t topk_blocks,
                 int64_t bs, int64_t nb_max, struct topk_elem *scratch, uint8_t *keep_scratch) {
    extern __shared__ __align__(16) unsigned char idx_smem[];
    int64_t r = blockIdx.x;
    const int32_t *pr = p + r * TOPK_P_COUNT;
    int64_t n = pr[TOPK_P_N], nv = pr[TOPK_P_VALID], vis = pr[TOPK_P_VISIBLE], nb = (n + bs - 1) / bs;
    struct topk_elem *q = scratch ? scratch + r * nb_max : (struct topk_elem *)idx_smem;
    uint8_t *keep = scratch ? keep_scratch + r * nb_max : idx_smem + nb_max * sizeof(struct topk_elem);
    const float *row = S + r * ld_s;
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
        struct topk_elem e;
        e.v = topk_block_max(row, b, bs, n, nv);
        e.i = (int32_t)b;
        q[b] = e;
        keep[b] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (vis > 0 && (vis - 1) / bs < nb) q[(vis - 1) / bs].v = __int_as_float(0x7f800000);
        topk_cand_finish(keep, nb, topk_blocks, q);
    }
    __syncthreads();
    uint8_t *out = mask + r * ld_m;
    for (int64_t j = threadIdx.x; j < ld_m; j += blockDim.x) out[j] = j < n ? keep[j / bs] : 0;
}

__global__ void idx_remap_kernel(int32_t *dst, int64_t ld_dst, const int32_t *src, int64_t ld_src, const int32_t *at,
                                 int64_t T, int64_t k) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * k) return;
    int64_t r = i / k, j = i % k;
    int32_t c = src[r * ld_src + j];
    dst[r * ld_dst + at[2 * r] + j] = c < 0 ? -1 : c + at[2 * r + 1];
}

void cuda_op_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                        const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T) {
    if (T <= 0) return;
    /* n <= ld_s on every row (a row holds at most its stride of entries) */
    size_t row_bytes = (size_t)ld_s * sizeof(struct topk_elem);
    bool smem = row_bytes <= IDX_SMEM_BYTES;
    struct topk_elem *scratch = smem ? NULL : (struct topk_elem *)cuda_be_scratch_raw(be, row_bytes * (size_t)T);
    index_topk_kernel<<<(unsigned)T, IDX_THREADS, smem ? row_bytes : 0, cuda_be_stream(be)>>>(top, ld_top, S, ld_s, p,
                                                                                             mask, ld_m, scratch);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, scratch);
}

void cuda_op_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                       const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs) {
    if (T <= 0) return;
    int64_t nb_max = (ld_s + bs - 1) / bs + 1;
    size_t need = (size_t)nb_max * (sizeof(struct topk_elem) + 1);
    bool smem = need <= IDX_SMEM_BYTES;
    struct topk_elem *scratch = NULL;
    uint8_t *keep = NULL;
    if (!smem) {
        scratch = (struct topk_elem *)cuda_be_scratch_raw(be, (size_t)nb_max * sizeof(struct topk_elem) * (size_t)T);
        keep = (uint8_t *)cuda_be_scratch_raw(be, (size_t)nb_max * (size_t)T);
    }
    cand_mask_kernel<<<(unsigned)T, IDX_THREADS, smem ? need : 0, cuda_be_stream(be)>>>(mask, ld_m, S, ld_s, p,
                                                                                       topk_blocks, bs, nb_max,
                                                                                       scratch, keep);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, scratch);
    cuda_be_scratch_free(be, keep);
}

void cuda_op_idx_remap(struct backend *be, int32_t *dst, int64_t ld_dst, const int32_t *src, int64_t ld_src,
                       const int32_t *at, int64_t T, int64_t k) {
    int64_t n = T * k;
    if (n <= 0) return;
    idx_remap_kernel<<<(unsigned)((n + 255) / 256), 256, 0, cuda_be_stream(be)>>>(dst, ld_dst, src, ld_src, at, T, k);
    KERNEL_CHECK();
}
