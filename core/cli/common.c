/* Helpers every command shares, below them all: messages and exit codes, options,
 * flags and integers, JSON output, the bundled example's files, byte counts and side names. The one piece of
 * state is an unknown option a command met, which main.c (holding the command table,
 * above every command) turns into a suggestion once the command returns. */
#include "cli.h"
#include "internal.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct {
    char command[64], option[64];
    bool pending;
} unknown;

int cli_unknown_option(const char *command, const char *option)
{
    snprintf(unknown.command, sizeof unknown.command, "%s", command);
    snprintf(unknown.option, sizeof unknown.option, "%s", option);
    unknown.pending = true;
    return CLI_USAGE;
}

bool cli_unknown_option_taken(const char **command, const char **option)
{
    if (!unknown.pending) return false;
    unknown.pending = false;
    *command = unknown.command;
    *option = unknown.option;
    return true;
}

int cli_fail(const rp_error *err)
{
    fprintf(stderr, "routepack: %s\n", err->text[0] ? err->text : rp_strerror(err->status));
    return CLI_FAIL;
}

int cli_vmessage(int code, const char *fmt, va_list ap)
{
    fprintf(stderr, "routepack: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    return code;
}

int cli_message(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cli_vmessage(code, fmt, ap);
    va_end(ap);
    return code;
}

int cli_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cli_vmessage(CLI_USAGE, fmt, ap);
    va_end(ap);
    return CLI_USAGE;
}

const char *cli_closest(const char *word, const char *const *names, size_t count)
{
    /* a typo: at most 2 edits, and fewer than the word has letters ("-x" suggests nothing) */
    size_t len = strlen(word), best_d = len > 2 ? 3 : len;
    const char *best = NULL;
    for (size_t i = 0; i < count; i++) {
        size_t d = rp_edit_distance(word, names[i]);
        if (d < best_d) best_d = d, best = names[i];
    }
    return best;
}

bool cli_opt(int argc, char **argv, int *i, const char *name, const char **value, bool *bad)
{
    if (strcmp(argv[*i], name) != 0) return false;
    if (*i + 1 >= argc) {
        cli_usage("%s needs a value", name);
        *bad = true;
        return true;
    }
    *value = argv[++*i];
    return true;
}

bool cli_int(const char *name, const char *text, int64_t *out)
{
    char *end;
    long long v = strtoll(text, &end, 10);
    if (!*text || *end) {
        cli_usage("%s expects an integer, got '%s'", name, text);
        return false;
    }
    *out = v;
    return true;
}

const char *cli_example_path(const char *file)
{
    static char path[4096];
    const char *dirs[3] = {getenv("RP_EXAMPLES_DIR"), RP_SOURCE_DIR "/examples", RP_DATADIR "/examples"};
    for (int i = 0; i < 3; i++) {
        if (!dirs[i]) continue;
        snprintf(path, sizeof path, "%s/%s", dirs[i], file);
        if (access(path, R_OK) == 0) return path;
    }
    return NULL;
}

const char *cli_human_bytes(double bytes, char *buf, size_t size)
{
    if (bytes >= 1e9) snprintf(buf, size, "%.2f GB", bytes / 1e9);
    else if (bytes >= 1e6) snprintf(buf, size, "%.1f MB", bytes / 1e6);
    else if (bytes >= 1e3) snprintf(buf, size, "%.1f KB", bytes / 1e3);
    else snprintf(buf, size, "%.0f B", bytes);
    return buf;
}

const char *cli_side_name(rp_side side)
{
    switch (side) {
    case RP_SIDE_ATTENTION: return "attention";
    case RP_SIDE_DISPATCH: return "dispatch";
    case RP_SIDE_EXPERT: return "expert";
    case RP_SIDE_COMBINE: return "combine";
    }
    return "?";
}

bool cli_flag(const char *arg, const char *name, bool *flag)
{
    if (strcmp(arg, name) != 0) return false;
    *flag = true;
    return true;
}

int cli_stray_arg(const char *command, const char *arg, const char *hint)
{
    if (arg[0] == '-' && arg[1]) return cli_unknown_option(command, arg);
    return cli_usage("%s takes no positional arguments, got '%s'%s", command, arg, hint);
}

bool cli_print_json(json_t *root, int precision)
{
    size_t flags = JSON_INDENT(2) | JSON_PRESERVE_ORDER | (precision > 0 ? JSON_REAL_PRECISION(precision) : 0);
    bool good = root && json_dumpf(root, stdout, flags) == 0 && putchar('\n') != EOF;
    json_decref(root);
    return good;
}
