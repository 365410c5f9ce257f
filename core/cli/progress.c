/* Progress of long commands on stderr: one line, redrawn in place, only when stderr is a
 * terminal, only once the work has run for PROGRESS_AFTER_S (short runs stay silent),
 * never with --quiet. Pipes, files and CI get nothing. */
#include "cli.h"

#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PROGRESS_AFTER_S 2.0
#define PROGRESS_EVERY_S 0.2

#include <stdlib.h>

static struct {
    bool quiet, shown;
    const char *what;
    double start, last, after_s;
    int64_t total_units;
    double total_bytes;
} progress;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void cli_progress_quiet(bool quiet)
{
    progress.quiet = quiet;
}

bool cli_progress_quiet_p(void)
{
    return progress.quiet;
}

void cli_progress_begin(const char *what, int64_t total_units, double total_bytes)
{
    /* RP_PROGRESS_AFTER_S replaces the 2 s (tests show the line on short runs with 0) */
    const char *after = getenv("RP_PROGRESS_AFTER_S");
    progress.after_s = after && *after ? atof(after) : PROGRESS_AFTER_S;
    progress.what = what;
    progress.start = now_s();
    progress.last = 0;
    progress.shown = false;
    progress.total_units = total_units;
    progress.total_bytes = total_bytes;
}

static const char *duration(double s, char *buf, size_t size)
{
    if (s < 60) snprintf(buf, size, "%.0fs", ceil(s));
    else if (s < 3600) snprintf(buf, size, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    else snprintf(buf, size, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    return buf;
}

void cli_progress_update(int64_t units_done, double bytes_done, const char *detail)
{
    if (progress.quiet || !progress.what || !isatty(STDERR_FILENO)) return;
    double t = now_s(), elapsed = t - progress.start;
    if (elapsed < progress.after_s || (progress.shown && t - progress.last < PROGRESS_EVERY_S)) return;
    progress.last = t;
    progress.shown = true;
    char line[512], a[32], b[32], eta[32];
    int n = snprintf(line, sizeof line, "%s %lld/%lld", progress.what, (long long)units_done,
                     (long long)progress.total_units);
    if (bytes_done > 0 && n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, ", %s%s%s, %s/s",
                      cli_human_bytes(bytes_done, a, sizeof a), progress.total_bytes > 0 ? " of ~" : "",
                      progress.total_bytes > 0 ? cli_human_bytes(progress.total_bytes, b, sizeof b) : "",
                      cli_human_bytes(bytes_done / elapsed, eta, sizeof eta));
    double frac = progress.total_units > 0 ? (double)units_done / (double)progress.total_units : 0;
    if (frac > 0 && frac < 1 && n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, ", ETA %s",
                      duration(elapsed * (1 - frac) / frac, eta, sizeof eta));
    if (detail && n < (int)sizeof line) snprintf(line + n, sizeof line - (size_t)n, "  %s", detail);
    fprintf(stderr, "\r\033[K%s", line);
    fflush(stderr);
}

void cli_progress_clear(void)
{
    if (progress.shown) fprintf(stderr, "\r\033[K");
    progress.shown = false;
}

void cli_progress_end(void)
{
    if (progress.shown) fprintf(stderr, "\r\033[K");
    fflush(stderr);
    progress.shown = false;
    progress.what = NULL;
}
