/* Attention-side ops of the SM80 suite: sparse attention with the sink (MODEL.md §3.9), the ratio-2
 * compressor's softmax pooling (§3.6) and the indexer's scores (§3.7). Each is a port of the CPU
 * oracle (kernels/cpu/cpu_attention.c) that keeps the oracle's order for every fp32 sum: every dot
 * product is one thread's sequential chain over its whole length (never split across lanes), and
 * every add/multiply/divide at a rounding point is an explicit __fadd_rn/__fmul_rn/__fdiv_rn, since
 * nvcc would otherwise contract a*b+c into an FMA. expf is glibc's algorithm ported exactly
 * (ds_expf, cuda_libm.cuh), not CUDA's. So all three ops are bit-identical to the CPU backend built against
 * glibc >= 2.28 on an x86-64 with FMA (the exp port matches that build on every float; a non-FMA
 * glibc build differs from it on 2 of the 2.24e9 floats with |x| < 88, a different libm would be
 * the one source of last-bit differences in P, the rescale factor, the denominator and the sink
 * term). Nothing depends on T, the grid or the other rows (batch invariance): the launch shapes
 * chosen below for occupancy never change a single operation of any (row, head) result.
 * With the mma switch on (the default; --exact-linears turns it off) sparse_attn takes the tensor-core
 * kernels of attention_mma_sm80.cu where the shapes fit; the kernels in this file are the exact
 * path, run with the switch off and for the shapes those do not take.
 *
 * sparse_attn runs as two kernels so both halves get the parallelism they need at decode (T = 1 per
 * sequence) and at prefill (T in the thousands):
 *   sparse_qk_kernel: the scaled logits s[t, h, i] = (q·k)·scale of every valid index entry, into
 *     scratch. One CTA per (row, 64-entry block, head group): the block's kv rows are staged in
 *     shared memory 64 columns at a time (double-buffered cp.async) and shared by all heads of the
 *     group; each thread owns one entry and up to two heads, so each kv row is read once per CTA.
 *   sparse_pv_kernel: the block-64 online softmax and P·V, in the CPU's order. One CTA per (row,
 *     head group, 64- or 128-column slice of hd), one warp per head: the softmax state is
 *     recomputed identically in every column slice (it is cheap), the block's valid kv rows are
 *     staged compacted (double-buffered cp.async, so the next block's rows load during this block's
 *     P·V), and each lane owns 2 (or 4) output columns whose P·V chains run over the valid entries in
 *     order. */
#include "cuda_internal.h"
#include "cuda_libm.cuh"

#define ATTN_BLOCK 64          /* idx entries per online-softmax block (backend.h) */
#define SMEM_LIMIT 49152       /* per CTA, static + dynamic: no opt-in to larger carve-outs */

/* ---------------------------------------------------------------------------------------------
 * Exact number helpers (src/formats.c semantics) and cp.async */

__device__ __forceinline__ float at_bf16r(float f) { return ds_bf16f(ds_bf16_rne(f)); }
/* The two bf16 of a little-endian 32-bit word: element 2i is the low half. */
__device__ __forceinline__ float at_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float at_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

/* a += q[i]·k[i] for i = 0..7 in order, product and sum each rounded: the CPU's `a += q * k` built
 * with -ffp-contract=off, continued over eight more elements of the same chain. */
__device__ __forceinline__ float at_dot8(float a, float4 q0, float4 q1, const float k[8]) {
    a = __fadd_rn(a, __fmul_rn(q0.x, k[0]));
    a = __fadd_rn(a, __fmul_rn(q0.y, k[1]));
    a = __fadd_rn(a, __fmul_rn(q0.z, k[2]));
    a = __fadd_rn(a, __fmul_rn(q0.w, k[3]));
    a = __fadd_rn(a, __fmul_rn(q1.x, k[4]));
    a = __fadd_rn(a, __fmul_rn(q1.y, k[5]));
    a = __fadd_rn(a, __fmul_rn(q1.z, k[6]));
    a = __fadd_rn(a, __fmul_rn(q1.w, k[7]));
    return a;
}

/* Stage columns [c0, c0 + CW) of the kv rows rows[0..nr) into dst [nr][KS] (bf16); entries with
 * rows[v] < 0 are skipped (never read). vec: hd % 8 == 0 and kv 16-byte aligned, so every 8-column
 * segment is one asynchronous 16-byte copy, and a segment is either wholly inside hd or wholly
 * outside (those are not copied and not read). Otherwise plain element copies with zeros past hd:
 * a zero column adds +0 products, which cannot change a dot except for the sign of an exact zero
 * (and that sign never reaches a result: see the kernels). */
template <int CW, int KS>
__device__ __forceinline__ void at_stage_kv(uint16_t *dst, const int *rows, int nr, const uint16_t *__restrict__ kv,
                                            int hd, int c0, int vec, int tid, int nt) {
    if (vec) {
        constexpr int SEGS = CW / 8;
        for (int e = tid; e < nr * SEGS; e += nt) {
            const int v = e / SEGS, s = e % SEGS, c = c0 + s * 8, row = rows[v];
            if (row >= 0 && c < hd) ds_cp16(dst + v * KS + s * 8, kv + (int64_t)row * hd + c);
        }
    } else {
        for (int e = tid; e < nr * CW; e += nt) {
            const int v = e / CW, s = e % CW, c = c0 + s, row = rows[v];
            if (row >= 0) dst[v * KS + s] = c < hd ? kv[(int64_t)row * hd + c] : (uint16_t)0;
        }
    }
}

/* dst[r][c] (fp32, row stride dld) = src[r * sld + c] widened (exact) for c < n, 0 for n <= c < np,
 * r < nr. vec: n % 8 == 0 (so np == n), sld % 8 == 0 and src 16-byte aligned. */
__device__ __forceinline__ void at_stage_rows_f32(float *dst, int dld, const uint16_t *__restrict__ src, int64_t sld,
                                                  int nr, int n, int np, int vec, int tid, int nt) {
    if (vec) {
        const int segs = n >> 3;
        for (int e = tid; e < nr * segs; e += nt) {
            const int r = e / segs, s = e - r * segs;
            const uint4 w = *reinterpret_cast<const uint4 *>(src + r * sld + s * 8);
            float4 *d = reinterpret_cast<float4 *>(dst + r * dld + s * 8);
            d[0] = make_float4(at_lo(w.x), at_hi(w.x), at_lo(w.y), at_hi(w.y));
            d[1] = make_float4(at_lo(w.z), at_hi(w.z), at_lo(w.w), at_hi(w.w));
        }
    } else {
        for (int e = tid; e < nr * np; e += nt) {
            const int r = e / np, c = e - r * np;
            dst[r * dld + c] = c < n ? ds_bf16f(src[r * sld + c]) : 0.0f;
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * sparse_attn, part 1: logits.
 *
 * Grid: x = row t * nblk + block (nblk = ceil(n_idx / 64)), y = head group of hq heads (hq a power of
 * two <= 8). Block: 64 * max(1, hq / 2) threads; thread tid owns entry v = tid % 64 of the block and
 * heads tid / 64 and tid / 64 + blockDim / 64 of the group (the second only when it exists), so the
 * two chains share every unpacked kv value and the q reads are warp-uniform broadcasts.
 * Shared: kvs [2][64][64 + 8] bf16 (the +8 puts consecutive rows 16 bytes apart on the banks, so a
 * warp's 16-byte row reads are conflict-free) and qs [hq][hdp] fp32, the group's q rows widened once.
 * Order: the dot of (t, h, i) is one sequential fp32 chain over d = 0..hd-1, carried in a register
 * across the 64-column chunks, then multiplied by scale: exactly the CPU's dot4_bf16 / dot_bf16 and
 * `s * scale`, so the logits are bit-identical to the CPU's. Invalid entries (idx < 0) are not
 * computed and their scratch slots are never read. */
/* Tried and not kept: 4 chunks in flight where the q rows leave room (2 here): H200, Nsight at
 * batch 1 (one head per CTA, 8 chunks of hd 512), 11.97 -> 11.69 µs a call. A CTA waits on its
 * threads' sequential 512-term chains (~2,000 instructions each), not on the staging. */
#define QK_DC 64
#define QK_KS (QK_DC + 8)
#define QK_SMEM_STATIC (2 * ATTN_BLOCK * QK_KS * 2 + ATTN_BLOCK * 4)

__global__ void __launch_bounds__(256)
    sparse_qk_kernel(float *__restrict__ sc, const uint16_t *__restrict__ q, const uint16_t *__restrict__ kv,
                     const int32_t *__restrict__ idx, int H, int hd, int n_idx, int nblk, float scale, int hq,
                     int vec, int vecq) {
    __shared__ __align__(16) uint16_t kvs[2][ATTN_BLOCK][QK_KS];
    __shared__ int ids[ATTN_BLOCK];
    extern __shared__ __align__(16) float qs[]; /* [hq][hdp] */
    const int tid = threadIdx.x, nt = blockDim.x;
    const int64_t t = blockIdx.x / nblk;
    const int b0 = (int)(blockIdx.x % nblk) * ATTN_BLOCK;
    const int h0 = blockIdx.y * hq, hv = min(hq, H - h0);
    const int hdp = (hd + 7) & ~7, nch = (hdp + QK_DC - 1) / QK_DC;

    for (int i = tid; i < ATTN_BLOCK; i += nt) ids[i] = b0 + i < n_idx ? idx[t * n_idx + b0 + i] : -1;
    at_stage_rows_f32(qs, hdp, q + (t * H + h0) * (int64_t)hd, hd, hv, hd, hdp, vecq, tid, nt);
    __syncthreads();
    at_stage_kv<QK_DC, QK_KS>(&kvs[0][0][0], ids, ATTN_BLOCK, kv, hd, 0, vec, tid, nt);
    ds_cp_commit();

    const int v = tid & (ATTN_BLOCK - 1), ha = tid >> 6, hb = ha + (nt >> 6);
    const bool act = ids[v] >= 0 && ha < hv, two = hb < hv;
    float da = 0.0f, db = 0.0f;
    for (int c = 0; c < nch; c++) {
        /* chunk c+1 loads while chunk c is summed; its buffer was last read by chunk c-1, which
         * every thread finished before the barrier that closed the previous iteration */
        if (c + 1 < nch) {
            at_stage_kv<QK_DC, QK_KS>(&kvs[(c + 1) & 1][0][0], ids, ATTN_BLOCK, kv, hd, (c + 1) * QK_DC, vec, tid, nt);
            ds_cp_commit();
            ds_cp_wait<1>();
        } else {
            ds_cp_wait<0>();
        }
        __syncthreads();
        if (act) {
            const int d0 = c * QK_DC, n = min(QK_DC, hdp - d0);
            const uint16_t *kr = &kvs[c & 1][v][0];
            const float *qa = qs + ha * hdp + d0, *qb = qs + hb * hdp + d0;
            if (two) {
#pragma unroll 2
                for (int d = 0; d < n; d += 8) {
                    float k[8];
                    unpack8(*reinterpret_cast<const uint4 *>(kr + d), k);
                    da = at_dot8(da, *reinterpret_cast<const float4 *>(qa + d),
                                 *reinterpret_cast<const float4 *>(qa + d + 4), k);
                    db = at_dot8(db, *reinterpret_cast<const float4 *>(qb + d),
                                 *reinterpret_cast<const float4 *>(qb + d + 4), k);
                }
            } else {
#pragma unroll 2
                for (int d = 0; d < n; d += 8) {
                    float k[8];
                    unpack8(*reinterpret_cast<const uint4 *>(kr + d), k);
                    da = at_dot8(da, *reinterpret_cast<const float4 *>(qa + d),
                                 *reinterpret_cast<const float4 *>(qa + d + 4), k);
                }
            }
        }
        __syncthreads();
    }
    if (act) {
        float *o = sc + (t * H + h0) * (int64_t)n_idx + b0 + v; /* scratch [T][H][n_idx] */
        o[(int64_t)ha * n_idx] = __fmul_rn(da, scale);
        if (two) o[(int64_t)hb * n_idx] = __fmul_rn(db, scale);
    }
}

/* ---------------------------------------------------------------------------------------------
 * sparse_attn, part 2: online softmax and P·V.
 *
 * Grid: x = row t, y = head group of hg heads (a power of two <= 8), z = column slice of CW = 64·CPT
 * columns. Block: 32·hg threads, warp w = head h0 + w. Lane l owns columns c0 + 64k + 2l, +1 (k <
 * CPT): one 32-bit word of a staged row, so a warp reads a row conflict-free.
 * Each lane also holds the block's idx entries i = l and l + 32 (all warps hold them, so every warp
 * derives the compaction of valid entries by ballot without a barrier) and its head's logits of
 * those entries; both are prefetched one block ahead so their latency hides under the P·V.
 * Per 64-entry block, in the CPU's order:
 *   m_new = max(m, valid logits) (exact in any order: the ±0 sign is the only freedom, and it cannot
 *     reach a result since m only enters through s − m and m − m_new);
 *   alpha = expf(m − m_new); p = expf(s − m_new) for valid entries, stored fp32 (for the
 *     denominator) and bf16-rounded (for P·V) at the entry's compacted position;
 *   lsum = Σ p over the valid entries in order (the CPU adds the invalid entries' exact zeros too,
 *     which never changes a sum that starts at +0), l = l·alpha + lsum;
 *   pv = Σ bf16(p)·v over the valid entries in order, from zero; acc = acc·alpha + pv.
 * A block without valid entries runs the same code (alpha = expf(0) = 1, lsum = pv = 0), as the CPU.
 * Every lane of a warp computes the same lsum/l/m (redundantly, instead of a serial sum on one
 * lane after a barrier). After the last block l += expf(sink[h] − m), o = bf16(acc / l); a row with
 * no valid entry anywhere gives zeros. */
#define PV_HG_MAX 8

__device__ __forceinline__ int pv_slot_id(const int32_t *ir, int n_idx, int i) { return i < n_idx ? ir[i] : -1; }

template <int CPT>
__device__ __forceinline__ void pv_step(float pv[CPT][2], float p, const uint32_t *row, int lane) {
#pragma unroll
    for (int k = 0; k < CPT; k++) {
        const uint32_t w = row[lane + 32 * k];
        pv[k][0] = __fadd_rn(pv[k][0], __fmul_rn(p, at_lo(w)));
        pv[k][1] = __fadd_rn(pv[k][1], __fmul_rn(p, at_hi(w)));
    }
}

template <int CPT>
__global__ void __launch_bounds__(256)
    sparse_pv_kernel(uint16_t *__restrict__ o, const float *__restrict__ sc, const uint16_t *__restrict__ kv,
                     const int32_t *__restrict__ idx, int H, int hd, int n_idx, const float *__restrict__ sink, int hg,
                     int vec) {
    constexpr int CW = 64 * CPT; /* columns of this CTA's slice */
    constexpr int KS = CW + 8;   /* staged row stride (bf16): rows 16 bytes apart on the banks */
    __shared__ __align__(16) uint16_t kvs[2][ATTN_BLOCK][KS]; /* compacted valid rows of a block */
    __shared__ __align__(16) float pbs[PV_HG_MAX][ATTN_BLOCK]; /* bf16(p) per head, compacted */
    __shared__ __align__(16) float pfs[PV_HG_MAX][ATTN_BLOCK]; /* fp32 p per head, compacted */
    __shared__ int rows[2][ATTN_BLOCK];                         /* kv row of each compacted entry */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
    const int64_t t = blockIdx.x;
    const int h = blockIdx.y * hg + warp;
    const bool hval = h < H; /* warp-uniform */
    const int c0 = blockIdx.z * CW;
    const int32_t *ir = idx + t * n_idx;
    const float *sr = sc + (t * H + (hval ? h : 0)) * (int64_t)n_idx;
    const int nb = (n_idx + ATTN_BLOCK - 1) / ATTN_BLOCK;
    const unsigned ltm = (1u << lane) - 1u;

    /* block 0's entries and logits, block 1's entries */
    int ic0 = pv_slot_id(ir, n_idx, lane), ic1 = pv_slot_id(ir, n_idx, lane + 32);
    int in0 = pv_slot_id(ir, n_idx, ATTN_BLOCK + lane), in1 = pv_slot_id(ir, n_idx, ATTN_BLOCK + lane + 32);
    float s0 = hval && ic0 >= 0 ? sr[lane] : 0.0f, s1 = hval && ic1 >= 0 ? sr[lane + 32] : 0.0f;
    {
        const unsigned m0 = __ballot_sync(0xffffffffu, ic0 >= 0), m1 = __ballot_sync(0xffffffffu, ic1 >= 0);
        if (warp == 0) {
            if (ic0 >= 0) rows[0][__popc(m0 & ltm)] = ic0;
            if (ic1 >= 0) rows[0][__popc(m0) + __popc(m1 & ltm)] = ic1;
        }
        __syncthreads();
        at_stage_kv<CW, KS>(&kvs[0][0][0], rows[0], __popc(m0) + __popc(m1), kv, hd, c0, vec, tid, nt);
        ds_cp_commit();
    }

    float acc[CPT][2], m = -1e30f, l = 0.0f;
#pragma unroll
    for (int k = 0; k < CPT; k++) acc[k][0] = acc[k][1] = 0.0f;
    bool any = false;
    for (int b = 0; b < nb; b++) {
        const int cur = b & 1;
        const unsigned m0 = __ballot_sync(0xffffffffu, ic0 >= 0), m1 = __ballot_sync(0xffffffffu, ic1 >= 0);
        const int nv = __popc(m0) + __popc(m1);
        any |= nv > 0;
        float alpha = 1.0f;
        if (hval) {
            float mx = -INFINITY;
            if (ic0 >= 0 && s0 > mx) mx = s0;
            if (ic1 >= 0 && s1 > mx) mx = s1;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                const float y = __shfl_xor_sync(0xffffffffu, mx, off);
                mx = y > mx ? y : mx;
            }
            const float mn = mx > m ? mx : m;
            alpha = ds_expf(__fsub_rn(m, mn));
            if (ic0 >= 0) {
                const float p = ds_expf(__fsub_rn(s0, mn));
                const int ps = __popc(m0 & ltm);
                pfs[warp][ps] = p;
                pbs[warp][ps] = at_bf16r(p);
            }
            if (ic1 >= 0) {
                const float p = ds_expf(__fsub_rn(s1, mn));
                const int ps = __popc(m0) + __popc(m1 & ltm);
                pfs[warp][ps] = p;
                pbs[warp][ps] = at_bf16r(p);
            }
            m = mn;
        }
        __syncwarp();
        /* the next block's compaction (its staging is issued below); rows[cur ^ 1] was last read when
         * block b-1 was staged, two barriers ago */
        const unsigned n0 = __ballot_sync(0xffffffffu, in0 >= 0), n1 = __ballot_sync(0xffffffffu, in1 >= 0);
        const int nvn = __popc(n0) + __popc(n1);
        if (warp == 0) {
            if (in0 >= 0) rows[cur ^ 1][__popc(n0 & ltm)] = in0;
            if (in1 >= 0) rows[cur ^ 1][__popc(n0) + __popc(n1 & ltm)] = in1;
        }
        /* prefetch: block b+1's logits, block b+2's entries */
        ic0 = in0, ic1 = in1;
        in0 = pv_slot_id(ir, n_idx, (b + 2) * ATTN_BLOCK + lane);
        in1 = pv_slot_id(ir, n_idx, (b + 2) * ATTN_BLOCK + lane + 32);
        s0 = hval && ic0 >= 0 ? sr[(b + 1) * ATTN_BLOCK + lane] : 0.0f;
        s1 = hval && ic1 >= 0 ? sr[(b + 1) * ATTN_BLOCK + lane + 32] : 0.0f;
        __syncthreads(); /* rows[cur ^ 1] written; every warp is past block b-1's P·V (buffer cur ^ 1 free) */
        if (b + 1 < nb) {
            at_stage_kv<CW, KS>(&kvs[cur ^ 1][0][0], rows[cur ^ 1], nvn, kv, hd, c0, vec, tid, nt);
            ds_cp_commit();
            ds_cp_wait<1>();
        } else {
            ds_cp_wait<0>();
        }
        __syncthreads(); /* block b's rows have landed and are visible */
        if (hval) {
            const uint32_t *kw = reinterpret_cast<const uint32_t *>(&kvs[cur][0][0]);
            const float *pb = pbs[warp], *pf = pfs[warp];
            float pv[CPT][2], lsum = 0.0f;
#pragma unroll
            for (int k = 0; k < CPT; k++) pv[k][0] = pv[k][1] = 0.0f;
            int v = 0;
            for (; v + 4 <= nv; v += 4) {
                const float4 p4 = *reinterpret_cast<const float4 *>(pb + v);
                const float4 f4 = *reinterpret_cast<const float4 *>(pf + v);
                pv_step<CPT>(pv, p4.x, kw + (v + 0) * (KS / 2), lane);
                pv_step<CPT>(pv, p4.y, kw + (v + 1) * (KS / 2), lane);
                pv_step<CPT>(pv, p4.z, kw + (v + 2) * (KS / 2), lane);
                pv_step<CPT>(pv, p4.w, kw + (v + 3) * (KS / 2), lane);
                lsum = __fadd_rn(lsum, f4.x);
                lsum = __fadd_rn(lsum, f4.y);
                lsum = __fadd_rn(lsum, f4.z);
                lsum = __fadd_rn(lsum, f4.w);
            }
            for (; v < nv; v++) {
                pv_step<CPT>(pv, pb[v], kw + v * (KS / 2), lane);
                lsum = __fadd_rn(lsum, pf[v]);
            }
            l = __fadd_rn(__fmul_rn(l, alpha), lsum);
#pragma unroll
            for (int k = 0; k < CPT; k++) {
                acc[k][0] = __fadd_rn(__fmul_rn(acc[k][0], alpha), pv[k][0]);
                acc[k][1] = __fadd_rn(__fmul_rn(acc[k][1], alpha), pv[k][1]);
            }
        }
        __syncwarp(); /* this warp's pbs/pfs readers are done before the next block's softmax writes */
    }
    if (!hval) return;
    if (any && sink) l = __fadd_rn(l, ds_expf(__fsub_rn(sink[h], m)));
    uint16_t *orow = o + (t * H + h) * (int64_t)hd;
#pragma unroll
    for (int k = 0; k < CPT; k++) {
        const int c = c0 + 64 * k + 2 * lane;
        const uint16_t y0 = any ? ds_bf16_rne(__fdiv_rn(acc[k][0], l)) : (uint16_t)0;
        const uint16_t y1 = any ? ds_bf16_rne(__fdiv_rn(acc[k][1], l)) : (uint16_t)0;
        if ((hd & 1) == 0 && c + 1 < hd) {
            *reinterpret_cast<uint32_t *>(orow + c) = (uint32_t)y0 | ((uint32_t)y1 << 16);
        } else {
            if (c < hd) orow[c] = y0;
            if (c + 1 < hd) orow[c + 1] = y1;
        }
    }
}

/* The largest power of two <= min(8, H). */
static int pow2_heads(int64_t H) {
    int c = 8;
    while (c > 1 && c > H) c >>= 1;
    return c;
}

void cuda_op_sparse_attn(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                         int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale) {
    if (T <= 0 || H <= 0 || hd <= 0) return;
    cudaStream_t st = cuda_be_stream(be);
    if (n_idx <= 0) { /* no entry at all: every row is a row without a valid index */
        CUDA_CHECK(cudaMemsetAsync(o, 0, (size_t)(T * H * hd) * sizeof(bf16_t), st));
        return;
    }
    if (cuda_be_mma(be) && cuda_sparse_attn_mma(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale, NULL)) return;
    if (H > 65535 * 8 || hd > (1 << 20) || n_idx > (1 << 30))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda sparse_attn", "unsupported shape");
    const int sms = cuda_be_sms(be), target = 2 * sms;
    const int hdp = (int)((hd + 7) & ~7LL);
    const int nblk = (int)((n_idx + ATTN_BLOCK - 1) / ATTN_BLOCK);
    const int vec = hd % 8 == 0 && ((uintptr_t)kv & 15) == 0;
    const int vecq = hd % 8 == 0 && ((uintptr_t)q & 15) == 0;
    const int64_t max_hq_hd = (SMEM_LIMIT - QK_SMEM_STATIC) / 4; /* qs [hq][hdp] fp32 must fit */
    if (hdp > max_hq_hd)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda sparse_attn", "head_dim too large for shared memory");

    /* Logits scratch [rows][H][n_idx] fp32, reused slice after slice of rows (stream order). */
    const int64_t row_bytes = H * n_idx * (int64_t)sizeof(float);
    const int64_t rs = cuda_attn_slice_rows(T, row_bytes);
    float *sc = (float *)cuda_be_scratch(be, (size_t)(rs * row_bytes));

    const uint16_t *q16 = (const uint16_t *)q, *kv16 = (const uint16_t *)kv;
    uint16_t *o16 = (uint16_t *)o;
    for (int64_t t0 = 0; t0 < T; t0 += rs) {
        const int64_t tn = T - t0 < rs ? T - t0 : rs;
        /* logits: the largest head group that still gives ~2 CTAs per SM, else one head per CTA
         * (a small decode batch then spreads over H times more SMs) */
        int hq = 1;
        for (int c = pow2_heads(H); c > 1; c >>= 1)
            if (c * (int64_t)hdp <= max_hq_hd && tn * nblk * ((H + c - 1) / c) >= target) {
                hq = c;
                break;
            }
        {
            const dim3 grid((unsigned)(tn * nblk), (unsigned)((H + hq - 1) / hq));
            const int nt = 64 * (hq > 2 ? hq / 2 : 1);
            const size_t smem = (size_t)hq * hdp * sizeof(float);
            sparse_qk_kernel<<<grid, nt, smem, st>>>(sc, q16 + t0 * H * hd, kv16, idx + t0 * n_idx, (int)H, (int)hd,
                                                     (int)n_idx, nblk, scale, hq, vec, vecq);
            KERNEL_CHECK();
        }
        /* softmax + P·V: 128-column slices with all heads of a group when the rows alone fill the
         * GPU; otherwise 64-column slices and smaller head groups, down to one warp per CTA */
        const int hg8 = pow2_heads(H);
        if (hd > 64 && tn * ((H + hg8 - 1) / hg8) * ((hd + 127) / 128) >= target) {
            const dim3 grid((unsigned)tn, (unsigned)((H + hg8 - 1) / hg8), (unsigned)((hd + 127) / 128));
            sparse_pv_kernel<2><<<grid, 32 * hg8, 0, st>>>(o16 + t0 * H * hd, sc, kv16, idx + t0 * n_idx, (int)H,
                                                           (int)hd, (int)n_idx, sink, hg8, vec);
            KERNEL_CHECK();
        } else {
            int hg = 1;
            for (int c = hg8; c > 1; c >>= 1)
                if (tn * ((H + c - 1) / c) * ((hd + 63) / 64) >= target) {
                    hg = c;
                    break;
                }
            const dim3 grid((unsigned)tn, (unsigned)((H + hg - 1) / hg), (unsigned)((hd + 63) / 64));
            sparse_pv_kernel<1><<<grid, 32 * hg, 0, st>>>(o16 + t0 * H * hd, sc, kv16, idx + t0 * n_idx, (int)H,
                                                          (int)hd, (int)n_idx, sink, hg, vec);
            KERNEL_CHECK();
        }
    }
    cuda_be_scratch_free(be, sc);
}

/* ---------------------------------------------------------------------------------------------
 * compress_pool: one thread per (group g, channel c), c fastest so every j-row read is coalesced.
 * Exactly the CPU's per-channel code: max by `s > mx`, Σ expf(s − mx) in j order, then
 * acc += kv · (e / sum) in j order skipping e == 0 (an unfilled slot's kv may be anything); a channel
 * whose scores are all −inf gives 0. Bit-identical to the CPU. */
__global__ void __launch_bounds__(256)
    compress_pool_kernel(uint16_t *__restrict__ lat, const float *__restrict__ kv, const float *__restrict__ score,
                         int64_t G, int r, int64_t n) {
    const int64_t total = G * n;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t g = e / n, c = e - g * n;
        const float *kg = kv + g * r * n + c, *sg = score + g * r * n + c; /* [r][n] per group */
        float mx = -INFINITY;
        for (int j = 0; j < r; j++) mx = sg[j * n] > mx ? sg[j * n] : mx;
        if (mx == -INFINITY) {
            lat[e] = 0;
            continue;
        }
        float sum = 0.0f;
        for (int j = 0; j < r; j++) sum = __fadd_rn(sum, ds_expf(__fsub_rn(sg[j * n], mx)));
        float acc = 0.0f;
        for (int j = 0; j < r; j++) {
            const float w = ds_expf(__fsub_rn(sg[j * n], mx));
            if (w == 0.0f) continue;
            acc = __fadd_rn(acc, __fmul_rn(kg[j * n], __fdiv_rn(w, sum)));
        }
        lat[e] = ds_bf16_rne(acc);
    }
}

void cuda_op_compress_pool(struct backend *be, bf16_t *lat, const float *kv, const float *score, int64_t G, int64_t r,
                           int64_t n) {
    if (G <= 0 || n <= 0) return;
    const int64_t total = G * n, cap = (int64_t)cuda_be_sms(be) * 8;
    int64_t blocks = (total + 255) / 256;
    if (blocks > cap) blocks = cap;
    compress_pool_kernel<<<(unsigned)blocks, 256, 0, cuda_be_stream(be)>>>((uint16_t *)lat, kv, score, G, (int)r, n);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * index_scores: one CTA per (row t, tile of IS_JB = 16 keys), 256 threads.
 * Thread (g = tid / 16, key j0 + tid % 16). Heads go in rounds of IS_RH = 32: in a round, group g
 * computes heads r0 + 2g and r0 + 2g + 1 (two chains sharing each unpacked key value), each dot one
 * sequential fp32 chain over d = 0..d-1 as the CPU's dot_bf16; then d_h = bf16(dot), relu,
 * p_h = bf16(relu · w_h) go to shared memory, and thread k < 16 adds the round's p_h to its key's
 * accumulator in h order. So the head sum is the CPU's ordered fp32 sum, and S is bit-identical to
 * the CPU. Splitting the heads over threads (instead of one thread per key running all heads) keeps
 * a decode step (T = 1, a few thousand keys) spread over the whole GPU.
 * Shared: Ks [16][dp + 8] bf16 (staged once, used by every head; +8: conflict-free row reads),
 * qs [32][dp] fp32 (the round's q rows, widened; reads are warp-uniform per 8 lanes), ps [32][17].
 * Tiles entirely at or beyond visible[t] write −inf without computing (as the CPU, which never
 * computes them), which skips half the work of a causal prefill. With K_rows / nk_rows every row has
 * its own keys (one launch for a batch of sequences); tiles past a row's own count end at once. */
#define IS_JB 16
#define IS_RH 32
#define IS_SMEM_STATIC (IS_RH * (IS_JB + 1) * 4 + IS_RH * 4)

__device__ __forceinline__ float is_p(float dot, float w) {
    const float dh = at_bf16r(dot);
    const float relu = dh < 0.0f ? 0.0f : dh; /* the CPU's expression: −0 and NaN pass through */
    return at_bf16r(__fmul_rn(relu, w));
}

__global__ void __launch_bounds__(256)
    index_scores_kernel(float *__restrict__ S, int64_t ld_s, const uint16_t *__restrict__ q, int64_t ld_q,
                        const uint16_t *__restrict__ K0, const uint16_t *const *__restrict__ K_rows,
                        const int32_t *__restrict__ nk_rows, const uint16_t *__restrict__ w, float w_scale,
                        const int32_t *__restrict__ visible, int nh, int d, int64_t nk_all, int64_t nkb, int veck0,
                        int vecq) {
    extern __shared__ __align__(16) unsigned char is_smem[];
    __shared__ float ps[IS_RH][IS_JB + 1];
    __shared__ float ws[IS_RH];
    const int dp = (d + 7) & ~7, ks = dp + 8;
    uint16_t *Ks = reinterpret_cast<uint16_t *>(is_smem);                  /* [IS_JB][ks] */
    float *qs = reinterpret_cast<float *>(is_smem + IS_JB * ks * 2);       /* [IS_RH][dp], 16-byte aligned */
    const int tid = threadIdx.x, nt = blockDim.x;
    const int64_t t = blockIdx.x / nkb, j0 = (int64_t)(blockIdx.x % nkb) * IS_JB;
    /* the row's own key matrix and key count (a batch of sequences, each with its own cache) */
    const uint16_t *__restrict__ K = K_rows ? K_rows[t] : K0;
    const int64_t nk = nk_rows ? (int64_t)nk_rows[t] : nk_all;
    const int veck = veck0 && ((uintptr_t)K & 15) == 0;
    if (j0 >= nk) return;
    const int64_t vis = visible ? (int64_t)visible[t] : nk;
    float *srow = S + t * ld_s;
    if (j0 >= vis) {
        if (tid < IS_JB && j0 + tid < nk) srow[j0 + tid] = -INFINITY;
        return;
    }
    /* the key tile, zero rows past nk (computed, never stored) */
    if (veck) {
        const int segs = dp >> 3;
        for (int e = tid; e < IS_JB * segs; e += nt) {
            const int kr = e / segs, s = e - kr * segs;
            const int64_t j = j0 + kr;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (j < nk) v = *reinterpret_cast<const uint4 *>(K + j * d + s * 8);
            *reinterpret_cast<uint4 *>(Ks + kr * ks + s * 8) = v;
        }
    } else {
        for (int e = tid; e < IS_JB * dp; e += nt) {
            const int kr = e / dp, c = e - kr * dp;
            const int64_t j = j0 + kr;
            Ks[kr * ks + c] = j < nk && c < d ? K[j * d + c] : (uint16_t)0;
        }
    }
    const int kl = tid & (IS_JB - 1), g = tid >> 4, ha = 2 * g, hb = 2 * g + 1;
    const uint16_t *kr = Ks + kl * ks;
    float acc = 0.0f;
    for (int r0 = 0; r0 < nh; r0 += IS_RH) {
        const int rh = min(IS_RH, nh - r0);
        __syncthreads(); /* the previous round's readers of qs / ws / ps are done */
        at_stage_rows_f32(qs, dp, q + t * ld_q + (int64_t)r0 * d, d, rh, d, dp, vecq, tid, nt);
        if (tid < rh) ws[tid] = at_bf16r(__fmul_rn(ds_bf16f(w[t * nh + r0 + tid]), w_scale));
        __syncthreads();
        if (ha < rh) {
            const float *qa = qs + ha * dp, *qb = qs + hb * dp;
            float da = 0.0f, db = 0.0f;
            if (hb < rh) {
#pragma unroll 2
                for (int c = 0; c < dp; c += 8) {
                    float k[8];
                    unpack8(*reinterpret_cast<const uint4 *>(kr + c), k);
                    da = at_dot8(da, *reinterpret_cast<const float4 *>(qa + c),
                                 *reinterpret_cast<const float4 *>(qa + c + 4), k);
                    db = at_dot8(db, *reinterpret_cast<const float4 *>(qb + c),
                                 *reinterpret_cast<const float4 *>(qb + c + 4), k);
                }
                ps[hb][kl] = is_p(db, ws[hb]);
            } else {
#pragma unroll 2
                for (int c = 0; c < dp; c += 8) {
                    float k[8];
                    unpack8(*reinterpret_cast<const uint4 *>(kr + c), k);
                    da = at_dot8(da, *reinterpret_cast<const float4 *>(qa + c),
                                 *reinterpret_cast<const float4 *>(qa + c + 4), k);
                }
            }
            ps[ha][kl] = is_p(da, ws[ha]);
        }
        __syncthreads();
        if (tid < IS_JB)
            for (int hh = 0; hh < rh; hh++) acc = __fadd_rn(acc, ps[hh][tid]);
    }
    if (tid < IS_JB) {
        const int64_t j = j0 + tid;
        if (j < nk) srow[j] = j >= vis ? -INFINITY : at_bf16r(acc);
    }
}

void cuda_op_index_scores(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q, const bf16_t *K,
                          const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w, float w_scale,
                          const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk) {
    if (T <= 0 || nk <= 0) return;
    if (d < 0) d = 0;
    const int64_t dp = (d + 7) & ~7LL;
    const size_t smem = (size_t)(IS_JB * (dp + 8) * 2 + IS_RH * dp * 4);
    const int64_t nkb = (nk + IS_JB - 1) / IS_JB;
    if (smem + IS_SMEM_STATIC > SMEM_LIMIT || nh > (1 << 30) || T * nkb > 0x7fffffffLL)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda index_scores", "unsupported shape");
    /* with K_rows each row's pointer is checked for alignment in the kernel */
    const int veck = d % 8 == 0 && (K_rows || ((uintptr_t)K & 15) == 0);
    const int vecq = d % 8 == 0 && ld_q % 8 == 0 && ((uintptr_t)q & 15) == 0;
    index_scores_kernel<<<(unsigned)(T * nkb), 256, smem, cuda_be_stream(be)>>>(
        S, ld_s, (const uint16_t *)q, ld_q, (const uint16_t *)K, (const uint16_t *const *)K_rows, nk_rows,
        (const uint16_t *)w, w_scale, visible, (int)nh, (int)d, nk, nkb, veck, vecq);
    KERNEL_CHECK();
}

/* sparse_attn, then the inverse RoPE on its output (sparse_attn_rope): under the mma switch the
 * tensor-core kernels rotate the rotary pairs as they store o (rope_kernel's arithmetic on the bf16
 * values they would store), one launch fewer on a decode step's attention chain; elsewhere (the
 * exact kernels, no rows, shapes the stores refuse) the two ops in turn. */
void cuda_op_sparse_attn_rope(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                              int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                              const struct attn_rope *r) {
    if (T <= 0 || H <= 0 || hd <= 0) return;
    if (n_idx > 0 && cuda_be_mma(be) && cuda_sparse_attn_mma(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale, r)) return;
    be_sparse_attn_rope_composed(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale, r);
}
