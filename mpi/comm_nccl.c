/* The NCCL backend of the comm table on device buffers, with the watchdog (see comm_nccl.h).
 *
 * Each op enqueues NCCL calls on the comm's stream and then polls the stream (cudaStreamQuery)
 * and the communicator (ncclCommGetAsyncError) against the deadline (comm_get_deadline) rather
 * than synchronizing: a synchronize cannot be interrupted, and a dead or absent peer would leave
 * an NCCL kernel spinning forever. On expiry the rank prints the same line as the MPI backend's
 * watchdog, aborts the NCCL communicator (which stops its kernels) and then the whole job.
 *
 * allreduce_sum is an ncclAllGather into a device scratch followed by a small kernel that adds
 * the ranks' rows in rank order in fp32, rounds bf16 once, and wraps integers, the arithmetic of
 * comm_mpi.c's sum_rank_order. ncclAllReduce would be cheaper but its summation order follows
 * the ring or tree NCCL builds, so fp32 bits would change with the rank count and NCCL_ALGO; the
 * model's reductions happen to add exact zeros (one rank holds each row), but comm.h promises rank
 * order for any values and the MPI and NCCL backends must give the same bits. This file is C
 * built by mpicc (host files stay out of nvcc), so the kernel comes as PTX text, generated once
 * from the CUDA source quoted below and JIT-compiled by the driver at the first comm_nccl_new
 * (cudaLibraryLoadData: no extra library, no .cu file).
 *
 * Creation checks every rank's device UUID over an MPI comm first: ncclCommInitRank with two ranks
 * on one GPU fails ("invalid usage") on some ranks while the others stay blocked in the collective
 * init, and the caller needs the same answer on every rank to fall back together. The MPI steps
 * (gather, bcast of the unique id) run under the watchdog, so a rank that never arrives is caught
 * before the ranks enter ncclCommInitRank, which cannot be interrupted. */
#ifdef DS_HAVE_CUDA

#include "comm_nccl.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm_mpi.h"
#include "log.h"

/* ------------------------------------------------------------------------------------------------
 * Checks: src/log.h's CHECK_* pattern for NCCL and the CUDA runtime (ds_fatal prints rank, host,
 * file:line, function, the call and the library's message, then aborts the job). They live here,
 * not in log.h, so that host files without CUDA headers keep compiling. */

static const char *nccl_str(ncclResult_t rc) {
    static char buf[512];
    const char *last = ncclGetLastError(NULL); /* NCCL's own detail: which argument, which peer */
    snprintf(buf, sizeof buf, "%s%s%s", ncclGetErrorString(rc), last && last[0] ? ": " : "", last ? last : "");
    return buf;
}

static const char *cuda_str(cudaError_t rc) {
    static char buf[256];
    snprintf(buf, sizeof buf, "%s (%s)", cudaGetErrorString(rc), cudaGetErrorName(rc));
    return buf;
}

#define CHECK_NCCL(call)                                                                           \
    do {                                                                                           \
        ncclResult_t ds_nr_ = (call);                                                              \
        if (ds_nr_ != ncclSuccess) ds_fatal(__FILE__, __LINE__, __func__, "NCCL", #call, nccl_str(ds_nr_)); \
    } while (0)

#define CHECK_CUDART(call)                                                                         \
    do {                                                                                           \
        cudaError_t ds_cr_ = (call);                                                               \
        if (ds_cr_ != cudaSuccess) ds_fatal(__FILE__, __LINE__, __func__, "CUDA", #call, cuda_str(ds_cr_)); \
    } while (0)

/* ------------------------------------------------------------------------------------------------
 * The rank-order sum kernels. Source (nvcc -ptx -arch=compute_80 -O3; header comments and blank
 * lines stripped, .version lowered to 7.0, which is all these instructions need, so that any
 * driver able to run an SM80 build can JIT it; ptxas accepts it for sm_80 and sm_90):
 *
 *   #define GRID_LOOP(i, n) \
 *       for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (n); \
 *            i += (unsigned long long)gridDim.x * blockDim.x)
 *   extern "C" __global__ void ds_sum_f32(float *out, const float *in, unsigned long long n, int size) {
 *       GRID_LOOP(i, n) {
 *           float a = in[i];
 *   #pragma unroll 1
 *           for (int r = 1; r < size; r++) a = __fadd_rn(a, in[r * n + i]);
 *           out[i] = a;
 *       }
 *   }
 *   extern "C" __global__ void ds_sum_bf16(unsigned short *out, const unsigned short *in, unsigned long long n, int size) {
 *       GRID_LOOP(i, n) {
 *           float a = __uint_as_float((unsigned)in[i] << 16);
 *   #pragma unroll 1
 *           for (int r = 1; r < size; r++) a = __fadd_rn(a, __uint_as_float((unsigned)in[r * n + i] << 16));
 *           unsigned u = __float_as_uint(a); // bf16_from_f32 of src/formats.c, bit for bit
 *           out[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (unsigned short)0x7FC0u
 *                                                    : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
 *       }
 *   }
 *   #define INT_SUM(name, T)                                                                 \
 *       extern "C" __global__ void name(T *out, const T *in, unsigned long long n, int size) { \
 *           GRID_LOOP(i, n) {                                                                \
 *               T a = in[i];                                                                 \
 *               _Pragma("unroll 1") for (int r = 1; r < size; r++) a = (T)(a + in[r * n + i]); \
 *               out[i] = a;                                                                  \
 *           }                                                                                \
 *       }
 *   INT_SUM(ds_sum_u32, unsigned)
 *   INT_SUM(ds_sum_u64, unsigned long long)
 *   INT_SUM(ds_sum_u8, unsigned char)
 *
 * __fadd_rn keeps the adds unfused and round-to-nearest with subnormals kept, like the host's
 * fp32 adds under -ffp-contract=off; "unroll 1" only keeps the PTX short. */
static const char sum_ptx[] =
    ".version 7.0\n"
    ".target sm_80\n"
    ".address_size 64\n"
    ".visible .entry ds_sum_f32(\n"
    " .param .u64 ds_sum_f32_param_0,\n"
    " .param .u64 ds_sum_f32_param_1,\n"
    " .param .u64 ds_sum_f32_param_2,\n"
    " .param .u32 ds_sum_f32_param_3\n"
    ")\n"
    "{\n"
    " .reg .pred %p<6>;\n"
    " .reg .f32 %f<7>;\n"
    " .reg .b32 %r<10>;\n"
    " .reg .b64 %rd<31>;\n"
    " ld.param.u64 %rd16, [ds_sum_f32_param_0];\n"
    " ld.param.u64 %rd17, [ds_sum_f32_param_1];\n"
    " ld.param.u64 %rd15, [ds_sum_f32_param_2];\n"
    " ld.param.u32 %r3, [ds_sum_f32_param_3];\n"
    " cvta.to.global.u64 %rd1, %rd16;\n"
    " cvta.to.global.u64 %rd2, %rd17;\n"
    " mov.u32 %r4, %ctaid.x;\n"
    " mov.u32 %r5, %ntid.x;\n"
    " cvt.u64.u32 %rd3, %r5;\n"
    " mul.wide.u32 %rd18, %r4, %r5;\n"
    " mov.u32 %r6, %tid.x;\n"
    " cvt.u64.u32 %rd19, %r6;\n"
    " add.s64 %rd28, %rd18, %rd19;\n"
    " setp.ge.u64 %p1, %rd28, %rd15;\n"
    " @%p1 bra $L__BB0_7;\n"
    " setp.gt.s32 %p2, %r3, 1;\n"
    " mov.u32 %r7, %nctaid.x;\n"
    " cvt.u64.u32 %rd20, %r7;\n"
    " mul.lo.s64 %rd5, %rd20, %rd3;\n"
    " @%p2 bra $L__BB0_3;\n"
    " bra.uni $L__BB0_2;\n"
    "$L__BB0_3:\n"
    " shl.b64 %rd9, %rd15, 2;\n"
    " add.s64 %rd8, %rd2, %rd9;\n"
    "$L__BB0_4:\n"
    " shl.b64 %rd24, %rd28, 2;\n"
    " add.s64 %rd25, %rd2, %rd24;\n"
    " ld.global.f32 %f6, [%rd25];\n"
    " add.s64 %rd30, %rd8, %rd24;\n"
    " mov.u32 %r9, 1;\n"
    "$L__BB0_5:\n"
    " .pragma \"nounroll\";\n"
    " ld.global.f32 %f5, [%rd30];\n"
    " add.rn.f32 %f6, %f6, %f5;\n"
    " add.s64 %rd30, %rd30, %rd9;\n"
    " add.s32 %r9, %r9, 1;\n"
    " setp.lt.s32 %p4, %r9, %r3;\n"
    " @%p4 bra $L__BB0_5;\n"
    " add.s64 %rd27, %rd1, %rd24;\n"
    " st.global.f32 [%rd27], %f6;\n"
    " add.s64 %rd28, %rd28, %rd5;\n"
    " setp.lt.u64 %p5, %rd28, %rd15;\n"
    " @%p5 bra $L__BB0_4;\n"
    " bra.uni $L__BB0_7;\n"
    "$L__BB0_2:\n"
    " shl.b64 %rd21, %rd28, 2;\n"
    " add.s64 %rd22, %rd2, %rd21;\n"
    " ld.global.f32 %f4, [%rd22];\n"
    " add.s64 %rd23, %rd1, %rd21;\n"
    " st.global.f32 [%rd23], %f4;\n"
    " add.s64 %rd28, %rd28, %rd5;\n"
    " setp.lt.u64 %p3, %rd28, %rd15;\n"
    " @%p3 bra $L__BB0_2;\n"
    "$L__BB0_7:\n"
    " ret;\n"
    "}\n"
    ".visible .entry ds_sum_bf16(\n"
    " .param .u64 ds_sum_bf16_param_0,\n"
    " .param .u64 ds_sum_bf16_param_1,\n"
    " .param .u64 ds_sum_bf16_param_2,\n"
    " .param .u32 ds_sum_bf16_param_3\n"
    ")\n"
    "{\n"
    " .reg .pred %p<8>;\n"
    " .reg .b16 %rs<8>;\n"
    " .reg .f32 %f<6>;\n"
    " .reg .b32 %r<27>;\n"
    " .reg .b64 %rd<31>;\n"
    " ld.param.u64 %rd16, [ds_sum_bf16_param_0];\n"
    " ld.param.u64 %rd17, [ds_sum_bf16_param_1];\n"
    " ld.param.u64 %rd15, [ds_sum_bf16_param_2];\n"
    " ld.param.u32 %r4, [ds_sum_bf16_param_3];\n"
    " cvta.to.global.u64 %rd1, %rd16;\n"
    " cvta.to.global.u64 %rd2, %rd17;\n"
    " mov.u32 %r5, %ctaid.x;\n"
    " mov.u32 %r6, %ntid.x;\n"
    " cvt.u64.u32 %rd3, %r6;\n"
    " mul.wide.u32 %rd18, %r5, %r6;\n"
    " mov.u32 %r7, %tid.x;\n"
    " cvt.u64.u32 %rd19, %r7;\n"
    " add.s64 %rd28, %rd18, %rd19;\n"
    " setp.ge.u64 %p1, %rd28, %rd15;\n"
    " @%p1 bra $L__BB1_9;\n"
    " setp.gt.s32 %p2, %r4, 1;\n"
    " mov.u32 %r8, %nctaid.x;\n"
    " cvt.u64.u32 %rd20, %r8;\n"
    " mul.lo.s64 %rd5, %rd20, %rd3;\n"
    " @%p2 bra $L__BB1_3;\n"
    " bra.uni $L__BB1_2;\n"
    "$L__BB1_3:\n"
    " shl.b64 %rd9, %rd15, 1;\n"
    " add.s64 %rd8, %rd2, %rd9;\n"
    "$L__BB1_4:\n"
    " shl.b64 %rd24, %rd28, 1;\n"
    " add.s64 %rd25, %rd2, %rd24;\n"
    " ld.global.u16 %r16, [%rd25];\n"
    " shl.b32 %r17, %r16, 16;\n"
    " mov.b32 %f5, %r17;\n"
    " add.s64 %rd30, %rd8, %rd24;\n"
    " mov.u32 %r26, 1;\n"
    "$L__BB1_5:\n"
    " .pragma \"nounroll\";\n"
    " ld.global.u16 %r18, [%rd30];\n"
    " shl.b32 %r19, %r18, 16;\n"
    " mov.b32 %f4, %r19;\n"
    " add.rn.f32 %f5, %f5, %f4;\n"
    " add.s64 %rd30, %rd30, %rd9;\n"
    " add.s32 %r26, %r26, 1;\n"
    " setp.lt.s32 %p5, %r26, %r4;\n"
    " @%p5 bra $L__BB1_5;\n"
    " mov.b32 %r3, %f5;\n"
    " and.b32 %r20, %r3, 2147483647;\n"
    " setp.gt.u32 %p6, %r20, 2139095040;\n"
    " mov.u16 %rs7, 32704;\n"
    " @%p6 bra $L__BB1_8;\n"
    " shr.u32 %r21, %r3, 16;\n"
    " and.b32 %r22, %r21, 1;\n"
    " add.s32 %r23, %r3, %r22;\n"
    " add.s32 %r24, %r23, 32767;\n"
    " shr.u32 %r25, %r24, 16;\n"
    " cvt.u16.u32 %rs7, %r25;\n"
    "$L__BB1_8:\n"
    " add.s64 %rd27, %rd1, %rd24;\n"
    " st.global.u16 [%rd27], %rs7;\n"
    " add.s64 %rd28, %rd28, %rd5;\n"
    " setp.lt.u64 %p7, %rd28, %rd15;\n"
    " @%p7 bra $L__BB1_4;\n"
    " bra.uni $L__BB1_9;\n"
    "$L__BB1_2:\n"
    " shl.b64 %rd21, %rd28, 1;\n"
    " add.s64 %rd22, %rd2, %rd21;\n"
    " ld.global.u16 %rs3, [%rd22];\n"
    " cvt.u32.u16 %r9, %rs3;\n"
    " and.b32 %r10, %r9, 32767;\n"
    " setp.gt.u32 %p3, %r10, 32640;\n"
    " and.b32 %r11, %r9, 1;\n"
    " prmt.b32 %r12, %r9, %r11, 4180;\n"
    " add.s32 %r13, %r12, 32767;\n"
    " shr.u32 %r14, %r13, 16;\n"
    " cvt.u16.u32 %rs4, %r14;\n"
    " selp.b16 %rs5, 32704, %rs4, %p3;\n"
    " add.s64 %rd23, %rd1, %rd21;\n"
    " st.global.u16 [%rd23], %rs5;\n"
    " add.s64 %rd28, %rd28, %rd5;\n"
    " setp.lt.u64 %p4, %rd28, %rd15;\n"
    " @%p4 bra $L__BB1_2;\n"
    "$L__BB1_9:\n"
    " ret;\n"
    "}\n"
    ".visible .entry ds_sum_u32(\n"
    " .param .u64 ds_sum_u32_param_0,\n"
    " .param .u64 ds_sum_u32_param_1,\n"
    " .param .u64 ds_sum_u32_param_2,\n"
    " .param .u32 ds_sum_u32_param_3\n"
    ")\n"
    "{\n"
    " .reg .pred %p<6>;\n"
    " .reg .b32 %r<16>;\n"
    " .reg .b64 %rd<31>;\n"
    " ld.param.u64 %rd16, [ds_sum_u32_param_0];\n"
    " ld.param.u64 %rd17, [ds_sum_u32_param_1];\n"
    " ld.param.u64 %rd15, [ds_sum_u32_param_2];\n"
    " ld.param.u32 %r6, [ds_sum_u32_param_3];\n"
    " cvta.to.global.u64 %rd1, %rd16;\n"
    " cvta.to.global.u64 %rd2, %rd17;\n"
    " mov.u32 %r7, %ctaid.x;\n"
    " mov.u32 %r8, %ntid.x;\n"
    " cvt.u64.u32 %rd3, %r8;\n"
    " mul.wide.u32 %rd18, %r7, %r8;\n"
    " mov.u32 %r9, %tid.x;\n"
    " cvt.u64.u32 %rd19, %r9;\n"
    " add.s64 %rd28, %rd18, %rd19;\n"
    " setp.ge.u64 %p1, %rd28, %rd15;\n"
    " @%p1 bra $L__BB2_7;\n"
    " setp.gt.s32 %p2, %r6, 1;\n"
    " mov.u32 %r10, %nctaid.x;\n"
    " cvt.u64.u32 %rd20, %r10;\n"
    " mul.lo.s64 %rd5, %rd20, %rd3;\n"
    " @%p2 bra $L__BB2_3;\n"
    " bra.uni $L__BB2_2;\n"
    "$L__BB2_3:\n"
    " shl.b64 %rd9, %rd15, 2;\n"
    " add.s64 %rd8, %rd2, %rd9;\n"
    "$L__BB2_4:\n"
    " shl.b64 %rd24, %rd28, 2;\n"
    " add.s64 %rd25, %rd2, %rd24;\n"
    " ld.global.u32 %r15, [%rd25];\n"
    " add.s64 %rd30, %rd8, %rd24;\n"
    " mov.u32 %r14, 1;\n"
    "$L__BB2_5:\n"
    " .pragma \"nounroll\";\n"
    " ld.global.u32 %r13, [%rd30];\n"
    " add.s32 %r15, %r13, %r15;\n"
    " add.s64 %rd30, %rd30, %rd9;\n"
    " add.s32 %r14, %r14, 1;\n"
    " setp.lt.s32 %p4, %r14, %r6;\n"
    " @%p4 bra $L__BB2_5;\n"
    " add.s64 %rd27, %rd1, %rd24;\n"
    " st.global.u32 [%rd27], %r15;\n"
    " add.s64 %rd28, %rd28, %rd5;\n"
    " setp.lt.u64 %p5, %rd28, %rd15;\n"
    " @%p5 bra $L__BB2_4;\n"
    " bra.uni $L__BB2_7;\n"
    "$L__BB2_2:\n"
    " shl.b64 %rd21, %rd28, 2;\n"
    " add.s64 %rd22, %rd2, %rd21;\n"
    " ld.global.u32 %r11, [%rd22];\n"
    " add.s64 %rd23, %rd1, %rd21;\n"
    " st.global.u32 [%rd23], %r11;\n"
    " add.s64 %rd28, %rd28, %rd5;\n"
    " setp.lt.u64 %p3, %rd28, %rd15;\n"
    " @%p3 bra $L__BB2_2;\n"
    "$L__BB2_7:\n"
    " ret;\n"
    "}\n"
    ".visible .entry ds_sum_u64(\n"
    " .param .u64 ds_sum_u64_param_0,\n"
    " .param .u64 ds_sum_u64_param_1,\n"
    " .param .u64 ds_sum_u64_param_2,\n"
    " .param .u32 ds_sum_u64_param_3\n"
    ")\n"
    "{\n"
    " .reg .pred %p<6>;\n"
    " .reg .b32 %r<10>;\n"
    " .reg .b64 %rd<37>;\n"
    " ld.param.u64 %rd19, [ds_sum_u64_param_0];\n"
    " ld.param.u64 %rd20, [ds_sum_u64_param_1];\n"
    " ld.param.u64 %rd18, [ds_sum_u64_param_2];\n"
    " ld.param.u32 %r3, [ds_sum_u64_param_3];\n"
    " cvta.to.global.u64 %rd1, %rd19;\n"
    " cvta.to.global.u64 %rd2, %rd20;\n"
    " mov.u32 %r4, %ctaid.x;\n"
    " mov.u32 %r5, %ntid.x;\n"
    " cvt.u64.u32 %rd3, %r5;\n"
    " mul.wide.u32 %rd21, %r4, %r5;\n"
    " mov.u32 %r6, %tid.x;\n"
    " cvt.u64.u32 %rd22, %r6;\n"
    " add.s64 %rd33, %rd21, %rd22;\n"
    " setp.ge.u64 %p1, %rd33, %rd18;\n"
    " @%p1 bra $L__BB3_7;\n"
    " setp.gt.s32 %p2, %r3, 1;\n"
    " mov.u32 %r7, %nctaid.x;\n"
    " cvt.u64.u32 %rd23, %r7;\n"
    " mul.lo.s64 %rd5, %rd23, %rd3;\n"
    " @%p2 bra $L__BB3_3;\n"
    " bra.uni $L__BB3_2;\n"
    "$L__BB3_3:\n"
    " shl.b64 %rd9, %rd18, 3;\n"
    " add.s64 %rd8, %rd2, %rd9;\n"
    "$L__BB3_4:\n"
    " shl.b64 %rd28, %rd33, 3;\n"
    " add.s64 %rd29, %rd2, %rd28;\n"
    " ld.global.u64 %rd36, [%rd29];\n"
    " add.s64 %rd35, %rd8, %rd28;\n"
    " mov.u32 %r9, 1;\n"
    "$L__BB3_5:\n"
    " .pragma \"nounroll\";\n"
    " ld.global.u64 %rd30, [%rd35];\n"
    " add.s64 %rd36, %rd30, %rd36;\n"
    " add.s64 %rd35, %rd35, %rd9;\n"
    " add.s32 %r9, %r9, 1;\n"
    " setp.lt.s32 %p4, %r9, %r3;\n"
    " @%p4 bra $L__BB3_5;\n"
    " add.s64 %rd32, %rd1, %rd28;\n"
    " st.global.u64 [%rd32], %rd36;\n"
    " add.s64 %rd33, %rd33, %rd5;\n"
    " setp.lt.u64 %p5, %rd33, %rd18;\n"
    " @%p5 bra $L__BB3_4;\n"
    " bra.uni $L__BB3_7;\n"
    "$L__BB3_2:\n"
    " shl.b64 %rd24, %rd33, 3;\n"
    " add.s64 %rd25, %rd2, %rd24;\n"
    " ld.global.u64 %rd26, [%rd25];\n"
    " add.s64 %rd27, %rd1, %rd24;\n"
    " st.global.u64 [%rd27], %rd26;\n"
    " add.s64 %rd33, %rd33, %rd5;\n"
    " setp.lt.u64 %p3, %rd33, %rd18;\n"
    " @%p3 bra $L__BB3_2;\n"
    "$L__BB3_7:\n"
    " ret;\n"
    "}\n"
    ".visible .entry ds_sum_u8(\n"
    " .param .u64 ds_sum_u8_param_0,\n"
    " .param .u64 ds_sum_u8_param_1,\n"
    " .param .u64 ds_sum_u8_param_2,\n"
    " .param .u32 ds_sum_u8_param_3\n"
    ")\n"
    "{\n"
    " .reg .pred %p<6>;\n"
    " .reg .b16 %rs<7>;\n"
    " .reg .b32 %r<10>;\n"
    " .reg .b64 %rd<25>;\n"
    " ld.param.u64 %rd14, [ds_sum_u8_param_0];\n"
    " ld.param.u64 %rd15, [ds_sum_u8_param_1];\n"
    " ld.param.u64 %rd13, [ds_sum_u8_param_2];\n"
    " ld.param.u32 %r3, [ds_sum_u8_param_3];\n"
    " cvta.to.global.u64 %rd1, %rd14;\n"
    " cvta.to.global.u64 %rd2, %rd15;\n"
    " mov.u32 %r4, %ctaid.x;\n"
    " mov.u32 %r5, %ntid.x;\n"
    " cvt.u64.u32 %rd3, %r5;\n"
    " mul.wide.u32 %rd16, %r4, %r5;\n"
    " mov.u32 %r6, %tid.x;\n"
    " cvt.u64.u32 %rd17, %r6;\n"
    " add.s64 %rd22, %rd16, %rd17;\n"
    " setp.ge.u64 %p1, %rd22, %rd13;\n"
    " @%p1 bra $L__BB4_6;\n"
    " setp.gt.s32 %p2, %r3, 1;\n"
    " mov.u32 %r7, %nctaid.x;\n"
    " cvt.u64.u32 %rd18, %r7;\n"
    " mul.lo.s64 %rd5, %rd18, %rd3;\n"
    " @%p2 bra $L__BB4_3;\n"
    " bra.uni $L__BB4_2;\n"
    "$L__BB4_3:\n"
    " add.s64 %rd24, %rd2, %rd22;\n"
    " ld.global.u8 %rs6, [%rd24];\n"
    " mov.u32 %r9, 1;\n"
    "$L__BB4_4:\n"
    " .pragma \"nounroll\";\n"
    " add.s64 %rd24, %rd24, %rd13;\n"
    " ld.global.u8 %rs5, [%rd24];\n"
    " add.s16 %rs6, %rs5, %rs6;\n"
    " add.s32 %r9, %r9, 1;\n"
    " setp.lt.s32 %p4, %r9, %r3;\n"
    " @%p4 bra $L__BB4_4;\n"
    " add.s64 %rd21, %rd1, %rd22;\n"
    " st.global.u8 [%rd21], %rs6;\n"
    " add.s64 %rd22, %rd22, %rd5;\n"
    " setp.lt.u64 %p5, %rd22, %rd13;\n"
    " @%p5 bra $L__BB4_3;\n"
    " bra.uni $L__BB4_6;\n"
    "$L__BB4_2:\n"
    " add.s64 %rd19, %rd2, %rd22;\n"
    " ld.global.u8 %rs4, [%rd19];\n"
    " add.s64 %rd20, %rd1, %rd22;\n"
    " st.global.u8 [%rd20], %rs4;\n"
    " add.s64 %rd22, %rd22, %rd5;\n"
    " setp.lt.u64 %p3, %rd22, %rd13;\n"
    " @%p3 bra $L__BB4_2;\n"
    "$L__BB4_6:\n"
    " ret;\n"
    "}\n";

/* Indexed by enum comm_dtype; I32 sums as u32 (wrapping, exact when the true sum fits). */
static const char *const sum_kernel_names[] = {"ds_sum_f32", "ds_sum_bf16", "ds_sum_u32", "ds_sum_u64", "ds_sum_u8"};
static const size_t dtype_bytes[] = {4, 2, 4, 8, 1};
static const char *const dtype_names[] = {"f32", "bf16", "i32", "i64", "u8"};

static cudaLibrary_t g_sum_lib;
static cudaKernel_t g_sum_kernel[5];

/* The library is loaded once per process (it is context-independent), but under lazy loading
 * (CUDA's default) a kernel is JIT-compiled and loaded into a context only at its first launch,
 * and that load waits for work in flight: with the stream stuck, the first allreduce blocked in
 * cudaLaunchKernel, outside the watchdog's poll, until the stream moved again (seen on the H200).
 * Reading each kernel's attributes loads it into the current device's context now, at creation. */
static void load_sum_kernels(void) {
    if (!g_sum_lib) {
        CHECK_CUDART(cudaLibraryLoadData(&g_sum_lib, sum_ptx, NULL, NULL, 0, NULL, NULL, 0));
        for (int i = 0; i < 5; i++) CHECK_CUDART(cudaLibraryGetKernel(&g_sum_kernel[i], g_sum_lib, sum_kernel_names[i]));
    }
    for (int i = 0; i < 5; i++) {
        struct cudaFuncAttributes fa;
        CHECK_CUDART(cudaFuncGetAttributes(&fa, (const void *)g_sum_kernel[i]));
    }
}

/* out[i] = in[0][i] + in[1][i] + ... (in is [size][n]) on `stream`. */
static void launch_sum(void *out, void *in, unsigned long long n, int size, enum comm_dtype dt, cudaStream_t stream) {
    /* memory-bound: enough blocks to fill the device, the grid loop covers the rest */
    unsigned blocks = (unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    void *args[] = {&out, &in, &n, &size};
    dim3 grid = {blocks, 1, 1}, block = {256, 1, 1};
    /* a cudaKernel_t passes as the function (cudaLaunchKernel accepts one since CUDA 12) */
    CHECK_CUDART(cudaLaunchKernel((const void *)g_sum_kernel[dt], grid, block, args, 0, stream));
}

void comm_nccl_sum_rank_order(void *out, const void *in, size_t count, int nranks, enum comm_dtype dt, void *cuda_stream) {
    if ((unsigned)dt >= 5) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "comm_nccl_sum_rank_order", "unknown comm_dtype");
    if (count == 0) return;
    load_sum_kernels();
    launch_sum(out, (void *)in, count, nranks, dt, (cudaStream_t)cuda_stream);
    CHECK_CUDART(cudaStreamSynchronize((cudaStream_t)cuda_stream));
}

/* ------------------------------------------------------------------------------------------------
 * State */

#define DEFAULT_MAX_TMP ((size_t)64 << 20)
static size_t g_max_tmp = DEFAULT_MAX_TMP;

void comm_nccl_set_tmp_limit(size_t max_tmp_bytes) { g_max_tmp = max_tmp_bytes ? max_tmp_bytes : DEFAULT_MAX_TMP; }

struct comm_req {
    char desc[96];
    const char *what;
    const void *buf;
    size_t bytes;
    int dst;
    int enqueued;          /* the ncclSend is on the stream (else it waits in the pending list) */
    cudaEvent_t done;      /* recorded after the ncclSend */
    struct comm_req *next; /* pending list, in issue order */
};

struct nccl_priv {
    ncclComm_t nc;
    cudaStream_t stream;
    int device;
    char name[64];
    struct comm *mpi; /* an MPI comm over the same ranks: creation and barrier */
    /* allreduce_sum's gather scratch, device memory from the stream-ordered pool, kept between
     * calls and grown as needed */
    void *tmp;
    size_t tmp_cap;
    struct comm_req *pending, *pending_tail; /* isends not yet enqueued */
    cudaEvent_t t0, t1; /* around each collective on the stream: its span, for comm.busy_s */
};

static const struct comm_ops nccl_ops;

static struct nccl_priv *priv_of(const struct comm *c) { return (struct nccl_priv *)c->priv; }

/* ------------------------------------------------------------------------------------------------
 * Watchdog */

static inline double now_s(void) { return comm_now_s(); }

static atomic_int g_nccl_aborted;

static void *abort_comm(void *nc) {
    ncclCommAbort((ncclComm_t)nc); /* no CHECK: we are aborting anyway */
    atomic_store(&g_nccl_aborted, 1);
    return NULL;
}

/* ncclCommAbort stops this rank's NCCL kernels so the device is left clean, but it can wait for
 * work that is not NCCL's (a stream stalled by a host function kept it waiting for as long as the
 * stall, in the test). So it runs on a thread of its own for at most ABORT_WAIT_S, and the job is
 * aborted either way: ending the job is the watchdog's promise. */
static void __attribute__((noreturn)) watchdog_fire(struct nccl_priv *p, const struct comm_op *o, double waited) {
    enum { ABORT_WAIT_S = 5 };
    comm_watchdog_print(o->comm_name, o->desc, o->what, waited);
    pthread_t th;
    if (pthread_create(&th, NULL, abort_comm, p->nc) == 0) {
        for (int i = 0; i < ABORT_WAIT_S * 100 && !atomic_load(&g_nccl_aborted); i++) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    MPI_Abort(MPI_COMM_WORLD, 3);
    _exit(3); /* MPI_Abort does not return; this only keeps the contract if it ever does */
}

/* A failure reported while polling: NCCL's asynchronous error (a peer's connection lost) or a
 * CUDA error on the stream (which may come from an earlier kernel of the caller's). */
static void __attribute__((noreturn)) op_failed(const struct comm_op *o, const char *lib, const char *call, const char *err) {
    char msg[768];
    snprintf(msg, sizeof msg, "%s '%s' on %s: %s", o->desc, o->what, o->comm_name, err);
    ds_fatal(__FILE__, __LINE__, "nccl_op_wait", lib, call, msg);
}

/* Wait for `ev` (NULL: everything enqueued on the comm's stream so far) under the watchdog. A
 * short spin first: most ops finish within microseconds and sleeping at once would add latency
 * to every one; one rank per GPU means the spinning rank takes no core a peer needs. */
static void op_wait(struct nccl_priv *p, const struct comm_op *o, cudaEvent_t ev) {
    const double spin_s = 2e-3;
    long sleep_ns = 20000;
    double deadline = comm_get_deadline();
    for (;;) {
        cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(p->stream);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) op_failed(o, "CUDA", ev ? "cudaEventQuery" : "cudaStreamQuery", cuda_str(e));
        ncclResult_t ae = ncclSuccess;
        CHECK_NCCL(ncclCommGetAsyncError(p->nc, &ae));
        if (ae != ncclSuccess && ae != ncclInProgress) op_failed(o, "NCCL", "ncclCommGetAsyncError", nccl_str(ae));
        double waited = now_s() - o->start;
        if (deadline > 0 && waited > deadline) watchdog_fire(p, o, waited);
        if (waited < spin_s) continue;
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 200000) sleep_ns *= 2;
    }
}

/* NCCL reads whatever address it is given: a host pointer would fault on the device (or, with
 * HMM, silently crawl over the bus). Say which op and which argument instead. */
static void require_device(const struct nccl_priv *p, const struct comm_op *o, const void *ptr, size_t bytes, const char *arg) {
    if (!bytes) return;
    struct cudaPointerAttributes a;
    CHECK_CUDART(cudaPointerGetAttributes(&a, ptr));
    int ok = (a.type == cudaMemoryTypeDevice && a.device == p->device) || a.type == cudaMemoryTypeManaged;
    if (ok) return;
    char msg[512];
    if (a.type == cudaMemoryTypeDevice)
        snprintf(msg, sizeof msg, "%s '%s' on %s: %s is memory of device %d, the comm is on device %d", o->desc,
                 o->what, o->comm_name, arg, a.device, p->device);
    else
        snprintf(msg, sizeof msg, "%s '%s' on %s: %s is a host pointer; an NCCL comm takes device buffers (use an MPI comm for host data)",
                 o->desc, o->what, o->comm_name, arg);
    ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "comm_nccl", msg);
}

/* ------------------------------------------------------------------------------------------------
 * Deferred isends */

/* Enqueue every pending isend, in issue order (NCCL matches a pair's messages by order), between
 * the caller's ncclGroupStart and ncclGroupEnd; then enqueue_pending_done records each request's
 * event after the group and empties the list. */
static void enqueue_pending(struct nccl_priv *p) {
    for (struct comm_req *r = p->pending; r; r = r->next)
        CHECK_NCCL(ncclSend(r->buf, r->bytes, ncclUint8, r->dst, p->nc, p->stream));
}

static void enqueue_pending_done(struct nccl_priv *p) {
    for (struct comm_req *r = p->pending; r; r = r->next) {
        CHECK_CUDART(cudaEventRecord(r->done, p->stream));
        r->enqueued = 1;
    }
    p->pending = p->pending_tail = NULL;
}

/* Before any op other than recv: pending sends go out first, as they were issued. */
static void flush_pending(struct nccl_priv *p) {
    if (!p->pending) return;
    CHECK_NCCL(ncclGroupStart());
    enqueue_pending(p);
    CHECK_NCCL(ncclGroupEnd());
    enqueue_pending_done(p);
}

/* ------------------------------------------------------------------------------------------------
 * Operations */

/* A collective's span on the stream: t0 before its first NCCL call, t1 after its last (and its
 * sum kernel); read once the op has completed, so the read never waits. */
static void span_begin(struct nccl_priv *p) { CHECK_CUDART(cudaEventRecord(p->t0, p->stream)); }
static void span_end(struct nccl_priv *p) { CHECK_CUDART(cudaEventRecord(p->t1, p->stream)); }
static void span_add(struct comm *c) {
    struct nccl_priv *p = priv_of(c);
    float ms = 0;
    CHECK_CUDART(cudaEventElapsedTime(&ms, p->t0, p->t1));
    c->busy_s += 1e-3 * (double)ms;
}

static void nccl_allgather(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "allgather (%zu bytes per rank)", bytes);
    if (bytes == 0) return;
    require_device(p, &o, send, bytes, "send");
    require_device(p, &o, recv, bytes * (size_t)c->size, "recv");
    flush_pending(p);
    /* send == recv + rank * bytes is NCCL's in-place gather: no special case needed */
    span_begin(p);
    CHECK_NCCL(ncclAllGather(send, recv, bytes, ncclUint8, p->nc, p->stream));
    span_end(p);
    op_wait(p, &o, NULL);
    span_add(c);
}

/* One group of a send and a receive per peer (itself included), NCCL's all-to-all pattern: the
 * pairs progress together, so no order of peers can deadlock. */
static void nccl_alltoall(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "alltoall (%zu bytes per rank pair)", bytes);
    if (bytes == 0) return;
    require_device(p, &o, send, bytes * (size_t)c->size, "send");
    require_device(p, &o, recv, bytes * (size_t)c->size, "recv");
    flush_pending(p);
    span_begin(p);
    CHECK_NCCL(ncclGroupStart());
    for (int r = 0; r < c->size; r++) {
        CHECK_NCCL(ncclSend((const char *)send + (size_t)r * bytes, bytes, ncclUint8, r, p->nc, p->stream));
        CHECK_NCCL(ncclRecv((char *)recv + (size_t)r * bytes, bytes, ncclUint8, r, p->nc, p->stream));
    }
    CHECK_NCCL(ncclGroupEnd());
    span_end(p);
    op_wait(p, &o, NULL);
    span_add(c);
}

static void nccl_allreduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    if ((unsigned)dt >= 5) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "allreduce_sum", "unknown comm_dtype");
    comm_op_begin(&o, priv_of(c)->name, what, "allreduce_sum (%zu x %s)", count, dtype_names[dt]);
    if (count == 0) return;
    size_t esz = dtype_bytes[dt];
    require_device(p, &o, buf, count * esz, "buf");
    flush_pending(p);
    /* Elements per round so that the gathered copy (size x round) stays within g_max_tmp. */
    size_t per_round = g_max_tmp / (esz * (size_t)c->size);
    if (per_round == 0) per_round = 1;
    if (per_round > count) per_round = count;
    size_t need = per_round * esz * (size_t)c->size;
    if (p->tmp_cap < need) {
        /* stream-ordered: the old scratch is released after the work already queued on it */
        if (p->tmp) CHECK_CUDART(cudaFreeAsync(p->tmp, p->stream));
        p->tmp = NULL;
        CHECK_CUDART(cudaMallocAsync(&p->tmp, need, p->stream));
        p->tmp_cap = need;
    }
    char *b = buf;
    span_begin(p);
    for (size_t off = 0; off < count; off += per_round) {
        size_t n = count - off < per_round ? count - off : per_round;
        CHECK_NCCL(ncclAllGather(b + off * esz, p->tmp, n * esz, ncclUint8, p->nc, p->stream));
        launch_sum(b + off * esz, p->tmp, n, c->size, dt, p->stream);
    }
    span_end(p);
    op_wait(p, &o, NULL);
    span_add(c);
}

static void nccl_bcast(struct comm *c, void *buf, size_t bytes, int root, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "bcast (%zu bytes from %d)", bytes, root);
    if (bytes == 0) return;
    require_device(p, &o, buf, bytes, "buf");
    flush_pending(p);
    span_begin(p);
    CHECK_NCCL(ncclBroadcast(buf, buf, bytes, ncclUint8, root, p->nc, p->stream));
    span_end(p);
    op_wait(p, &o, NULL);
    span_add(c);
}

static void nccl_send(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "send (%zu bytes to %d, tag %d)", bytes, dst, tag);
    if (bytes == 0) return; /* NCCL would send nothing too; the MPI backend's zero-byte send matches a zero-byte recv */
    require_device(p, &o, buf, bytes, "buf");
    flush_pending(p);
    CHECK_NCCL(ncclSend(buf, bytes, ncclUint8, dst, p->nc, p->stream));
    op_wait(p, &o, NULL);
}

static void nccl_recv(struct comm *c, void *buf, size_t bytes, int src, int tag, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "recv (%zu bytes from %d, tag %d)", bytes, src, tag);
    if (bytes == 0) return;
    require_device(p, &o, buf, bytes, "buf");
    /* One group with the pending isends: NCCL progresses them together, which is what lets two
     * ranks isend to each other and then recv (and a rank isend to itself and recv). */
    CHECK_NCCL(ncclGroupStart());
    enqueue_pending(p);
    CHECK_NCCL(ncclRecv(buf, bytes, ncclUint8, src, p->nc, p->stream));
    CHECK_NCCL(ncclGroupEnd());
    enqueue_pending_done(p);
    op_wait(p, &o, NULL);
}

static struct comm_req *nccl_isend(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what) {
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "send (%zu bytes to %d, tag %d)", bytes, dst, tag);
    require_device(p, &o, buf, bytes, "buf");
    struct comm_req *r = ds_calloc(1, sizeof *r);
    memcpy(r->desc, o.desc, sizeof r->desc);
    r->what = o.what;
    r->buf = buf;
    r->bytes = bytes;
    r->dst = dst;
    CHECK_CUDART(cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming));
    if (bytes == 0) { /* nothing to send: complete at once, like the MPI backend's empty isend */
        r->enqueued = 1;
        CHECK_CUDART(cudaEventRecord(r->done, p->stream));
        return r;
    }
    if (p->pending_tail)
        p->pending_tail->next = r;
    else
        p->pending = r;
    p->pending_tail = r;
    return r;
}

static void nccl_wait(struct comm *c, struct comm_req *r) {
    if (!r) return;
    struct nccl_priv *p = priv_of(c);
    if (!r->enqueued) flush_pending(p); /* r and the isends before it go out now, in order */
    struct comm_op o;
    o.comm_name = p->name;
    memcpy(o.desc, r->desc, sizeof o.desc);
    o.what = r->what;
    o.start = now_s(); /* the deadline covers the wait, not the time the caller spent elsewhere */
    op_wait(p, &o, r->done);
    CHECK_CUDART(cudaEventDestroy(r->done));
    free(r);
}

static void nccl_barrier(struct comm *c, const char *what) {
    struct nccl_priv *p = priv_of(c);
    flush_pending(p);
    p->mpi->ops->barrier(p->mpi, what);
}

static void nccl_free(struct comm *c) {
    if (!c) return;
    struct nccl_priv *p = priv_of(c);
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, "comm free", "free");
    flush_pending(p);
    if (p->tmp) CHECK_CUDART(cudaFreeAsync(p->tmp, p->stream));
    op_wait(p, &o, NULL); /* nothing of ours may still run when the communicator goes */
    CHECK_NCCL(ncclCommDestroy(p->nc));
    CHECK_CUDART(cudaEventDestroy(p->t0));
    CHECK_CUDART(cudaEventDestroy(p->t1));
    p->mpi->ops->free(p->mpi);
    free(p);
    free(c);
}

static const struct comm_ops nccl_ops = {
    .name = "nccl",
    .allgather = nccl_allgather,
    .alltoall = nccl_alltoall,
    .allreduce_sum = nccl_allreduce_sum,
    .bcast = nccl_bcast,
    .send = nccl_send,
    .recv = nccl_recv,
    .barrier = nccl_barrier,
    .isend = nccl_isend,
    .wait = nccl_wait,
    .free = nccl_free,
};

/* ------------------------------------------------------------------------------------------------
 * Creation */

/* What each rank says about its device before NCCL is touched. */
struct gpu_id {
    int32_t ok;            /* 1: a device is current and its properties were read */
    int32_t device;        /* cudaGetDevice */
    unsigned char uuid[16];
    char bus[32];          /* PCI bus id, for the message */
    char host[64];
    char err[96];          /* why not ok */
};

static void probe_gpu(struct gpu_id *g) {
    memset(g, 0, sizeof *g);
    gethostname(g->host, sizeof g->host - 1);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n == 0) e = cudaErrorNoDevice;
    if (e == cudaSuccess) e = cudaGetDevice(&g->device);
    struct cudaDeviceProp prop;
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, g->device);
    if (e == cudaSuccess) e = cudaDeviceGetPCIBusId(g->bus, (int)sizeof g->bus, g->device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* a probe's failure is an answer, not a sticky error */
        snprintf(g->err, sizeof g->err, "%s", cudaGetErrorString(e));
        return;
    }
    memcpy(g->uuid, prop.uuid.bytes, sizeof g->uuid);
    g->ok = 1;
}

/* The same decision on every rank, from the same gathered table. Returns 0 when NCCL can run. */
static int check_gpus(const struct gpu_id *all, int size, const char *name) {
    for (int r = 0; r < size; r++)
        if (!all[r].ok) {
            ds_err_set("NCCL comm '%s': rank %d (host %s) has no usable CUDA device (%s)", name, r, all[r].host, all[r].err);
            return -1;
        }
    for (int r = 0; r < size; r++)
        for (int q = r + 1; q < size; q++)
            if (!memcmp(all[r].uuid, all[q].uuid, sizeof all[r].uuid)) {
                ds_err_set("NCCL comm '%s': ranks %d and %d share one GPU (%s on host %s); NCCL takes one GPU per rank, "
                           "so use the MPI comm with device staging (comm_mpi_set_staging)",
                           name, r, q, all[r].bus, all[r].host);
                return -1;
            }
    return 0;
}

struct comm *comm_nccl_new(MPI_Comm c, const char *name, void *cuda_stream) {
    if (!name || !name[0]) name = "communicator";
    struct comm *mpi = comm_mpi_new_named(c, name); /* collective, under the watchdog */
    int rank = mpi->rank, size = mpi->size;

    struct gpu_id me, *all = ds_malloc(sizeof *all * (size_t)size);
    probe_gpu(&me);
    mpi->ops->allgather(mpi, &me, all, sizeof me, "NCCL device check");
    int rc = check_gpus(all, size, name);
    free(all);
    if (rc) {
        mpi->ops->free(mpi);
        return NULL;
    }

    struct nccl_priv *p = ds_calloc(1, sizeof *p);
    struct comm *cm = ds_calloc(1, sizeof *cm);
    cm->ops = &nccl_ops;
    cm->priv = p;
    cm->rank = rank;
    cm->size = size;
    p->mpi = mpi;
    p->stream = (cudaStream_t)cuda_stream;
    p->device = me.device;
    snprintf(p->name, sizeof p->name, "%s", name);
    CHECK_CUDART(cudaEventCreate(&p->t0));
    CHECK_CUDART(cudaEventCreate(&p->t1));

    load_sum_kernels();
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) CHECK_NCCL(ncclGetUniqueId(&id));
    mpi->ops->bcast(mpi, &id, sizeof id, 0, "NCCL unique id");
    CHECK_NCCL(ncclCommInitRank(&p->nc, size, id, rank));
    return cm;
}

#endif /* DS_HAVE_CUDA */
