/* The device layout of FP4 (e2m1) weights: the bits of each 32-bit word of the checkpoint's packed
 * codes, permuted once when the weight is prepared (weight_prepare; cuda_fp4_pack for arrays
 * uploaded by hand), so that the tensor-core kernels turn a word into the four bf16 pairs of the
 * mma fragments with shifts and masks alone.
 *
 * The checkpoint's word (MODEL.md §2): code c (0..7) in bits 4c..4c+3, bit 4c = m, 4c+1..4c+2 =
 * the exponent e, 4c+3 = the sign. The kernels want code 2j in the low and code 2j+1 in the high
 * half of pair j, each as the bf16 bit pattern s | e << 7 | m << 6, which reads x·2^-126 for
 * every code, the subnormal ones (e = 0) included, so one exact bf16 multiply by 2^126 gives x.
 * Those eight bits of a pair sit at P = {6, 7, 8, 15, 22, 23, 24, 31}; here pairs 0, 1 and 2 are
 * P, P - 3 and P - 6 of the word (one mask, one shift and a mask each), and pair 3 takes the
 * eight bits left over, {10, 11, 13, 14, 26, 27, 29, 30}, in three pieces (no three shifts of P
 * tile the word, and none leave a remainder that two shifts place). Against the table lookup on
 * the checkpoint's layout (10 prmt + 3 lop3 per word, all on the integer pipe) this is 6 lop3,
 * 2 shifts on the integer pipe and 3 shifts + 4 bf16 multiplies elsewhere.
 *
 * Pure bit moves: every word packs and unpacks (tests/unit/test_fp4_layout.c checks both ways and
 * the raw pairs against the e2m1 values). The CPU backend keeps the checkpoint's layout. */
#ifndef DS_FP4_LAYOUT_H
#define DS_FP4_LAYOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define FP4L_FN __host__ __device__
#else
#define FP4L_FN
#endif

/* Position in the device word of the magnitude's lowest bit (m) and of the sign of codes 0..5;
 * codes 6 and 7 are split (m, e0 | e1 | s). */
#define FP4L_MAG(c) ((c) == 0 ? 6 : (c) == 1 ? 22 : (c) == 2 ? 3 : (c) == 3 ? 19 : (c) == 4 ? 0 : 16)
#define FP4L_SGN(c) ((c) == 0 ? 15 : (c) == 1 ? 31 : (c) == 2 ? 12 : (c) == 3 ? 28 : (c) == 4 ? 9 : 25)

/* checkpoint word -> device word */
static inline FP4L_FN uint32_t fp4_pack_word(uint32_t u) {
    uint32_t p = 0;
    for (int c = 0; c < 6; c++) {
        const uint32_t code = (u >> (4 * c)) & 15u;
        p |= (code & 7u) << FP4L_MAG(c) | (code >> 3) << FP4L_SGN(c);
    }
    for (int h = 0; h < 2; h++) { /* codes 6 (h = 0) and 7: m, e0 at 10, 11; e1 at 13; s at 14 (+16) */
        const uint32_t code = (u >> (24 + 4 * h)) & 15u;
        p |= (code & 3u) << (10 + 16 * h) | (code >> 2) << (13 + 16 * h);
    }
    return p;
}

/* The four bf16 pairs of a device word before the multiply: r[j] = codes 2j (low half) and 2j + 1
 * (high half) as s | e << 7 | m << 6, i.e. x·2^-126 (the decode in mma_sm80.cuh multiplies by
 * 2^126 in bf16, exactly). */
static inline FP4L_FN void fp4_raw_pairs(uint32_t p, uint32_t r[4]) {
    const uint32_t M = 0x81C081C0u; /* P */
    r[0] = p & M;
    r[1] = (p << 3) & M;
    r[2] = (p << 6) & M;
    r[3] = ((p >> 4) & 0x00C000C0u) | ((p >> 5) & 0x01000100u) | ((p << 1) & 0x80008000u);
}

/* device word -> checkpoint word, read back through the decode's own pairs (code 2j + h is half h
 * of pair j: its magnitude at bits 8..6, its sign at bit 15) */
static inline FP4L_FN uint32_t fp4_unpack_word(uint32_t p) {
    uint32_t r[4], u = 0;
    fp4_raw_pairs(p, r);
    for (int c = 0; c < 8; c++) {
        const uint32_t half = r[c / 2] >> (16 * (c % 2));
        u |= (((half >> 6) & 7u) | ((half >> 12) & 8u)) << (4 * c);
    }
    return u;
}

/* The same raw halves paired as codes j (low) and j + 4 (high) of the checkpoint's word, for the
 * exact expert kernels (cuda_moe.cu), which multiply in fp32 and want a word's two halves 16 bits
 * apart: straight from the device word, fewer live values than regrouping fp4_raw_pairs. */
static inline FP4L_FN void fp4_raw_pairs_j4(uint32_t p, uint32_t r[4]) {
    const uint32_t LO = 0x000081C0u, HI = 0x81C00000u;
    r[0] = (p & LO) | ((p << 22) & HI);         /* code 0 in place, code 4 from {0, 1, 2, 9} */
    r[1] = ((p >> 16) & LO) | ((p << 6) & HI);  /* codes 1 and 5 */
    r[2] = ((p << 3) & LO) | ((p << 12) & 0x00C00000u) | ((p << 11) & 0x01000000u) | ((p << 17) & 0x80000000u);
    r[3] = ((p >> 13) & LO) | ((p >> 4) & 0x00C00000u) | ((p >> 5) & 0x01000000u) | ((p << 1) & 0x80000000u);
}

#endif
