/* The lever statistics of a simulated step as simulate --json's "levers" (docs/cli.md). */
#include "levers.h"

json_t *cli_levers_json(const rp_plan *plan, const rp_config *cfg)
{
    rp_lever_stats s;
    rp_error err;
    if (!plan || rp_plan_lever_stats(plan, cfg, &s, &err) != RP_OK) return NULL;
    return json_pack("{s:i, s:i, s:i, s:i, s:f, s:f}", "replicas", s.replicas, "share_sets", s.share_sets,
                     "extra_replicas", s.extra_replicas, "extras_fetched", s.extras_fetched, "bytes_fetched",
                     s.bytes_fetched, "bytes_fetched_ahead", s.bytes_fetched_ahead);
}
