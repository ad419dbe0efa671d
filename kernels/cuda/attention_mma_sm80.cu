/* sparse_attn on the tensor cores (the mma switch: on unless --exact-linears; cuda_op_sparse_attn
 * calls cuda_sparse_attn_mma when the switch is on and the shapes fit). The exact kernels of
 * cuda_attention.cu run every q·k and P·V dot as one thread's sequential fp32 chain, which at the
 * real shapes (8 heads × hd 512 × 640 entries a row) is ~1.4 ms a layer of a 2 K-token prefill on
 * CUDA cores; here both products are mma.sync m16n8k16 bf16 with fp32 accumulation. Everything
 * else is the CPU's arithmetic in the CPU's order: the block-64 online softmax (exact max, the
 * glibc expf port, the bf16 rounding of P, l = l·alpha + lsum and acc = acc·alpha + pv with pv a
 * block's P·V from zero, the sink term, the final divide). What changes is the order (and, inside
 * an MMA, the truncating adder) of three sums: the hd-term q·k, the 64-term P·V of a block and the
 * 64-term Σ p of a block: the sum bounds of src/tolerances.h (TOL_GPU_SUM_U_PER_TERM), which the
 * sparse_attn test's interval model already carries. Which rows share a launch, the grid and the
 * column slice width never change an operation of any (row, head, channel): the MMA's k positions
 * of every product are fixed by the entry's place in its block and the d's place in hd, and the
 * partial q·k sums are combined in a fixed order, so the results are batch invariant. Calls of
 * AM_SPLIT_MIN_T rows and more run the softmax once per (row, head group) in its own launch and P·V
 * as one warp per channel slice (attn_softmax_mma_kernel, attn_pv_split_kernel); but from
 * AM_ONE_MIN_T rows, where hd <= 512, attn_one_pass_kernel takes the call, reading each kv row from
 * memory once where the others read it for the scores and again for P·V (attn_mma.h):
 * the same operations per element in the same order, so a row's bits do not depend on which path
 * took it. Every form reads a row's index entries through am_id: from attn_index's lists, or
 * (sparse_attn_index, the engine's decode and prefill path under the mma switch) formed from the
 * row's geometry where they are read, which saves the lists' launch.
 *
 * Neither kernel stages kv in shared memory: lanes load their fragments straight from the cache
 * rows (16 contiguous bytes a lane for q·k; 4·TL for P·V), which the mma layouts allow because a
 * dot product may take its terms in any order as long as both operands agree (q·k: lane (g, t)
 * holds d = 8t..8t+7 of a 32-wide k-block and both operands use that k permutation; P·V: a lane's
 * output rows are 2·TL consecutive channels, so one row load feeds TL tiles). */
#include "attn_index_core.h"
#include "attn_mma.h"
#include "cuda_internal.h"
#include "cuda_libm.cuh"
#include "mma_sm80.cuh"
#include "rope_common.cuh"

#define AM_BLOCK 64            /* idx entries per online-softmax block (backend.h) */
#define AM_HG 8                /* heads per CTA: the mma's n = 8 */
#define AM_QK_EG 2             /* 16-entry groups per q·k CTA (q fragments reused across them) */
#define AM_W 4                 /* warps per CTA */
/* two-pass calls of this many rows and more (the op's where hd > 512, or CUDA_ATTN_TWO_PASS forced:
 * from AM_ONE_MIN_T rows the op otherwise takes the one pass) compute the softmax once
 * (attn_softmax_mma_kernel) and P·V without barriers (attn_pv_split_kernel); fewer take
 * attn_pv_mma_kernel, which needs no second launch and spreads a decode step's few rows over the
 * channel slices */
#define AM_SPLIT_MIN_T 128

/* Where a row's index entries come from (every kernel below reads entry e of row t through am_id):
 * attn_index's lists [T][n_idx], or, idx NULL, the entry attn_index would have stored, formed from
 * the row's geometry as it is read (attn_index_entry, kernels/attn_index_core.h: the same function
 * the index kernel runs), so sparse_attn_index needs no list in memory and no launch to build it. */
struct am_ix {
    const int32_t *idx; /* [T][n_idx], or NULL */
    const int32_t *geo; /* [T][AIX_COLS] (idx NULL) */
    const int32_t *src; /* [T][ld_src] compressed ids, NULL where k = 0 */
    int64_t W, ring0, ld_src, k, src0, cap;
};

/* entry e of row t (-1 past n_idx) */
static __device__ __forceinline__ int am_id(const am_ix &x, int64_t t, int n_idx, int e) {
    if (e >= n_idx) return -1;
    if (x.idx) return x.idx[t * n_idx + e];
    return attn_index_entry(x.geo + t * AIX_COLS, e, x.W, x.ring0, x.k ? x.src + t * x.ld_src : NULL, x.k, x.src0,
                            x.cap);
}

/* ---------------------------------------------------------------------------------------------
 * Logits: sc[t, h, e] = (q·k)·scale for every valid entry (idx >= 0), into scratch [T][H][n_idx].
 *
 * Grid: x = row t · ncta + group of 32 entries, y = group of 8 heads. Block: 4 warps; warp w sums
 * the k-blocks [w·nkb/4, (w+1)·nkb/4) of hd (nkb = hd/32) of all 32 entries × 8 heads as one MMA
 * chain per 16 entries (A = kv rows: entries × d; B = q rows: d × heads); the four partial sums are
 * then added in warp order, ((p0 + p1) + p2) + p3, and multiplied by scale (the CPU's `s * scale`).
 * Lane (g, t) loads d = 32·kb + 8t .. +7 of entry rows g and g + 8 and of head row g (16 bytes
 * each): registers .x/.y feed the k-block's first mma (as k = 2t, 2t+1 and 2t+8, 2t+9), .z/.w its
 * second. Heads past H and invalid entries load zeros and are not stored. */
/* A warp's share of the logits: for each group eg of 16 entries (rows g and g + 8 of the group: kv
 * rows id[eg][0], id[eg][1], -1 = zeros) one MMA chain from zero over the k-blocks [kb0, kb1) of hd
 * in order, A = the entries' rows, B = the 8 heads' q rows (qr: the lane's head row at its 16-byte
 * chunk tq, zeros where !hok). Both the two-pass and the one-pass forms take their partial sums from
 * here, so a logit's operations do not depend on the form. */
template <int EG>
static __device__ __forceinline__ void am_qk_chain(float (&d)[EG][4], const uint4 *qr, bool hok, const uint16_t *kv,
                                                   const int (&id)[EG][2], int hd, int kb0, int kb1, int tq) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int eg = 0; eg < EG; eg++) d[eg][0] = d[eg][1] = d[eg][2] = d[eg][3] = 0.0f;
    for (int kb = kb0; kb < kb1; kb += 4) {
        uint4 qf[4], af[EG][2][4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const bool in = kb + u < kb1;
            qf[u] = in && hok ? __ldg(qr + (kb + u) * 4) : zero;
#pragma unroll
            for (int eg = 0; eg < EG; eg++)
#pragma unroll
                for (int r = 0; r < 2; r++)
                    af[eg][r][u] = in && id[eg][r] >= 0
                                       ? __ldg(reinterpret_cast<const uint4 *>(kv + (int64_t)id[eg][r] * hd) +
                                               (kb + u) * 4 + tq)
                                       : zero;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (kb + u >= kb1) break; /* warp-uniform */
#pragma unroll
            for (int eg = 0; eg < EG; eg++) {
                float *c = d[eg];
                mma_bf16(d[eg], af[eg][0][u].x, af[eg][1][u].x, af[eg][0][u].y, af[eg][1][u].y, qf[u].x, qf[u].y,
                         c[0], c[1], c[2], c[3]);
                mma_bf16(d[eg], af[eg][0][u].z, af[eg][1][u].z, af[eg][0][u].w, af[eg][1][u].w, qf[u].z, qf[u].w,
                         c[0], c[1], c[2], c[3]);
            }
        }
    }
}

/* The logit of fragment register r of group eg: warp 0's chain plus warps 1..3's in warp order
 * (part[w][eg·4 + r][lane] = warp w + 1's), times scale (the CPU's `s * scale`). D fragment: r = 0,
 * 1 -> entry row g, heads 2t, 2t+1; r = 2, 3 -> entry row g + 8. */
static __device__ __forceinline__ float am_qk_logit(float d, const float (*part)[AM_QK_EG * 4][32], int q, int lane,
                                                    float scale) {
#pragma unroll
    for (int w = 0; w < AM_W - 1; w++) d = __fadd_rn(d, part[w][q][lane]);
    return __fmul_rn(d, scale);
}

__global__ void __launch_bounds__(128)
    attn_qk_mma_kernel(float *__restrict__ sc, const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv,
                       const am_ix ix, int H, int hd, int n_idx, int ncta, float scale) {
    __shared__ float part[AM_W - 1][AM_QK_EG * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int64_t t = blockIdx.x / ncta;
    const int e0 = (int)(blockIdx.x % ncta) * (16 * AM_QK_EG);
    const int h0 = blockIdx.y * AM_HG;
    const int nkb = hd >> 5, kb0 = warp * nkb / AM_W, kb1 = (warp + 1) * nkb / AM_W;
    int id[AM_QK_EG][2];
#pragma unroll
    for (int eg = 0; eg < AM_QK_EG; eg++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int e = e0 + 16 * eg + g + 8 * r;
            id[eg][r] = am_id(ix, t, n_idx, e);
        }
    const bool hok = h0 + g < H;
    const uint4 *qr = reinterpret_cast<const uint4 *>(q + (t * H + (hok ? h0 + g : 0)) * (int64_t)hd) + tq;
    float d[AM_QK_EG][4];
    am_qk_chain<AM_QK_EG>(d, qr, hok, kv, id, hd, kb0, kb1, tq);
    if (warp > 0) {
#pragma unroll
        for (int eg = 0; eg < AM_QK_EG; eg++)
#pragma unroll
            for (int r = 0; r < 4; r++) part[warp - 1][eg * 4 + r][lane] = d[eg][r];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int eg = 0; eg < AM_QK_EG; eg++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int e = e0 + 16 * eg + g + 8 * (r >> 1), h = h0 + 2 * tq + (r & 1);
            if (h < H && id[eg][r >> 1] >= 0) sc[(t * H + h) * (int64_t)n_idx + e] = am_qk_logit(d[eg][r], part, eg * 4 + r, lane, scale);
        }
}

/* ---------------------------------------------------------------------------------------------
 * The pieces of a block of the online softmax and its P·V that both P·V kernels run, so that
 * their operations (and hence a row's bits) are the same whichever path a call takes. Softmax
 * layout: lane (g, t) holds head g, entries 16t .. 16t + 15 of the block. */

/* the lane's 16 logits from sb (entry e of the row first); zeros past n_idx */
static __device__ __forceinline__ void am_load_s(float (&s)[16], const float *sb, int e, int n_idx, int vecs) {
    if (vecs) {
#pragma unroll
        for (int i = 0; i < 16; i += 4) { /* n_idx % 4 == 0: a float4 is wholly inside or past the row */
            const float4 v = e + i < n_idx ? __ldg(reinterpret_cast<const float4 *>(sb + i)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            s[i] = v.x, s[i + 1] = v.y, s[i + 2] = v.z, s[i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; i++) s[i] = e + i < n_idx ? __ldg(sb + i) : 0.0f;
    }
}

/* the head's block max over the entries in vm: the lane's in order, then across its 4 lanes */
static __device__ __forceinline__ float am_block_max(const float (&s)[16], unsigned vm) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < 16; i++)
        if (vm >> i & 1u) mx = s[i] > mx ? s[i] : mx;
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, mx, off);
        mx = y > mx ? y : mx;
    }
    return mx;
}

/* p = expf(s − mn) (0 outside vm) as bf16 pairs into pw; returns the head's Σ p (the lane's 16 in
 * order, then the xor tree over its 4 lanes) */
static __device__ __forceinline__ float am_block_p(const float (&s)[16], unsigned vm, float mn, uint32_t (&pw)[8]) {
    float lsum = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
        const float p0 = vm >> i & 1u ? ds_expf(__fsub_rn(s[i], mn)) : 0.0f;
        const float p1 = vm >> (i + 1) & 1u ? ds_expf(__fsub_rn(s[i + 1], mn)) : 0.0f;
        lsum = __fadd_rn(__fadd_rn(lsum, p0), p1);
        pw[i / 2] = (uint32_t)ds_bf16_rne(p0) | ((uint32_t)ds_bf16_rne(p1) << 16);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) lsum = __fadd_rn(lsum, __shfl_xor_sync(0xffffffffu, lsum, off));
    return lsum;
}

/* the lane's 2·TL channels of kv row id (kvd: the slice's first channel of the lane), zeros for
 * an invalid entry (P is 0 there, and 0 · NaN is not 0) */
template <int TL>
static __device__ __forceinline__ void am_load_v(uint32_t (&v)[TL], const uint16_t *kvd, int hd, int id) {
    const uint16_t *src = kvd + (int64_t)(id >= 0 ? id : 0) * hd;
    if constexpr (TL == 4) {
        const uint4 u = id >= 0 ? __ldg(reinterpret_cast<const uint4 *>(src)) : make_uint4(0u, 0u, 0u, 0u);
        v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
    } else if constexpr (TL == 2) {
        const uint2 u = id >= 0 ? __ldg(reinterpret_cast<const uint2 *>(src)) : make_uint2(0u, 0u);
        v[0] = u.x, v[1] = u.y;
    } else {
        v[0] = id >= 0 ? __ldg(reinterpret_cast<const uint32_t *>(src)) : 0u;
    }
}

/* pv = the block's P·V from zero: per 16-channel tile j one MMA chain over the 4 k-steps, A = V^T
 * assembled from the rows of entries 16ks + {2t, 2t+1, 2t+8, 2t+9} by byte permutes, B = P^T
 * (pb[ks]: entries 16ks + 2t, 2t+1 and 2t+8, 2t+9 of head g) */
template <int TL>
static __device__ __forceinline__ void am_block_pv(float (&pv)[TL][4], const uint32_t (&vw)[4][4][TL],
                                                   const uint32_t (&pb)[4][2]) {
#pragma unroll
    for (int j = 0; j < TL; j++) pv[j][0] = pv[j][1] = pv[j][2] = pv[j][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int j = 0; j < TL; j++) {
            const uint32_t a0 = __byte_perm(vw[ks][0][j], vw[ks][1][j], 0x5410u);
            const uint32_t a1 = __byte_perm(vw[ks][0][j], vw[ks][1][j], 0x7632u);
            const uint32_t a2 = __byte_perm(vw[ks][2][j], vw[ks][3][j], 0x5410u);
            const uint32_t a3 = __byte_perm(vw[ks][2][j], vw[ks][3][j], 0x7632u);
            float *c = pv[j];
            mma_bf16(pv[j], a0, a1, a2, a3, pb[ks][0], pb[ks][1], c[0], c[1], c[2], c[3]);
        }
}

/* A block into a row's P·V in the fragment layout (the split and one-pass kernels): pv from zero
 * (am_block_pv), then acc = acc·alpha + pv per element, alpha a0 for head 2t and a1 for 2t + 1
 * (the fragment register's r & 1). */
template <int TL>
static __device__ __forceinline__ void am_block_fold(float (&acc)[TL][4], const uint32_t (&vw)[4][4][TL],
                                                     const uint32_t (&pb)[4][2], float a0, float a1) {
    float pv[TL][4];
    am_block_pv<TL>(pv, vw, pb);
#pragma unroll
    for (int j = 0; j < TL; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[j][r] = __fadd_rn(__fmul_rn(acc[j][r], r & 1 ? a1 : a0), pv[j][r]);
}

/* sparse_attn_rope's RoPE on the stored output (struct attn_rope; pos NULL: none), row t of a launch
 * at pos[t] (pos offset to the launch's first row): rope_kernel's arithmetic on the bf16 values the
 * plain store would write, so o is the bits of sparse_attn, then rope. */
struct am_rope {
    const int32_t *pos;
    const float *freqs;
    int off, rd, inverse;
};

/* whether channels c, c + 1 (c even) are a rotary pair of rp */
static __device__ __forceinline__ bool am_rope_on(const am_rope &rp, int c) {
    return rp.pos && c >= rp.off && c < rp.off + rp.rd;
}

/* (cos, ±sin) of the pairs at channels cbase + 2q (q < np) that are rotary pairs of rp into cs[q],
 * thread i of `stride`: filled at a kernel's start, so that the glibc-port sines and cosines (double
 * arithmetic) run under the attention's loads instead of after them in the stores (computed in
 * the stores, they cost the step what the rope launch had: H100, batch 1 4.00 4.03 -> 4.06 4.05 ms) */
static __device__ __forceinline__ void am_rope_cs(float2 *cs, const am_rope &rp, int64_t t, int cbase, int np, int i,
                                                  int stride) {
    if (!rp.pos) return;
    for (int q = i; q < np; q += stride) {
        const int c = cbase + 2 * q;
        if (!am_rope_on(rp, c)) continue;
        const float2 v = rope_cs(rp.pos[t], rp.freqs[(c - rp.off) >> 1]);
        cs[q] = make_float2(v.x, rp.inverse ? -v.y : v.y);
    }
}

/* channels c, c + 1 of a head (c even) as bf16 codes lo, hi: rotated in place where they are a
 * rotary pair of rp, with cs its (cos, ±sin) from am_rope_cs */
static __device__ __forceinline__ void am_rope_pair(uint16_t &lo, uint16_t &hi, const am_rope &rp, int c, const float2 &cs) {
    if (!am_rope_on(rp, c)) return;
    rope_rotate(ds_bf16f(lo), ds_bf16f(hi), cs.x, cs.y, lo, hi);
}

/* ---------------------------------------------------------------------------------------------
 * Online softmax and P·V.
 *
 * Grid: x = row t, y = group of 8 heads, z = slice of DS = 16·TL channels. Block: 4 warps. The
 * blocks of 64 entries go in rounds of four, warp w taking block 4r + w:
 *   1. its ids (shared within the warp), then its P·V operand rows: lane (g, t) loads channels
 *      2TL·g .. 2TL·g + 2TL − 1 of the slice from the rows of entries 16ks + {2t, 2t+1, 2t+8, 2t+9}
 *      (ks = 0..3), zeros for invalid entries (P is 0 there, and 0 · NaN is not 0);
 *   2. its logits (lane: head g, entries 16t .. 16t + 15) and their max per head -> shared;
 *   barrier; the running max before and after the block, m_prev and m_new, is the CPU's sequential
 *      `x > m ? x : m` over the previous rounds' result and the earlier blocks of this round;
 *      alpha = expf(m_prev − m_new), p = expf(s − m_new), bf16(p) -> the warp's P tile, lsum = Σ p;
 *   3. pv = P·V of the block, one MMA chain from zero over the 4 k-steps per tile of 16 channels
 *      (A = V^T: channels × entries, assembled from the loaded rows by byte permutes; B = P^T:
 *      entries × heads); tile j's row g is channel 2TL·g + 2j, row g + 8 the next one;
 *   barrier; every thread folds the round's blocks in order into its TL accumulators,
 *      acc = acc·alpha + pv, and threads 0..7 fold l = l·alpha + lsum and m for their head.
 * After the last round l += expf(sink − m) where the row has a valid entry, o = bf16(acc / l),
 * staged in shared memory for 16-byte stores; a row without a valid entry gives zeros. */
template <int TL> /* 4 CTAs an SM's worth of registers: without the cap TL = 2 spills */
__global__ void __launch_bounds__(128, 4)
    attn_pv_mma_kernel(uint16_t *__restrict__ o, const float *__restrict__ sc, const uint16_t *__restrict__ kv,
                       const am_ix ix, int H, int hd, int n_idx, const float *__restrict__ sink, int vecs,
                       am_rope rp) {
    constexpr int DS = 16 * TL; /* channels of the slice */
    constexpr int NE = 4 * TL;  /* pv fragment registers per lane */
    __shared__ __align__(16) uint16_t ps[AM_W][AM_HG][AM_BLOCK + 8]; /* bf16(p) per warp's block */
    __shared__ float pvs[AM_W][NE][32];                               /* the round's pv, by fragment */
    __shared__ int ids[AM_W][AM_BLOCK];
    __shared__ float bm[2][AM_W][AM_HG], al[AM_W][AM_HG], lsm[AM_W][AM_HG], mrow[AM_HG], lrow[AM_HG];
    __shared__ __align__(16) uint16_t os[AM_HG][DS];
    __shared__ float2 rcs[DS / 2]; /* the slice's RoPE (cos, ±sin), am_rope_cs */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int64_t t = blockIdx.x;
    const int h0 = blockIdx.y * AM_HG, c0 = blockIdx.z * DS;
    am_rope_cs(rcs, rp, t, c0, DS / 2, tid, blockDim.x);
    const int nb = (n_idx + AM_BLOCK - 1) / AM_BLOCK;
    const bool shok = h0 + g < H; /* softmax layout: head g, entries 16 tq + i */
    const float *srow = sc + (t * H + (shok ? h0 + g : 0)) * (int64_t)n_idx;
    const uint16_t *kvd = kv + c0 + 2 * TL * g;
    if (tid < AM_HG) mrow[tid] = -1e30f, lrow[tid] = 0.0f;
    float acc[TL];
#pragma unroll
    for (int i = 0; i < TL; i++) acc[i] = 0.0f;
    bool any = false;
    __syncthreads();
    for (int r0 = 0, par = 0; r0 < nb; r0 += AM_W, par ^= 1) {
        const int b = r0 + warp;
        const bool bact = b < nb; /* warp-uniform */
        uint32_t vw[4][4][TL];    /* [k-step][entry 2t, 2t+1, 2t+8, 2t+9][word] */
        float s[16];
        unsigned vm = 0u;
        if (bact) {
            for (int k = lane; k < AM_BLOCK; k += 32) ids[warp][k] = am_id(ix, t, n_idx, b * AM_BLOCK + k);
            __syncwarp();
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
#pragma unroll
                for (int u = 0; u < 4; u++) am_load_v<TL>(vw[ks][u], kvd, hd, ids[warp][16 * ks + 2 * tq + (u & 1) + 8 * (u >> 1)]);
            am_load_s(s, srow + b * AM_BLOCK + 16 * tq, b * AM_BLOCK + 16 * tq, n_idx, vecs);
#pragma unroll
            for (int i = 0; i < 16; i++) {
                const bool valid = ids[warp][16 * tq + i] >= 0;
                any |= valid;
                if (valid && shok) vm |= 1u << i;
            }
            const float mx = am_block_max(s, vm);
            if (tq == 0) bm[par][warp][g] = mx;
        }
        __syncthreads();
        if (bact) {
            float mp = mrow[g];
            for (int w = 0; w < warp; w++) {
                const float x = bm[par][w][g];
                mp = x > mp ? x : mp;
            }
            const float x = bm[par][warp][g], mn = x > mp ? x : mp;
            const float alpha = ds_expf(__fsub_rn(mp, mn));
            uint32_t pw[8];
            const float lsum = am_block_p(s, vm, mn, pw);
            uint4 *pd = reinterpret_cast<uint4 *>(&ps[warp][g][16 * tq]);
            pd[0] = make_uint4(pw[0], pw[1], pw[2], pw[3]);
            pd[1] = make_uint4(pw[4], pw[5], pw[6], pw[7]);
            if (tq == 0) al[warp][g] = alpha, lsm[warp][g] = lsum;
            __syncwarp();
            uint32_t pb[4][2];
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                pb[ks][0] = *reinterpret_cast<const uint32_t *>(&ps[warp][g][16 * ks + 2 * tq]);
                pb[ks][1] = *reinterpret_cast<const uint32_t *>(&ps[warp][g][16 * ks + 2 * tq + 8]);
            }
            float pv[TL][4];
            am_block_pv<TL>(pv, vw, pb);
#pragma unroll
            for (int j = 0; j < TL; j++)
#pragma unroll
                for (int r = 0; r < 4; r++) pvs[warp][4 * j + r][lane] = pv[j][r];
        }
        __syncthreads();
        const int nw = min(AM_W, nb - r0);
#pragma unroll
        for (int i = 0; i < TL; i++) {
            const int qe = warp + 4 * i, hh = 2 * tq + (qe & 1); /* fragment register qe = 4j + r */
            for (int w = 0; w < nw; w++) acc[i] = __fadd_rn(__fmul_rn(acc[i], al[w][hh]), pvs[w][qe][lane]);
        }
        if (tid < AM_HG) {
            float l = lrow[tid], m = mrow[tid];
            for (int w = 0; w < nw; w++) {
                l = __fadd_rn(__fmul_rn(l, al[w][tid]), lsm[w][tid]);
                const float x = bm[par][w][tid];
                m = x > m ? x : m;
            }
            lrow[tid] = l, mrow[tid] = m;
        }
    }
    any = __syncthreads_or(any);
    if (tid < AM_HG && any && sink && h0 + tid < H) lrow[tid] = __fadd_rn(lrow[tid], ds_expf(__fsub_rn(sink[h0 + tid], mrow[tid])));
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TL; i++) {
        const int qe = warp + 4 * i, hh = 2 * tq + (qe & 1);
        const int ch = 2 * TL * g + 2 * (qe >> 2) + ((qe >> 1) & 1);
        os[hh][ch] = any ? ds_bf16_rne(__fdiv_rn(acc[i], lrow[hh])) : (uint16_t)0;
    }
    __syncthreads();
    for (int c = tid; c < AM_HG * DS / 8; c += blockDim.x) {
        const int hh = c / (DS / 8), s8 = c % (DS / 8);
        if (h0 + hh < H) {
            uint4 v = *reinterpret_cast<const uint4 *>(&os[hh][8 * s8]);
            if (rp.pos) {
                uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    uint16_t lo = (uint16_t)(w[k] & 0xffffu), hi = (uint16_t)(w[k] >> 16);
                    am_rope_pair(lo, hi, rp, c0 + 8 * s8 + 2 * k, rcs[4 * s8 + k]);
                    w[k] = (uint32_t)lo | ((uint32_t)hi << 16);
                }
                v = make_uint4(w[0], w[1], w[2], w[3]);
            }
            *reinterpret_cast<uint4 *>(o + (t * H + h0 + hh) * (int64_t)hd + c0 + 8 * s8) = v;
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Two-pass calls of AM_SPLIT_MIN_T rows and more: the same arithmetic as attn_pv_mma_kernel in
 * two launches, so that the softmax is not recomputed for every channel slice (8 times at hd 512)
 * and P·V needs no barrier.
 *
 * attn_softmax_mma_kernel: a warp per (row, 8 heads), lane (g, t) = head g, entries 16t .. 16t + 15
 * of each block, the blocks in order: the block's max per head (the same comparisons in the same
 * order as attn_pv_mma_kernel), m_new = the CPU's `x > m ? x : m`, alpha = expf(m − m_new),
 * p = expf(s − m_new) as bf16 into P [rows][H][nb·64] (zeros past n_idx and for invalid
 * entries), lsum (the lane's 16 in order, then the xor tree over the 4 lanes of a head),
 * l = l·alpha + lsum; alpha into AL [rows][H][nb]; at the end l (+ expf(sink − m)) into L [rows][H],
 * or −1 when the row has no valid entry (l is never negative otherwise). */
/* (128, 4): with the block size alone ptxas chose 48 registers and spilled 8 bytes */
__global__ void __launch_bounds__(128, 4)
    attn_softmax_mma_kernel(uint16_t *__restrict__ P, float *__restrict__ AL, float *__restrict__ L,
                            const float *__restrict__ sc, const am_ix ix, int64_t tn, int H,
                            int n_idx, const float *__restrict__ sink, int vecs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int64_t t = (int64_t)blockIdx.x * AM_W + warp;
    if (t >= tn) return; /* the whole warp */
    const int h = blockIdx.y * AM_HG + g;
    const bool shok = h < H;
    const int nb = (n_idx + AM_BLOCK - 1) / AM_BLOCK, npad = nb * AM_BLOCK;
    const float *srow = sc + (t * H + (shok ? h : 0)) * (int64_t)n_idx;
    uint16_t *prow = P + (t * H + (shok ? h : 0)) * (int64_t)npad;
    float m = -1e30f, l = 0.0f;
    bool any = false;
    for (int b = 0; b < nb; b++) {
        const int e0 = b * AM_BLOCK;
        const bool va = am_id(ix, t, n_idx, e0 + lane) >= 0;
        const bool vb = am_id(ix, t, n_idx, e0 + 32 + lane) >= 0;
        const uint64_t vmask = (uint64_t)__ballot_sync(0xffffffffu, va) | (uint64_t)__ballot_sync(0xffffffffu, vb) << 32;
        any |= vmask != 0;
        const unsigned vm = shok ? (unsigned)(vmask >> (16 * tq)) & 0xffffu : 0u;
        float s[16];
        am_load_s(s, srow + e0 + 16 * tq, e0 + 16 * tq, n_idx, vecs);
        const float mx = am_block_max(s, vm);
        const float mn = mx > m ? mx : m;
        const float alpha = ds_expf(__fsub_rn(m, mn));
        uint32_t pw[8];
        const float lsum = am_block_p(s, vm, mn, pw);
        l = __fadd_rn(__fmul_rn(l, alpha), lsum);
        m = mn;
        if (shok) {
            uint4 *pd = reinterpret_cast<uint4 *>(prow + e0 + 16 * tq);
            pd[0] = make_uint4(pw[0], pw[1], pw[2], pw[3]);
            pd[1] = make_uint4(pw[4], pw[5], pw[6], pw[7]);
            if (tq == 0) AL[(t * H + h) * (int64_t)nb + b] = alpha;
        }
    }
    if (shok && tq == 0)
        L[t * H + h] = !any ? -1.0f : sink ? __fadd_rn(l, ds_expf(__fsub_rn(sink[h], m))) : l;
}

/* The end of a row's P·V in the fragment layout of am_block_pv (acc[j][r]: head h0 + 2t + (r & 1),
 * channel c0 + 2TL·g + 2j + (r >> 1)): o = bf16(acc / l) with l[hh] the denominator of head
 * h0 + 2t + hh, or 0 where l < 0 (a row without a valid entry); 2TL consecutive bf16 a head, which
 * are whole RoPE pairs (channel c0 + 2TL·g + 2j and the next; rcs: am_rope_cs from channel c0). */
template <int TL>
static __device__ __forceinline__ void am_store_o(uint16_t *o, const float (&acc)[TL][4], const float (&l)[2], int64_t t,
                                                  int H, int hd, int h0, int c0, int g, int tq, const am_rope &rp,
                                                  const float2 *rcs) {
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int h = h0 + 2 * tq + hh;
        if (h >= H) continue;
        uint32_t wd[TL];
#pragma unroll
        for (int j = 0; j < TL; j++) {
            uint16_t lo = l[hh] < 0.0f ? (uint16_t)0 : ds_bf16_rne(__fdiv_rn(acc[j][hh], l[hh]));
            uint16_t hi = l[hh] < 0.0f ? (uint16_t)0 : ds_bf16_rne(__fdiv_rn(acc[j][2 + hh], l[hh]));
            am_rope_pair(lo, hi, rp, c0 + 2 * TL * g + 2 * j, rcs[TL * g + j]);
            wd[j] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
        uint16_t *dst = o + (t * H + h) * (int64_t)hd + c0 + 2 * TL * g;
        if constexpr (TL == 4) *reinterpret_cast<uint4 *>(dst) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
        else if constexpr (TL == 2) *reinterpret_cast<uint2 *>(dst) = make_uint2(wd[0], wd[1]);
        else *reinterpret_cast<uint32_t *>(dst) = wd[0];
    }
}

/* attn_pv_split_kernel: a warp per (row, 8 heads, slice of 16·TL channels), 4 slices a CTA (x = row,
 * y = head group, z = group of 4 slices), the blocks in order with no barrier: the block's V
 * fragments as attn_pv_mma_kernel loads them, B = P^T from P, pv = the block's MMA chain from zero,
 * then acc = acc·alpha + pv in the fragment registers; o = bf16(acc / l), or 0 when l < 0. The
 * operations on every element are attn_pv_mma_kernel's, in its order, so rows give the same bits
 * through either path (test_batch_invariance_sparse_attn runs both in one comparison). */
template <int TL>
__global__ void __launch_bounds__(128)
    attn_pv_split_kernel(uint16_t *__restrict__ o, const uint16_t *__restrict__ P, const float *__restrict__ AL,
                         const float *__restrict__ L, const uint16_t *__restrict__ kv, const am_ix ix, int H, int hd,
                         int n_idx, am_rope rp) {
    constexpr int DS = 16 * TL;
    __shared__ float2 rcs[AM_W][DS / 2]; /* each warp's slice's RoPE (cos, ±sin), am_rope_cs */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int slice = blockIdx.z * AM_W + warp;
    if (slice * DS >= hd) return; /* the whole warp */
    const int64_t t = blockIdx.x;
    const int h0 = blockIdx.y * AM_HG, c0 = slice * DS;
    am_rope_cs(rcs[warp], rp, t, c0, DS / 2, lane, 32);
    const int nb = (n_idx + AM_BLOCK - 1) / AM_BLOCK, npad = nb * AM_BLOCK;
    const bool pok = h0 + g < H, aok0 = h0 + 2 * tq < H, aok1 = h0 + 2 * tq + 1 < H;
    const uint16_t *prow = P + (t * H + (pok ? h0 + g : 0)) * (int64_t)npad;
    const float *al0 = AL + (t * H + (aok0 ? h0 + 2 * tq : 0)) * (int64_t)nb;
    const float *al1 = AL + (t * H + (aok1 ? h0 + 2 * tq + 1 : 0)) * (int64_t)nb;
    const uint16_t *kvd = kv + c0 + 2 * TL * g;
    float acc[TL][4];
#pragma unroll
    for (int j = 0; j < TL; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const int e0 = b * AM_BLOCK;
        const int ia = am_id(ix, t, n_idx, e0 + lane), ib = am_id(ix, t, n_idx, e0 + 32 + lane);
        uint32_t vw[4][4][TL]; /* [k-step][entry 2t, 2t+1, 2t+8, 2t+9][word] */
#pragma unroll
        for (int ks = 0; ks < 4; ks++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                am_load_v<TL>(vw[ks][u], kvd, hd,
                              __shfl_sync(0xffffffffu, ks < 2 ? ia : ib, (16 * ks + 2 * tq + (u & 1) + 8 * (u >> 1)) & 31));
        uint32_t pb[4][2];
#pragma unroll
        for (int ks = 0; ks < 4; ks++) {
            pb[ks][0] = pok ? __ldg(reinterpret_cast<const uint32_t *>(prow + e0 + 16 * ks + 2 * tq)) : 0u;
            pb[ks][1] = pok ? __ldg(reinterpret_cast<const uint32_t *>(prow + e0 + 16 * ks + 2 * tq + 8)) : 0u;
        }
        const float a0 = aok0 ? __ldg(al0 + b) : 0.0f, a1 = aok1 ? __ldg(al1 + b) : 0.0f;
        am_block_fold<TL>(acc, vw, pb, a0, a1);
    }
    const float lv[2] = {aok0 ? L[t * H + h0 + 2 * tq] : 0.0f, aok1 ? L[t * H + h0 + 2 * tq + 1] : 0.0f};
    __syncwarp();
    am_store_o<TL>(o, acc, lv, t, H, hd, h0, c0, g, tq, rp, rcs[warp]);
}

/* ---------------------------------------------------------------------------------------------
 * One pass (attn_mma.h, CUDA_ATTN_ONE_PASS): a CTA of AM_OW = 8 warps per (row t, 8 heads) takes the
 * row's blocks of 64 entries in order, each wholly before the next:
 *   1. scores: warp w sums quarter w % 4 of hd for the block's entries 32 (w / 4) .. + 31 (two
 *      16-entry groups, one chain after the other: both at once spilled at 2 CTAs an SM) with
 *      am_qk_chain, the qk kernel's chain; warps 0 and 4 add the other three
 *      quarters in warp order and scale (am_qk_logit) into the block's logits in shared memory;
 *   2. softmax: warp 0, lane (g, t) = head g, entries 16t .. 16t + 15, the block's max per head
 *      (am_block_max) and the new running max (the CPU's `x > m ? x : m`, block by block) and
 *      alpha; then every thread p = expf(s − m_new) for two (head, entry) pairs (am_block_p's
 *      expression; with warp 0 computing all 512 as am_block_p does, a block took ~7 µs), bf16(p)
 *      into shared memory; warp 0 sums the p in am_block_p's order, l = l·alpha + lsum, while
 *      the others go on;
 *   3. P·V: warp w the 64 channels 64w .. 64w + 63 (TL = 4: am_load_v, am_block_pv from zero),
 *      acc = acc·alpha + pv.
 * The same operations on every element as the two-pass kernels, in the same order, hence the same
 * bits (test_sparse_attn_forms); what changes is that a block's kv rows are read from memory once:
 * step 3 reads the rows step 1 has just read, from the cache. Meanwhile the next block's indices are
 * read and its rows prefetched into L2 (prefetch.global.L2), so a block's loads do not start cold.
 * After the last block l += expf(sink − m) where the row has a valid entry, o = bf16(acc / l) as
 * attn_pv_split_kernel stores it (am_store_o). hd <= 512 (a channel slice a warp). */
#define AM_OW 8
#define AM_ONE_TL 4 /* P·V channels a warp: 16·TL = 64 */
__global__ void __launch_bounds__(32 * AM_OW, 2)
    attn_one_pass_kernel(uint16_t *__restrict__ o, const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv,
                         const am_ix ix, int H, int hd, int n_idx, const float *__restrict__ sink, float scale,
                         am_rope rp) {
    constexpr int TL = AM_ONE_TL, DS = 16 * TL;
    __shared__ float part[2][AM_W - 1][AM_QK_EG * 4][32]; /* [entry half][quarter 1..3][fragment][lane] */
    __shared__ float sb[AM_HG][AM_BLOCK + 4];               /* the block's logits [head][entry] */
    __shared__ __align__(16) uint16_t ps[AM_HG][AM_BLOCK + 8];
    __shared__ int ids[3][AM_BLOCK]; /* this block's, the next one's, and the one P·V may still read */
    __shared__ __align__(8) float pf[AM_HG][AM_BLOCK]; /* the block's p as float, for the ordered sum */
    __shared__ float al_s[AM_HG], mn_s[AM_HG], l_s[AM_HG];
    __shared__ float2 rcs[AM_OW * DS / 2]; /* the row's RoPE (cos, ±sin) from channel 0, am_rope_cs */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int64_t t = blockIdx.x;
    const int h0 = blockIdx.y * AM_HG;
    am_rope_cs(rcs, rp, t, 0, hd / 2, tid, blockDim.x);
    const int nb = (n_idx + AM_BLOCK - 1) / AM_BLOCK;
    const int qw = warp % AM_W, eh = warp / AM_W; /* scores: quarter of hd, half of the block's entries */
    const int nkb = hd >> 5, kb0 = qw * nkb / AM_W, kb1 = (qw + 1) * nkb / AM_W;
    const bool hok = h0 + g < H;
    const uint4 *qr = reinterpret_cast<const uint4 *>(q + (t * H + (hok ? h0 + g : 0)) * (int64_t)hd) + tq;
    const int c0 = warp * DS;
    const bool cact = c0 < hd; /* P·V: the warp's slice */
    const uint16_t *kvd = kv + c0 + 2 * TL * g;
    float acc[TL][4];
#pragma unroll
    for (int j = 0; j < TL; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float m = -1e30f, l = 0.0f; /* warp 0: head g's running max and denominator */
    bool any = false;
    /* threads 0..63: entry tid of the block after next, loaded a block ahead of its store so that
     * its latency is not on the block's path */
    auto id_at = [&](int blk) { return blk < nb ? am_id(ix, t, n_idx, blk * AM_BLOCK + tid) : -1; };
    int nid = -1;
    if (tid < AM_BLOCK) {
        ids[0][tid] = id_at(0);
        nid = id_at(1);
    }
    __syncthreads();
    for (int b = 0; b < nb; b++) {
        const int cur = b % 3;
        if (tid < AM_BLOCK && b + 1 < nb) {
            const int id = nid;
            ids[(b + 1) % 3][tid] = id;
            nid = id_at(b + 2);
            if (id >= 0) {
                const char *row = reinterpret_cast<const char *>(kv + (int64_t)id * hd);
                for (int c = 0; c < hd * 2; c += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + c));
            }
        }
        float d[AM_QK_EG][4]; /* the groups' chains one after the other: half the load registers */
#pragma unroll
        for (int eg = 0; eg < AM_QK_EG; eg++) {
            const int id1[1][2] = {{ids[cur][32 * eh + 16 * eg + g], ids[cur][32 * eh + 16 * eg + g + 8]}};
            float d1[1][4];
            am_qk_chain<1>(d1, qr, hok, kv, id1, hd, kb0, kb1, tq);
            d[eg][0] = d1[0][0], d[eg][1] = d1[0][1], d[eg][2] = d1[0][2], d[eg][3] = d1[0][3];
        }
        if (qw > 0) {
#pragma unroll
            for (int eg = 0; eg < AM_QK_EG; eg++)
#pragma unroll
                for (int r = 0; r < 4; r++) part[eh][qw - 1][eg * 4 + r][lane] = d[eg][r];
        }
        __syncthreads();
        if (qw == 0) {
#pragma unroll
            for (int eg = 0; eg < AM_QK_EG; eg++)
#pragma unroll
                for (int r = 0; r < 4; r++)
                    sb[2 * tq + (r & 1)][32 * eh + 16 * eg + g + 8 * (r >> 1)] =
                        am_qk_logit(d[eg][r], part[eh], eg * 4 + r, lane, scale);
        }
        __syncthreads();
        if (warp == 0) { /* the block's max and the new running max per head, alpha */
            float s[16];
            unsigned vm = 0u;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                s[i] = sb[g][16 * tq + i];
                const bool valid = ids[cur][16 * tq + i] >= 0;
                any |= valid;
                if (valid && hok) vm |= 1u << i;
            }
            const float mx = am_block_max(s, vm), mn = mx > m ? mx : m;
            if (tq == 0) mn_s[g] = mn, al_s[g] = ds_expf(__fsub_rn(m, mn));
            m = mn;
        }
        __syncthreads();
        { /* p = expf(s − m_new) of every (head, entry) at once, two entries a thread (am_block_p's
           * expression), as bf16 for P·V and as float for warp 0's ordered sum */
            const int hh = tid >> 5, e = 2 * (tid & 31);
            const bool hv = h0 + hh < H, v0 = hv && ids[cur][e] >= 0, v1 = hv && ids[cur][e + 1] >= 0;
            const float mn = mn_s[hh];
            const float p0 = v0 ? ds_expf(__fsub_rn(sb[hh][e], mn)) : 0.0f;
            const float p1 = v1 ? ds_expf(__fsub_rn(sb[hh][e + 1], mn)) : 0.0f;
            *reinterpret_cast<uint32_t *>(&ps[hh][e]) = (uint32_t)ds_bf16_rne(p0) | ((uint32_t)ds_bf16_rne(p1) << 16);
            *reinterpret_cast<float2 *>(&pf[hh][e]) = make_float2(p0, p1);
        }
        __syncthreads();
        if (warp == 0) { /* lsum in am_block_p's order: the lane's 16 in turn, then the xor tree */
            float lsum = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; i++) lsum = __fadd_rn(lsum, pf[g][16 * tq + i]);
#pragma unroll
            for (int off = 1; off < 4; off <<= 1) lsum = __fadd_rn(lsum, __shfl_xor_sync(0xffffffffu, lsum, off));
            l = __fadd_rn(__fmul_rn(l, al_s[g]), lsum);
        }
        if (cact) {
            uint32_t vw[4][4][TL]; /* [k-step][entry 2t, 2t+1, 2t+8, 2t+9][word] */
#pragma unroll
            for (int ks = 0; ks < 4; ks++)
#pragma unroll
                for (int u = 0; u < 4; u++) am_load_v<TL>(vw[ks][u], kvd, hd, ids[cur][16 * ks + 2 * tq + (u & 1) + 8 * (u >> 1)]);
            uint32_t pb[4][2];
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                pb[ks][0] = *reinterpret_cast<const uint32_t *>(&ps[g][16 * ks + 2 * tq]);
                pb[ks][1] = *reinterpret_cast<const uint32_t *>(&ps[g][16 * ks + 2 * tq + 8]);
            }
            const float a0 = al_s[2 * tq], a1 = al_s[2 * tq + 1];
            am_block_fold<TL>(acc, vw, pb, a0, a1);
        }
    }
    if (warp == 0) {
        any = __any_sync(0xffffffffu, any);
        if (tq == 0) l_s[g] = !any ? -1.0f : sink && hok ? __fadd_rn(l, ds_expf(__fsub_rn(sink[h0 + g], m))) : l;
    }
    __syncthreads();
    if (cact) {
        const float lv[2] = {l_s[2 * tq], l_s[2 * tq + 1]};
        am_store_o<TL>(o, acc, lv, t, H, hd, h0, c0, g, tq, rp, rcs + c0 / 2);
    }
}

/* AUTO takes the one pass from AM_ONE_MIN_T rows (attn_mma.h), measured with bench_attn (H100, the
 * forced forms in one run, µs a call, two passes -> one pass): 1 15.9 -> 50.8, 8 21.5 -> 52.9, 32
 * 33.4 -> 53.8, 64 47.6 -> 55.6, 96 76.4 -> 57.5, 128 104.2 -> 60.2, 256 172.1 -> 89.2 (62 % of
 * the copy bandwidth), and a prefill chunk's rows (shared entries, in L2 between the passes) 512
 * 161.4 -> 136.7, 2,048 550.5 -> 537.6. A one-pass CTA walks its row's 10 blocks one after the
 * other (~5 µs a block), which a handful of rows cannot hide; the two passes spread a row over 20
 * score CTAs and 8 channel slices. (With warp 0 computing the block's 512 exponentials itself, as
 * am_block_p does, a block took ~7 µs: 67-74 µs a call up to 64 rows, 79.5 at 128, 107.1 at 256;
 * a warp's two 16-entry groups loaded at once, one CTA an SM for the registers, 5-8 % faster up to
 * 128 rows and 30-40 % slower from 192.) Where a block's time goes (Nsight Compute on the H100,
 * clocks locked, bench_attn): at 8 rows (8 CTAs, 2 warps a scheduler) 0.26 instructions issued a
 * cycle per scheduler, a warp stalled 7.75 cycles an instruction — on global loads (2.1), fixed
 * latencies (1.9: the MMA chains, the exponentials), barriers (1.1) — so a block is one CTA's
 * dependent chain of ~10 K cycles; at 256 rows (4 warps a scheduler, 24 % occupancy at 127
 * registers) DRAM 47 % busy, L1 hits 47 %, the stalls on global loads (4.2), barriers and fixed
 * latencies (2.0 each). More warps a row (a CTA's registers cap them at 8) or fewer dependent
 * steps a block would close the rest. (Tried and not kept: the softmax with a warp per head, its
 * max, exponentials and sum in that warp and one barrier fewer a block — the same bits, but
 * 60.9 -> 62.7 µs at 128 rows, 89.9 -> 94.7 at 256, 537.2 -> 571.4 at 2,048: every warp then
 * runs the serial max and sum that only warp 0 ran.) */
#define AM_ONE_MIN_T 80

/* The forms over entries from ix (am_ix: lists, or the geometry), rows t0.. of it from row 0 */
static am_ix am_ix_rows(am_ix x, int64_t t0, int64_t n_idx) {
    if (x.idx) x.idx += t0 * n_idx;
    x.geo += x.geo ? t0 * AIX_COLS : 0;
    x.src += x.src ? t0 * x.ld_src : 0;
    return x;
}

static bool sparse_attn_mma_ix(struct backend *be, int path, bf16_t *o, const bf16_t *q, const bf16_t *kv, const am_ix &ix,
                               int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                               const struct attn_rope *rope) {
    if (hd % 64 || hd > 4096 || n_idx <= 0 || n_idx > (1 << 30) || H > 65535LL * AM_HG || T <= 0 ||
        T > 0x7fffffffLL || (((uintptr_t)q | (uintptr_t)kv | (uintptr_t)o) & 15) || path < CUDA_ATTN_AUTO ||
        path > CUDA_ATTN_ONE_PASS)
        return false;
    const bool rot = rope && rope->rd > 0;
    if (rot && (rope->off < 0 || rope->off % 2 || rope->rd % 2 || rope->off + rope->rd > hd || !rope->pos || !rope->freqs))
        return false; /* pairs the stores do not hold whole */
    am_rope rp = {rot ? rope->pos : NULL, rot ? rope->freqs : NULL, rot ? (int)rope->off : 0, rot ? (int)rope->rd : 0,
                  rot && rope->inverse};
    cudaStream_t st = cuda_be_stream(be);
    const int64_t target = 2LL * cuda_be_sms(be), hgs = (H + AM_HG - 1) / AM_HG;
    const bool one_fits = hd <= AM_OW * 16 * AM_ONE_TL;
    if (path == CUDA_ATTN_ONE_PASS && !one_fits) return false;
    if (path == CUDA_ATTN_ONE_PASS || (path == CUDA_ATTN_AUTO && one_fits && T >= AM_ONE_MIN_T)) {
        attn_one_pass_kernel<<<dim3((unsigned)T, (unsigned)hgs), 32 * AM_OW, 0, st>>>(
            (uint16_t *)o, (const uint16_t *)q, (const uint16_t *)kv, ix, (int)H, (int)hd, (int)n_idx, sink, scale, rp);
        KERNEL_CHECK();
        return true;
    }
    const int ncta = (int)((n_idx + 16 * AM_QK_EG - 1) / (16 * AM_QK_EG));
    const int64_t nb = (n_idx + AM_BLOCK - 1) / AM_BLOCK;
    /* per row: the logits [H][n_idx] f32; split calls also P [H][nb·64] bf16, AL [H][nb], L [H] */
    const int64_t sc_bytes = H * n_idx * (int64_t)sizeof(float), p_bytes = H * nb * AM_BLOCK * 2,
                  al_bytes = H * nb * (int64_t)sizeof(float), l_bytes = H * (int64_t)sizeof(float);
    const bool split = T >= AM_SPLIT_MIN_T;
    const int64_t rs = cuda_attn_slice_rows(T, split ? sc_bytes + p_bytes + al_bytes + l_bytes : sc_bytes);
    const int64_t p_off = (rs * sc_bytes + 15) & ~15LL; /* P after the logits, 16-byte aligned */
    uint8_t *scratch = (uint8_t *)cuda_be_scratch_raw(
        be, (size_t)(split ? p_off + rs * (p_bytes + al_bytes + l_bytes) : rs * sc_bytes));
    float *sc = (float *)scratch;
    uint16_t *Pb = (uint16_t *)(scratch + p_off); /* p_bytes is a multiple of 128 */
    float *ALb = (float *)((uint8_t *)Pb + rs * p_bytes), *Lb = ALb + rs * H * nb;
    const uint16_t *q16 = (const uint16_t *)q, *kv16 = (const uint16_t *)kv;
    uint16_t *o16 = (uint16_t *)o;
    const int vecs = n_idx % 4 == 0;
    for (int64_t t0 = 0; t0 < T; t0 += rs) {
        const int64_t tn = T - t0 < rs ? T - t0 : rs;
        const am_ix it = am_ix_rows(ix, t0, n_idx);
        am_rope rt = rp; /* the slice's rows from its first */
        if (rt.pos) rt.pos += t0;
        attn_qk_mma_kernel<<<dim3((unsigned)(tn * ncta), (unsigned)hgs), 128, 0, st>>>(
            sc, q16 + t0 * H * hd, kv16, it, (int)H, (int)hd, (int)n_idx, ncta, scale);
        KERNEL_CHECK();
        uint16_t *ot = o16 + t0 * H * hd;
        if (split) {
            attn_softmax_mma_kernel<<<dim3((unsigned)((tn + AM_W - 1) / AM_W), (unsigned)hgs), 128, 0, st>>>(
                Pb, ALb, Lb, sc, it, tn, (int)H, (int)n_idx, sink, vecs);
            KERNEL_CHECK();
            /* the widest slices that still give ~16 warps per SM */
            const int64_t wt = 8 * target;
            if (tn * hgs * (hd / 64) >= wt)
                attn_pv_split_kernel<4><<<dim3((unsigned)tn, (unsigned)hgs, (unsigned)((hd / 64 + AM_W - 1) / AM_W)), 128, 0, st>>>(
                    ot, Pb, ALb, Lb, kv16, it, (int)H, (int)hd, (int)n_idx, rt);
            else if (tn * hgs * (hd / 32) >= wt)
                attn_pv_split_kernel<2><<<dim3((unsigned)tn, (unsigned)hgs, (unsigned)((hd / 32 + AM_W - 1) / AM_W)), 128, 0, st>>>(
                    ot, Pb, ALb, Lb, kv16, it, (int)H, (int)hd, (int)n_idx, rt);
            else
                attn_pv_split_kernel<1><<<dim3((unsigned)tn, (unsigned)hgs, (unsigned)((hd / 16 + AM_W - 1) / AM_W)), 128, 0, st>>>(
                    ot, Pb, ALb, Lb, kv16, it, (int)H, (int)hd, (int)n_idx, rt);
            KERNEL_CHECK();
            continue;
        }
        /* the widest slices that still give ~2 CTAs per SM (the softmax is recomputed per slice) */
        if (tn * hgs * (hd / 64) >= target) {
            attn_pv_mma_kernel<4><<<dim3((unsigned)tn, (unsigned)hgs, (unsigned)(hd / 64)), 128, 0, st>>>(
                ot, sc, kv16, it, (int)H, (int)hd, (int)n_idx, sink, vecs, rt);
        } else if (tn * hgs * (hd / 32) >= target) {
            attn_pv_mma_kernel<2><<<dim3((unsigned)tn, (unsigned)hgs, (unsigned)(hd / 32)), 128, 0, st>>>(
                ot, sc, kv16, it, (int)H, (int)hd, (int)n_idx, sink, vecs, rt);
        } else {
            attn_pv_mma_kernel<1><<<dim3((unsigned)tn, (unsigned)hgs, (unsigned)(hd / 16)), 128, 0, st>>>(
                ot, sc, kv16, it, (int)H, (int)hd, (int)n_idx, sink, vecs, rt);
        }
        KERNEL_CHECK();
    }
    cuda_be_scratch_free(be, scratch);
    return true;
}

bool cuda_sparse_attn_mma_path(struct backend *be, int path, bf16_t *o, const bf16_t *q, const bf16_t *kv,
                               const int32_t *idx, int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink,
                               float scale, const struct attn_rope *rope) {
    const am_ix ix = {idx, NULL, NULL, 0, 0, 0, 0, 0, 0};
    return sparse_attn_mma_ix(be, path, o, q, kv, ix, T, H, hd, n_idx, sink, scale, rope);
}

bool cuda_sparse_attn_index_path(struct backend *be, int path, bf16_t *o, const bf16_t *q, const bf16_t *kv,
                                 const int32_t *geo, const struct attn_index_par *par, int64_t T, int64_t H, int64_t hd,
                                 int64_t n_idx, const float *sink, float scale, const struct attn_rope *rope) {
    if (!geo || !par || (par->k > 0 && !par->src) || par->k < 0 || par->W <= 0) return false;
    const am_ix ix = {NULL, geo, par->k > 0 ? par->src : NULL, par->W, par->ring0, par->ld_src, par->k, par->src0, par->cap};
    return sparse_attn_mma_ix(be, path, o, q, kv, ix, T, H, hd, n_idx, sink, scale, rope);
}

bool cuda_sparse_attn_mma(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                          int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                          const struct attn_rope *rope) {
    return cuda_sparse_attn_mma_path(be, CUDA_ATTN_AUTO, o, q, kv, idx, T, H, hd, n_idx, sink, scale, rope);
}

/* sparse_attn_index (backend.h): the tensor-core forms over entries formed from the geometry, under
 * the mma switch; false (nothing launched: the caller runs attn_index, then sparse_attn_rope) for
 * the exact kernels and the shapes the forms refuse. */
bool cuda_op_sparse_attn_index(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *geo,
                               const struct attn_index_par *par, int64_t T, int64_t H, int64_t hd, int64_t n_idx,
                               const float *sink, float scale, const struct attn_rope *r) {
    if (T <= 0 || H <= 0 || hd <= 0) return true; /* no rows: nothing either way */
    if (n_idx <= 0 || !cuda_be_mma(be)) return false;
    return cuda_sparse_attn_index_path(be, CUDA_ATTN_AUTO, o, q, kv, geo, par, T, H, hd, n_idx, sink, scale, r);
}
