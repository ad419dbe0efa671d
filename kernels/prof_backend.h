/* A profiling decorator for any backend (prof_backend.c): per-op host-clock time, each op followed
 * by the inner backend's sync, for the step breakdown of the benchmarks. */
#ifndef DS_PROF_BACKEND_H
#define DS_PROF_BACKEND_H

#include <stdio.h>

#include "backend.h"

#define PROF_N_OPS_PUBLIC 42

/* be becomes a backend whose ops run on inner and are timed; inner stays owned by the caller. */
void prof_backend_init(struct backend *be, struct backend *inner);
/* The same without the syncs: each op is charged only the host time of its call (the launches and
 * the host work of an asynchronous backend; a download still waits for the device). */
void prof_backend_init_host(struct backend *be, struct backend *inner);
/* A clock on the device's stream: mark records a point after everything enqueued so far and
 * returns its index; ms(a, b) is the device time between two marks, valid once the device has
 * passed b; reset forgets every mark. */
struct prof_clock {
    void *ctx;
    int (*mark)(void *ctx);
    double (*ms)(void *ctx, int a, int b);
    void (*reset)(void *ctx);
};
/* Each op charged its device time between a mark before and one after it, nothing synchronized:
 * the split of a step as the device ran it (the report resolves the marks). */
void prof_backend_init_device(struct backend *be, struct backend *inner, const struct prof_clock *clk);
void prof_backend_reset(struct backend *be);
/* CSV rows "label,op,calls,ms,share%" per op (divided by `per`, e.g. steps); returns seconds per `per`. */
double prof_backend_report(struct backend *be, FILE *f, const char *label, int per);
void prof_backend_free(struct backend *be);
/* Calls of op `op` (its name in the report) since the last reset; -1 for an unknown name. */
long prof_backend_calls(struct backend *be, const char *op);
/* The name of counter i < PROF_N_OPS_PUBLIC (the report's op column), else NULL. */
const char *prof_backend_op_name(int i);

#endif /* DS_PROF_BACKEND_H */
