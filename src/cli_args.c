/* Checked numbers from command-line flags (see cli_args.h). */
#include "cli_args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "log.h"

int64_t cli_int(const char *opt, const char *v, int64_t lo, int64_t hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        ds_die("%s: '%s' is not an integer in [%lld, %lld]", opt, v, (long long)lo, (long long)hi);
    return x;
}

uint64_t cli_u64(const char *opt, const char *v) {
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || *v == '-') ds_die("%s: '%s' is not an integer in [0, 2^64)", opt, v);
    return x;
}

double cli_real(const char *opt, const char *v, double lo, double hi, bool lo_open) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x) || (lo_open ? !(x > lo) : !(x >= lo)) || !(x <= hi)) {
        if (isinf(hi)) ds_die("%s: '%s' is not a number %s %g", opt, v, lo_open ? ">" : ">=", lo);
        ds_die("%s: '%s' is not a number in %c%g, %g]", opt, v, lo_open ? '(' : '[', lo, hi);
    }
    return x;
}
