/* Progress of long commands on stderr: one line, redrawn in place, only when stderr is a
 * terminal, only once the work has run for PROGRESS_AFTER_S (short runs stay silent),
 * never with --quiet. Pipes, files and CI get nothing. Inside one step the library's
 * progress hook (rp_context_set_progress: bytes of a trace written, verified or
 * validated) moves the line on, so a single huge step is not silent either. */
#include "cli.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PROGRESS_AFTER_S 2.0
#define PROGRESS_EVERY_S 0.2

static struct {
    bool quiet, shown, terminal;
    const char *what;
    double start, last, after_s, every_s;
    int64_t total_units;
    double total_bytes;
    int64_t units_done; /* where the command is (cli_progress_at), for the library's hook */
    double bytes_done;
} bar; /* the line on stderr (not `progress`: the library's hook has that name) */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double env_seconds(const char *name, double fallback)
{
    const char *v = getenv(name);
    return v && *v ? atof(v) : fallback;
}

void cli_progress_quiet(bool quiet)
{
    bar.quiet = quiet;
}

bool cli_progress_quiet_p(void)
{
    return bar.quiet;
}

void cli_progress_begin(const char *what, int64_t total_units, double total_bytes)
{
    /* Tests set these (docs/cli.md): RP_PROGRESS_AFTER_S replaces the 2 s before the
     * line shows, RP_PROGRESS_EVERY_S the 0.2 s between redraws, and RP_PROGRESS_TERMINAL
     * (1 or 0) decides "stderr is a terminal" instead of isatty, so a test sees the
     * line through a pipe. */
    const char *terminal = getenv("RP_PROGRESS_TERMINAL");
    bar.terminal = terminal && *terminal ? strcmp(terminal, "0") != 0 : isatty(STDERR_FILENO);
    bar.after_s = env_seconds("RP_PROGRESS_AFTER_S", PROGRESS_AFTER_S);
    bar.every_s = env_seconds("RP_PROGRESS_EVERY_S", PROGRESS_EVERY_S);
    bar.what = what;
    bar.start = now_s();
    bar.last = 0;
    bar.shown = false;
    bar.total_units = total_units;
    bar.total_bytes = total_bytes;
    bar.units_done = 0;
    bar.bytes_done = 0;
}

static const char *duration(double s, char *buf, size_t size)
{
    if (s < 60) snprintf(buf, size, "%.0fs", ceil(s));
    else if (s < 3600) snprintf(buf, size, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else snprintf(buf, size, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    return buf;
}

/* The line, with `total_bytes` as the byte total (0: none known). */
static void draw(int64_t units_done, double bytes_done, double total_bytes, const char *detail)
{
    if (bar.quiet || !bar.what || !bar.terminal) return;
    double t = now_s(), elapsed = t - bar.start;
    if (elapsed < bar.after_s || (bar.shown && t - bar.last < bar.every_s)) return;
    bar.last = t;
    bar.shown = true;
    char line[512], a[32], b[32], eta[32];
    int n = snprintf(line, sizeof line, "%s", bar.what);
    if (bar.total_units > 0)
        n += snprintf(line + n, sizeof line - (size_t)n, " %lld/%lld", (long long)units_done,
                      (long long)bar.total_units);
    if (bytes_done > 0 && n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, ", %s%s%s, %s/s",
                      cli_human_bytes(bytes_done, a, sizeof a), total_bytes > 0 ? " of ~" : "",
                      total_bytes > 0 ? cli_human_bytes(total_bytes, b, sizeof b) : "",
                      cli_human_bytes(elapsed > 0 ? bytes_done / elapsed : 0, eta, sizeof eta));
    /* the ETA from the bytes when their total is known (it moves inside a step), else
     * from the steps */
    double frac = total_bytes > 0 && bytes_done > 0 ? bytes_done / total_bytes
                  : bar.total_units > 0 ? (double)units_done / (double)bar.total_units : 0;
    if (frac > 0 && frac < 1 && n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, ", ETA %s",
                      duration(elapsed * (1 - frac) / frac, eta, sizeof eta));
    if (detail && n < (int)sizeof line) snprintf(line + n, sizeof line - (size_t)n, "  %s", detail);
    fprintf(stderr, "\r\033[K%s", line);
    fflush(stderr);
}

void cli_progress_update(int64_t units_done, double bytes_done, const char *detail)
{
    bar.units_done = units_done;
    bar.bytes_done = bytes_done;
    draw(units_done, bytes_done, bar.total_bytes, detail);
}

void cli_progress_at(int64_t units_done, double bytes_done)
{
    bar.units_done = units_done;
    bar.bytes_done = bytes_done;
}

void cli_progress_hook(void *ud, const char *what, int64_t done_bytes, int64_t total_bytes)
{
    (void)ud;
    /* a command that counts bytes itself gave their total; one that does not (opening
     * a trace) shows the library's pass as it is */
    double total = bar.total_bytes > 0 ? bar.total_bytes : bar.bytes_done + (double)total_bytes;
    draw(bar.units_done, bar.bytes_done + (double)done_bytes, total, what);
}

void cli_progress_clear(void)
{
    if (bar.shown) fprintf(stderr, "\r\033[K");
    bar.shown = false;
}

void cli_progress_end(void)
{
    if (bar.shown) fprintf(stderr, "\r\033[K");
    fflush(stderr);
    bar.shown = false;
    bar.what = NULL;
}

rp_status cli_trace_open(rp_context *ctx, const char *path, unsigned flags, rp_trace **out, rp_error *err)
{
    cli_progress_begin(path, 0, 0);
    rp_status st = rp_trace_open(ctx, path, flags, out, err);
    cli_progress_end();
    return st;
}
