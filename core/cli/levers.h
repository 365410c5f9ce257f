/* The lever statistics of a simulated step (rp_plan_lever_stats) as the "levers" object of
 * its record in simulate --json (core/cli/levers.c). */
#ifndef RP_CLI_LEVERS_H
#define RP_CLI_LEVERS_H

#include "routepack/routepack.h"

#include <jansson.h>

/* {"replicas", "share_sets", "extra_replicas", "extras_fetched", "bytes_fetched",
 * "bytes_fetched_ahead"} of the plan; NULL when it is NULL or the statistics fail. */
json_t *cli_levers_json(const rp_plan *plan, const rp_config *cfg);

#endif
