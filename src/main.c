/* build/dsbatch: subcommand dispatch. Commands that run the engine start MPI themselves; the
 * file tools (inspect, plan, mkmodel) do not need it. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "jobspec.h"
#include "log.h"

struct command {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
};

static const struct command commands[] = {
    {"generate", cmd_generate, "generate continuations for prompts (JSONL) on a model folder"},
    {"score", cmd_score, "per-token log-probabilities and NLL of prompts (JSONL)"},
    {"replay", cmd_replay, "run a golden fixture through the engine, write its results"},
    {"verify", cmd_verify, "replay every fixture of a golden folder and judge it layer by layer"},
    {"inspect", cmd_inspect, "validate a model folder and print parameters and bytes by role/rank"},
    {"plan", cmd_plan, "per-rank weight, Engram, KV cache and workspace bytes of a TP x PP layout"},
    {"mkmodel", cmd_mkmodel, "write a synthetic checkpoint in the official format"},
    {"prompts", cmd_prompts, "build an HDF5 prompt file from JSONL or token ids, or --check one"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: dsbatch COMMAND [options]   (dsbatch COMMAND --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof *commands; i++)
        if (!strcmp(argv[1], commands[i].name)) {
            /* a job spec (--job FILE.json) becomes the command's first options; flags override */
            int n;
            char **args;
            if (jobspec_expand(argc - 1, argv + 1, &n, &args)) ds_die_err();
            return commands[i].fn(n, args);
        }
    fprintf(stderr, "dsbatch: error: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
