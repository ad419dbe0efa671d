/* The subcommands of build/dsbatch. Each takes the arguments after its name and returns the
 * process exit status; bad input prints one error line (ds_die_err) rather than returning. */
#ifndef DS_CLI_H
#define DS_CLI_H

int cmd_inspect(int argc, char **argv);  /* src/inspect.c */
int cmd_mkmodel(int argc, char **argv);  /* src/mkmodel.c */
int cmd_replay(int argc, char **argv);   /* src/cmd_replay.c */
int cmd_verify(int argc, char **argv);   /* src/cmd_replay.c */
int cmd_generate(int argc, char **argv); /* src/generate.c */
int cmd_score(int argc, char **argv);    /* src/generate.c */
int cmd_plan(int argc, char **argv);     /* src/plan.c */
int cmd_prompts(int argc, char **argv);  /* src/cmd_prompts.c */

#endif /* DS_CLI_H */
