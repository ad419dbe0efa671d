/* Logging, error reporting and the check-macro family.
 *
 * Two kinds of failure exist in dsbatch and they are handled differently:
 *  - bad input (a truncated checkpoint, a config missing a key): the loader records one line naming
 *    the file and the field with ds_err_set() and returns -1, so tests can call it and the CLI can
 *    print the one line and exit non-zero on every rank;
 *  - a failing library call (libc, MPI, HDF5, zstd, CUDA, NCCL): the CHECK_* macros print rank,
 *    host, file:line, function, the call text and the library's message, then abort the whole job
 *    (MPI_Abort when MPI is up), never one rank alone.
 * The CUDA and NCCL instances live with the CUDA backend so host files stay free of CUDA headers. */
#ifndef DS_LOG_H
#define DS_LOG_H

#include <stdarg.h>
#include <stddef.h>

/* Identity used in every message prefix; set by the topology once MPI is up. */
void log_set_identity(int world_rank, int pp_stage, int tp_rank);
void log_set_quiet(int quiet);

void log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Bad-input errors: one line, kept until the next ds_err_set. */
void ds_err_set(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *ds_err_get(void);

/* Print "dsbatch: error: <last error>" and end the job (MPI_Abort when MPI is initialized). */
void ds_die_err(void) __attribute__((noreturn));
void ds_die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* Library failure: prints who/where/what and aborts the job. `lib` names the library. */
void ds_fatal(const char *file, int line, const char *func, const char *lib, const char *call,
              const char *msg) __attribute__((noreturn));

/* libc calls that return -1 / NULL and set errno. */
#define CHECK_LIBC(call)                                                                        \
    do {                                                                                        \
        if ((call) == -1) ds_fatal(__FILE__, __LINE__, __func__, "libc", #call, ds_errno_str()); \
    } while (0)
#define CHECK_PTR(ptr, call_text)                                                               \
    do {                                                                                        \
        if (!(ptr)) ds_fatal(__FILE__, __LINE__, __func__, "libc", call_text, ds_errno_str());   \
    } while (0)
const char *ds_errno_str(void);

/* MPI calls return an error code once MPI_ERRORS_RETURN is set on the communicators (done at
 * init), so a failure is reported here with MPI's own message instead of MPI's default abort. */
#define CHECK_MPI(call)                                                                         \
    do {                                                                                        \
        int ds_rc_ = (call);                                                                    \
        if (ds_rc_ != 0) ds_fatal(__FILE__, __LINE__, __func__, "MPI", #call, ds_mpi_str(ds_rc_)); \
    } while (0)
const char *ds_mpi_str(int code);

/* HDF5 calls return a negative herr_t / hid_t on failure. */
#define CHECK_H5(call)                                                                          \
    do {                                                                                        \
        if ((long long)(call) < 0) ds_fatal(__FILE__, __LINE__, __func__, "HDF5", #call, "negative return"); \
    } while (0)

/* zstd calls return a size_t that ZSTD_isError() recognises (include zstd.h before use). */
#define CHECK_ZSTD(call)                                                                        \
    do {                                                                                        \
        size_t ds_zr_ = (call);                                                                 \
        if (ZSTD_isError(ds_zr_)) ds_fatal(__FILE__, __LINE__, __func__, "zstd", #call, ZSTD_getErrorName(ds_zr_)); \
    } while (0)

/* Allocation that cannot fail silently. */
void *ds_malloc(size_t n);
void *ds_calloc(size_t n, size_t size);
void *ds_realloc(void *p, size_t n);
char *ds_strdup(const char *s);

#endif /* DS_LOG_H */
