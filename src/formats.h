/* Number formats of the checkpoint and of the reference's quantize-dequantize (QDQ) steps, all
 * bit-exact with the official kernels (MODEL.md §2.1, §3.0): bf16 RNE, OCP e4m3fn, e8m0, e2m1,
 * the three activation quantizers, and dequantization of the stored weight encodings.
 * bf16 values travel as uint16_t bit patterns everywhere in dsbatch. */
#ifndef DS_FORMATS_H
#define DS_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t bf16_t;

/* bf16 <-> fp32. from_f32 rounds to nearest even; NaN stays NaN (quiet). */
static inline float bf16_to_f32(bf16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}
bf16_t bf16_from_f32(float f);
static inline float bf16_round(float f) { return bf16_to_f32(bf16_from_f32(f)); }

/* OCP e4m3fn: bias 7, max ±448, no inf, NaN = 0x7F/0xFF. */
float e4m3_to_f32(uint8_t b);
/* RNE with saturation to ±448 (CUDA satfinite); NaN input gives 0x7F. */
uint8_t e4m3_from_f32(float f);
/* e8m0: 2^(b-127); 255 = NaN. */
float e8m0_to_f32(uint8_t b);
/* e2m1 code (bit 3 = sign) -> value. */
float e2m1_to_f32(uint8_t code);
/* fp32 already clamped to [-6, 6] -> e2m1 code, RNE (ties up only at 0.75, 1.75, 3.5), sign kept. */
uint8_t e2m1_from_f32(float f);

/* 2^ceil(log2(amax * max_inv)) by the exponent-bit trick of the reference (exact powers stay). */
float ds_round_scale_pow2(float amax, float max_inv);

/* act_quant(x, 32, ue8m0): per 32 contiguous values. q gets e4m3 codes, s the power-of-two scale
 * per group (n/32 floats). n must be a multiple of 32. */
void act_quant_fp8_32(const bf16_t *x, size_t n, uint8_t *q, float *s);
/* The same, quantized then dequantized in place (bf16 -> bf16). */
void qdq_fp8_32(bf16_t *x, size_t n);
/* fp4_act_quant(x, 32, ue8m0 scales) QDQ in place (index q/k). */
void qdq_fp4_32_ue8m0(bf16_t *x, size_t n);
/* fp4_act_quant(x, 16, e4m3 scales) QDQ in place (compressed KV). */
void qdq_fp4_16_e4m3(bf16_t *x, size_t n);

/* Dequantize stored weights to fp32 (tests, inspect, mkmodel round trips, bf16 wo_a).
 * FP8 32x32 tiles: w [n, k] e4m3 (row stride ld), s [ceil(n/32), ceil(k/32)] e8m0 (row stride s_ld). */
void dequant_fp8_tiles(const uint8_t *w, const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld,
                       float *out);
/* The same to bf16 (each fp32 value rounded once): the weight the reference dequantizes at load
 * (wo_a), for every backend. */
void dequant_fp8_tiles_bf16(const uint8_t *w, const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld,
                            bf16_t *out);
/* FP4 experts: w [n, k/2] packed (low nibble = even element), s [n, k/32] e8m0. */
void dequant_fp4_rows(const uint8_t *w, const uint8_t *s, int64_t n, int64_t k, float *out);
/* One Engram row: w [dim] e4m3, s [dim/32] e8m0 -> bf16 (the reference casts to bf16 on lookup). */
void dequant_engram_row(const uint8_t *w, const uint8_t *s, int dim, bf16_t *out);

/* Quantizers used by mkmodel to write weights: round fp32 weights into the stored encodings with
 * the smallest power-of-two scale that holds the block's amax. */
void quant_fp8_tiles(const float *w, int64_t n, int64_t k, uint8_t *q, uint8_t *s);
void quant_fp4_rows(const float *w, int64_t n, int64_t k, uint8_t *q, uint8_t *s);

#ifdef __cplusplus
}
#endif

#endif /* DS_FORMATS_H */
