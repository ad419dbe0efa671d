/* Job specs: a JSON object of a command's options (the files in jobs/), given as `--job FILE.json`. Each
 * key is an option name without the leading dashes ("max-seqs": 8, "logprobs": true,
 * "stop-ids": [1, 7]); the file's options come first and the command line's after them, so a flag
 * overrides the file. The effective option list is kept for the output files' /meta. */
#ifndef DS_JOBSPEC_H
#define DS_JOBSPEC_H

/* Replace `--job FILE` in argv (argv[0] is the command name) by the file's options. On bad input
 * (unreadable file, not an object, a value that is not a string, number, bool or array of them)
 * returns -1 with ds_err_set naming the file and key. *argv_out is owned by the caller. */
int jobspec_expand(int argc, char **argv, int *argc_out, char ***argv_out);

/* The effective options as a JSON object text (caller frees): every --option of argv with its
 * value, later occurrences winning. */
char *jobspec_effective_json(int argc, char **argv);

#endif /* DS_JOBSPEC_H */
