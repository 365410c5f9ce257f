/* The lever statistics of a simulated step (rp_plan_lever_stats) as flat keys of its
 * metrics in simulate --json (core/cli/levers.c). */
#ifndef RP_CLI_LEVERS_H
#define RP_CLI_LEVERS_H

#include "routepack/routepack.h"

#include <jansson.h>

/* Add lever_replicas, lever_share_sets, lever_extra_replicas, lever_extras_fetched,
 * lever_bytes_fetched and lever_bytes_fetched_ahead to `metrics` (an object; nothing
 * when it or the plan is NULL, or the statistics fail). */
void cli_add_levers(json_t *metrics, const rp_plan *plan, const rp_config *cfg);

#endif
