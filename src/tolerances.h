/* The one tolerance table of dsbatch. Every bound used to judge our numbers against the official
 * reference (golden fixtures) or the GPU against the CPU reference lives here, with the reason it
 * is what it is. Never loosen one to make a test pass: find the bug. */
#ifndef DS_TOLERANCES_H
#define DS_TOLERANCES_H

/* Stream-forced per-layer residual stream (x_out, decode_x_out): relative RMS error of one layer
 * given the golden input. The golden README's noise study puts one bf16 rounding step of drift at
 * <= 6e-4 (small6) / 2e-3 (tp8pp2) per layer and a 1e-3 perturbation at 4e-3..1.7e-2; isolated
 * rows near a routing or top-k tie legitimately move more. Issue #3 fixes: every layer 1e-2,
 * median layer 2e-3. */
#define TOL_LAYER_REL_RMS_MAX 1e-2
#define TOL_LAYER_REL_RMS_MEDIAN 2e-3
/* The mHC pre mix handed on (pre_out) is judged the same way as the stream it is computed from. */
#define TOL_PRE_REL_RMS_MAX 1e-2
#define TOL_PRE_REL_RMS_MEDIAN 2e-3
/* Logits from the forced last layer: the README's stream-forced 1e-3 noise gives 0.040–0.042. */
#define TOL_FORCED_LOGITS_MAX_ABS 0.05
/* Logits from the golden final_hidden through our fp32 head: only the fp32 summation order over
 * hidden differs from the reference (README: "agree to about 1e-5"). */
#define TOL_HEAD_LOGITS_MAX_ABS 1e-5

#endif /* DS_TOLERANCES_H */
