/* Pieces shared by the two routed-expert paths of the SM80 backend — the exact FP4 GEMV kernels
 * (cuda_moe.cu) and the tensor-core ones (moe_mma_sm80.cu): the bf16 conversions and the clamped
 * SwiGLU with the CPU backend's arithmetic, the experts' pointer table of one launch, and the
 * routing plan (pairs bucketed by local expert and cut into tiles) with its tile lookup. Internal
 * to each translation unit that includes it (anonymous namespace). */
#ifndef DS_MOE_COMMON_CUH
#define DS_MOE_COMMON_CUH

#include "cuda_common.cuh"
#include "cuda_libm.cuh"

namespace {

#define MOE_CHUNK 64   /* experts per launch (pointer table passed by value) */
#define MOE_MAX_LOCAL 1024

/* Expert pointers of one launch: [expert - c0][matrix] (gate/up: 0 = w1, 1 = w3; down: 0 = w2). */
struct moe_wtab {
    const uint8_t *w[MOE_CHUNK][2];
    const uint8_t *s[MOE_CHUNK][2];
};


/* The clamped SwiGLU of one element (swiglu_rows in cpu_moe.c): g, u are the bf16 GEMM outputs
 * widened; silu(g) = g / (1 + expf(-g)); the routing weight, if any, multiplies last. */
__device__ __forceinline__ float mo_swiglu(float g, float u, float limit, bool has_wt, float wt) {
    if (limit > 0.0f) {
        u = u < -limit ? -limit : (u > limit ? limit : u);
        g = g > limit ? limit : g;
    }
    float h = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, ds_expf(-g))), u);
    return has_wt ? __fmul_rn(wt, h) : h;
}

/* The SwiGLU of one row's output pair (i0, i0 + 1) from w1's and w3's tensor-core partials as the
 * linears leave them unfolded (CUDA_MMA_OUT_PARTS; g at pg, u at pu, 8-byte aligned, chunks cs
 * floats apart): each folded in chunk order and rounded to bf16 as the linears' chunk fold would,
 * then mo_swiglu rounded to bf16 — the h that w2's act quant takes (the routed experts' gate/up
 * finish, the shared expert's SwiGLU). */
__device__ __forceinline__ float2 mo_swiglu_parts(const float *__restrict__ pg, const float *__restrict__ pu, int64_t cs,
                                                  int nch, float limit, bool has_wt, float wt) {
    float2 sg = *reinterpret_cast<const float2 *>(pg), su = *reinterpret_cast<const float2 *>(pu);
#pragma unroll 4
    for (int c = 1; c < nch; c++) {
        const float2 a = *reinterpret_cast<const float2 *>(pg + (int64_t)c * cs);
        const float2 b = *reinterpret_cast<const float2 *>(pu + (int64_t)c * cs);
        sg.x = __fadd_rn(sg.x, a.x), sg.y = __fadd_rn(sg.y, a.y);
        su.x = __fadd_rn(su.x, b.x), su.y = __fadd_rn(su.y, b.y);
    }
    const float g0 = ds_bf16f(mma_fold_bf16(sg.x)), u0 = ds_bf16f(mma_fold_bf16(su.x));
    const float g1 = ds_bf16f(mma_fold_bf16(sg.y)), u1 = ds_bf16f(mma_fold_bf16(su.y));
    return make_float2(ds_bf16f(ds_bf16_rne(mo_swiglu(g0, u0, limit, has_wt, wt))),
                       ds_bf16f(ds_bf16_rne(mo_swiglu(g1, u1, limit, has_wt, wt))));
}

/* Plan, int32: tstart [n_local + 1] (first tile of each expert; tstart[n_local] = tiles), off
 * [n_local + 1] (first list entry of each expert; off[n_local] = the local pairs), list [M] (flat
 * pair ids t*k + slot, grouped by expert). Tiles hold at most P pairs of one expert; with `tiles`
 * (else NULL) the kernel also writes each tile's entry {le | np << 16, first list entry}, so that a
 * CTA finds its tile with one load instead of a binary search (moe_tiles_max entries, moe_mma.h). One CTA
 * (of 256 or 1024 threads): count per expert, prefix sums by one warp, then scatter. (Thread 0's serial
 * prefix over the experts was a ~48-step chain of shared-memory round trips.) A thread's first
 * MOE_PLAN_PT pairs are read once, all loads issued together, and kept for the scatter: a loop of
 * a load and an atomic a pair is a chain of memory latencies (6 rounds at 1,536 pairs on 256
 * threads, batch 256), now one up to 1,024 pairs; pairs past them are read in the loops. The
 * kernels running it are bounded (1024, 1): with (1024) alone ptxas kept them to 32 registers and
 * the kept pairs spilled. The order of
 * pairs inside an expert's group comes from shared-memory atomics and is not deterministic; the
 * users compute each pair the same way whatever its place. */
#define MOE_PLAN_PT 4
__device__ __forceinline__ void moe_plan_body(int32_t *__restrict__ plan, int2 *__restrict__ tiles,
                                              const int32_t *__restrict__ idx, int64_t M, int64_t e0, int n_local, int P) {
    __shared__ int cnt[MOE_MAX_LOCAL], fill[MOE_MAX_LOCAL], offs[MOE_MAX_LOCAL], tst[MOE_MAX_LOCAL];
    int32_t *tstart = plan, *off = plan + n_local + 1, *list = plan + 2 * (n_local + 1);
    const int64_t bd = blockDim.x, rest = MOE_PLAN_PT * bd; /* pairs from rest on: the loops below */
    auto local = [&](int64_t p) { /* pair p's local expert, or -1 (none, or another rank's) */
        const int64_t e = p < M ? (int64_t)idx[p] - e0 : -1;
        return e >= 0 && e < n_local ? (int)e : -1;
    };
    int le[MOE_PLAN_PT]; /* local(threadIdx.x + i·bd) */
#pragma unroll
    for (int i = 0; i < MOE_PLAN_PT; i++) le[i] = local(threadIdx.x + i * bd);
    for (int i = threadIdx.x; i < n_local; i += blockDim.x) {
        cnt[i] = 0;
        fill[i] = 0;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MOE_PLAN_PT; i++)
        if (le[i] >= 0) atomicAdd(&cnt[le[i]], 1);
    for (int64_t p = threadIdx.x + rest; p < M; p += bd) {
        const int e = local(p);
        if (e >= 0) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x < 32) { /* prefix sums by warp 0: a lane's run of experts, a shuffle scan of the runs */
        const int lane = threadIdx.x, m = (n_local + 31) / 32, ea = lane * m < n_local ? lane * m : n_local,
                  eb = ea + m < n_local ? ea + m : n_local;
        int so = 0, st = 0;
        for (int e = ea; e < eb; e++) so += cnt[e], st += (cnt[e] + P - 1) / P;
        int io = so, it = st; /* inclusive over lanes 0..lane */
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, io, d), b = __shfl_up_sync(0xffffffffu, it, d);
            if (lane >= d) io += a, it += b;
        }
        int o = io - so, ts = it - st;
        for (int e = ea; e < eb; e++) {
            offs[e] = o;
            off[e] = o;
            tst[e] = ts;
            tstart[e] = ts;
            o += cnt[e];
            ts += (cnt[e] + P - 1) / P;
        }
        if (lane == 31) {
            off[n_local] = io;
            tstart[n_local] = it;
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MOE_PLAN_PT; i++)
        if (le[i] >= 0) list[offs[le[i]] + atomicAdd(&fill[le[i]], 1)] = (int32_t)(threadIdx.x + i * bd);
    for (int64_t p = threadIdx.x + rest; p < M; p += bd) {
        const int e = local(p);
        if (e >= 0) list[offs[e] + atomicAdd(&fill[e], 1)] = (int32_t)p;
    }
    if (tiles)
        for (int e = threadIdx.x; e < n_local; e += blockDim.x)
            for (int t = 0; t * P < cnt[e]; t++) {
                const int first = offs[e] + t * P, np = cnt[e] - t * P < P ? cnt[e] - t * P : P;
                tiles[tst[e] + t] = make_int2(e | (np << 16), first);
            }
}

__global__ void __launch_bounds__(1024, 1)
    moe_plan_kernel(int32_t *__restrict__ plan, int2 *__restrict__ tiles, const int32_t *__restrict__ idx, int64_t M,
                    int64_t e0, int n_local, int P) {
    moe_plan_body(plan, tiles, idx, M, e0, n_local, P);
}

/* Tile j of the plan (j < tstart[c0 + cn]), looked up among the experts [c0, c0 + cn): its
 * expert (*le, from a binary search of tstart) and its first list entry (*first); returns the
 * tile's pairs (1..P). */
__device__ __forceinline__ int moe_tile_span(const int32_t *plan, int n_local, int64_t j, int c0, int cn, int P,
                                             int *le, int64_t *first) {
    const int32_t *tstart = plan, *off = plan + n_local + 1;
    int lo = c0, hi = c0 + cn - 1; /* last le with tstart[le] <= j */
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tstart[mid] <= j) lo = mid; else hi = mid - 1;
    }
    const int64_t f = off[lo] + (j - tstart[lo]) * P, end = off[lo + 1];
    *le = lo;
    *first = f;
    return (int)(end - f < P ? end - f : P);
}

} /* namespace */

#endif /* DS_MOE_COMMON_CUH */
