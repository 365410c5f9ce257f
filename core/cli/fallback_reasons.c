/* A simulated policy's fallback reasons: distinct texts in the order they first occurred,
 * each with its first step and count, printed under simulate's table and given to the
 * HTML report (issue 32: the reasons were in --json alone). */
#include "fallback_reasons.h"

#include <stdlib.h>
#include <string.h>

bool cli_reasons_add(cli_reasons *r, const char *text, int64_t step)
{
    if (!text || !*text) return true;
    for (int32_t i = 0; i < r->count; i++)
        if (strcmp(r->list[i].text, text) == 0) {
            r->list[i].count++;
            return true;
        }
    if (r->count == r->cap) {
        int32_t cap = r->cap ? 2 * r->cap : 8;
        rp_report_reason *more = realloc(r->list, (size_t)cap * sizeof *more);
        if (!more) return false;
        r->list = more;
        r->cap = cap;
    }
    r->list[r->count++] = (rp_report_reason){text, step, 1};
    return true;
}

void cli_reasons_print(FILE *out, const char *label, const cli_reasons *r, int32_t fallbacks, int32_t max_lines)
{
    if (r->count == 0) return;
    fprintf(out, "  %s fell back at %d step%s:\n", label, (int)fallbacks, fallbacks == 1 ? "" : "s");
    for (int32_t i = 0; i < r->count && i < max_lines; i++) {
        const rp_report_reason *why = &r->list[i];
        if (why->count > 1)
            fprintf(out, "    step %lld first, %d steps: %s\n", (long long)why->first_step, (int)why->count, why->text);
        else
            fprintf(out, "    step %lld: %s\n", (long long)why->first_step, why->text);
    }
    if (r->count > max_lines)
        fprintf(out, "    ... and %d more reason%s (--json has every step's)\n", (int)(r->count - max_lines),
                r->count - max_lines == 1 ? "" : "s");
}

void cli_reasons_free(cli_reasons *r)
{
    free(r->list);
    memset(r, 0, sizeof *r);
}
