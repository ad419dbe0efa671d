/* One entry of sparse_attn's index lists (backend.h's attn_index) and the ring row of a chunk row
 * (ring_store), the same code for the CPU backend's loops and the CUDA backend's kernels, so the
 * two cannot drift. A list: the window part from the row's geometry (position, chunk start, chunk
 * key row, slot, window width), the compressed part from the top-k row, -1 past both. The lists
 * were built on the host per layer and uploaded (T x n_idx ints a layer); the geometry is uploaded
 * once a forward, with the positions. */
#ifndef DS_ATTN_INDEX_CORE_H
#define DS_ATTN_INDEX_CORE_H

#include <stdint.h>

#ifdef __CUDACC__
#define ATTN_INDEX_FN static __host__ __device__ __forceinline__
#else
#define ATTN_INDEX_FN static inline
#endif

/* geometry columns of a row (attn_index's and ring_store's geo [T, AIX_COLS]): AIX_END is the
 * chunk's end (start + len), for ring_store */
enum { AIX_P, AIX_START, AIX_CHUNK_ROW, AIX_SLOT, AIX_NW, AIX_END, AIX_COLS };

/* Where ring_store puts the row with geometry g: its ring row (slot·W + p mod W) where it is one of
 * its chunk's last W positions, else -1 (an earlier row of the chunk owns that ring row). */
ATTN_INDEX_FN int64_t ring_store_row(const int32_t *g, int64_t W) {
    const int64_t p = g[AIX_P];
    return p >= (int64_t)g[AIX_END] - W ? (int64_t)g[AIX_SLOT] * W + p % W : -1;
}

/* Entry j of the row with geometry g: W the window, ring0 the key row of slot 0's ring; srow the
 * row's k compressed ids (NULL when k = 0), src0 + slot·cap the key row of its slot's first. */
ATTN_INDEX_FN int32_t attn_index_entry(const int32_t *g, int64_t j, int64_t W, int64_t ring0, const int32_t *srow,
                                       int64_t k, int64_t src0, int64_t cap) {
    const int64_t p = g[AIX_P], start = g[AIX_START], nw = g[AIX_NW], slot = g[AIX_SLOT];
    if (j < nw) {
        /* reference prefill (nw < W): positions from max(0, p - W + 1) upwards, trailing -1;
         * otherwise the W positions ending at p, oldest first, leading -1 */
        const int64_t qp = (nw < W ? (p - W + 1 > 0 ? p - W + 1 : 0) : p - W + 1) + j;
        if (qp < 0 || qp > p) return -1;
        return (int32_t)(qp >= start ? g[AIX_CHUNK_ROW] + (qp - start) : ring0 + slot * W + qp % W);
    }
    if (j < nw + k) {
        const int32_t c = srow[j - nw];
        return c < 0 ? -1 : (int32_t)(c + src0 + slot * cap);
    }
    return -1;
}

#endif
