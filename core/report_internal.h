/* The HTML report's sections, one file each (core/report_*.c), and what they share. */
#ifndef RP_REPORT_INTERNAL_H
#define RP_REPORT_INTERNAL_H

#include "report.h"
#include "report_svg.h"

/* The policy ran at least one step, so it has figures to chart. */
bool report_charted(const rp_report_policy *p);
/* The longest label of the charted policies, in characters (legend widths). */
size_t report_longest_label(const rp_report *r);

/* Step and migration time per step; the migration table; plan time against step time. */
void report_steps(text_buf *b, const rp_report *r);
/* The expert load the placements left at rp_report.load_step: bars or heatmaps. */
void report_expert_load(text_buf *b, const rp_report *r);

/* Memory per GPU: the busiest GPU of each policy's run against the capacity. */
void report_memory(text_buf *b, const rp_report *r);

#endif
