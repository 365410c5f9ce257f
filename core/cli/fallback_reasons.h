/* Why a simulated policy fell back: its distinct reasons with the first step each occurred
 * at and how often (core/cli/fallback_reasons.c), for simulate's table and report. */
#ifndef RP_CLI_FALLBACK_REASONS_H
#define RP_CLI_FALLBACK_REASONS_H

#include "report.h"

#include <stdbool.h>
#include <stdio.h>

typedef struct cli_reasons {
    rp_report_reason *list; /* texts borrowed from the caller's step records */
    int32_t count, cap;
} cli_reasons;

/* Count `text` at `step`: a new reason, or one more of an equal text. False when out of
 * memory (the reason is then left out). */
bool cli_reasons_add(cli_reasons *r, const char *text, int64_t step);
/* Print the reasons of policy `label` under a table: "  LABEL fell back N times:" then
 * one line per reason (at most `max_lines`, then how many more). Nothing when none. */
void cli_reasons_print(FILE *out, const char *label, const cli_reasons *r, int32_t fallbacks, int32_t max_lines);
void cli_reasons_free(cli_reasons *r);

#endif
