/* Extra replicas fetched once a step (docs/cost-model.md, "Extra replicas"): what an
 * executor that fetches the step's extras into buffers pays, and, when it fetches them
 * ahead (routepack.torch's set_placement(prefetch=True): every layer's fetch starts at
 * the step's start on a stream of its own, the layer waits for it at its first forward),
 * the part of the fetches the first microbatch's compute does not hide. */
#include "cost_internal.h"

/* Whether (m, l) gives expert e an extra replica on EP rank j. */
static bool extra_on(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t e, int32_t j)
{
    const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
    for (; o < end && o->expert <= e; o++)
        if (o->expert == e)
            for (int32_t i = 0; i < o->num_extra; i++)
                if (st->extra_rank[o->extra_off + i] == j) return true;
    return false;
}

/* Layer l's fetch in EP group q: per receiving EP rank j, its distinct extras of the step
 * (the first microbatch that has one fetches it), each from the rank of the expert's first
 * replica (the lowest slot holding it: set_placement's source) over NVLink when the two
 * GPUs share a node, over the network otherwise; a rank's NVLink and network fetches add,
 * one latency for each link it uses. The layer's time is its slowest receiver's (`mean`:
 * the mean over receivers, the bound's even spread). */
static double fetch_layer(const rp_cost *c, const cost_state *st, int32_t l, int32_t q, bool mean)
{
    const int32_t E = c->E, ep = c->ep;
    const int32_t *rep_off = st->rep_off + (size_t)l * (E + 1), *rep_rank = st->rep_rank + (size_t)l * st->S;
    double most = 0.0, sum = 0.0;
    for (int32_t j = 0; j < ep; j++) {
        int32_t nv = 0, net = 0;
        for (int32_t m = 0; m < st->M; m++) {
            const cost_override *o = st->ov + st->ov_begin[m * c->L + l];
            const cost_override *end = st->ov + st->ov_begin[m * c->L + l + 1];
            for (; o < end; o++) {
                bool here = false, seen = false;
                for (int32_t i = 0; i < o->num_extra && !here; i++) here = st->extra_rank[o->extra_off + i] == j;
                for (int32_t p = 0; here && p < m && !seen; p++) seen = extra_on(c, st, p, l, o->expert, j);
                if (!here || seen) continue;
                int32_t src = rep_off[o->expert + 1] > rep_off[o->expert] ? rep_rank[rep_off[o->expert]] : j;
                if (c->gpu_node[q * ep + src] == c->gpu_node[q * ep + j])
                    nv++;
                else
                    net++;
            }
        }
        double t = 0.0;
        if (nv > 0) t += nv * c->expert_bytes / c->nv_bw + c->nv_lat;
        if (net > 0) t += net * c->expert_bytes / c->net_bw + c->net_lat;
        sum += t;
        if (t > most) most = t;
    }
    return mean ? sum / ep : most;
}

/* The first microbatch's forward compute of group q before layer l's dispatch, within
 * stage r (the fetch shares its links with the dispatch and combine, so only the dense
 * phases and the expert GEMMs of the layers before it and l's own dense phase hide it). */
static double window_before(const rp_cost *c, const cost_state *st, int32_t r, int32_t l, int32_t q)
{
    const double df = st->dfmax[q]; /* m = 0 */
    double w = df;
    for (int32_t k = 0; k < l; k++)
        if (c->layer_stage[k] == r) w += df + st->xmax[(size_t)k * c->Q + q];
    return w;
}

/* Extra-replica fetches of stage r (the sum over its layers, or with `ahead` the part the
 * first microbatch's compute leaves exposed), the slowest EP group's. Fetched ahead, layer
 * l's fetch ends at F(l), the sum of the stage's fetches up to l in layer order, and the
 * layer needs it at C(l) (window_before); the forward waits max over l of F(l) - C(l) in
 * all, or nothing when every fetch is in time. */
double cost_extras_once(const rp_cost *c, const cost_state *st, int32_t r, bool mean, bool ahead)
{
    if (!st->ov_begin) return 0.0;
    double worst = 0.0;
    for (int32_t q = 0; q < c->Q; q++) {
        double fetched = 0.0, wait = 0.0;
        for (int32_t l = 0; l < c->L; l++) {
            if (c->layer_stage[l] != r) continue;
            fetched += fetch_layer(c, st, l, q, mean);
            if (ahead) {
                double late = fetched - window_before(c, st, r, l, q);
                if (late > wait) wait = late;
            }
        }
        double t = ahead ? wait : fetched;
        if (t > worst) worst = t;
    }
    return worst;
}
