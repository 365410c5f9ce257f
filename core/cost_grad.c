/* The cost of reducing replica gradients after the backward: which experts each
 * executor's reduction carries, between which GPUs, over which links
 * (docs/cost-model.md, "Replica gradients"). */
#include "cost_internal.h"

#include <string.h>

/* Whether expert e has an extra replica at (m, l): the (m, l) overrides are sorted by
 * expert. */
static bool has_extra_at(const rp_cost *c, const cost_state *st, int32_t m, int32_t l, int32_t e)
{
    const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
    for (; o < end && o->expert <= e; o++)
        if (o->expert == e && o->num_extra > 0) return true;
    return false;
}

/* The experts of layer l one all-reduce of the EP group carries (routepack.torch's
 * reduce_replica_grads): those with more than one replica in the placement, and those
 * with an extra replica at some microbatch of the step. */
int32_t cost_grad_experts(const rp_cost *c, const cost_state *st, int32_t l, const int32_t *rep_off)
{
    int32_t R = 0;
    for (int32_t e = 0; e < c->E; e++) R += rep_off[e + 1] - rep_off[e] >= 2;
    if (!st->ov_begin || st->ov_begin[st->M * c->L] == 0) return R;
    for (int32_t m = 0; m < st->M; m++) {
        const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
        for (; o < end; o++) {
            if (o->num_extra == 0 || rep_off[o->expert + 1] - rep_off[o->expert] >= 2) continue;
            bool seen = false;
            for (int32_t k = 0; k < m && !seen; k++) seen = has_extra_at(c, st, k, l, o->expert);
            R += !seen;
        }
    }
    return R;
}

/* The distinct EP ranks holding a copy of expert e over the step at layer l (its replicas
 * in the placement, rep_rank[rep_off[e] ..], and its extra replicas of every microbatch),
 * into out (at most ep), those holding it in a slot first (*slots of them); their count.
 * routepack.torch's replica_holders. */
static int32_t expert_holders(const rp_cost *c, const cost_state *st, int32_t l, int32_t e, const int32_t *rep_off,
                              const int32_t *rep_rank, int32_t *out, int32_t *slots)
{
    int32_t n = 0;
    for (int32_t i = rep_off[e]; i < rep_off[e + 1]; i++) {
        bool seen = false;
        for (int32_t k = 0; k < n && !seen; k++) seen = out[k] == rep_rank[i];
        if (!seen) out[n++] = rep_rank[i];
    }
    *slots = n;
    for (int32_t m = 0; st->ov_begin && m < st->M; m++) {
        const cost_override *o = st->ov + st->ov_begin[m * c->L + l], *end = st->ov + st->ov_begin[m * c->L + l + 1];
        for (; o < end && o->expert <= e; o++) {
            if (o->expert != e) continue;
            for (int32_t i = 0; i < o->num_extra; i++) {
                const int32_t j = st->extra_rank[o->extra_off + i];
                bool seen = false;
                for (int32_t k = 0; k < n && !seen; k++) seen = out[k] == j;
                if (!seen && n < c->ep) out[n++] = j;
            }
        }
    }
    return n;
}

/* Gradient reduction that replicas add, per GPU, for one layer, as the executor runs it
 * (execution.replica_grad_reduce), each expert's gradient at grad_bytes (the executor's
 * dtype):
 * - pairwise: every replica beyond the first (lowest slot) of an expert runs one
 *   two-party all-reduce of the expert's gradient with the first replica's GPU, in every
 *   EP group; each of the two GPUs sends and receives the gradient's bytes once, over
 *   NVLink inside a node and the network across nodes, plus that link's latency. Replicas
 *   on the same GPU add nothing (a local sum).
 * - group: one ring all-reduce of [R, params] over each EP group (routepack.torch), R the
 *   experts cost_grad_experts counts (none: no collective): every GPU of the group sends
 *   and receives 2 (ep - 1) / ep of its bytes, in 2 (ep - 1) steps of one latency each,
 *   over the network when the group spans nodes.
 * - holders: every distinct holder of an expert (its replicas and the step's extra
 *   replicas, expert_holders) sends its gradient to every other holder that keeps the
 *   expert in a slot (s of the n holders); only those receive (routepack.torch's batched
 *   exchange among holders: a holder of extra replicas alone drops them after the step,
 *   so it needs no sum). Each message is the gradient's bytes over that pair's link plus
 *   the link's latency; one batch, so a GPU takes the longer of its sends and its
 *   receives (full duplex), summed over its experts. The holders also move gradients
 *   through their own memory: each message is read where it is sent and written where it
 *   is received, and a slot holder adds the n - 1 copies it receives into its own
 *   gradient in place (a read of both, a write: 3 passes each), so (s - 1) + 4 (n - 1)
 *   passes over the gradient's bytes there (5 (n - 1) when every holder keeps a slot);
 *   a holder of extra replicas alone only reads what it sends, s passes
 *   (routepack.torch's copy-free exchange, issue 29: on 4 CPU ranks the holders had
 *   spent ~7 ms a step on copies the model did not price before it).
 * `bytes` (NULL: not wanted) gets what each GPU of EP group 0 sends. */
void cost_grad_layer(const rp_cost *c, const cost_state *st, int32_t layer, const int32_t *rep_off,
                     const int32_t *rep_rank, double *row, double *bytes)
{
    cost_count(c, (int64_t)c->G + c->E);
    for (int32_t g = 0; g < c->G; g++) row[g] = 0.0;
    if (bytes)
        for (int32_t j = 0; j < c->ep; j++) bytes[j] = 0.0;
    if (c->grad_form == RP_GRAD_REDUCE_HOLDERS) {
        /* per GPU: its sends' link time in row, its receives' in recv, its memory passes'
         * in mem; then row = max(sends, receives) + memory */
        int32_t held[256], *h = held;
        double small[2 * 256], *recv = small;
        void *big = NULL;
        if (c->ep > 256 || c->G > 256) { /* rare: EP or GPUs > 256 */
            big = rp_alloc(c->ctx, (size_t)c->ep * sizeof *h + 2 * (size_t)c->G * sizeof *recv);
            recv = big;
            h = big ? (int32_t *)(recv + 2 * (size_t)c->G) : NULL;
        }
        double *mem = recv + c->G;
        for (int32_t g = 0; h && g < c->G; g++) recv[g] = mem[g] = 0.0;
        for (int32_t e = 0; h && e < c->E; e++) {
            int32_t s = 0; /* h[0 .. s) keep e in a slot: they receive */
            const int32_t n = expert_holders(c, st, layer, e, rep_off, rep_rank, h, &s);
            cost_count(c, (int64_t)n * n * c->Q + rep_off[e + 1] - rep_off[e]);
            if (n < 2) continue;
            for (int32_t a = 0; a < n; a++) {
                const int32_t sends = a < s ? s - 1 : s, receives = a < s ? n - 1 : 0;
                if (bytes) bytes[h[a]] += sends * c->grad_bytes;
                for (int32_t q = 0; q < c->Q; q++) mem[q * c->ep + h[a]] += (sends + 4.0 * receives) * c->grad_mem_s;
            }
            for (int32_t q = 0; q < c->Q; q++)
                for (int32_t a = 0; a < n; a++)
                    for (int32_t b = 0; b < s; b++) { /* a sends to slot holder b */
                        if (a == b) continue;
                        const int32_t ga = q * c->ep + h[a], gb = q * c->ep + h[b];
                        const double t = c->gpu_node[ga] == c->gpu_node[gb] ? c->grad_bytes / c->nv_bw + c->nv_lat
                                                                            : c->grad_bytes / c->net_bw + c->net_lat;
                        row[ga] += t;
                        recv[gb] += t;
                    }
        }
        for (int32_t g = 0; h && g < c->G; g++) row[g] = (row[g] > recv[g] ? row[g] : recv[g]) + mem[g];
        rp_free(c->ctx, big);
        return;
    }
    if (c->grad_form == RP_GRAD_REDUCE_GROUP) {
        const int32_t R = c->ep > 1 ? cost_grad_experts(c, st, layer, rep_off) : 0;
        if (R == 0) return;
        const double steps = 2.0 * (c->ep - 1);
        for (int32_t q = 0; q < c->Q; q++) {
            const int32_t g0 = q * c->ep;
            const bool in_node = c->gpu_node[g0] == c->gpu_node[g0 + c->ep - 1];
            const double t = steps / c->ep * R * c->grad_bytes / (in_node ? c->nv_bw : c->net_bw) +
                             steps * (in_node ? c->nv_lat : c->net_lat);
            for (int32_t g = g0; g < g0 + c->ep; g++) row[g] = t;
        }
        if (bytes)
            for (int32_t j = 0; j < c->ep; j++) bytes[j] = steps / c->ep * R * c->grad_bytes;
        return;
    }
    const double nv = c->grad_bytes / c->nv_bw + c->nv_lat;
    const double net = c->grad_bytes / c->net_bw + c->net_lat;
    for (int32_t e = 0; e < c->E; e++) {
        if (rep_off[e + 1] - rep_off[e] < 2) continue;
        int32_t first = rep_rank[rep_off[e]];
        for (int32_t i = rep_off[e] + 1; i < rep_off[e + 1]; i++) {
            int32_t r = rep_rank[i];
            cost_count(c, 1);
            if (r == first) continue;
            if (bytes) bytes[first] += c->grad_bytes, bytes[r] += c->grad_bytes;
            cost_count(c, c->Q);
            for (int32_t q = 0; q < c->Q; q++) {
                int32_t a = q * c->ep + first, b = q * c->ep + r;
                double t = c->gpu_node[a] == c->gpu_node[b] ? nv : net;
                row[a] += t;
                row[b] += t;
            }
        }
    }
}

/* max over GPUs of the per-layer rows summed in layer order; `row` replaces layer
 * `layer` when given (a trial), else the state's rows are used as they are. */
double cost_grad_total(const rp_cost *c, const cost_state *st, int32_t layer, const double *row)
{
    double worst = 0.0;
    cost_count(c, (int64_t)c->G * c->L * c->PP);
    /* under PP the stages reduce their own layers' replicas at once: the slowest GPU of
     * the slowest stage */
    for (int32_t r = 0; r < c->PP; r++)
        for (int32_t g = 0; g < c->G; g++) {
            double sum = 0.0;
            for (int32_t l = 0; l < c->L; l++)
                if (c->layer_stage[l] == r) sum += (row && l == layer) ? row[g] : st->grad_gpu[(size_t)l * c->G + g];
            if (sum > worst) worst = sum;
        }
    return worst;
}
