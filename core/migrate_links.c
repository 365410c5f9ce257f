/* Migration time per EP rank (migrate_links.h; docs/cost-model.md, "Migration"). */
#include "migrate_links.h"

int32_t migrate_links_ep_ranks(const rp_topology *t)
{
    return t->tensor_parallel_size * t->context_parallel_size / t->expert_tensor_parallel_size;
}

void migrate_links_init(migrate_links *ml, const rp_topology *t, double hbm_bytes_per_s)
{
    const int32_t etp = t->expert_tensor_parallel_size;
    ml->ep_ranks = migrate_links_ep_ranks(t);
    ml->nv_bw = etp * t->nvlink_bytes_per_s;
    ml->net_bw = etp * t->net_bytes_per_s;
    ml->nv_lat = t->nvlink_latency_s;
    ml->net_lat = t->net_latency_s;
    ml->hbm_bw = etp * hbm_bytes_per_s;
}

double migrate_links_s(const migrate_links *ml, double nv_bytes, double net_bytes, double hbm_bytes)
{
    double s = 0.0;
    if (nv_bytes > 0) s += nv_bytes / ml->nv_bw + ml->nv_lat;
    if (net_bytes > 0) s += net_bytes / ml->net_bw + ml->net_lat;
    return s + hbm_bytes / ml->hbm_bw;
}
