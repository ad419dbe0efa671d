/* A kernel timeline for the GPU machine, where Nsight Systems cannot make a report: a CUDA injection
 * library (the driver loads it when CUDA_INJECTION64_PATH names it, before the program's first CUDA
 * call, and calls InitializeInjection) that records, through CUPTI's activity API, every kernel's
 * start and end on the device clock, its stream and, for a kernel replayed from a CUDA graph, its
 * graph, plus the moments cuProfilerStart / cuProfilerStop return (bench_step
 * --profiler-range puts them around its timed steps, after a stream sync). At exit it writes
 * `kernel_trace.csv` in the working directory: Nsight Compute (tests/gpu/kernel_times.sh) gives
 * each kernel's duration run alone; this gives them as the step runs, concurrent on their streams,
 * with the gaps between them (tests/bench/step_timeline.py reads it; tests/gpu/step_timeline.sh runs
 * both). CONCURRENT_KERNEL tracing keeps kernels concurrent; it adds a little time per kernel,
 * which the script reports by comparing the traced step with bench_step's own untraced one.
 * Every CUPTI call is checked; a failure prints the call and its message and exits non-zero. */
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRACE_FILE "kernel_trace.csv"
#define TRACE_BUF (8u << 20)

#define CUPTI_CALL(call)                                                                                      \
    do {                                                                                                      \
        CUptiResult r_ = (call);                                                                              \
        if (r_ != CUPTI_SUCCESS) {                                                                            \
            const char *m_ = "?";                                                                             \
            cuptiGetResultString(r_, &m_);                                                                    \
            fprintf(stderr, "cupti_trace: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, m_);                   \
            exit(3);                                                                                          \
        }                                                                                                     \
    } while (0)

struct kernel_rec {
    uint64_t start, end;
    uint32_t stream, graph, corr;
    int32_t grid, block;
    char *name;
};

static struct kernel_rec *g_k;
static size_t g_nk, g_capk;
static uint64_t g_marks[256]; /* profiler start / stop timestamps, in call order */
static int g_mark_on[256];
static int g_nmarks;

static void CUPTIAPI buf_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *buf = aligned_alloc(8, TRACE_BUF);
    if (!*buf) {
        fprintf(stderr, "cupti_trace: out of host memory for an activity buffer\n");
        exit(3);
    }
    *size = TRACE_BUF;
    *max_records = 0;
}

static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
    CUpti_Activity *rec = NULL;
    for (;;) {
        CUptiResult r = cuptiActivityGetNextRecord(buf, valid, &rec);
        if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break;
        CUPTI_CALL(r);
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
        if (g_nk == g_capk) {
            g_capk = g_capk ? 2 * g_capk : 65536;
            g_k = realloc(g_k, g_capk * sizeof *g_k);
            if (!g_k) {
                fprintf(stderr, "cupti_trace: out of host memory for %zu kernel records\n", g_capk);
                exit(3);
            }
        }
        struct kernel_rec *o = &g_k[g_nk++];
        o->start = k->start, o->end = k->end, o->stream = k->streamId, o->graph = k->graphId;
        o->corr = k->correlationId, o->grid = k->gridX * k->gridY * k->gridZ;
        o->block = k->blockX * k->blockY * k->blockZ;
        o->name = strdup(k->name ? k->name : "?");
    }
    free(buf);
}

static void CUPTIAPI on_api(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void *data) {
    /* the driver's cuProfilerStart / Stop: what cudaProfilerStart calls, with the static runtime too */
    const CUpti_CallbackData *cd = data;
    if (domain != CUPTI_CB_DOMAIN_DRIVER_API || cd->callbackSite != CUPTI_API_EXIT) return;
    if (cbid != CUPTI_DRIVER_TRACE_CBID_cuProfilerStart && cbid != CUPTI_DRIVER_TRACE_CBID_cuProfilerStop) return;
    if (g_nmarks < (int)(sizeof g_marks / sizeof g_marks[0])) {
        CUPTI_CALL(cuptiGetTimestamp(&g_marks[g_nmarks]));
        g_mark_on[g_nmarks++] = cbid == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart;
    }
}

/* names go into a quoted CSV field: template arguments carry commas, never quotes */
static void write_trace(void) {
    CUPTI_CALL(cuptiActivityFlushAll(1));
    FILE *f = fopen(TRACE_FILE, "w");
    if (!f) {
        perror("cupti_trace: " TRACE_FILE);
        exit(3);
    }
    fprintf(f, "kind,start_ns,end_ns,stream,graph,corr,grid,block,name\n");
    for (int i = 0; i < g_nmarks; i++)
        fprintf(f, "%s,%llu,%llu,0,0,0,0,0,\"\"\n", g_mark_on[i] ? "range_on" : "range_off",
                (unsigned long long)g_marks[i], (unsigned long long)g_marks[i]);
    for (size_t i = 0; i < g_nk; i++)
        fprintf(f, "kernel,%llu,%llu,%u,%u,%u,%d,%d,\"%s\"\n", (unsigned long long)g_k[i].start,
                (unsigned long long)g_k[i].end, g_k[i].stream, g_k[i].graph, g_k[i].corr, g_k[i].grid, g_k[i].block,
                g_k[i].name);
    if (fclose(f) != 0) {
        perror("cupti_trace: " TRACE_FILE);
        exit(3);
    }
    fprintf(stderr, "cupti_trace: %zu kernels, %d range marks -> " TRACE_FILE "\n", g_nk, g_nmarks);
}

int InitializeInjection(void) {
    CUpti_SubscriberHandle sub;
    CUPTI_CALL(cuptiActivityRegisterCallbacks(buf_requested, buf_completed));
    CUPTI_CALL(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CUPTI_CALL(cuptiSubscribe(&sub, (CUpti_CallbackFunc)on_api, NULL));
    CUPTI_CALL(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStart));
    CUPTI_CALL(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStop));
    atexit(write_trace);
    return 1;
}
