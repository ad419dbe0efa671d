/* The CPU reference backend's op table, its init/free, the memory ops and weight preparation.
 *
 * On the CPU "device" memory is host memory, so the memory ops are calloc/free/memcpy and ops run
 * inline (sync has nothing to wait for). Weights keep pointing into the checkpoint mapping; the one
 * exception is a weight the model asks to have in bf16 (wo_a, which the reference dequantizes at
 * load): that gets an owned bf16 copy, and the original description is parked in be_priv so that
 * release can free the copy and hand the weight back exactly as it came. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "log.h"

static void *cpu_alloc(struct backend *be, size_t bytes) { return ds_calloc(1, bytes); }

static void cpu_free(struct backend *be, void *p) { free(p); }

static void *cpu_scratch(struct backend *be, size_t bytes) {
    void *p = ds_malloc(bytes ? bytes : 1);
    memset(p, 0xff, bytes);
    return p;
}

static void cpu_upload(struct backend *be, void *dst, const void *src_host, size_t bytes) {
    if (bytes) memcpy(dst, src_host, bytes);
}

static void cpu_download(struct backend *be, void *dst_host, const void *src, size_t bytes) {
    if (bytes) memcpy(dst_host, src, bytes);
}

static void cpu_copy(struct backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes) memmove(dst, src, bytes);
}

static void cpu_copy_segs(struct backend *be, const struct copy_seg *segs, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (segs[i].bytes) memcpy(segs[i].dst, segs[i].src, segs[i].bytes);
}

static void cpu_sync(struct backend *be) {}

static int cpu_weight_prepare(struct backend *be, struct qweight *w, bool dequant_bf16) {
    if (!dequant_bf16 || w->fmt == WF_BF16) return 0;
    if (w->fmt != WF_FP8) {
        ds_err_set("cpu weight_prepare: a bf16 copy was asked of a weight in format %d (only FP8 converts)",
                   (int)w->fmt);
        return -1;
    }
    if (w->be_priv) {
        ds_err_set("cpu weight_prepare: weight is already prepared");
        return -1;
    }
    int64_t n = w->n, k = w->k;
    bf16_t *copy = ds_malloc((size_t)(n * k) * sizeof(bf16_t));
    dequant_fp8_tiles_bf16(w->w, w->s, n, k, w->ld, w->s_ld, copy);
    struct qweight *orig = ds_malloc(sizeof *orig);
    *orig = *w;
    w->be_priv = orig;
    w->fmt = WF_BF16;
    w->w = copy;
    w->ld = k;
    w->s = NULL;
    w->s_ld = 0;
    return 0;
}

static void cpu_weight_release(struct backend *be, struct qweight *w) {
    struct qweight *orig = w->be_priv;
    if (!orig) return;
    free((void *)w->w);
    *w = *orig;
    w->be_priv = NULL;
    free(orig);
}

static const void *cpu_tensor_prepare(struct backend *be, const void *host, size_t bytes, bool host_resident) {
    return host;
}

static void cpu_tensor_release(struct backend *be, const void *p) {}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .scratch = cpu_scratch,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy = cpu_copy,
    .copy_segs = cpu_copy_segs,
    .sync = cpu_sync,
    .weight_prepare = cpu_weight_prepare,
    .weight_release = cpu_weight_release,
    .tensor_prepare = cpu_tensor_prepare,
    .tensor_release = cpu_tensor_release,
    .linear = cpu_op_linear,
    .linear_f32 = cpu_op_linear_f32,
    .grouped_linear = cpu_op_grouped_linear,
    .head = cpu_op_head,
    .argmax = cpu_op_argmax,
    .row_lse = cpu_op_row_lse,
    .row_topk = cpu_op_row_topk,
    .rmsnorm = cpu_op_rmsnorm,
    .rope = cpu_op_rope,
    .qdq_fp8_32 = cpu_op_qdq_fp8_32,
    .qdq_fp4_32 = cpu_op_qdq_fp4_32,
    .qdq_fp4_16 = cpu_op_qdq_fp4_16,
    .hc_mixes = cpu_op_hc_mixes,
    .hc_collapse = cpu_op_hc_collapse,
    .hc_expand = cpu_op_hc_expand,
    .hc_init = cpu_op_hc_init,
    .embed = cpu_op_embed,
    .engram_gather = cpu_op_engram_gather,
    .engram_gate = cpu_op_engram_gate,
    .sparse_attn = cpu_op_sparse_attn,
    .compress_pool = cpu_op_compress_pool,
    .index_scores = cpu_op_index_scores,
    .index_topk = cpu_op_index_topk,
    .cand_mask = cpu_op_cand_mask,
    .attn_index = cpu_op_attn_index,
    .ring_store = cpu_op_ring_store,
    .router = cpu_op_router,
    .moe_experts = cpu_op_moe_experts,
    .shared_expert = cpu_op_shared_expert,
    .moe_combine = cpu_op_moe_combine,
    .interleave = cpu_op_interleave,
};

int backend_cpu_init(struct backend *be) {
    /* Build the decode tables here, outside any parallel region. */
    (void)cpu_e4m3_lut();
    be->ops = &cpu_ops;
    be->priv = NULL;
    return 0;
}

void backend_cpu_free(struct backend *be) {
    be->ops = NULL;
    be->priv = NULL;
}
