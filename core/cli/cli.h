/* Shared pieces of the routepack command-line tool: the command table, option
 * parsing and error reporting. */
#ifndef RP_CLI_H
#define RP_CLI_H

#include "routepack/routepack.h"
#include "routepack/sched.h"

#include <jansson.h>
#include <stdarg.h>
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
    const char *options; /* the help page's options, one per line, with their defaults */
    const char *example; /* one command line that works from the source tree */
} cli_command;

/* Exit statuses: 0 success, 1 the input was bad or the work failed, 2 usage error. */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2 };

/* Print "routepack: <err.text>" to stderr and return CLI_FAIL. */
int cli_fail(const rp_error *err);
/* Print "routepack: <message>" to stderr and return CLI_USAGE. */
int cli_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Print "routepack: <message>" to stderr and return `code` (cli_usage's, with any exit
 * status). */
int cli_message(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int cli_vmessage(int code, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

/* The name in `names` a typo of `word` most likely meant (at most 2 edits away, fewer
 * than the word's length), or NULL: the "did you mean" of commands, options and policy
 * names. */
const char *cli_closest(const char *word, const char *const *names, size_t count);
/* Records that COMMAND ("simulate", "plan eval", ...) met an unknown option and returns
 * CLI_USAGE; once the command returns, main.c prints "COMMAND: unknown option 'OPT' (did
 * you mean '--opt'?)", the options taken from COMMAND's help page. */
int cli_unknown_option(const char *command, const char *option);
/* The unknown option the command met, if any (main.c prints its suggestion once the
 * command has returned; cli_unknown_option only records it). */
bool cli_unknown_option_taken(const char **command, const char **option);

/* Minimal option parsing: returns true and advances *i when argv[*i] is `name`
 * followed by a value (stored in *value). A missing value is a usage error reported
 * through *bad. */
bool cli_opt(int argc, char **argv, int *i, const char *name, const char **value, bool *bad);
/* A flag option: true, and *flag set, when `arg` is `name` ("--json"). */
bool cli_flag(const char *arg, const char *name, bool *flag);
/* An argument no option of `command` took: an unknown option (recorded, see
 * cli_unknown_option) or a positional one ("COMMAND takes no positional arguments, got
 * 'ARG'" and `hint`, "" for none). Returns CLI_USAGE. */
int cli_stray_arg(const char *command, const char *arg, const char *hint);
/* Print `root` (owned; NULL fails) to stdout as indented JSON in key order, with
 * `precision` significant digits for reals (0: jansson's default), and a newline;
 * false when anything failed. */
bool cli_print_json(json_t *root, int precision);
/* Parse an integer option value; false (with a message) when it is not one. */
bool cli_int(const char *name, const char *text, int64_t *out);

/* Output paths, checked before any work (usage errors, exit 2, naming `option`): a file
 * whose folder exists and is writable, not a folder itself; a folder, created when its
 * parent exists. */
int cli_check_output_file(const char *option, const char *path);
int cli_make_output_dir(const char *option, const char *dir);

/* Progress of long work (core/cli/progress.c): one line on stderr, redrawn, only on a
 * terminal and after ~2 s of work; --quiet (any command) turns it off. `units` are steps
 * (total 0: not shown); `bytes` 0 when not counted; `detail` may be NULL. End clears the
 * line. */
void cli_progress_quiet(bool quiet);
bool cli_progress_quiet_p(void);
void cli_progress_begin(const char *what, int64_t total_units, double total_bytes);
void cli_progress_update(int64_t units_done, double bytes_done, const char *detail);
/* Where the command is, without drawing: the library's passes that follow (the hook
 * below) add their bytes to `bytes_done`. */
void cli_progress_at(int64_t units_done, double bytes_done);
/* The context's progress hook (rp_progress_fn), installed by main: redraws the line
 * inside a step as the trace writer or reader gets on. */
void cli_progress_hook(void *ud, const char *what, int64_t done_bytes, int64_t total_bytes);
/* rp_trace_open with the checksum pass of a huge trace on the line ("PATH, 1.2 GB of
 * ~6.8 GB, ...  verifying"). */
rp_status cli_trace_open(rp_context *ctx, const char *path, unsigned flags, rp_trace **out, rp_error *err);
void cli_progress_end(void);
/* Erase the line before printing a message; the next update draws it again. */
void cli_progress_clear(void);

/* Resolve a bundled example file: RP_EXAMPLES_DIR, then the source tree's examples/,
 * then the install's data directory. Returns a static buffer or NULL. */
const char *cli_example_path(const char *file);

/* The command implementations (one file per group). */
int cmd_trace_gen(rp_context *ctx, int argc, char **argv);
int cmd_trace_info(rp_context *ctx, int argc, char **argv);
int cmd_trace_validate(rp_context *ctx, int argc, char **argv);
int cmd_trace_import(rp_context *ctx, int argc, char **argv);
int cmd_stats(rp_context *ctx, int argc, char **argv);
/* `stats --shift OLD.rpt NEW.rpt` (core/cli/cmd_shift.c). */
int cmd_stats_shift(rp_context *ctx, const char *old_path, const char *new_path, int64_t step, int32_t threads,
                    bool json);
int cmd_simulate(rp_context *ctx, int argc, char **argv);
int cmd_policy_list(rp_context *ctx, int argc, char **argv);
int cmd_policy_check(rp_context *ctx, int argc, char **argv);
int cmd_plan_baseline(rp_context *ctx, int argc, char **argv);
int cmd_plan_eval(rp_context *ctx, int argc, char **argv);
int cmd_plan_validate(rp_context *ctx, int argc, char **argv);
int cmd_memory(rp_context *ctx, int argc, char **argv);
/* One GPU's memory figures as a JSON object (cmd_memory.c; NULL when out of memory). */
struct json_t *cli_memory_json(const rp_gpu_memory *m);

/* A --policies spec with params, `NAME:KEY=VALUE[:KEY=VALUE]` (core/cli/policy_params.c):
 * *name gets NAME and *params_json the params as rp_sched_options.params_json takes them
 * ({"key": value}; for a PACKING+PLACEMENT pair one object per component, KEY written
 * COMPONENT.KEY or, where one component declares it, KEY alone), each value typed and
 * checked against the declared params (unknown keys with a "did you mean"). A spec
 * without ':' (or an existing file) is *name alone, *params_json NULL. Both malloc'd.
 * Returns CLI_OK, or CLI_USAGE after a message. */
int cli_policy_params(rp_context *ctx, const rp_config *cfg, const char *spec, char **name, char **params_json);

/* ---- shared by simulate, policy, plan and memory (input.c; cli_human_bytes and
 * cli_side_name in common.c; errors are filled with the library's rp_fail) ---- */

/* Load a config; `microbatches` > 0 replaces its limits.num_microbatches (errors in the
 * file are still reported against the file's own lines). */
rp_status cli_config_load(rp_context *ctx, const char *path, int64_t microbatches,
                          rp_config **out, rp_error *err);

/* Where the steps of a run come from: a trace, or generator settings (in memory). */
typedef struct cli_input {
    rp_trace *trace;
    rp_gen *gen;
    const char *path;
    int32_t num_steps;       /* steps of the trace, or the settings' step count */
    int32_t num_layers, num_experts, top_k;
} cli_input;

/* Open `trace` or, when it is NULL, generator settings `gen`. */
rp_status cli_input_open(rp_context *ctx, const char *trace, const char *gen, cli_input *in,
                         rp_error *err);
/* The input's model shape must be the config's. */
rp_status cli_input_check(const cli_input *in, const rp_config *cfg, rp_error *err);
/* Batch (caller frees) and routing view of step i, counted from 0; the view is valid
 * until the next read or close. *step_index is the step as recorded. */
rp_status cli_input_read(cli_input *in, int32_t i, rp_batch **batch, rp_routing *routing,
                         int64_t *step_index, rp_error *err);
void cli_input_close(cli_input *in);
/* The bundled example (config-small.json with small.rpt, or with gen-small.json when the
 * trace is absent): paths in static buffers, false when the example cannot be found. */
bool cli_default_example(const char **config, const char **trace, const char **gen);
/* "12.3 MB" into buf. */
const char *cli_human_bytes(double bytes, char *buf, size_t size);
/* Name of a cost-model side ("attention", "dispatch", "expert", "combine"). */
const char *cli_side_name(rp_side side);

#endif
