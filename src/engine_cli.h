/* What every engine-running command shares: the engine switches on the command line
 * (--no-stale-index-keys, --window-layout, --backend, --exact-linears, --eager, --moe-exchange) and opening a model folder into a ready engine on the
 * CPU backend, so generate, score, replay and verify parse and build the engine one way. */
#ifndef DS_ENGINE_CLI_H
#define DS_ENGINE_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "loader.h"
#include "model.h"

enum engine_backend {
    ENGINE_BACKEND_CPU = 0, /* the reference backend (kernels/cpu) */
    ENGINE_BACKEND_CUDA,    /* the SM80 suite (kernels/cuda), one GPU per rank */
};

struct engine_flags {
    bool no_stale_keys;
    enum window_layout layout;
    enum engine_backend backend; /* --backend cpu|cuda */
    bool exact_linears;          /* --exact-linears: linears, experts, head and sparse attention in the CPU backend's order on the GPU */
    bool eager;                  /* --eager: every op launched by the host, no graph segments (same bits) */
    enum moe_exchange moe_exchange; /* --moe-exchange auto|gather|owner: the experts' TP exchange (same bits) */
};

/* "cpu" / "cuda", for logs and the configuration echoed into output files. */
const char *engine_backend_name(enum engine_backend b);

/* Initialise the backend the flags ask for on GPU `device` (ignored for the CPU); dies with one
 * error line when it cannot (no GPU, built without CUDA). */
void engine_backend_init(struct backend *be, const struct engine_flags *f, int device);
void engine_backend_free(struct backend *be, const struct engine_flags *f);

/* Host buffers the backend downloads into every step (backend_ops.host_alloc, else malloc); they
 * must be released with engine_host_free before the backend goes. */
void *engine_host_alloc(struct backend *be, size_t bytes);
void engine_host_free(struct backend *be, void *p);

/* --moe-exchange's value (dies with one error line on anything else). */
enum moe_exchange engine_moe_exchange_parse(const char *v);

/* If argv[*i] is an engine switch, consume it (and its value) and return 1; else 0. */
int engine_flag_parse(int argc, char **argv, int *i, struct engine_flags *f);

/* Load DIR (dies with one error line on bad input) and build the engine. max_seq_len > 0 asks for
 * that many positions per sequence (an error beyond the model's max_position_embeddings); 0 takes
 * the default, raised to at least min_len. */
struct model *engine_open(struct loaded_model *lm, struct backend *be, const char *dir,
                          const struct engine_flags *f, int64_t max_seq_len, int64_t min_len, int max_seqs);
void engine_close(struct model *m, struct loaded_model *lm, struct backend *be, const struct engine_flags *f);

#endif /* DS_ENGINE_CLI_H */
