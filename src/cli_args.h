/* Numbers from command-line flags, checked: a value that is not a number of the flag's range
 * (--top-p 1.5, --max-seqs x, --temperature -1) is one error line naming the flag and the value,
 * never read as something else (atoi's 0, a silently clamped value). Every subcommand's flags use
 * these. */
#ifndef DS_CLI_ARGS_H
#define DS_CLI_ARGS_H

#include <stdbool.h>
#include <stdint.h>

/* An integer in [lo, hi]. */
int64_t cli_int(const char *opt, const char *v, int64_t lo, int64_t hi);
/* An unsigned 64-bit integer (seeds). */
uint64_t cli_u64(const char *opt, const char *v);
/* A finite number in [lo, hi], or (lo, hi] when lo_open. */
double cli_real(const char *opt, const char *v, double lo, double hi, bool lo_open);

#endif /* DS_CLI_ARGS_H */
