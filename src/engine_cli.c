/* Engine switches and engine construction shared by the commands (see engine_cli.h). */
#include "engine_cli.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

enum moe_exchange engine_moe_exchange_parse(const char *v) {
    if (!strcmp(v, "auto")) return MOE_EXCHANGE_AUTO;
    if (!strcmp(v, "gather")) return MOE_EXCHANGE_GATHER;
    if (!strcmp(v, "owner")) return MOE_EXCHANGE_OWNER;
    ds_die("--moe-exchange: '%s' is not one of auto, gather, owner", v);
}

int engine_flag_parse(int argc, char **argv, int *i, struct engine_flags *f) {
    if (!strcmp(argv[*i], "--no-stale-index-keys")) {
        f->no_stale_keys = true;
        return 1;
    }
    if (!strcmp(argv[*i], "--window-layout") && *i + 1 < argc) {
        const char *v = argv[++*i];
        if (!strcmp(v, "reference"))
            f->layout = WINDOW_LAYOUT_REFERENCE;
        else if (!strcmp(v, "decode"))
            f->layout = WINDOW_LAYOUT_DECODE;
        else
            ds_die("--window-layout: '%s' is not one of reference, decode", v);
        return 1;
    }
    if (!strcmp(argv[*i], "--exact-linears")) {
        f->exact_linears = true;
        return 1;
    }
    if (!strcmp(argv[*i], "--eager")) {
        f->eager = true;
        return 1;
    }
    if (!strcmp(argv[*i], "--moe-exchange") && *i + 1 < argc) {
        f->moe_exchange = engine_moe_exchange_parse(argv[++*i]);
        return 1;
    }
    if (!strcmp(argv[*i], "--backend") && *i + 1 < argc) {
        const char *v = argv[++*i];
        if (!strcmp(v, "cpu"))
            f->backend = ENGINE_BACKEND_CPU;
        else if (!strcmp(v, "cuda"))
            f->backend = ENGINE_BACKEND_CUDA;
        else
            ds_die("--backend: '%s' is not one of cpu, cuda", v);
        return 1;
    }
    return 0;
}

void *engine_host_alloc(struct backend *be, size_t bytes) {
    return be->ops->host_alloc ? be->ops->host_alloc(be, bytes) : ds_malloc(bytes);
}

void engine_host_free(struct backend *be, void *p) {
    if (be->ops->host_free) be->ops->host_free(be, p);
    else free(p);
}

const char *engine_backend_name(enum engine_backend b) { return b == ENGINE_BACKEND_CUDA ? "cuda" : "cpu"; }

void engine_backend_init(struct backend *be, const struct engine_flags *f, int device) {
    if (f->backend == ENGINE_BACKEND_CPU) {
        if (f->exact_linears) ds_die("--exact-linears needs --backend cuda");
        if (backend_cpu_init(be)) ds_die("cannot initialise the CPU backend");
        return;
    }
#ifdef DS_HAVE_CUDA
    if (backend_cuda_init(be, device < 0 ? 0 : device)) ds_die_err();
    backend_cuda_set_mma(be, !f->exact_linears);
#else
    (void)device;
    ds_die("--backend cuda: this dsbatch was built without CUDA (nvcc was not found at build time)");
#endif
}

void engine_backend_free(struct backend *be, const struct engine_flags *f) {
#ifdef DS_HAVE_CUDA
    if (f->backend == ENGINE_BACKEND_CUDA) {
        if (!f->eager) {
            long replays = 0, recordings = 0;
            size_t mem = 0;
            backend_cuda_graph_stats(be, &replays, &recordings, &mem);
            log_info("CUDA graph segments: %ld recorded, %ld replayed; their temporaries held %.1f MiB at most",
                     recordings, replays, (double)mem / (1 << 20));
        }
        backend_cuda_free(be);
        return;
    }
#endif
    backend_cpu_free(be);
}

struct model *engine_open(struct loaded_model *lm, struct backend *be, const char *dir,
                          const struct engine_flags *f, int64_t max_seq_len, int64_t min_len, int max_seqs) {
    if (loader_open(lm, dir, NULL)) ds_die_err();
    engine_backend_init(be, f, 0);
    struct engine_opts eo = engine_opts_default(&lm->cfg);
    if (max_seq_len > 0) {
        if (max_seq_len > lm->cfg.max_pos)
            ds_die("--max-seq-len %lld exceeds the model's max_position_embeddings %lld", (long long)max_seq_len,
                   (long long)lm->cfg.max_pos);
        eo.max_seq_len = max_seq_len;
    } else if (eo.max_seq_len < min_len) {
        eo.max_seq_len = min_len;
    }
    eo.max_seqs = max_seqs;
    eo.stale_index_keys = !f->no_stale_keys;
    eo.window_layout = f->layout;
    eo.graphs = !f->eager;
    eo.moe_exchange = f->moe_exchange;
    return model_new(&lm->cfg, &lm->w, be, lm->have_token_map ? &lm->ec : NULL, &eo);
}

void engine_close(struct model *m, struct loaded_model *lm, struct backend *be, const struct engine_flags *f) {
    model_free(m);
    engine_backend_free(be, f);
    loader_close(lm);
}
