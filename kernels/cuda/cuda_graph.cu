/* Graph segments of the SM80 backend (backend.h's graph_begin / graph_end): a decode step is a few
 * hundred small kernels, and launching each from the host costs more than many of them run. The
 * model marks runs of ops whose work is fixed by a key (layer, rows, buffer addresses); the first
 * time a key comes, the stream records the ops into a CUDA graph (stream capture), which is
 * instantiated and launched; every later time the graph is launched alone, one host call for the
 * run. The recorded kernels are the same kernels with the same arguments, so a replay computes the
 * same bits as the ops would (tests/cli/test_cuda_engine.sh compares against --eager).
 *
 * Recorded temporaries come from an arena of the recordings' own (cuda_backend.cu routes scratch
 * there while recording; graph allocation nodes where it is short, until the next recording grows
 * it and drops the graphs that point into the old one), freed inside the graph, so a replay never
 * writes a block that the host has since handed to other work. A branch (backend.h) inside a
 * segment is recorded as two parallel chains of the graph: the side stream joins the capture
 * through the fork event and leaves it through the join event. The mma switch is part of every
 * key: a test that flips it between forwards gets new recordings. The cache is bounded: past
 * GRAPHS_MAX recordings it is emptied (a job whose batch sizes keep changing records again rather
 * than growing without end). */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

extern "C" void *ds_malloc(size_t n);
extern "C" void *ds_calloc(size_t n, size_t m);

#define GRAPHS_MAX 4096
#define KEY_MAX 64

struct seg_graph {
    uint64_t key[KEY_MAX + 1]; /* the caller's words, then the mma switch */
    int n;
    uint64_t hash;
    cudaGraphExec_t exec;
    struct seg_graph *next; /* bucket chain */
};

struct cuda_graphs {
    struct seg_graph **tab; /* [cap] buckets */
    size_t cap, n;
    long replays, recordings;
    struct seg_graph *open; /* the recording in progress, or NULL */
};

static uint64_t key_hash(const uint64_t *k, int n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) {
        h ^= k[i];
        h *= 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h;
}

static struct cuda_graphs *graphs(struct backend *be) {
    struct cuda_graphs **g = cuda_be_graphs(be);
    if (!*g) {
        *g = (struct cuda_graphs *)ds_calloc(1, sizeof **g);
        (*g)->cap = 1024;
        (*g)->tab = (struct seg_graph **)ds_calloc((*g)->cap, sizeof *(*g)->tab);
    }
    return *g;
}

static void drop_all(struct cuda_graphs *g) {
    for (size_t i = 0; i < g->cap; i++)
        while (g->tab[i]) {
            struct seg_graph *s = g->tab[i];
            g->tab[i] = s->next;
            /* a graph still in flight is freed when it completes (cudaGraphExecDestroy) */
            CUDA_CHECK(cudaGraphExecDestroy(s->exec));
            free(s);
        }
    g->n = 0;
}

bool cuda_graph_begin(struct backend *be, const uint64_t *key, int n_key) {
    struct cuda_graphs *g = graphs(be);
    if (g->open)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "graph_begin", "a graph segment begins inside another one");
    if (cuda_be_branch_open(be))
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "graph_begin", "a graph segment begins inside a branch (backend.h)");
    if (n_key < 0 || n_key > KEY_MAX)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "graph_begin", "segment key longer than KEY_MAX words");
    struct seg_graph probe;
    memcpy(probe.key, key, sizeof *key * (size_t)n_key);
    probe.key[n_key] = cuda_be_mma(be);
    probe.n = n_key + 1;
    probe.hash = key_hash(probe.key, probe.n);
    for (struct seg_graph *s = g->tab[probe.hash & (g->cap - 1)]; s; s = s->next)
        if (s->hash == probe.hash && s->n == probe.n && !memcmp(s->key, probe.key, sizeof *key * (size_t)probe.n)) {
            CUDA_CHECK(cudaGraphLaunch(s->exec, cuda_be_stream(be)));
            g->replays++;
            return false;
        }
    if (g->n >= GRAPHS_MAX) drop_all(g);
    /* a recording that outgrew the temporaries' arena: the recorded graphs point into it, so they go
     * with it (recorded again as their keys come) */
    if (cuda_be_garena_bytes(be) < cuda_be_garena_need(be)) {
        drop_all(g);
        cuda_be_garena_grow(be);
    }
    g->open = (struct seg_graph *)ds_malloc(sizeof *g->open);
    *g->open = probe;
    /* thread-local: another thread's unrelated CUDA calls (an MPI progress thread, say) do not
     * invalidate the recording */
    CUDA_CHECK(cudaStreamBeginCapture(cuda_be_stream(be), cudaStreamCaptureModeThreadLocal));
    cuda_be_set_capturing(be, true);
    return true;
}

void cuda_graph_end(struct backend *be) {
    struct cuda_graphs *g = graphs(be);
    struct seg_graph *s = g->open;
    if (!s) ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "graph_end", "no graph segment is open");
    if (cuda_be_branch_open(be))
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "graph_end", "a graph segment ends with its branch not joined (backend.h)");
    cudaGraph_t graph = NULL;
    CUDA_CHECK(cudaStreamEndCapture(cuda_be_stream(be), &graph));
    cuda_be_set_capturing(be, false);
    /* the kernel nodes keep their lane's priority (captured from the stream); without the flag a
     * graph would run at the priority of the stream it is launched into */
    cudaError_t e = cudaGraphInstantiate(&s->exec, graph, cudaGraphInstantiateFlagUseNodePriority);
    if (e == cudaErrorMemoryAllocation)
        ds_fatal(__FILE__, __LINE__, __func__, "CUDA", "cudaGraphInstantiate",
                 "not enough GPU memory for a decode step's graph (its temporaries live in the graph pool, "
                 "beside the stream-ordered one): lower --max-seqs, or run with --eager");
    CUDA_CHECK(e);
    CUDA_CHECK(cudaGraphDestroy(graph));
    s->next = g->tab[s->hash & (g->cap - 1)];
    g->tab[s->hash & (g->cap - 1)] = s;
    g->n++;
    g->open = NULL;
    g->recordings++;
    /* recording ran nothing: the work of this segment runs now */
    CUDA_CHECK(cudaGraphLaunch(s->exec, cuda_be_stream(be)));
}

void cuda_graphs_free(struct backend *be) {
    struct cuda_graphs **gp = cuda_be_graphs(be);
    if (!*gp) return;
    CUDA_CHECK(cudaStreamSynchronize(cuda_be_stream(be)));
    drop_all(*gp);
    free((*gp)->open);
    free((*gp)->tab);
    free(*gp);
    *gp = NULL;
}

extern "C" void backend_cuda_graph_stats(struct backend *be, long *replays, long *recordings, size_t *mem_high) {
    struct cuda_graphs *g = *cuda_be_graphs(be);
    *replays = g ? g->replays : 0;
    *recordings = g ? g->recordings : 0;
    /* the recordings' temporaries share one physical pool (graphs launched into one stream) */
    int dev = 0;
    unsigned long long high = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetGraphMemAttribute(dev, cudaGraphMemAttrReservedMemHigh, &high));
    *mem_high = (size_t)high + cuda_be_garena_bytes(be); /* and the arena most of them now come from */
}
