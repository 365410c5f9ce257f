/* Shared pieces of the routepack command-line tool: the command table, option
 * parsing and error reporting. */
#ifndef RP_CLI_H
#define RP_CLI_H

#include "routepack/routepack.h"

#include <stdbool.h>
#include <stdio.h>

/* A subcommand: `routepack <group> [<name>] args...`. `run` gets the arguments after
 * the command words (argv[0] is the first of them) and returns the exit status. */
typedef struct cli_command {
    const char *group;   /* "trace", "stats", ... */
    const char *name;    /* "gen", "info", ...; NULL for a one-word command */
    int (*run)(rp_context *ctx, int argc, char **argv);
    const char *usage;   /* one line: arguments */
    const char *summary; /* one line: what it does */
} cli_command;

/* Exit statuses: 0 success, 1 the input was bad or the work failed, 2 usage error. */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2 };

/* Print "routepack: <err.text>" to stderr and return CLI_FAIL. */
int cli_fail(const rp_error *err);
/* Print "routepack: <message>" to stderr and return CLI_USAGE. */
int cli_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Minimal option parsing: returns true and advances *i when argv[*i] is `name`
 * followed by a value (stored in *value). A missing value is a usage error reported
 * through *bad. */
bool cli_opt(int argc, char **argv, int *i, const char *name, const char **value, bool *bad);
/* Parse an integer option value; false (with a message) when it is not one. */
bool cli_int(const char *name, const char *text, int64_t *out);

/* Resolve a bundled example file: RP_EXAMPLES_DIR, then the source tree's examples/,
 * then the install's data directory. Returns a static buffer or NULL. */
const char *cli_example_path(const char *file);

/* The command implementations (one file per group). */
int cmd_trace_gen(rp_context *ctx, int argc, char **argv);
int cmd_trace_info(rp_context *ctx, int argc, char **argv);
int cmd_trace_validate(rp_context *ctx, int argc, char **argv);
int cmd_trace_import(rp_context *ctx, int argc, char **argv);
int cmd_stats(rp_context *ctx, int argc, char **argv);

#endif
