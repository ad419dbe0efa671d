/* The SM80 tensor-core primitives shared by the tensor-core linears (linear_mma_sm80.cu) and the
 * tensor-core routed experts (moe_mma_sm80.cu): cp.async, ldmatrix, mma.sync m16n8k16 bf16, the
 * exact in-register FP8/FP4 weight decodes, the e8m0 scale decode, the k-chunk of the order
 * contract and the activation quantization with its k-permuted layout. One definition of each, so
 * that a routed expert's output has, bit for bit, the arithmetic of the same expert computed with
 * the tensor-core linears (the order contract at the top of linear_mma_sm80.cu). Every function
 * is internal to the translation unit that includes this (anonymous namespace). */
#ifndef DS_MMA_SM80_CUH
#define DS_MMA_SM80_CUH

#include "cuda_common.cuh"
#include "fp4_layout.h"

namespace {

constexpr int KCH = 32; /* k-blocks per k-chunk: the fixed split of every output's sum (order contract) */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16-byte async copy global -> shared; valid == false zero-fills the 16 bytes (src is not read). */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
/* 4 bytes (4-byte aligned at both ends), zero-filled when !valid: small tables such as scale rows. */
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* d = A(16x16, row) · B(16x8, col) + c, bf16 inputs, fp32 accumulation. */
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1, float c0, float c1, float c2, float c3) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
}

/* e8m0 byte -> fp32 exactly as ds_e8m0 (255 = NaN, 0 = 2^-127), without branches; 0x100 (not a
 * byte: a missing row) -> 0. */
__device__ __forceinline__ float e8m0f(uint32_t b) {
    uint32_t bits = b << 23;
    bits = b == 0u ? 0x00400000u : bits;
    bits = b == 255u ? 0x7fc00000u : bits;
    bits = b > 255u ? 0u : bits;
    return __uint_as_float(bits);
}

/* Four 8x8 b16 matrices from shared memory: lane L gives the address of row L % 8 of matrix L / 8
 * (16 contiguous bytes); register j receives row (lane / 4), elements 2 (lane % 4) + {0, 1} of
 * matrix j. */
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* bf16x2 a·b + c, round to nearest (subnormal inputs and results are kept). */
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* Two e4m3 bytes of u (chosen by sel: 0x1404 = bytes 0,1; 0x3424 = bytes 2,3) -> bf16x2 (lower
 * byte in the low half). prmt puts each byte in the high byte of its 16-bit lane; the 7 magnitude
 * bits move to bf16 bits 4..10 (exponent field = the e4m3 exponent, top 3 mantissa bits = its
 * mantissa) and the sign stays at bit 15, which is the value times 2^-120 for normals and
 * subnormals alike (an e4m3 subnormal m·2^-9 lands on the bf16 subnormal m·2^-129); the bf16
 * multiply by 2^120 (0x7B80) is then exact. -0 as the addend keeps the sign of zeros. */
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t u, uint32_t sel) {
    uint32_t p = __byte_perm(u, 0u, sel);
    uint32_t r = ((p >> 4) & 0x07f007f0u) | (p & 0x80008000u);
    return fma_bf16x2(r, 0x7B807B80u, 0x80008000u);
}

/* Eight e4m3 codes (a lane's 8 bytes of a k-block row) -> the four bf16x2 B-fragment registers:
 * out[0..1] feed the block's first mma (bytes 0..3), out[2..3] its second (bytes 4..7). */
__device__ __forceinline__ void e4m3x8_to_bf16x2(uint2 v, uint32_t (&out)[4]) {
    out[0] = e4m3x2_to_bf16x2(v.x, 0x1404u);
    out[1] = e4m3x2_to_bf16x2(v.x, 0x3424u);
    out[2] = e4m3x2_to_bf16x2(v.y, 0x1404u);
    out[3] = e4m3x2_to_bf16x2(v.y, 0x3424u);
}

/* Eight e2m1 codes (one 32-bit word of the device layout, fp4_layout.h) -> four bf16x2, code 2i of
 * the checkpoint's word in the low half of out[i] and 2i + 1 in the high half: the raw pairs
 * (x·2^-126 as bf16) times 2^126, exact (-0 as the addend keeps the sign of zeros).
 * History: the form before ba7fc88 placed each code's bits by prmt, shifts and masks on the
 * checkpoint's layout and multiplied (21 instructions a word); ba7fc88 looked the bf16 bytes up
 * in prmt tables (10 prmt + 3 lop3 + 1 shift), which left the routed-expert kernels' integer pipe
 * 74 % busy at batch 64 (Nsight Compute, H100) with math-pipe-throttle the top stall. On the
 * device layout a word takes 6 lop3 + 2 shifts on that pipe and 3 shifts + 4 bf16 multiplies on
 * the others: bench_step decode ms on the H200, three runs each alternated with the table form in
 * one device call: batch 1 4.24 4.16 4.23 -> 4.18 4.18 4.12, 8 5.95 5.87 5.91 -> 5.77 5.76 5.72,
 * 64 13.57 13.43 13.51 -> 12.78 12.74 12.71, 256 25.45 25.07 25.23 -> 24.15 24.04 24.02 (on an
 * H100 -1 to -2 %); the 2K prefill unchanged.
 * test_cuda_ops_misc runs every 32-bit word through it (packed) against the CPU's e2m1 values. */
__device__ __forceinline__ void e2m1x8_to_bf16x2(uint32_t p, uint32_t (&out)[4]) {
    uint32_t r[4];
    fp4_raw_pairs(p, r);
#pragma unroll
    for (int i = 0; i < 4; i++) out[i] = fma_bf16x2(r[i], 0x7E807E80u, 0x80008000u); /* 2^126 */
}

/* Two 8x8 b16 matrices (lanes 0-15 give the row addresses): r[0] from lanes 0-7's rows, r[1] from
 * lanes 8-15's. */
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

/* A fragments of one k-block's two mma (k 0..15 and 16..31) for the m16 tile whose lane address is
 * `at`: MR = 16 by ldmatrix.x4; MR = 8 by ldmatrix.x2, rows 8..15 being zero registers. */
template <int MR>
__device__ __forceinline__ void decode_a_frags(uint32_t at, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
    if (MR == 16) {
        ldmatrix_x4(a0, at);
        ldmatrix_x4(a1, at + 32u);
    } else {
        uint32_t r0[2], r1[2];
        ldmatrix_x2(r0, at);
        ldmatrix_x2(r1, at + 32u);
        a0[0] = r0[0], a0[1] = 0u, a0[2] = r0[1], a0[3] = 0u;
        a1[0] = r1[0], a1[1] = 0u, a1[2] = r1[1], a1[3] = 0u;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Activation quantization, 4 threads per 32-value group (aligned lanes 4j..4j+3 of a warp, all
 * four active), 8 values per thread: the reference's act_quant_kernel arithmetic (the group amax
 * is a max, exact in any order, so every thread derives the same scale; power-of-two scale by the
 * exponent bits as fast_round_scale; the quotient, clamp and RNE e4m3 of ds_fp8_q, the CPU's bits,
 * NaN included). H200, Nsight at batch 1: with __fdiv_rn and the SM80 software e4m3 conversion
 * (and an fminf/fmaxf clamp, which turned a NaN into -448) mma_act_quant_kernel took 3.80 µs a
 * call, with ds_fp8_q 2.85 µs. o[c] receives the
 * dequantized q·s_x (exact in bf16) of values 2c, 2c+1 as a bf16 pair. */
__device__ __forceinline__ void mma_quant8(const float (&v)[8], uint32_t (&o)[4]) {
    float amax = fabsf(v[0]);
#pragma unroll
    for (int j = 1; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float sc = ds_fp8_scale(amax), rsc = ds_pow2_inv(sc);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        uint32_t hh[2];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            __nv_bfloat16 b = __float2bfloat16_rn(__fmul_rn(ds_fp8_q(v[j + q], rsc), sc));
            hh[q] = (uint32_t)__bfloat16_as_ushort(b);
        }
        o[j / 2] = hh[0] | (hh[1] << 16);
    }
}

/* The k-permuted store of mma_quant8's output: thread tq (0..3) of the 32-group starting at word
 * g32 (16 words per group) — value pair c of the thread (k = 8 tq + 2c + {0,1}) goes to group
 * word 4c + tq, so that ldmatrix hands lane (g, t) the k values 8t..8t+7 (linear_mma_sm80.cu). */
__device__ __forceinline__ void mma_store_perm8(uint32_t *group, int tq, const uint32_t (&o)[4]) {
#pragma unroll
    for (int c = 0; c < 4; c++) group[4 * c + tq] = o[c];
}

/* The same quantization with 16 threads per 32-value group (lanes 16h..16h+15 of a warp, all
 * active), 2 values per thread: thread j of the group holds values 2j, 2j+1 and gets their
 * dequantized bf16 pair. Same bits as mma_quant8 (the amax is a max; the rest is per value); a
 * quarter of the per-thread chain, for epilogues whose values are each a long computation. */
__device__ __forceinline__ uint32_t mma_quant2(float v0, float v1) {
    float amax = fmaxf(fabsf(v0), fabsf(v1));
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sc = ds_fp8_scale(amax), rsc = ds_pow2_inv(sc);
    const uint32_t h0 = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(ds_fp8_q(v0, rsc), sc)));
    const uint32_t h1 = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(ds_fp8_q(v1, rsc), sc)));
    return h0 | (h1 << 16);
}

/* mma_quant2's k-permuted store: thread j's pair (k = 8 tq + 2c + {0,1}: tq = j / 4, c = j % 4)
 * goes to group word 4c + tq, as mma_store_perm8. */
__device__ __forceinline__ void mma_store_perm2(uint32_t *group, int j, uint32_t w) { group[4 * (j & 3) + (j >> 2)] = w; }

/* The 8 values x's 16-byte word src holds, quantized as x's word i of a row-major [rows, k] x would
 * be and stored there (ok false: the thread only joins its group's shuffles): the body below with
 * x read elsewhere (mma_act_quant_blocks_kernel: x's column blocks). */
__device__ __forceinline__ void mma_act_quant_at(const __nv_bfloat16 *__restrict__ x, __nv_bfloat16 *__restrict__ xq,
                                                 bool ok, int64_t src, int64_t i) {
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (ok) raw = __ldg(reinterpret_cast<const uint4 *>(x) + src);
    const uint32_t wd[4] = {raw.x, raw.y, raw.z, raw.w};
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = __uint_as_float(((wd[j / 2] >> (16 * (j % 2))) & 0xffffu) << 16);
    uint32_t o[4];
    mma_quant8(v, o);
    if (ok) mma_store_perm8(reinterpret_cast<uint32_t *>(xq) + (i >> 2) * 16, (int)(i & 3), o);
}

/* x [rows, k] bf16 -> xq, the same shape k-permuted, 8 values per thread (n8 = rows·k / 8): thread
 * i of the grid's flat index, every thread of a warp calling it (the group shuffles). */
__device__ __forceinline__ void mma_act_quant_body(const __nv_bfloat16 *__restrict__ x, __nv_bfloat16 *__restrict__ xq,
                                                   int64_t n8, int64_t i) {
    mma_act_quant_at(x, xq, i < n8, i, i); /* n8 is a multiple of 4, so a group is all in or all out */
}


} /* namespace */

#endif /* DS_MMA_SM80_CUH */
