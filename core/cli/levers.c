/* The lever statistics of a simulated step as flat metrics keys (docs/cli.md). */
#include "levers.h"

void cli_add_levers(json_t *metrics, const rp_plan *plan, const rp_config *cfg)
{
    rp_lever_stats s;
    rp_error err;
    if (!metrics || !plan || rp_plan_lever_stats(plan, cfg, &s, &err) != RP_OK) return;
    json_object_set_new(metrics, "lever_replicas", json_integer(s.replicas));
    json_object_set_new(metrics, "lever_share_sets", json_integer(s.share_sets));
    json_object_set_new(metrics, "lever_extra_replicas", json_integer(s.extra_replicas));
    json_object_set_new(metrics, "lever_extras_fetched", json_integer(s.extras_fetched));
    json_object_set_new(metrics, "lever_bytes_fetched", json_real(s.bytes_fetched));
    json_object_set_new(metrics, "lever_bytes_fetched_ahead", json_real(s.bytes_fetched_ahead));
}
