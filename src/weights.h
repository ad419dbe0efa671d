/* Typed model weights, bound once from the checkpoint and validated strictly.
 *
 * weights_bind() walks the role table (config.h) for every layer of the model, looks up each
 * tensor the layer must have, checks its dtype and shape against the config, and points the
 * typed fields into the mmap'd shards (no copies). All layers are validated on every rank, but
 * only the rank's pipeline stage keeps pointers, and only its tensor-parallel slices (MODEL.md §5):
 * heads / output groups / index heads / experts by id / vocab rows / engram rows. Anything
 * missing, misshapen or left over (except vision.*, aligner.*, image_* which a text run ignores)
 * is a one-line error naming the tensor, the expected and actual dtype/shape, and the file. */
#ifndef DS_WEIGHTS_H
#define DS_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "config.h"
#include "safetensors.h"

struct attn_weights {
    struct qweight wq_a;  /* FP8 [q_lora, D] */
    struct qweight wq_b;  /* FP8 [H_local*hd, q_lora] (column slice) */
    struct qweight wkv;   /* FP8 [hd, D] */
    struct qweight wo_a;  /* FP8 [G_local*o_lora, H*hd/G] (column slice), used dequantized to bf16 */
    struct qweight wo_b;  /* FP8 [D/tp, G*o_lora]: this rank's output rows, whole K */
    const bf16_t *q_norm;  /* [q_lora] */
    const bf16_t *kv_norm; /* [hd] */
    const float *attn_sink; /* [H_local] */
    /* compressor (KV sources) */
    struct qweight cmp_wkv;   /* BF16 [hd, D] */
    struct qweight cmp_wgate; /* BF16 [hd, D] (ratio > 1 only) */
    const bf16_t *cmp_norm;   /* [hd] */
    /* indexer (index sources) */
    struct qweight idx_wq_b;         /* FP8 [ih*id, q_lora] (replicated) */
    struct qweight idx_weights_proj; /* BF16 [ih, D] (replicated) */
    struct qweight idx_wk;           /* BF16 [id, hd] (key owners) */
    const bf16_t *idx_k_norm;        /* [id] */
};

struct ffn_weights {
    struct qweight gate;        /* BF16 [E, D] */
    const float *bias;          /* [E] */
    const float *bias_vl;       /* [E] (image tokens only) */
    int n_experts, n_local, e0; /* experts e0 .. e0+n_local-1 live on this rank */
    struct qweight *w1, *w3, *w2; /* [n_local] FP4: w1/w3 [inter, D], w2 [D, inter] */
    struct qweight sh_w1, sh_w3, sh_w2; /* FP8 shared expert */
};

struct engram_weights {
    const uint8_t *table;  /* e4m3 [rows_local, hd] */
    const uint8_t *scale;  /* e8m0 [rows_local, hd/32] */
    int64_t rows, row0, rows_local;
    struct qweight wkv;    /* FP8 [(hc+1)*D, C*hd] */
    const bf16_t *q_weight, *k_weight; /* [hc, D] */
};

struct layer_weights {
    bool present; /* this stage holds the layer */
    struct attn_weights attn;
    struct ffn_weights ffn;
    const bf16_t *attn_norm, *ffn_norm;     /* [D] */
    const float *hc_attn_fn, *hc_ffn_fn;     /* [(2+hc)*hc, hc*D] */
    const float *hc_attn_base, *hc_ffn_base; /* [(2+hc)*hc] */
    const float *hc_attn_scale, *hc_ffn_scale; /* [3] */
    bool has_engram;
    struct engram_weights engram;
    /* DSpark extras (mtp.0 / last mtp block) */
    struct qweight main_proj;  /* FP8 [D, D*n_targets] */
    const bf16_t *main_norm;   /* [D] */
    const bf16_t *mtp_norm;    /* [D] */
    struct qweight markov_embed, markov_head; /* BF16 [V, rank] */
    struct qweight confidence; /* BF16 [1, D+rank] */
};

struct bind_opts {
    int tp_rank, tp_size;     /* TP slice (1 rank = whole model) */
    int layer_begin, layer_end; /* backbone layers this stage runs: [begin, end) */
    bool first_stage, last_stage; /* embed + engram tables / norm + head + DSpark */
};

struct model_weights {
    const struct model_config *cfg;
    struct bind_opts opt;
    const bf16_t *embed; /* [V_local, D] */
    int64_t vocab_row0, vocab_rows;
    struct qweight head; /* BF16 [V_local, D] */
    const bf16_t *norm;  /* [D] */
    struct layer_weights *layers; /* [n_layers + n_mtp] */
    /* accounting for inspect/plan: bytes of the tensors this rank maps */
    uint64_t bytes_total, bytes_engram, bytes_experts;
    int64_t n_tensors_checked;
};

/* Validate every tensor of the checkpoint against the config and bind this rank's slices.
 * Returns 0 or -1 with ds_err_set naming file, tensor, expected and actual dtype/shape. */
int weights_bind(struct model_weights *mw, const struct model_config *cfg, struct st_model *st,
                 const struct bind_opts *opt);
void weights_free(struct model_weights *mw);

/* Default whole-model options (TP1, one stage). */
struct bind_opts bind_opts_single(const struct model_config *cfg);

#endif /* DS_WEIGHTS_H */
