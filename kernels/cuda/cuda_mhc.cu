/* The mHC ops of the SM80 backend (MODEL.md §3.2): the mixes (segment dot products, the row
 * statistic and the Sinkhorn split), the collapse with the block norm, the expand and the init.
 * Row-local and bit-identical to the CPU oracle (kernels/cpu/cpu_elementwise.c) under the rules
 * at the top of cuda_elementwise.cu, but for the mixes' dot products under the tensor-core switch
 * (hc_mixes_mma below); the shared row sums and launch shapes are in cuda_rows.cuh. */
#include <stdint.h>

#include "cuda_rows.cuh"
#include "linear_mma.h"
#include "mma_sm80.cuh"


/* ---------------------------------------------------------------------------------------------
 * mHC mixes: m[t, j] = (Σ_s Σ_{i in segment s} x_i · fn[j, i]) · r over the L = hc·D values of
 * row t (segments of BE_HC_MIX_SEG, as the CPU), then the Sinkhorn split. Two kernels:
 *
 * hc_mix_part: CTA (row block of R rows, segment s) computes the segment's sums for every
 * (row, j), a dependent chain of BE_HC_MIX_SEG fp32 adds each, one thread per pair in the small
 * row blocks and per row and JB mixes in the large ones (hc_jb); tiles of 64 values
 * of fn [nm, 64] and of the rows' x [R, 64] stream through a cp.async ring in shared memory, so
 * fn is read once per CTA for all its rows, and the chains read it conflict-free (row stride 68
 * floats). The segments run in parallel: one long chain per j over all of L (the CPU's order
 * before) kept a single CTA busy for ~370 µs at L = 16384. R = HC_R rows for small calls (decode:
 * more CTAs), hc_r_big (16 at hc <= 4) from HC_R_BIG_T rows on (prefill: fn's tiles, most of the
 * bytes a CTA moves, then serve 4x the rows; a 2K-token call took 0.43 ms at R = 4 on the H200).
 * R changes no bit: each chain's order is its own. (Tried and not kept: 4 segments per CTA in turn,
 * to spread the ring's fill over more tiles: hc_mixes 10.5 -> 10.8 ms per 2K-token prefill; and,
 * with JB = 4, R = 32 rows instead of 16: bench_step's 2K-token prefill 125.6 127.1 -> 127.3
 * 130.5 ms.)
 *
 * hc_mix_finish: CTA per row adds the segment sums in order, takes the row's sum of squares in
 * torch's order (torch_sum_block), and the Sinkhorn split runs on one warp, a lane per element of C
 * (hc_split_sinkhorn_warp; HC * HC > 32: thread 0 with C in registers; HC is a template parameter).
 * The row's segment sums (NM x nseg, 6 KB at hc = 4, D = 4096) are staged in shared memory by
 * every thread's cp.async at the start, in flight while the row statistic runs, and the NM threads
 * fold them from there (where they fit and align; otherwise each walks its own in global memory,
 * 16 dependent rounds of 4 loads at nseg = 64). H200 Nsight (kernel_times.sh): 11.85 -> 10.34 µs
 * a call at batch 1, 43.7 -> 39.4 µs at 2,048 rows. (Tried before, without the overlap: the
 * partials fetched by the whole CTA in one coalesced round after the statistic, or held in
 * registers across it; the step did not move then: 6.02 / 9.19 / 18.91 -> 6.03 / 9.22 / 18.98 ms
 * at batch 1 / 8 / 64.) */

#define HC_R 4     /* rows per CTA (small calls) */
#define HC_R_BIG_T 64
/* <= 1024 chains, >= 2 stages, and registers for them (hc = 8 at 8 rows spilled under the SM90 JIT) */
template <int HC> struct hc_r_big { static constexpr int R = HC <= 4 ? 16 : (HC <= 6 ? 8 : HC_R); };
#define HC_KT 64   /* values per tile */
#define HC_FN_LD (HC_KT + 4)
#define HC_X_LD (HC_KT + 8)
#define HC_SMEM_MAX (46 * 1024)
/* hc_mix_part's ring: two stages (one tile in flight beside the one being summed) rather than four
 * leave a CTA 17.7 KB instead of 35 KB at hc 4, so twice the CTAs share an SM (12 rather than 6 on
 * an H100, 9 rather than 4 on an A100), and their barriers hide each other. H100, bench_step
 * --ctx 64 --batch 1,64,256 --steps 5 --prefill 2048, two runs alternated: 4 stages 4.18 4.17 /
 * 11.27 11.27 / 20.54 20.57 / 100.1 100.7 ms, 3 stages 4.17 4.20 / 11.23 11.34 / 20.68 20.61 / 99.8
 * 99.9, 2 stages 4.15 4.19 / 11.08 11.24 / 20.52 20.60 / 99.1 99.5. */
#define HC_STAGES_MAX 2
/* the unaligned fallback's ring (scalar copies): four stages, as before (with two, hc 3 at 16 rows
 * spilled under ptxas) */
#define HC_STAGES_MAX_SCALAR 4
/* hc_mix_finish's CTA: 256 threads at every T. (640, the row statistic's 20 level-0 runs at hc 4,
 * D 5120 in one round, was the decode form up to ROW_WIDE_T rows: 13.3 µs a call where 256 took 15.2
 * on the H200 alone, and a 2K-token prefill's rows took 1.57 ms at 256 against 2.51 at 640. Since
 * the mixes run on a lane of their own (model.c, block_attn_in), the call is off the critical path
 * and the narrow CTA leaves the lanes beside it more of the GPU: H100, bench_step --ctx 64 --batch
 * 1,8,64,256 --steps 5 --prefill "", two runs alternated: 3.628 3.728 / 4.787 4.819 / 10.13 10.18 /
 * 17.47 17.53 -> 3.573 3.676 / 4.704 4.731 / 10.04 10.17 / 17.39 17.52 ms.) */
#define HC_FIN_THREADS 256
#define HC_PS_MAX 2048 /* floats of hc_mix_finish's staged segment sums (hc = 4, D = 4096: 24 x 68) */
static_assert(BE_HC_MIX_SEG % HC_KT == 0, "segments must be whole tiles");

/* mixes per chain thread of hc_mix_part at R rows: JB chains share the thread's x values, unpacked
 * once, in the vector form of the large row blocks (prefill). The small ones (decode, R = HC_R)
 * keep one chain a thread: a decode step's few rows are bound by the chains' latency, and 4 a
 * thread made batch 1 slower (H200 bench_step, 4.60 4.64 -> 4.72 4.76 ms); the unaligned fallback
 * too (with more the SM90 compiler spilled it). */
template <int HC, bool VEC, int R> struct hc_jb {
    static constexpr int NM = (2 + HC) * HC;
    static constexpr int JB = !VEC || R == HC_R ? 1 : (NM % 4 == 0 ? 4 : (NM % 3 == 0 ? 3 : 1));
};
template <int HC, int R = HC_R, int JB_ = 1, int STAGES_MAX = HC_STAGES_MAX>
struct hc_cfg {
    static constexpr int NM = (2 + HC) * HC;
    static constexpr int JB = JB_;
    static_assert(NM % JB == 0, "whole mix groups");
    static constexpr int NG = NM / JB; /* mix groups */
    static constexpr int CHAIN = R * NG;
    static constexpr int CHAIN_WARPS = (CHAIN + 31) / 32;
    static constexpr int THREADS = CHAIN_WARPS * 32;
    static constexpr int STAGE_BYTES = NM * HC_FN_LD * 4 + R * HC_X_LD * 2;
    static constexpr int STAGES = HC_SMEM_MAX / STAGE_BYTES > STAGES_MAX ? STAGES_MAX : HC_SMEM_MAX / STAGE_BYTES;
    static_assert(STAGES >= 2, "hc too large for the shared-memory ring");
    static_assert(STAGE_BYTES % 16 == 0, "stages must stay 16-byte aligned");
    static_assert(THREADS <= 1024, "one CTA's chains");
};

/* One Sinkhorn half-step on C [HC][HC] in registers: each line a (rows: OUTER = HC, INNER = 1;
 * columns: OUTER = 1, INNER = HC) divided by (its sum in order from 0) + eps. */
template <int HC, int OUTER, int INNER>
__device__ __forceinline__ void hc_sinkhorn_lines(float (&C)[HC * HC], float eps) {
#pragma unroll
    for (int a = 0; a < HC; a++) {
        float sum = 0.0f;
#pragma unroll
        for (int b = 0; b < HC; b++) sum = __fadd_rn(sum, C[a * OUTER + b * INNER]);
        const float den = __fadd_rn(sum, eps);
#pragma unroll
        for (int b = 0; b < HC; b++) C[a * OUTER + b * INNER] = __fdiv_rn(C[a * OUTER + b * INNER], den);
    }
}

/* split_sinkhorn of cpu_elementwise.c for one row, C[j][k] in registers. */
template <int HC>
__device__ void hc_split_sinkhorn(const float *m, const float *__restrict__ scale, const float *__restrict__ base,
                                  int iters, float eps, float *pre, float *post, float *comb) {
    const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
#pragma unroll
    for (int j = 0; j < HC; j++) {
        pre[j] = __fadd_rn(ds_sigmoid(__fadd_rn(__fmul_rn(m[j], s0), base[j])), eps);
        post[j] = __fmul_rn(2.0f, ds_sigmoid(__fadd_rn(__fmul_rn(m[HC + j], s1), base[HC + j])));
    }
    float C[HC * HC];
#pragma unroll
    for (int j = 0; j < HC; j++) { /* softmax over k of row j, + eps */
        float *row = C + j * HC;
#pragma unroll
        for (int k = 0; k < HC; k++)
            row[k] = __fadd_rn(__fmul_rn(m[2 * HC + j * HC + k], s2), base[2 * HC + j * HC + k]);
        float mx = row[0];
#pragma unroll
        for (int k = 1; k < HC; k++) mx = row[k] > mx ? row[k] : mx;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < HC; k++) {
            row[k] = ds_expf(__fsub_rn(row[k], mx));
            sum = __fadd_rn(sum, row[k]);
        }
#pragma unroll
        for (int k = 0; k < HC; k++) row[k] = __fadd_rn(__fdiv_rn(row[k], sum), eps);
    }
    /* a column step always (the CPU's first one runs even for iters <= 0), then iters - 1 passes of
     * row then column; the softmax made the rows sum to one, so the first pass is a column step alone */
    const int passes = iters > 1 ? iters : 1;
    for (int it = 0; it < passes; it++) {
        if (it > 0) hc_sinkhorn_lines<HC, HC, 1>(C, eps); /* rows */
        hc_sinkhorn_lines<HC, 1, HC>(C, eps);             /* columns */
    }
#pragma unroll
    for (int e = 0; e < HC * HC; e++) comb[e] = C[e];
}

/* The same split with one lane per element of C (HC * HC <= 32; called by a whole warp, lanes
 * past HC * HC compute on a copy of element 0 and store nothing). Bit for bit the serial version:
 * each lane gathers its row's (or column's) HC values by shuffles and runs the serial code's loop
 * over them in its order (the max, the sums), and rows (columns) are independent within a step,
 * so only where the work runs changes. One step costs a few shuffles and one division per lane,
 * where thread 0 alone ran HC * HC dependent-latency divisions per step (~25 µs per call at HC = 4
 * and 20 iterations). */
template <int HC>
__device__ void hc_split_sinkhorn_warp(const float *m, const float *__restrict__ scale, const float *__restrict__ base,
                                       int iters, float eps, float *pre, float *post, float *comb) {
    static_assert(HC * HC <= 32, "one lane per element of C");
    const int lane = threadIdx.x & 31;
    const bool on = lane < HC * HC;
    const int e = on ? lane : 0, j = e / HC, k = e % HC;
    const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
    if (lane < HC) {
        pre[lane] = __fadd_rn(ds_sigmoid(__fadd_rn(__fmul_rn(m[lane], s0), base[lane])), eps);
        post[lane] = __fmul_rn(2.0f, ds_sigmoid(__fadd_rn(__fmul_rn(m[HC + lane], s1), base[HC + lane])));
    }
    float c = __fadd_rn(__fmul_rn(m[2 * HC + e], s2), base[2 * HC + e]);
    float v[HC];
#pragma unroll
    for (int q = 0; q < HC; q++) v[q] = __shfl_sync(0xffffffffu, c, j * HC + q);
    float mx = v[0];
#pragma unroll
    for (int q = 1; q < HC; q++) mx = v[q] > mx ? v[q] : mx;
    c = ds_expf(__fsub_rn(c, mx)); /* softmax over k of row j, + eps */
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < HC; q++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, j * HC + q));
    c = __fadd_rn(__fdiv_rn(c, sum), eps);
    const int passes = iters > 1 ? iters : 1; /* as hc_split_sinkhorn */
    for (int it = 0; it < passes; it++) {
        if (it > 0) {
            sum = 0.0f;
#pragma unroll
            for (int q = 0; q < HC; q++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, j * HC + q));
            c = __fdiv_rn(c, __fadd_rn(sum, eps));
        }
        sum = 0.0f;
#pragma unroll
        for (int q = 0; q < HC; q++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, q * HC + k));
        c = __fdiv_rn(c, __fadd_rn(sum, eps));
    }
    if (on) comb[lane] = c;
}

/* VEC: L % 8 == 0 and X, fn 16-byte aligned, tiles by cp.async; otherwise plain loads.
 * part: [T, NM, nseg] f32, segment sums. Thread (row r = tid % R, mix group jg = tid / R) runs the
 * JB chains of mixes jg·JB .. jg·JB + JB - 1 for row r side by side: each x value is unpacked
 * once for JB chains, and 8 consecutive lanes share one group's fn row (a broadcast) while reading
 * 8 rows of x (conflict-free, row stride 36 words). One thread per chain issued ~5.6 instructions
 * per multiply-add where the multiply and the add are 2 (Nsight Compute on the H200: 176 M warp
 * instructions for a 2K-token call's 1.0 G multiply-adds, issue slots 79 % busy): the unpack, the
 * loads, and the tile copy's index divisions (full tiles now take compile-time strides). Measured
 * (tests/gpu/kernel_times.sh, 2K-token prefill and batch 1): 219.7 -> 163.0 µs a call at 16 rows,
 * and 6.31 -> 5.44 µs at batch 1 (the copy strides alone). */
template <int HC, bool VEC, int R>
using hc_part_cfg = hc_cfg<HC, R, hc_jb<HC, VEC, R>::JB, VEC ? HC_STAGES_MAX : HC_STAGES_MAX_SCALAR>;

template <int HC, bool VEC, int R>
__global__ void __launch_bounds__(hc_part_cfg<HC, VEC, R>::THREADS)
    hc_mix_part_kernel(float *__restrict__ part, const uint16_t *__restrict__ X, int64_t T, int64_t D,
                       const float *__restrict__ fn, int nseg) {
    using cfg = hc_part_cfg<HC, VEC, R>;
    constexpr int NM = cfg::NM, JB = cfg::JB, STAGES = cfg::STAGES, SEG_TILES = BE_HC_MIX_SEG / HC_KT;
    extern __shared__ __align__(16) unsigned char hc_smem[]; /* STAGES × { fn [NM][68] f32, x [R][72] bf16 } */

    const int64_t L = HC * D;
    const int64_t t0 = (int64_t)blockIdx.x * R;
    const int seg = blockIdx.y;
    const int nrows = T - t0 < R ? (int)(T - t0) : R;
    const int all_tiles = (int)((L + HC_KT - 1) / HC_KT);
    const int tile0 = seg * SEG_TILES;
    const int ntiles = all_tiles - tile0 < SEG_TILES ? all_tiles - tile0 : SEG_TILES;
    const int tid = threadIdx.x;
    /* chain thread: row r, mixes jg·JB ..; JB = 1 (the fallback): consecutive lanes on one row */
    const int r = JB == 1 ? tid / NM : tid % R, jg = JB == 1 ? tid % NM : tid / R;
    const bool chain_live = tid < cfg::CHAIN && r < nrows;

    auto fn_tile = [&](int st) { return reinterpret_cast<float *>(hc_smem + (size_t)st * cfg::STAGE_BYTES); };
    auto x_tile = [&](int st) {
        return reinterpret_cast<uint16_t *>(hc_smem + (size_t)st * cfg::STAGE_BYTES + NM * HC_FN_LD * 4);
    };
    /* the copies of one tile: 16-byte chunks q < nf of fn (fch per row), then of x (xch per row) */
    auto copy_chunks = [&](float *fs, uint16_t *xs, int64_t e0, int fch, int xch) {
        const int nf = NM * fch, nx = R * xch;
        for (int q = tid; q < nf + nx; q += cfg::THREADS) {
            if (q < nf) {
                const int jj = q / fch, c = q % fch;
                ds_cp16(fs + jj * HC_FN_LD + c * 4, fn + jj * L + e0 + c * 4);
            } else {
                const int rr = (q - nf) / xch, c = (q - nf) % xch;
                if (rr < nrows) ds_cp16(xs + rr * HC_X_LD + c * 8, X + (t0 + rr) * L + e0 + c * 8);
            }
        }
    };
    auto load_tile = [&](int lt) {
        float *fs = fn_tile(lt % STAGES);
        uint16_t *xs = x_tile(lt % STAGES);
        const int64_t e0 = (int64_t)(tile0 + lt) * HC_KT;
        const int len = L - e0 < HC_KT ? (int)(L - e0) : HC_KT;
        if constexpr (VEC) { /* len % 8 == 0: whole 16-byte chunks; a full tile's strides are constants */
            if (len == HC_KT)
                copy_chunks(fs, xs, e0, HC_KT / 4, HC_KT / 8);
            else
                copy_chunks(fs, xs, e0, len / 4, len / 8);
        } else { /* the unaligned fallback */
            for (int q = tid; q < NM * HC_KT; q += cfg::THREADS)
                if (q % HC_KT < len) fs[(q / HC_KT) * HC_FN_LD + q % HC_KT] = fn[(q / HC_KT) * L + e0 + q % HC_KT];
            for (int q = tid; q < nrows * HC_KT; q += cfg::THREADS)
                if (q % HC_KT < len) xs[(q / HC_KT) * HC_X_LD + q % HC_KT] = X[(t0 + q / HC_KT) * L + e0 + q % HC_KT];
        }
    };

    float acc[JB];
#pragma unroll
    for (int jj = 0; jj < JB; jj++) acc[jj] = 0.0f;
#pragma unroll 1
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < ntiles) load_tile(st);
        ds_cp_commit(); /* empty groups keep the wait count uniform */
    }
    for (int lt = 0; lt < ntiles; lt++) {
        ds_cp_wait<STAGES - 2>();
        __syncthreads(); /* tile's data visible; everyone is done with tile - 1's stage */
        if (lt + STAGES - 1 < ntiles) load_tile(lt + STAGES - 1);
        ds_cp_commit();
        const float *fs = fn_tile(lt % STAGES);
        const uint16_t *xs = x_tile(lt % STAGES);
        const int64_t e0 = (int64_t)(tile0 + lt) * HC_KT;
        const int len = L - e0 < HC_KT ? (int)(L - e0) : HC_KT;
        if (chain_live) {
            const float *fr = fs + jg * JB * HC_FN_LD;
            const uint16_t *xr = xs + r * HC_X_LD;
            if (len == HC_KT) {
#pragma unroll
                for (int ii = 0; ii < HC_KT; ii += 8) {
                    float xv[8];
                    unpack8(*reinterpret_cast<const uint4 *>(xr + ii), xv);
#pragma unroll
                    for (int jj = 0; jj < JB; jj++) {
                        const float4 f0 = *reinterpret_cast<const float4 *>(fr + jj * HC_FN_LD + ii);
                        const float4 f1 = *reinterpret_cast<const float4 *>(fr + jj * HC_FN_LD + ii + 4);
                        float a = acc[jj];
                        a = __fadd_rn(a, __fmul_rn(xv[0], f0.x));
                        a = __fadd_rn(a, __fmul_rn(xv[1], f0.y));
                        a = __fadd_rn(a, __fmul_rn(xv[2], f0.z));
                        a = __fadd_rn(a, __fmul_rn(xv[3], f0.w));
                        a = __fadd_rn(a, __fmul_rn(xv[4], f1.x));
                        a = __fadd_rn(a, __fmul_rn(xv[5], f1.y));
                        a = __fadd_rn(a, __fmul_rn(xv[6], f1.z));
                        a = __fadd_rn(a, __fmul_rn(xv[7], f1.w));
                        acc[jj] = a;
                    }
                }
            } else {
                for (int ii = 0; ii < len; ii++) {
                    const float xv = ds_bf16f(xr[ii]);
#pragma unroll
                    for (int jj = 0; jj < JB; jj++)
                        acc[jj] = __fadd_rn(acc[jj], __fmul_rn(xv, fr[jj * HC_FN_LD + ii]));
                }
            }
        }
    }
    ds_cp_wait<0>();
    if (chain_live)
#pragma unroll
        for (int jj = 0; jj < JB; jj++) part[((t0 + r) * NM + jg * JB + jj) * nseg + seg] = acc[jj];
}

/* hc_mix_finish's staged row stride in shared memory (floats): padded where nseg is a multiple of 4
 * (the NM folding threads' reads spread over the banks); nseg = 3 (the tensor-core form) reads at
 * stride 3, conflict-free as it is. The host sizes the staging with it. */
__host__ __device__ __forceinline__ int hc_ps_ld(int nseg) { return nseg % 4 == 0 ? nseg + 4 : nseg; }

template <int HC>
__global__ void __launch_bounds__(HC_FIN_THREADS)
    hc_mix_finish_kernel(float *__restrict__ pre, float *__restrict__ post, float *__restrict__ comb,
                         const float *__restrict__ part, const uint16_t *__restrict__ X, int64_t D, int nseg,
                         int nch, int64_t cs, const float *__restrict__ scale, const float *__restrict__ base,
                         int iters, float norm_eps, float hc_eps, bool staged) {
    constexpr int NM = hc_cfg<HC>::NM;
    static_assert(3 + NM <= HC_FIN_THREADS, "one thread per mix (and per Sinkhorn parameter)");
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float m_s[NM];
    __shared__ float prm_s[3 + NM]; /* scale [3], base [NM]: fetched first, so their latency hides under the row's */
    __shared__ float rn_s;
    __shared__ __align__(16) float ps[HC_PS_MAX]; /* the row's sums, staged: [nch][NM][nseg + pad] */
    const int64_t t = blockIdx.x, L = HC * D;
    const int tid = threadIdx.x;
    const int pld = hc_ps_ld(nseg);
    if (staged) { /* every thread's cp.async, in flight while the row statistic runs */
        const int nc = NM * nseg / 4, rc = nseg % 4 == 0 ? nseg / 4 : nc; /* 16-byte pieces a chunk, a row */
        for (int q = tid; q < nch * nc; q += HC_FIN_THREADS) {
            const int c = q / nc, r = q % nc;
            ds_cp16(ps + c * NM * pld + (r / rc) * pld + (r % rc) * 4, part + c * cs + t * NM * nseg + r * 4);
        }
        ds_cp_commit();
    }
    if (tid < 3 + NM) prm_s[tid] = tid < 3 ? scale[tid] : base[tid - 3];
    /* each sum's chunks in chunk order, then a mix's nseg sums in order: the tilings' own chunk fold
     * (mma_chunk_sum_kernel) and the segment fold, one launch fewer */
    if (!staged && tid < NM) {
        const float *pr = part + (t * NM + tid) * nseg; /* [nseg], in each of the nch chunks */
        float acc = 0.0f;
        for (int sg = 0; sg < nseg; sg++) acc = __fadd_rn(acc, mma_fold_chunks(pr + sg, cs, nch));
        m_s[tid] = acc;
    }
    const float rn = row_rstd_block(X + t * L, L, norm_eps, l0, &rn_s); /* X row [L] bf16 */
    if (staged) {
        ds_cp_wait<0>();
        __syncthreads();
        if (nch > 1) { /* NM·nseg threads fold a sum's chunks each, into chunk 0's slot (their own) */
            for (int q = tid; q < NM * nseg; q += HC_FIN_THREADS) {
                float *p0 = ps + (q / nseg) * pld + q % nseg;
                float v = *p0;
#pragma unroll 4
                for (int c = 1; c < nch; c++) v = __fadd_rn(v, p0[c * NM * pld]);
                *p0 = v;
            }
            __syncthreads();
        }
        if (tid < NM) {
            float acc = 0.0f;
            for (int sg = 0; sg < nseg; sg++) acc = __fadd_rn(acc, ps[tid * pld + sg]);
            m_s[tid] = acc;
        }
    }
    if (tid < NM) m_s[tid] = __fmul_rn(m_s[tid], rn);
    __syncthreads();
    if (HC * HC <= 32) {
        if (tid < 32)
            hc_split_sinkhorn_warp<(HC * HC <= 32 ? HC : 1)>(m_s, prm_s, prm_s + 3, iters, hc_eps, pre + t * HC,
                                                             post + t * HC, comb + t * HC * HC);
    } else if (tid == 0) {
        hc_split_sinkhorn<HC>(m_s, prm_s, prm_s + 3, iters, hc_eps, pre + t * HC, post + t * HC, comb + t * HC * HC);
    }
}

template <int HC, int R>
static void hc_mix_part_launch(struct backend *be, float *part, const bf16_t *X, int64_t T, int64_t D, const float *fn,
                               int nseg) {
    using cv = hc_part_cfg<HC, true, R>;
    using cs = hc_part_cfg<HC, false, R>; /* the same stage size, more threads (and stages) */
    const dim3 grid(ew_blocks(T, R), (unsigned)nseg);
    if ((HC * D) % 8 == 0 && al16(X) && al16(fn))
        hc_mix_part_kernel<HC, true, R><<<grid, cv::THREADS, (size_t)cv::STAGES * cv::STAGE_BYTES, cuda_be_stream(be)>>>(
            part, X, T, D, fn, nseg);
    else
        hc_mix_part_kernel<HC, false, R><<<grid, cs::THREADS, (size_t)cs::STAGES * cs::STAGE_BYTES, cuda_be_stream(be)>>>(
            part, X, T, D, fn, nseg);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * The mixes' dot products on the tensor cores (the backend's mma switch, the engine's default):
 * fn's fp32 rows split into three bf16 pieces, fn = hi + mid + lo (hi = bf16(fn), mid =
 * bf16(fn − hi), lo = fn − hi − mid: each difference exact in fp32, and lo, at most 8 significant
 * bits, exact in bf16 for |fn| >= 2^-100), stored as the rows j·3 + s of one BF16 weight [3·NM, L],
 * so that the BF16 mma tilings of linear_mma_sm80.cu give each row t the three sums Σ x·piece_s
 * side by side, per k-chunk of 1,024 (CUDA_MMA_OUT_PARTS: [nch, T, NM, nseg = 3] fp32, unfolded),
 * and hc_mix_finish folds them as the tilings' chunk fold would (each sum's chunks in order), one
 * launch fewer a call, then m = ((P_hi + P_mid) + P_lo)·r. Every product of a bf16 x and a bf16
 * piece is exact in fp32, so m is within the fp32 sum bound of the exact Σ x·fn (tolerances.h,
 * TOL_GPU_HC_MIX_MMA_U_PER_TERM) rather than the CPU's bits, and every row has the same bits at
 * any T (the tilings' order contract): batch invariant. The CUDA-core chains above run at one
 * multiply and one add per term in the CPU's order: H100, Nsight, a 2K-token prefill's 40 calls
 * 6.6 ms (165 µs each, 41 % of the fp32 issue rate). hc·D a multiple of 32 (the tilings' k) and 16-byte rows;
 * other shapes, and --exact-linears, keep the chains. */
__global__ void __launch_bounds__(EW_THREADS)
    hc_fn_split_kernel(uint16_t *__restrict__ w3, const float *__restrict__ fn, int64_t NM, int64_t L) {
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= NM * L) return;
    const int64_t j = g / L, i = g - j * L;
    const float f = fn[g];
    const uint16_t hi = ds_bf16_rne(f);
    const float r1 = __fsub_rn(f, ds_bf16f(hi));
    const uint16_t mid = ds_bf16_rne(r1);
    const uint16_t lo = ds_bf16_rne(__fsub_rn(r1, ds_bf16f(mid)));
    uint16_t *o = w3 + j * 3 * L + i; /* w3 [NM, 3, L] bf16 = [3·NM, L] */
    o[0] = hi;
    o[L] = mid;
    o[2 * L] = lo;
}

/* whether the mixes of rows of L = hc·D values take the tensor cores: the mma switch, and a k the
 * tilings take (hc_prepare splits fn for the same shapes) */
static bool hc_mma_shape(struct backend *be, int64_t L) {
    return cuda_be_mma(be) && L % 32 == 0 && L <= ((int64_t)1 << 21);
}

static void hc_fn_split(cudaStream_t st, uint16_t *w3, const float *fn, int64_t NM, int64_t L) {
    hc_fn_split_kernel<<<ew_blocks(NM * L, EW_THREADS), EW_THREADS, 0, st>>>(w3, fn, NM, L);
    KERNEL_CHECK();
}

/* part [nch, T, NM, 3] f32, each k-chunk's three sums unfolded (hc_mix_finish folds them); the
 * pieces hc_prepare made for fn, or split here (the same values) */
static void hc_mixes_mma(struct backend *be, float *part, const bf16_t *X, int64_t T, int64_t L, int64_t NM,
                         const float *fn) {
    cudaStream_t st = cuda_be_stream(be);
    const uint16_t *w3 = (const uint16_t *)cuda_be_prep_derived(be, fn); /* [3·NM, L] bf16 */
    uint16_t *own = NULL;
    if (!w3) {
        own = (uint16_t *)cuda_be_scratch_raw(be, (size_t)(3 * NM * L) * 2);
        hc_fn_split(st, own, fn, NM, L);
        w3 = own;
    }
    cuda_linear_mma_tiling(CUDA_MMA_AUTO | CUDA_MMA_OUT_PARTS, WF_BF16, (uint16_t *)part, (const uint16_t *)X, T, w3,
                           NULL, 3 * NM, L, L, 0, NULL, (void *)st);
    if (own) cuda_be_scratch_free(be, own);
}

/* hc_prepare: fn's three pieces once, beside fn's own device copy (under the mma switch and where
 * hc_mixes_mma takes the shape; 1.5x fn's bytes: 118 MB for V4.1-Flash's 40 mixes of a PP stage).
 * Splitting on every call cost ~3 µs a call, 40 calls a step (H100: batch 1 4.21 -> 4.31 ms). */
void cuda_op_hc_prepare(struct backend *be, const float *fn, int64_t hc, int64_t D) {
    const int64_t L = hc * D, NM = (2 + hc) * hc;
    if (!fn || !hc_mma_shape(be, L) || cuda_be_prep_derived(be, fn)) return;
    void *w3 = NULL;
    CUDA_CHECK(cudaMalloc(&w3, (size_t)(3 * NM * L) * 2));
    cudaStream_t st = cuda_be_stream(be);
    hc_fn_split(st, (uint16_t *)w3, fn, NM, L);
    CUDA_CHECK(cudaStreamSynchronize(st));
    if (!cuda_be_prep_set_derived(be, fn, w3)) CUDA_CHECK(cudaFree(w3)); /* fn not a prepared pointer */
}

template <int HC>
static void hc_mixes_launch(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                            int64_t D, const float *fn, const float *scale, const float *base, int iters,
                            float norm_eps, float hc_eps) {
    const int64_t L = HC * D, NM = hc_cfg<HC>::NM;
    int nseg = (int)((L + BE_HC_MIX_SEG - 1) / BE_HC_MIX_SEG), nch = 1;
    const bool mma = hc_mma_shape(be, L) && al16(X);
    if (mma) nseg = 3, nch = (int)cuda_linear_mma_chunks(L);
    const int64_t cs = nch > 1 ? T * NM * nseg : 0; /* floats between a row's chunks */
    float *part = (float *)cuda_be_scratch_raw(be, (size_t)(nch * T * NM * nseg) * sizeof(float)); /* [nch, T, NM, nseg] */
    if (mma)
        hc_mixes_mma(be, part, X, T, L, NM, fn);
    else if (T >= HC_R_BIG_T)
        hc_mix_part_launch<HC, hc_r_big<HC>::R>(be, part, X, T, D, fn, nseg);
    else
        hc_mix_part_launch<HC, HC_R>(be, part, X, T, D, fn, nseg);
    /* the sums staged in shared memory by 16-byte copies where they fit and align (as the kernel pads them) */
    const int pld = hc_ps_ld(nseg);
    const bool staged = (NM * nseg) % 4 == 0 && nch * NM * pld <= HC_PS_MAX && al16(part);
    hc_mix_finish_kernel<HC><<<(unsigned)T, HC_FIN_THREADS, 0, cuda_be_stream(be)>>>(
        pre, post, comb, part, X, D, nseg, nch, cs, scale, base, iters, norm_eps, hc_eps, staged);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, part);
}

void cuda_op_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                      int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters,
                      float norm_eps, float hc_eps) {
    if (T <= 0) return;
    switch (hc) {
#define HC_CASE(H)                                                                                         \
    case H:                                                                                                \
        hc_mixes_launch<H>(be, pre, post, comb, X, T, D, fn, scale, base, iters, norm_eps, hc_eps);        \
        break;
        HC_CASE(1)
        HC_CASE(2)
        HC_CASE(3)
        HC_CASE(4)
        HC_CASE(6)
        HC_CASE(8)
#undef HC_CASE
    default:
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "hc_mixes", "hc_mult not instantiated (1, 2, 3, 4, 6, 8)");
    }
}

/* ---------------------------------------------------------------------------------------------
 * mHC collapse / expand / init: one thread per VEC consecutive d of a row, sums over the copies
 * j in order, as the CPU. */

template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_collapse_kernel(uint16_t *__restrict__ y, const uint16_t *__restrict__ X, const float *__restrict__ p,
                       int64_t T, int64_t hc, int64_t D) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * nv) return;
    const int64_t t = g / nv, d = (g % nv) * VEC;
    const uint16_t *xr = X + t * hc * D + d; /* X [T, hc, D] bf16 */
    const float *pr = p + t * hc;            /* p [T, hc] */
    float acc[VEC], xv[VEC];
    load_bf<VEC>(xr, xv);
    const float p0 = pr[0];
#pragma unroll
    for (int i = 0; i < VEC; i++) acc[i] = __fmul_rn(p0, xv[i]);
    for (int64_t jj = 1; jj < hc; jj++) {
        const float pj = pr[jj];
        load_bf<VEC>(xr + jj * D, xv);
#pragma unroll
        for (int i = 0; i < VEC; i++) acc[i] = __fadd_rn(acc[i], __fmul_rn(pj, xv[i]));
    }
    store_bf<VEC>(y + t * D + d, acc); /* y [T, D] bf16 */
}

/* (Tried and not kept, branch expand-collapse: the FFN's entry, the hc_expand before this, in the
 * same row CTA — the expanded row made in registers, stored and collapsed — with the two ops' bits;
 * H100 bench_step at batch 1 / 8 / 64 / 256, three runs alternated, 4.09 4.13 4.08 / 5.50 5.54 5.50
 * / 11.10 11.09 11.07 / 19.83 19.70 19.63 -> 4.15 4.07 4.13 / 5.56 5.45 5.54 / 11.02 10.97 11.21 /
 * 19.66 19.56 20.04 ms: the expand's loads and stores moved onto this CTA's serial path.)
 * hc_collapse with norm_w: the collapse and the rmsnorm after it in one pass per row (a CTA of
 * HCN_WARPS warps, HCN_WARPS_NARROW above ROW_WIDE_T rows): each thread collapses its 8-wide
 * chunks of the row with every copy's load issued at once (HC is a template parameter, as for
 * hc_mixes), rounds y to bf16 in shared memory, and the norm runs there — row_rstd_block's
 * torch-order sum of squares, then w · (y · r) — with the collapse's and rmsnorm_kernel's
 * arithmetic, so the bits are the two ops'.
 * It saves the norm's launch and its read of y; the norm weights are loaded before the sum, as
 * rmsnorm_kernel's. D up to HCN_MAX_D (y's row in shared memory); other shapes run the two
 * kernels. */
#define HCN_MAX_D 8192
/* 20 warps: at D = 5120 one 8-wide chunk a thread (every load of the collapse in one round) and the
 * norm's 5 level-0 runs in one round; with RMS_WARPS (4) a thread walked 5 chunks and warp 0 two
 * rounds of runs. H200, Nsight, batch 1 / 64: 8.7 / 9.5 -> 7.1 / 7.6 µs a call, with
 * hc_mix_finish's CTA 256 -> 640 threads (back to 256 since) 15.2 / 15.4 -> 13.3 / 13.5 µs;
 * bench_step decode ms, three runs alternated (both changes over the router's rank kernel): b1
 * 4.28 4.35 4.35 -> 4.28 4.29 4.31, b8 6.80 6.86 6.80 -> 6.77 6.76 6.76, b64 14.85 14.99 14.84 ->
 * 14.59 14.60 14.68. */
#define HCN_WARPS 20
#define HCN_WARPS_NARROW RMS_WARPS /* above ROW_WIDE_T rows: 1.54 -> 2.05 ms a 2K-token prefill with 20 */

/* y's element (t, d) when y is [D / Db, T, Db] (the op's y_blocks; Db = D: [T, D]). A VEC-wide run
 * from d stays in one block: VEC divides Db. */
__device__ __forceinline__ int64_t hc_y_at(int64_t t, int64_t d, int64_t T, int64_t Db) {
    return (d / Db * T + t) * Db + d % Db;
}

/* The expand in front of the collapse (hc_expand_collapse): Xo = hc_expand(yin, X, post, comb),
 * yin in y_blocks column blocks of Db (hc_y_at), and the collapse reads Xo's bf16 values as they
 * are stored rather than X's. */
struct hc_expand_in {
    uint16_t *Xo;         /* [T, HC, D] bf16 */
    const uint16_t *yin;  /* [D / Db, T, Db] bf16 */
    const float *post;    /* [T, HC] */
    const float *comb;    /* [T, HC, HC] */
    int64_t T, Db;
};

template <int HC, int WARPS, bool ACT, bool EXPAND>
__global__ void __launch_bounds__(WARPS * 32)
    hc_collapse_norm_kernel(uint16_t *__restrict__ y, uint32_t *__restrict__ ya, const uint16_t *__restrict__ X,
                            const float *__restrict__ p, const uint16_t *__restrict__ w, int64_t D, float eps,
                            hc_expand_in ex) {
    constexpr int STEP = WARPS * 32 * 8, NP = (HCN_MAX_D + STEP - 1) / STEP;
    __shared__ __align__(16) uint16_t ys[HCN_MAX_D]; /* the row's collapsed y [D] bf16 */
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float r_s;
    const int64_t t = blockIdx.x;
    const uint16_t *xr = X + t * HC * D; /* X [T, HC, D] bf16 */
    /* the expand's post [HC] and comb [HC][HC] (c[j*hc + k]) in shared memory: in registers beside
     * the row's values they made the 640-thread CTA spill under the SM90 compiler (96 registers) */
    __shared__ float pc_s[EXPAND ? HC + HC * HC : 1];
    float pj[HC];
#pragma unroll
    for (int j = 0; j < HC; j++) pj[j] = p[t * HC + j];
    if constexpr (EXPAND) {
        if (threadIdx.x < HC + HC * HC)
            pc_s[threadIdx.x] = threadIdx.x < HC ? ex.post[t * HC + threadIdx.x] : ex.comb[t * HC * HC + threadIdx.x - HC];
        __syncthreads();
    }
    const float *pk = pc_s, *ck = pc_s + HC;
    uint4 wp[NP];
#pragma unroll
    for (int q = 0; q < NP; q++) {
        const int64_t e = (int64_t)threadIdx.x * 8 + q * STEP;
        if (e >= D) break;
        uint4 xv[HC];
#pragma unroll
        for (int j = 0; j < HC; j++) xv[j] = *reinterpret_cast<const uint4 *>(xr + j * D + e);
        uint4 yv = make_uint4(0, 0, 0, 0);
        if constexpr (EXPAND) yv = *reinterpret_cast<const uint4 *>(ex.yin + hc_y_at(t, e, ex.T, ex.Db));
        wp[q] = __ldg(reinterpret_cast<const uint4 *>(w + e));
        float acc[8], f[8];
        if constexpr (EXPAND) { /* hc_expand_all_kernel's arithmetic per output copy k, then its bf16 into the collapse */
#pragma unroll
            for (int k = 0; k < HC; k++) { /* the inputs unpacked per use: packed they hold a quarter of the registers */
                float mix[8];
                unpack8(xv[0], f);
#pragma unroll
                for (int i = 0; i < 8; i++) mix[i] = __fmul_rn(ck[k], f[i]);
#pragma unroll
                for (int jj = 1; jj < HC; jj++) {
                    unpack8(xv[jj], f);
#pragma unroll
                    for (int i = 0; i < 8; i++) mix[i] = __fadd_rn(mix[i], __fmul_rn(ck[jj * HC + k], f[i]));
                }
                unpack8(yv, f);
#pragma unroll
                for (int i = 0; i < 8; i++) mix[i] = __fadd_rn(__fmul_rn(pk[k], f[i]), mix[i]);
                const uint4 xo = pack8(mix);
                *reinterpret_cast<uint4 *>(ex.Xo + (t * HC + k) * D + e) = xo;
                unpack8(xo, f);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] = k == 0 ? __fmul_rn(pj[0], f[i]) : __fadd_rn(acc[i], __fmul_rn(pj[k], f[i]));
            }
        } else {
            unpack8(xv[0], f);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = __fmul_rn(pj[0], f[i]);
#pragma unroll
            for (int j = 1; j < HC; j++) {
                unpack8(xv[j], f);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] = __fadd_rn(acc[i], __fmul_rn(pj[j], f[i]));
            }
        }
        *reinterpret_cast<uint4 *>(ys + e) = pack8(acc);
    }
    __syncthreads();
    const float r = row_rstd_block(ys, D, eps, l0, &r_s);
#pragma unroll
    for (int q = 0; q < NP; q++) {
        const int64_t e = (int64_t)threadIdx.x * 8 + q * STEP;
        if (e >= D) break;
        float xv[8], wv[8];
        unpack8(*reinterpret_cast<const uint4 *>(ys + e), xv);
        unpack8(wp[q], wv);
#pragma unroll
        for (int i = 0; i < 8; i++) xv[i] = __fmul_rn(wv[i], __fmul_rn(xv[i], r));
        const uint4 yo = pack8(xv);
        *reinterpret_cast<uint4 *>(y + t * D + e) = yo;
        if (ACT) { /* y's act quant from its bf16 values, as mma_act_quant_body (D % 256 == 0: whole warps) */
            uint32_t o[4];
            unpack8(yo, xv);
            mma_quant8(xv, o);
            mma_store_perm8(ya + (t * D + e) / 32 * 16, (int)((e >> 3) & 3), o);
        }
    }
}

/* One launch of the collapse-norm kernel on the row count's CTA width. */
template <int HC, bool ACT, bool EXPAND>
static void hcn_launch(cudaStream_t st, bf16_t *y, uint32_t *ya, const bf16_t *X, const float *p, int64_t T, int64_t D,
                       const bf16_t *norm_w, float eps, const hc_expand_in &ex) {
    if (T <= ROW_WIDE_T)
        hc_collapse_norm_kernel<HC, HCN_WARPS, ACT, EXPAND>
            <<<(unsigned)T, HCN_WARPS * 32, 0, st>>>(y, ya, X, p, norm_w, D, eps, ex);
    else
        hc_collapse_norm_kernel<HC, HCN_WARPS_NARROW, ACT, EXPAND>
            <<<(unsigned)T, HCN_WARPS_NARROW * 32, 0, st>>>(y, ya, X, p, norm_w, D, eps, ex);
}

/* The collapse-norm kernel for hc streams (ya: y's act form, ACT; ex: the expand in front, or
 * NULL); false where hc has no instance (with the expand hc = 4 only, the release's hc_mult: an
 * instance is 40-90 KB of SASS in every binary of the suite). */
template <bool ACT>
static bool hc_collapse_norm_launch(cudaStream_t st, bf16_t *y, uint32_t *ya, const bf16_t *X, const float *p, int64_t T,
                                    int64_t hc, int64_t D, const bf16_t *norm_w, float eps,
                                    const hc_expand_in *ex = NULL) {
    const hc_expand_in none = {NULL, NULL, NULL, NULL, 0, 0};
    if (ex) {
        if (hc != 4) return false;
        hcn_launch<4, ACT, true>(st, y, ya, X, p, T, D, norm_w, eps, *ex);
    } else {
        switch (hc) {
        case 1: hcn_launch<1, ACT, false>(st, y, ya, X, p, T, D, norm_w, eps, none); break;
        case 2: hcn_launch<2, ACT, false>(st, y, ya, X, p, T, D, norm_w, eps, none); break;
        case 3: hcn_launch<3, ACT, false>(st, y, ya, X, p, T, D, norm_w, eps, none); break;
        case 4: hcn_launch<4, ACT, false>(st, y, ya, X, p, T, D, norm_w, eps, none); break;
        case 6: hcn_launch<6, ACT, false>(st, y, ya, X, p, T, D, norm_w, eps, none); break;
        case 8: hcn_launch<8, ACT, false>(st, y, ya, X, p, T, D, norm_w, eps, none); break;
        default: return false;
        }
    }
    KERNEL_CHECK();
    return true;
}

void cuda_op_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                         int64_t D, const bf16_t *norm_w, float eps) {
    if (T <= 0 || D <= 0 || hc <= 0) return;
    cudaStream_t st = cuda_be_stream(be);
    if (norm_w && D % 8 == 0 && D <= HCN_MAX_D && al16(y) && al16(X) && al16(norm_w) && T <= 0x7fffffff) {
        if (hc_collapse_norm_launch<false>(st, y, NULL, X, p, T, hc, D, norm_w, eps)) return;
    }
    if (D % 8 == 0 && al16(y) && al16(X))
        hc_collapse_kernel<8><<<ew_blocks(T * D / 8, EW_THREADS), EW_THREADS, 0, st>>>(y, X, p, T, hc, D);
    else
        hc_collapse_kernel<1><<<ew_blocks(T * D, EW_THREADS), EW_THREADS, 0, st>>>(y, X, p, T, hc, D);
    KERNEL_CHECK();
    if (norm_w) cuda_op_rmsnorm(be, y, y, norm_w, T, D, eps, NULL);
}

/* hc_collapse with norm_w, and ya = y's activation form (cuda_linear_mma_act_bytes(T, D)): the
 * collapse-norm kernel quantizes each row's bf16 outputs as it stores them (mma_quant8 on the
 * values it holds, the k-permuted store of mma_act_quant_kernel), so the linears after it skip
 * their act-quant launch (CUDA_MMA_PREQUANT); the same bits as hc_collapse, then the act quant.
 * Where the one pass cannot take the shape (D not a multiple of 256: a warp's 8-wide chunks would
 * end mid-warp, and its shuffles need every lane), the two. */
void cuda_op_hc_collapse_act(struct backend *be, bf16_t *y, void *ya, const bf16_t *X, const float *p, int64_t T,
                             int64_t hc, int64_t D, const bf16_t *norm_w, float eps) {
    if (T <= 0 || D <= 0 || hc <= 0) return;
    cudaStream_t st = cuda_be_stream(be);
    if (norm_w && D % 256 == 0 && D <= HCN_MAX_D && al16(y) && al16(ya) && al16(X) && al16(norm_w) && T <= 0x7fffffff) {
        if (hc_collapse_norm_launch<true>(st, y, (uint32_t *)ya, X, p, T, hc, D, norm_w, eps)) return;
    }
    cuda_op_hc_collapse(be, y, X, p, T, hc, D, norm_w, eps);
    if (D % 32) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "hc_collapse_act", "D is not a multiple of 32");
    cuda_linear_mma_act_quant((uint16_t *)ya, (const uint16_t *)y, T, D, (void *)st);
}

/* hc_expand, then the collapse (+ norm, + y's act form where ya is given) of its output: one pass
 * where the collapse-norm kernel takes the shape (hc = 4, the norm, its D and alignment, y's
 * column blocks a multiple of 8 wide): a CTA per row forms the row's hc expanded copies with
 * hc_expand_all_kernel's arithmetic, stores them, and collapses their bf16 values as
 * hc_collapse_norm_kernel would have read them back, so both outputs have the two ops' bits. It
 * saves the expand's launch and the collapse's read of Xo: at batch 1 the expand is a 2-CTA
 * kernel of ~2.3 µs on the critical path, twice a block (results/PERFORMANCE_HISTORY.md).
 * Other shapes run the two ops. */
void cuda_op_hc_expand_collapse(struct backend *be, bf16_t *Xo, const bf16_t *yin, const bf16_t *X, const float *post,
                                const float *comb, int64_t y_blocks, bf16_t *y, void *ya, const float *p,
                                const bf16_t *norm_w, float eps, int64_t T, int64_t hc, int64_t D) {
    if (y_blocks < 1 || D % y_blocks)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "hc_expand_collapse", "y_blocks does not divide D");
    if (T <= 0 || D <= 0 || hc <= 0) return;
    const int64_t Db = D / y_blocks;
    const bool act_ok = !ya || (D % 256 == 0 && al16(ya));
    if (norm_w && act_ok && D % 8 == 0 && Db % 8 == 0 && D <= HCN_MAX_D && al16(Xo) && al16(yin) && al16(X) &&
        al16(y) && al16(norm_w) && T <= 0x7fffffff) {
        const hc_expand_in ex = {(uint16_t *)Xo, (const uint16_t *)yin, post, comb, T, Db};
        cudaStream_t st = cuda_be_stream(be);
        if (ya ? hc_collapse_norm_launch<true>(st, y, (uint32_t *)ya, X, p, T, hc, D, norm_w, eps, &ex)
               : hc_collapse_norm_launch<false>(st, y, NULL, X, p, T, hc, D, norm_w, eps, &ex))
            return;
    }
    cuda_op_hc_expand(be, Xo, yin, X, post, comb, T, hc, D, y_blocks);
    if (ya)
        cuda_op_hc_collapse_act(be, y, ya, Xo, p, T, hc, D, norm_w, eps);
    else
        cuda_op_hc_collapse(be, y, Xo, p, T, hc, D, norm_w, eps);
}

/* Thread (t, k, VEC d's): output copy k reads column k of C over the input copies (L1 serves the
 * other k's reads of the same X). */
template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_expand_kernel(uint16_t *__restrict__ Xo, const uint16_t *__restrict__ y, const uint16_t *__restrict__ X,
                     const float *__restrict__ post, const float *__restrict__ comb, int64_t T, int64_t hc,
                     int64_t D, int64_t Db) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * hc * nv) return;
    const int64_t d = (g % nv) * VEC, tk = g / nv, k = tk % hc, t = tk / hc;
    const uint16_t *xr = X + t * hc * D + d; /* X [T, hc, D] bf16 */
    const float *c = comb + t * hc * hc;     /* comb [T, hc, hc]: c[j*hc + k] */
    float mix[VEC], xv[VEC];
    load_bf<VEC>(xr, xv);
    const float c0 = c[k];
#pragma unroll
    for (int i = 0; i < VEC; i++) mix[i] = __fmul_rn(c0, xv[i]);
    for (int64_t jj = 1; jj < hc; jj++) {
        const float cj = c[jj * hc + k];
        load_bf<VEC>(xr + jj * D, xv);
#pragma unroll
        for (int i = 0; i < VEC; i++) mix[i] = __fadd_rn(mix[i], __fmul_rn(cj, xv[i]));
    }
    const float pk = post[t * hc + k];           /* post [T, hc] */
    load_bf<VEC>(y + hc_y_at(t, d, T, Db), xv); /* y [D / Db, T, Db] bf16 */
#pragma unroll
    for (int i = 0; i < VEC; i++) mix[i] = __fadd_rn(__fmul_rn(pk, xv[i]), mix[i]);
    store_bf<VEC>(Xo + tk * D + d, mix); /* Xo [T, hc, D] bf16 */
}

/* The same outputs with hc a template parameter: thread (t, VEC d's) reads the hc input copies
 * once and forms all hc output copies (the kernel above reads each input 16 bytes hc times, through
 * L1), in the same order per output. */
template <int HC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_expand_all_kernel(uint16_t *__restrict__ Xo, const uint16_t *__restrict__ y, const uint16_t *__restrict__ X,
                         const float *__restrict__ post, const float *__restrict__ comb, int64_t T, int64_t D,
                         int64_t Db) {
    const int64_t nv = D / 8, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * nv) return;
    const int64_t d = (g % nv) * 8, t = g / nv;
    const uint16_t *xr = X + t * HC * D + d; /* X [T, hc, D] bf16 */
    const float *c = comb + t * HC * HC;     /* comb [T, hc, hc]: c[j*hc + k] */
    float xv[HC][8], yv[8];
#pragma unroll
    for (int j = 0; j < HC; j++) load_bf<8>(xr + j * D, xv[j]);
    load_bf<8>(y + hc_y_at(t, d, T, Db), yv); /* y [D / Db, T, Db] bf16 */
#pragma unroll
    for (int k = 0; k < HC; k++) {
        float mix[8];
        const float c0 = c[k], pk = post[t * HC + k]; /* post [T, hc] */
#pragma unroll
        for (int i = 0; i < 8; i++) mix[i] = __fmul_rn(c0, xv[0][i]);
#pragma unroll
        for (int jj = 1; jj < HC; jj++) {
            const float cj = c[jj * HC + k];
#pragma unroll
            for (int i = 0; i < 8; i++) mix[i] = __fadd_rn(mix[i], __fmul_rn(cj, xv[jj][i]));
        }
#pragma unroll
        for (int i = 0; i < 8; i++) mix[i] = __fadd_rn(__fmul_rn(pk, yv[i]), mix[i]);
        store_bf<8>(Xo + (t * HC + k) * D + d, mix); /* Xo [T, hc, D] bf16 */
    }
}

void cuda_op_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                       const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks) {
    if (y_blocks < 1 || D % y_blocks)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "hc_expand", "y_blocks does not divide D");
    if (T <= 0 || D <= 0 || hc <= 0) return;
    const int64_t Db = D / y_blocks;
    const bool vec = Db % 8 == 0 && al16(Xo) && al16(y) && al16(X);
    if (hc == 4 && vec)
        hc_expand_all_kernel<4><<<ew_blocks(T * D / 8, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            Xo, y, X, post, comb, T, D, Db);
    else if (vec)
        hc_expand_kernel<8><<<ew_blocks(T * hc * D / 8, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            Xo, y, X, post, comb, T, hc, D, Db);
    else
        hc_expand_kernel<1><<<ew_blocks(T * hc * D, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            Xo, y, X, post, comb, T, hc, D, Db);
    KERNEL_CHECK();
}

/* X[t, c, :] = e[t, :]; pre[t] = one-hot(0). Thread g copies VEC values to every copy and, for
 * g < T·hc, also writes pre[g]. */
template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_init_kernel(uint16_t *__restrict__ X, float *__restrict__ pre, const uint16_t *__restrict__ e, int64_t T,
                   int64_t hc, int64_t D) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g < T * hc) pre[g] = g % hc == 0 ? 1.0f : 0.0f; /* pre [T, hc] */
    if (g >= T * nv) return;
    const int64_t t = g / nv, d = (g % nv) * VEC;
    if (VEC == 8) {
        const uint4 v = *reinterpret_cast<const uint4 *>(e + t * D + d); /* e [T, D] bf16 */
        for (int64_t c = 0; c < hc; c++) *reinterpret_cast<uint4 *>(X + (t * hc + c) * D + d) = v;
    } else {
        const uint16_t v = e[t * D + d];
        for (int64_t c = 0; c < hc; c++) X[(t * hc + c) * D + d] = v;
    }
}

void cuda_op_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc,
                     int64_t D) {
    if (T <= 0 || hc <= 0) return;
    const bool vec = D % 8 == 0 && al16(X) && al16(e);
    const int64_t items = T * (vec ? D / 8 : D), n = items > T * hc ? items : T * hc;
    if (vec)
        hc_init_kernel<8><<<ew_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(X, pre, e, T, hc, D);
    else
        hc_init_kernel<1><<<ew_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(X, pre, e, T, hc, D);
    KERNEL_CHECK();
}
