/* Logging and fatal-error paths shared by every module (see log.h for the two failure kinds).
 * MPI is only touched through weak hooks so the CPU tools that never start MPI still link. */
#include "log.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

static int g_rank = -1, g_stage = -1, g_tp = -1, g_quiet;
static char g_err[1024];

void log_set_identity(int world_rank, int pp_stage, int tp_rank) {
    g_rank = world_rank;
    g_stage = pp_stage;
    g_tp = tp_rank;
}

void log_set_quiet(int quiet) { g_quiet = quiet; }

/* One whole line per write: stderr is unbuffered, and under mpirun the lines of many ranks share one
 * stream, so a prefix written apart from its message can be split by another rank's line. */
static void emit_line(const char *kind, const char *fmt, va_list ap) {
    char line[2048];
    int n = g_rank >= 0 ? snprintf(line, sizeof line, "dsbatch[r%d pp%d tp%d]: %s", g_rank, g_stage, g_tp, kind)
                        : snprintf(line, sizeof line, "dsbatch: %s", kind);
    if (n < 0) n = 0;
    if ((size_t)n < sizeof line) vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    size_t len = strlen(line);
    if (len == sizeof line - 1) len--; /* truncated: keep room for the newline */
    line[len++] = '\n';
    fwrite(line, 1, len, stderr);
}

static void emit(const char *kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(const char *kind, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    emit_line(kind, fmt, ap);
    va_end(ap);
}

void log_info(const char *fmt, ...) {
    if (g_quiet) return;
    va_list ap;
    va_start(ap, fmt);
    emit_line("", fmt, ap);
    va_end(ap);
}

void log_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    emit_line("warning: ", fmt, ap);
    va_end(ap);
}

void ds_err_set(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
}

const char *ds_err_get(void) { return g_err[0] ? g_err : "unknown error"; }

/* abort: a library failure or a stuck peer (one rank knows, the job must end now).
 * Otherwise bad input, which every rank finds the same way (they all read the same files and
 * validate before talking to each other): each prints its own line and leaves through
 * MPI_Finalize, so no rank's message is cut off by another's abort. A rank left waiting in a
 * collective instead is ended by its watchdog. */
static void __attribute__((noreturn)) end_job(int code, bool abort_job) {
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    fflush(stdout);
    fflush(stderr);
    if (up && !down) {
        int size = 1;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        if (size > 1 && abort_job) MPI_Abort(MPI_COMM_WORLD, code);
        MPI_Finalize();
    }
    exit(code);
}

void ds_die_err(void) {
    emit("error: ", "%s", ds_err_get());
    end_job(1, false);
}

void ds_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    ds_die_err();
}

void ds_fatal(const char *file, int line, const char *func, const char *lib, const char *call,
              const char *msg) {
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    fprintf(stderr, "dsbatch: FATAL rank %d (pp %d, tp %d) host %s: %s:%d %s(): %s call `%s` failed: %s\n",
            g_rank, g_stage, g_tp, host, file, line, func, lib, call, msg ? msg : "");
    end_job(2, true);
}

const char *ds_errno_str(void) { return strerror(errno); }

const char *ds_mpi_str(int code) {
    static char buf[MPI_MAX_ERROR_STRING + 1];
    int len = 0;
    if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) snprintf(buf, sizeof buf, "MPI error %d", code);
    return buf;
}

void *ds_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) ds_fatal(__FILE__, __LINE__, __func__, "libc", "malloc", "out of memory");
    return p;
}

void *ds_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) ds_fatal(__FILE__, __LINE__, __func__, "libc", "calloc", "out of memory");
    return p;
}

void *ds_realloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) ds_fatal(__FILE__, __LINE__, __func__, "libc", "realloc", "out of memory");
    return q;
}

char *ds_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = ds_malloc(n);
    memcpy(d, s, n);
    return d;
}
