/* FP8 / FP4 linear layers for decode-sized batches on SM80, bit-identical to the CPU reference.
 *
 * y[t, n] = bf16( Σ_b ((Σ_{i<32} qx[t, 32b+i] · qw[n, 32b+i]) · sx[t, b]) · sw[n, b] ), where the
 * inner sum runs over the 32 products of a k-block in k order and the outer sum over blocks in
 * block order: the reference's block-scaled GEMM (MODEL.md §3.0), in the CPU backend's order.
 *
 * Grid/CTA roles: act_quant_kernel — one warp per 32-value group of x (e4m3 value as float plus
 * its power-of-two scale). gemv kernels — one warp per output row n (grid-stride over rows); per
 * round of 32 k-blocks, lane j reduces block 32r+j sequentially (its 32 weight bytes, or 16 bytes
 * of packed FP4, are one coalesced warp-wide load), then lane 0 folds the 32 block partials in
 * block order through shuffles. Products of e4m3 and e4m3/e2m1 values are exact in fp32 and every
 * add/multiply is an explicit round-to-nearest intrinsic, so no reordering or FMA can change bits.
 * Weight-bandwidth bound at decode: each weight byte is read once per call for all T <= 16 rows.
 * FP4 weights are in the device layout of every FP4 kernel (fp4_layout.h); this exact path puts
 * each word back into the checkpoint's order as it loads it. cuda_fp4_pack, here with the FP4
 * entry point, makes that layout from the checkpoint's (weight_prepare, tests, benchmarks). */
#include "cuda_common.cuh"
#include "cuda_linear.h"
#include "fp4_layout.h"

#define WARPS_PER_CTA 8

/* One warp per 32-value group: lane i quantizes element i; the group's amax is a warp max (max is
 * exact in any order), so every lane derives the same power-of-two scale. */
__global__ void act_quant_kernel(const __nv_bfloat16 *__restrict__ x, float *__restrict__ q, float *__restrict__ s,
                                 int64_t groups) {
    const int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (g >= groups) return;
    float v = __bfloat162float(x[g * 32 + lane]);
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sc = ds_fp8_scale(amax); /* as the reference's fast_round_scale */
    if (lane == 0) s[g] = sc;
    q[g * 32 + lane] = ds_fp8_q(v, ds_pow2_inv(sc));
}

/* Per round of 32 k-blocks (1024 k values) the CTA stages the quantized activations of the round
 * in shared memory as fp16 (e4m3 values are exact in fp16) with a padded stride, coalesced from
 * global memory and shared by its 8 warps (8 output rows). Lane j then reduces block 32r+j for all
 * T rows (T independent chains the compiler interleaves) reading its block conflict-free from
 * shared memory, stores the scaled partials, and after a warp sync lane t folds row t's 32
 * partials in block order. T is a template parameter so every per-row value is a register. */
#define XS_STRIDE 34 /* halves per staged block: 32 + 2, so lanes' rows start on different banks */
template <int FP4, int T>
__global__ void __launch_bounds__(WARPS_PER_CTA * 32)
    gemv_kernel(__nv_bfloat16 *__restrict__ y, const float *__restrict__ qx, const float *__restrict__ sx,
                const uint8_t *__restrict__ w, const uint8_t *__restrict__ s, int64_t n, int64_t k, int64_t ld,
                int64_t s_ld) {
    __shared__ float sm_part[WARPS_PER_CTA][T][33]; /* +1: no bank conflicts on the row reads */
    __shared__ __half sm_x[T][32][XS_STRIDE];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int64_t nb = k / 32;
    const int64_t row = (int64_t)blockIdx.x * WARPS_PER_CTA + wid;
    const bool active = row < n;
    float acc = 0.0f; /* lane t < T owns row t's accumulator */
    const uint8_t *wr = w + (active ? row : 0) * ld;
    for (int64_t r0 = 0; r0 < nb; r0 += 32) {
        const int nr = (int)(nb - r0 < 32 ? nb - r0 : 32);
        __syncthreads(); /* the previous round's readers are done */
        for (int idx = threadIdx.x; idx < T * nr * 32; idx += WARPS_PER_CTA * 32) {
            int t = idx / (nr * 32), rem = idx % (nr * 32);
            sm_x[t][rem / 32][rem % 32] = __float2half_rn(qx[(int64_t)t * k + r0 * 32 + rem]);
        }
        __syncthreads();
        const int64_t b = r0 + lane;
        if (active && lane < nr) {
            /* the raw block stays packed in registers and each weight is decoded where it is
             * used: 32 decoded floats live at once would spill at T = 7, 8 */
            uint32_t words[8];
            float sw;
            if (FP4) {
                uint4 raw = __ldg(reinterpret_cast<const uint4 *>(wr + b * 16)); /* device layout */
                words[0] = fp4_unpack_word(raw.x), words[1] = fp4_unpack_word(raw.y);
                words[2] = fp4_unpack_word(raw.z), words[3] = fp4_unpack_word(raw.w);
                sw = ds_e8m0(__ldg(s + row * s_ld + b));
            } else {
                uint4 a0 = __ldg(reinterpret_cast<const uint4 *>(wr + b * 32));
                uint4 a1 = __ldg(reinterpret_cast<const uint4 *>(wr + b * 32 + 16));
                words[0] = a0.x, words[1] = a0.y, words[2] = a0.z, words[3] = a0.w;
                words[4] = a1.x, words[5] = a1.y, words[6] = a1.z, words[7] = a1.w;
                sw = ds_e8m0(__ldg(s + (row / 32) * s_ld + b));
            }
            float p[T];
#pragma unroll
            for (int i = 0; i < 32; i++) {
                /* FP4: byte i/2 of the 16, low nibble = even element; FP8: byte i */
                const float wv = FP4 ? ds_e2m1(((words[i / 8] >> (8 * ((i / 2) % 4))) >> (4 * (i % 2))) & 0xf)
                                     : ds_e4m3((words[i / 4] >> (8 * (i % 4))) & 0xff);
#pragma unroll
                for (int t = 0; t < T; t++) {
                    const float prod = __fmul_rn(__half2float(sm_x[t][lane][i]), wv);
                    p[t] = i == 0 ? prod : __fadd_rn(p[t], prod);
                }
            }
            /* the scaled block partial does not depend on the running sum: form it here, in
             * parallel, so the ordered fold below is nothing but adds */
#pragma unroll
            for (int t = 0; t < T; t++)
                sm_part[wid][t][lane] = __fmul_rn(__fmul_rn(p[t], __ldg(sx + (int64_t)t * nb + b)), sw);
        }
        __syncwarp();
        if (active && lane < T) {
#pragma unroll
            for (int j = 0; j < 32; j++)
                if (j < nr) acc = __fadd_rn(acc, sm_part[wid][lane][j]);
        }
    }
    if (active && lane < T) y[(int64_t)lane * n + row] = __float2bfloat16_rn(acc);
}

extern "C" int cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver / no GPU: clear the sticky error, report none */
        return 0;
    }
    return n;
}

extern "C" size_t cuda_linear_workspace_bytes(int64_t T, int64_t k) {
    return sizeof(float) * (size_t)(T * k + T * (k / 32));
}

static void linear(int fp4, uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s, int64_t n,
                   int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    if (T < 1 || T > CUDA_LINEAR_MAX_T || k % 32 || n < 1)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda linear", "unsupported shape (T <= 16, k % 32 == 0)");
    cudaStream_t st = (cudaStream_t)stream;
    float *qx = (float *)workspace, *sx = qx + T * k;
    int64_t groups = T * (k / 32);
    act_quant_kernel<<<(unsigned)((groups * 32 + 255) / 256), 256, 0, st>>>((const __nv_bfloat16 *)x, qx, sx, groups);
    KERNEL_CHECK();
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int64_t ctas = (n + WARPS_PER_CTA - 1) / WARPS_PER_CTA; /* one output row per warp */
    (void)sms;
    dim3 grid((unsigned)ctas), block(WARPS_PER_CTA * 32);
    /* rows are independent: more than 8 go through in launches of at most 8, which keeps the
     * staged activations and partials of one CTA within 48 KB of shared memory */
    for (int64_t t0 = 0; t0 < T; t0 += 8) {
        int64_t tt = T - t0 < 8 ? T - t0 : 8;
        __nv_bfloat16 *yb = (__nv_bfloat16 *)y + t0 * n;
        const float *qxb = qx + t0 * k, *sxb = sx + t0 * (k / 32);
#define GEMV_CASE(TT)                                                                                     \
    case TT:                                                                                             \
        if (fp4)                                                                                         \
            gemv_kernel<1, TT><<<grid, block, 0, st>>>(yb, qxb, sxb, w, s, n, k, ld, s_ld);              \
        else                                                                                             \
            gemv_kernel<0, TT><<<grid, block, 0, st>>>(yb, qxb, sxb, w, s, n, k, ld, s_ld);              \
        break;
        switch (tt) { GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4) GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8) }
        KERNEL_CHECK();
    }
#undef GEMV_CASE
    KERNEL_CHECK();
}

extern "C" void cuda_linear_fp8(uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s,
                                int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    linear(0, y, x, T, w, s, n, k, ld, s_ld, workspace, stream);
}

/* One thread per 4-byte word (fp4_pack_word). */
__global__ void fp4_pack_kernel(uint32_t *__restrict__ w, int64_t words) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (int64_t)gridDim.x * blockDim.x)
        w[i] = fp4_pack_word(w[i]);
}

extern "C" void cuda_fp4_pack(uint8_t *w, int64_t bytes, void *stream) {
    if (bytes <= 0) return;
    if (bytes % 4 || ((uintptr_t)w & 3))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_fp4_pack",
                 "FP4 codes must be whole 4-byte words, 4-byte aligned");
    const int64_t words = bytes / 4, blocks = (words + 255) / 256;
    fp4_pack_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, (cudaStream_t)stream>>>(
        reinterpret_cast<uint32_t *>(w), words);
    KERNEL_CHECK();
}

extern "C" void cuda_linear_fp4(uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s,
                                int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    linear(1, y, x, T, w, s, n, k, ld, s_ld, workspace, stream);
}
