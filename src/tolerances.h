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

/* ---------------------------------------------------------------------------------------------
 * GPU (CUDA backend) vs CPU backend, per op
 *
 * tests/unit/test_cuda_ops.c + test_cuda_moe.c + test_cuda_ops_misc.c + test_cuda_attn.c (every op
 * of kernels/backend.h) and tests/unit/test_cuda_linear.c (the SM80 FP8/FP4 decode kernels) run
 * the GPU and the CPU backend (the oracle) on the same inputs. The GPU must round where backend.h
 * says. The bounds below allow only the two freedoms backend.h grants a GPU backend, and follow
 * from them and from the op's rounding points; none is fitted to what a kernel happens to produce:
 *  (a) the order of an fp32 sum ("GPU backends may reorder within an fp32 sum"), including a sum
 *      inside a tensor-core MMA;
 *  (b) CUDA's single-precision libm (expf, sinf, cosf, log1pf, rsqrtf) in place of glibc's.
 * Per output element the test checks
 *     |gpu − cpu| <= atol + rtol·|cpu|
 * where atol carries Σ|terms| of the fp32 sums that feed the element (computed by the test on the
 * host, in double) and the ulps of the output rounding. Where an op rounds to bf16 *in the middle*
 * (sparse_attn's P, index_scores' d_h and p_h, the experts' g, u, h and h's re-quantization), one
 * bf16 ulp at that rounding point can flip and travel on; the test then carries each intermediate as
 * the interval of values either backend may produce (the exact double-precision value widened by
 * these bounds, every rounding applied to both ends), so a flip propagates exactly as far as it can,
 * and it also requires the CPU result inside the same interval (a check of the derivation).
 *
 * Units: u = 2^-24, the fp32 unit roundoff (round-to-nearest of x is within u·|x|); one fp32 ulp
 * of x is at most 2u·|x|; one bf16 ulp of x is 2^(floor(log2|x|) − 7) <= 2^-7·|x|. Two fp32 values
 * within E of each other round to bf16 values within E + 1 bf16 ulp (of the larger) of each other. */
#define TOL_FP32_U 0x1p-24
/* Below 2^-126 the relative bound above does not hold: a result there is rounded to a multiple of
 * the subnormal spacing 2^-149, so each rounding errs by up to half of it, whatever the result's
 * size (Higham §2.1: fl(x) = x(1 + d) + e, |e| <= 2^-150). A chain of r roundings adds r·2^-150. */
#define TOL_FP32_UNDERFLOW_ABS 0x1p-150
/* Sums. An fp32 sum of n terms evaluated in any order with round-to-nearest adds is within
 * (n − 1)·u·Σ|t| of the exact sum (Higham, Accuracy and Stability of Numerical Algorithms, §4.2);
 * a product feeding it that is itself rounded (bf16 × fp32) adds u·|t|: n·u·Σ|t| in all. The CPU
 * adds in IEEE fp32. A GPU sum may run inside an MMA, whose adder aligns and normalizes by
 * truncation (Fasi, Higham, Mikaitis, Pranesh 2021, "Numerical behavior of NVIDIA tensor cores"):
 * up to 2u per add. Hence, per term, in units of u·Σ|t|: */
#define TOL_CPU_SUM_U_PER_TERM 1.0 /* |cpu − exact| <= 1·n·u·Σ|t| */
#define TOL_GPU_SUM_U_PER_TERM 2.0 /* |gpu − exact| <= 2·n·u·Σ|t| */
/* ... so the same sum on the two backends: |gpu − cpu| <= (1 + 2)·n·u·Σ|t|. */
#define TOL_GPU_SUM_RTOL_PER_TERM ((TOL_CPU_SUM_U_PER_TERM + TOL_GPU_SUM_U_PER_TERM) * TOL_FP32_U)
/* libm. CUDA Math API, maximum ulp error (no fast math): expf 2, sinf 2, cosf 2, log1pf 1, rsqrtf 2;
 * glibc's fp32 expf/sinf/cosf/log1pf are within 1 ulp. One ulp is <= 2u relative. */
#define TOL_GPU_LIBM_ULP 2.0
#define TOL_CPU_LIBM_ULP 1.0
/* A normalizing scale r = 1/sqrtf(s/n + eps) (rmsnorm, hc_mixes, engram_gate), one backend: the /n
 * and +eps roundings (2u) and either sqrtf then an IEEE division (2u) or CUDA's rsqrtf (2 ulp = 4u):
 * at most 6u relative, on top of what the sum s brings. */
#define TOL_GPU_NORM_SCALE_U 6.0
/* A division a/b where backend.h writes one (attention's acc/l, the pooling and routing weights, the
 * Sinkhorn normalizations): a kernel may take it as a·(1/b), two roundings instead of one. */
#define TOL_GPU_DIV_ROUNDINGS 2

/* Exact (0 ulp):
 *  - memory ops (copy_segs, ring_store too), weight_prepare (incl. the dequant_bf16 copy: e4m3 ·
 *    2^k is exact in fp32, then one RNE), tensor_prepare, hc_init, embed, engram_gather (e4m3 ·
 *    e8m0 exact, one RNE), interleave: data movement;
 *  - argmax: comparisons only, under a total order (value, then the lower index), so any reduction
 *    tree picks the same entry;
 *  - qdq_fp8_32 / qdq_fp4_32 / qdq_fp4_16: integer exponent arithmetic, a division by a power of two
 *    (exact) or one IEEE division (CUDA's '/' is correctly rounded unless -prec-div=false), RNE
 *    casts: no freedom at all. */
#define TOL_GPU_DATA_EXACT 0
#define TOL_GPU_QDQ_EXACT 0
/* index_topk, cand_mask (and attn_index, integer adds): comparisons and moves only, and both
 * backends run the same selection code (kernels/topk_core.h), so the same sets, order and masks
 * bit for bit; copy_segs is data movement. */
#define TOL_GPU_INDEX_SELECT_EXACT 0
/* hc_collapse, hc_expand, moe_combine: a short chain of fp32 products and adds whose order
 * backend.h spells out (((p0·X0 + p1·X1) + p2·X2) + …; post·y + mix; experts in ascending id,
 * then + the shared expert — the reference's expression order, not an "fp32 sum" a GPU may
 * reorder), then one bf16 rounding: exact. The kernel must not let nvcc contract a·b + c into an FMA (it does by
 * default): __fmul_rn/__fadd_rn. */
#define TOL_GPU_ELEMENTWISE_EXACT 0
/* The fused forms, hc_collapse with a norm weight and rmsnorm with a post (RoPE, QDQ): against the
 * same backend's ops run in turn, exact — one pass with each step's arithmetic and its bf16
 * rounding between the steps (test_cuda_ops_misc compares them with the GPU's own ops; against the
 * CPU each step keeps its own entry here, e.g. the rmsnorm bound below). */
#define TOL_GPU_FUSED_EXACT 0

/* linear (FP8, FP4, BF16) and grouped_linear, bf16 out: only the order of the k-sum may differ
 * (a fixed warp-shuffle tree over per-lane k-block partials, or the MMA's internal order within
 * fixed k-chunks of 1,024 added in order: linear_mma_sm80.cu; the bound holds for any order), the
 * activation quantization is exact (act_quant is deterministic), and the scalings by s_x·s_w are
 * powers of two (exact). Terms t_i = x̂_i·ŵ_i over the whole k (x̂ the dequantized activation, ŵ the
 * dequantized weight); both fp32 accumulators are within the sum bound of Σ t, then each is rounded
 * to bf16 once:
 *     |gpu − cpu| <= TOL_GPU_LINEAR_RTOL_SUM · k · Σ|x̂·ŵ| + TOL_GPU_LINEAR_OUT_ULPS · ulp_bf16(out) */
#define TOL_GPU_LINEAR_RTOL_SUM TOL_GPU_SUM_RTOL_PER_TERM
#define TOL_GPU_LINEAR_OUT_ULPS 1
/* linear_f32 and head, fp32 out, on the exact dense kernels of cuda_linear_ops.cu (--exact-linears,
 * F32 weights, shapes the tensor-core tiles cannot take): the CPU's own order,
 * segments of BE_DOT_SEG in k order then the segment sums in order, one rounded product and one
 * rounded add per term (no FMA), so the outputs are the CPU's bits. (Any other order would need
 * the sum bound k · u · Σ|x·w|; the test also checks the CPU against that bound of the exact sum.) */
#define TOL_GPU_DENSE_F32_EXACT 0
/* linear_f32 and head on BF16 weights under the tensor-core switch (the engine's default;
 * dense_mma in cuda_linear_ops.cu): the BF16 mma tilings with fp32 outputs, each k-chunk of 1,024
 * summed by the mma accumulator in its own order, the chunks added in order. Every product of two
 * bf16 is exact in fp32, so both backends are within their fp32 sum bounds of the exact sum (the
 * GPU's, TOL_GPU_SUM_U_PER_TERM, holds for any order):
 *     |gpu − cpu| <= TOL_GPU_DENSE_MMA_U_PER_TERM · k · u · Σ|x·w| (+ the underflow term)
 * (linear on BF16 weights, bf16 out, takes the same tilings under the linear bound above.) */
#define TOL_GPU_DENSE_MMA_U_PER_TERM (TOL_GPU_SUM_U_PER_TERM + TOL_CPU_SUM_U_PER_TERM)

/* rmsnorm: the mean of squares is an fp32 sum of n non-negative terms (Σ|t| = the sum itself), so
 * the two sums differ by at most δ = 3·n·u relatively; r ∝ (sum)^-1/2 moves by at most
 * 1/sqrt(1 − δ) − 1; each backend's 1/sqrtf(mean + eps) adds TOL_GPU_NORM_SCALE_U, and w·(x·r) two
 * more roundings each (4u); one bf16 rounding at the end:
 *     |gpu − cpu| <= TOL_GPU_RMSNORM_RTOL(n) · |y| + TOL_GPU_RMSNORM_OUT_ULPS · ulp_bf16(out) */
#define TOL_GPU_RMSNORM_RTOL(n)                                                                            \
    ((1.0 / sqrt(1.0 - TOL_GPU_SUM_RTOL_PER_TERM * (double)(n)) - 1.0) + (2.0 * TOL_GPU_NORM_SCALE_U + 4.0) * TOL_FP32_U)
#define TOL_GPU_RMSNORM_OUT_ULPS 1

/* rope: the angle (float)pos · freq is one correctly rounded product on both; c = cosf, s = sinf differ
 * by at most 2 + 1 ulp (6u relative); a·c and b·s move by 6u·|a·c|, 6u·|b·s|, and the two products
 * and the add/sub round on each backend (an FMA on the GPU removes one of them): at most
 * (6 + 2 + 2)·u·(|a| + |b|) before the bf16 rounding, whatever the cancellation in a·c − b·s:
 *     |gpu − cpu| <= TOL_GPU_ROPE_ATOL_U · u · (|a| + |b|) + TOL_GPU_ROPE_OUT_ULPS · ulp_bf16(out) */
#define TOL_GPU_ROPE_ATOL_U 10.0
#define TOL_GPU_ROPE_OUT_ULPS 1

/* hc_mixes (fp32 out): m = (Σ x·fn)·r is a sum of hc·D terms (both backends in the same segmented
 * order, BE_HC_MIX_SEG; the bound, with Σ|x·fn|·r, holds for any order) times
 * the normalizing scale (the rmsnorm bound); z = m·scale + base adds 2u per backend. pre/post =
 * sigmoid(z) (+ eps): the slope of sigmoid on [z − Δz, z + Δz] times Δz, plus expf's ulps (both
 * backends) and the add/divide (2u each). comb = split_sinkhorn's 2·iters normalization steps: each
 * step's own rounding (its hc-term sums by the sum bound, the divide and the +eps, and the softmax's
 * expf ulps and argument rounding) is a relative perturbation of that step's output, carried to the
 * end by the Jacobian of the remaining steps, and Δz by the Jacobian of the whole map (Jacobians of
 * the double-precision map, by central differences; first order). Per element:
 *     |gpu − cpu| <= Σ_steps |∂out/∂C_s|·|C_s|·ρ_s + |∂out/∂z|·Δz   (ρ_s in units below) */
/* hc_mixes under the tensor-core switch (cuda_mhc.cu, hc_mixes_mma; hc·D a multiple of 32): the
 * dot products as three any-order fp32 sums of exact products over the bf16 pieces of fn (hi + mid +
 * lo = fn, Σ|piece| <= (1 + 2^-6)·|fn|), added in order, so the GPU's m is within
 * (1 + 2^-6)·(2·n + 2)·u·Σ|x·fn| of the exact sum, at most 2.1·n·u·Σ|x·fn| for n >= 32: the model
 * above with this per-term factor in place of TOL_GPU_SUM_U_PER_TERM (the CPU's own stays). */
#define TOL_GPU_HC_MIX_MMA_U_PER_TERM 2.1
/* per normalization step, both backends together: the +eps add (1u each) and the divide (1u on the
 * CPU, TOL_GPU_DIV_ROUNDINGS on the GPU) */
#define TOL_GPU_HC_SINKHORN_STEP_EXTRA_U (2.0 + 1.0 + TOL_GPU_DIV_ROUNDINGS)

/* engram_gate: three fp32 sums over D (Σh², Σkey², Σ(h·w)·key with two rounded products per term,
 * by the sum bound), the two normalizing scales (TOL_GPU_NORM_SCALE_U each), D^-0.5 (which a GPU may
 * take from rsqrtf: 2 ulp), the signed sqrt (monotone) and sigmoid (expf ulps + 2u), then
 * bf16(h + g·value): carried as intervals; g is monotone in dot, so the interval of g is exact. At a
 * dot of exactly ±0 either sign of the 1e-3 floor is allowed (the sign of a zero sum depends on the
 * order). Output: inside the interval, i.e. at most the propagated Δg·|value| + 1 bf16 ulp. */
#define TOL_GPU_ENGRAM_GATE_OUT_ULPS 1

/* sparse_attn: s = (q·k)·scale is a sum of hd exact bf16 products (sum bound) and one product; the
 * block max moves with it; P = expf(s − m) adds expf's ulps and the argument's rounding; P is rounded
 * to bf16 before P·V, so where a rounding boundary lies within P's uncertainty the two backends' P
 * differ by one bf16 ulp (TOL_GPU_SPARSE_ATTN_P_FLIP_ULPS) and that enters P·V at full weight (the
 * denominator sums the fp32 P, so it does not cancel); the P·V and denominator sums (sum bound),
 * the rescales by expf(m_old − m_new), the sink term, the final divide and the bf16 rounding of o
 * follow. Carried as intervals per (row, head, channel). */
#define TOL_GPU_SPARSE_ATTN_P_FLIP_ULPS 1
#define TOL_GPU_SPARSE_ATTN_OUT_ULPS 1

/* index_scores: d_h = bf16(Σ_d q·K) (hd exact products, sum bound) can flip one bf16 ulp; p_h =
 * bf16(relu(d_h)·w) is an exact product of two bf16 values, rounded once: it follows the flip and can
 * flip itself; S = bf16(Σ_h p_h) (sum bound over the heads) one more. So at most one bf16 ulp at each
 * of the three rounding points, propagated as intervals. Masked positions are −inf on both, exactly;
 * every finite score must be a bf16 value. */
#define TOL_GPU_INDEX_SCORES_FLIP_ULPS 1

/* compress_pool: e = expf(s − max) (the argument is the same correctly rounded subtraction on both;
 * expf's ulps), Σe and Σ kv·(e/Σe) by the sum bound, the divide (TOL_GPU_DIV_ROUNDINGS) and the
 * products (1u), one bf16 rounding; a slot whose score is −inf has weight exactly 0 and is skipped
 * (its kv may be anything, NaN included); a channel with no filled slot gives exactly 0. Carried as
 * intervals:  |gpu − cpu| <= that + TOL_GPU_COMPRESS_POOL_OUT_ULPS · ulp_bf16(out). */
#define TOL_GPU_COMPRESS_POOL_OUT_ULPS 1

/* router: z by the linear_f32 bound; softplus and sqrt are monotone (expf and log1pf ulps, sqrtf
 * correctly rounded); v = s + bias one more rounding. The selection may differ from the CPU's only
 * between experts whose v intervals overlap (a near tie the sum order can break either way): every
 * expert the GPU ranks above another must have an upper bound at least the other's lower bound
 * (1 = such swaps accepted; 0 would demand the CPU's selection). The weights are checked against
 * the interval for the GPU's own selection (k-term sum, divide, route_scale). */
#define TOL_GPU_ROUTER_NEAR_TIE_SWAPS 1

/* moe_experts, shared_expert (either path: the exact kernels, or the tensor cores, whose sums are
 * the tensor-core linears' and so within the same order-free linear bound):
 * g = bf16(x̂·w1ᵀ), u = bf16(x̂·w3ᵀ) by the linear bound (either can flip
 * one bf16 ulp), clamps (monotone), silu (not monotone: its exact range over the interval), expf ulps,
 * the products by u and the routing weight, bf16(h) (another flip), then h's activation
 * quantization for w2: a flipped h can move its e4m3 code by one step and, if it is the block's
 * amax, the block's power-of-two scale; then the w2 sum (linear bound) and the bf16 output. All
 * carried as intervals (the quantization over every scale the amax interval allows). Slots routed to
 * other ranks must keep their poison bit for bit. */
#define TOL_GPU_MOE_FLIP_ULPS 1

/* row_lse (the log-probabilities' slices, kernels/lse_core.h, and with temperatures the full-row
 * draws' weight sums): the same terms (a float difference, the quotient by T when given, and expf,
 * glibc's on the host and its bit-for-bit copy on the device), the same lanes and the same tree of
 * double adds on both backends, the maximum a comparison, a NaN sum one fixed NaN: exact. */
#define TOL_GPU_ROW_LSE_EXACT 0

/* ---------------------------------------------------------------------------------------------
 * Host arithmetic against a double-precision oracle */

/* The log-probability (sampler_logprob; row_lse + sampler_lse_merge) against the first version's
 * sum of exp((double)x - max) in double over the row (tests/unit/sampler_ref.h). Each term is now
 * expf of a float difference: fl(x - m) errs by u·(m - x) in the exponent, hence relatively in the
 * term, and glibc's expf by at most 1 ulp = 2u (this constant); the slices' maxima m are <= the
 * row's M. So |lp - ref| <= u·(TOL_LOGPROB_EXPF_U + Σ p_i (M - x_i)) to first order (p_i the row's
 * probabilities), plus the double sums' n·2^-53 on each side; test_sampler computes the bound per
 * row (x 1.01 for the second-order terms). Both log-probabilities are in double; logits are fp32 of
 * bf16-rounded sums, so ~1e-6 here is far below what the model's own rounding moves. */
#define TOL_LOGPROB_EXPF_U 2.0

#endif /* DS_TOLERANCES_H */
