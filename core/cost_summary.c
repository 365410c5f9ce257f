/* What an evaluation reports: the summary (step, straggler, phases), the pipeline's,
 * the per-layer accessors and the breakdown JSON (docs/cost-model.md). */
#include "cost_internal.h"
#include "textbuf.h"
#include "routepack/executor.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---- summary and breakdown ------------------------------------------------------- */

/* Phase maxima of (m, l) over sync domain q (-1: every group): forward dense phase and
 * backward, dispatch, experts, and the GPUs that set the forward ones. */
typedef struct phase_max {
    double df, db, d, x;
    int32_t dfarg, darg, xarg;
} phase_max;

static phase_max domain_phases(const rp_cost *c, const cost_state *s, int32_t m, int32_t l, int32_t q)
{
    const size_t ml = (size_t)m * c->L + l, mq = (size_t)m * c->Q;
    const int32_t q0 = q < 0 ? 0 : q, q1 = q < 0 ? c->Q : q + 1;
    phase_max p = {-1, -1, -1, -1, 0, 0, 0};
    for (int32_t k = q0; k < q1; k++) {
        if (s->dfmax[mq + k] > p.df) p.df = s->dfmax[mq + k], p.dfarg = s->dfarg[mq + k];
        if (s->dbmax[mq + k] > p.db) p.db = s->dbmax[mq + k];
        if (s->dmax[ml * c->Q + k] > p.d) p.d = s->dmax[ml * c->Q + k], p.darg = s->darg[ml * c->Q + k];
        if (s->xmax[ml * c->Q + k] > p.x) p.x = s->xmax[ml * c->Q + k], p.xarg = s->xarg[ml * c->Q + k];
    }
    return p;
}

/* The largest forward phase term of (m, l) in domain q: the dense phase (side attention),
 * dispatch or experts, and the GPU that sets it; ties to the earlier side. */
static rp_side layer_straggler(const rp_cost *c, const cost_state *s, int32_t m, int32_t l, int32_t q,
                               int32_t *gpu, double *value)
{
    phase_max p = domain_phases(c, s, m, l, q);
    rp_side side = RP_SIDE_ATTENTION;
    double best = p.df;
    *gpu = p.dfarg;
    if (p.d > best) {
        best = p.d;
        side = RP_SIDE_DISPATCH;
        *gpu = p.darg;
    }
    if (p.x > best) {
        best = p.x;
        side = RP_SIDE_EXPERT;
        *gpu = p.xarg;
    }
    if (value) *value = best;
    return side;
}

/* The sync domain that sets the step (-1 under global sync: every GPU). */
static int32_t summary_domain(const rp_cost *c, const cost_state *s)
{
    return c->sync == RP_SYNC_GROUP ? cost_critical_domain(c, s) : -1;
}

void cost_summary(const rp_cost *c, const cost_state *s, rp_cost_summary *out)
{
    const int32_t M = s->M, L = c->L, G = c->G, ep = c->ep;
    /* with cost_bound_step's loops */
    cost_count(c, (int64_t)M * G + (int64_t)M * L * (5 * (int64_t)c->Q + (int64_t)c->Q * ep + 3 * (int64_t)G + ep + 1) +
                      (int64_t)L * G);
    memset(out, 0, sizeof *out);
    const int32_t dom = summary_domain(c, s);
    double attn = 0, disp = 0, expert = 0, a_imb = 0, x_imb = 0, best = -1;
    for (int32_t m = 0; m < M; m++) {
        double sum = 0, amax = 0;
        for (int32_t g = 0; g < G; g++) {
            double a = s->attn[(size_t)g * M + m];
            sum += a;
            if (a > amax) amax = a;
        }
        double mean = sum / G;
        a_imb += mean > 0 ? amax / mean : 1.0;
        for (int32_t l = 0; l < L; l++) {
            size_t ml = (size_t)m * L + l;
            phase_max p = domain_phases(c, s, m, l, dom);
            attn += p.df + p.db;
            disp += p.d;
            expert += p.x;
            for (int32_t q = 0; q < c->Q; q++) {
                double gsum = 0;
                for (int32_t r = 0; r < ep; r++) gsum += s->expert[ml * G + (size_t)q * ep + r];
                double gmean = gsum / ep;
                x_imb += gmean > 0 ? s->xmax[ml * c->Q + q] / gmean : 1.0;
            }
            int32_t gpu;
            double value;
            rp_side side = layer_straggler(c, s, m, l, dom, &gpu, &value);
            if (value > best) {
                best = value;
                out->straggler_gpu = gpu;
                out->straggler_mb = m;
                out->straggler_layer = l;
                out->straggler_side = side;
            }
        }
    }
    /* every epoch runs every microbatch again; the replica gradient reduction follows
     * every mini-batch (factors of 1 leave the figures as they were) */
    const double E = c->epochs, EK = (double)c->epochs * c->K;
    out->step_s = s->step_s;
    out->attention_s = E * attn;
    out->dispatch_s = E * ((1.0 + c->bwd.communication) * disp);
    out->expert_s = E * ((1.0 + c->bwd.experts) * expert);
    out->combine_s = out->dispatch_s;
    out->grad_reduce_s = EK * s->grad_s;
    out->extra_copy_s = E * s->extra_s;
    out->lower_bound_s = cost_bound_step(c, s);
    out->ratio = out->lower_bound_s > 0 ? out->step_s / out->lower_bound_s : 1.0;
    out->attention_imbalance = a_imb / M;
    out->expert_imbalance = x_imb / ((double)M * L * c->Q);
}

/* The sync domain that sets mini-batch b's time, as cost_step_from takes it. */
static int32_t minibatch_domain(const rp_cost *c, const cost_state *s, int32_t b, double *time)
{
    int32_t q = 0;
    double worst = 0.0;
    for (int32_t d = 0; d < c->NQ; d++) {
        double sum = cost_pipe_domain(c, s, s->layer_t, d, b);
        if (d == 0 || sum > worst) worst = sum, q = d;
    }
    if (time) *time = worst;
    return q;
}

/* Pipeline figures (docs/cost-model.md, "Pipeline figures"): per mini-batch (each its own
 * pipeline) the critical path of the sync domain that sets it, and each stage's own
 * passes in that domain; summed over the mini-batches, times the epochs. Not on a hot
 * path: the domains' paths are recomputed per stage rather than kept. */
static void pipeline_summary(const rp_cost *c, const cost_state *s, rp_pipeline_summary *out)
{
    const int32_t L = c->L, Mk = s->M / c->K;
    memset(out, 0, sizeof *out);
    out->stages = c->PP;
    out->step_s = s->step_s;
    for (int32_t b = 0; b < c->K; b++) {
        double worst;
        minibatch_domain(c, s, b, &worst);
        out->critical_path_s += worst;
    }
    out->critical_path_s *= c->epochs;
    out->stage_busy_s = out->critical_path_s; /* one stage: the path is its passes */
    for (int32_t r = 0; r < c->PP && c->PP > 1; r++) {
        double busy = 0.0;
        for (int32_t b = 0; b < c->K; b++) {
            const int32_t q = minibatch_domain(c, s, b, NULL);
            const int32_t *order = cost_domain_order(c, s, q);
            for (int32_t pos = b * Mk; pos < (b + 1) * Mk; pos++) {
                const int32_t m = order ? order[pos] : pos;
                for (int32_t l = 0; l < L; l++)
                    if (c->layer_stage[l] == r) {
                        const double *t = s->layer_t + ((size_t)m * L + l) * c->LW;
                        busy += t[c->NQ + q] + t[2 * c->NQ + q];
                    }
            }
        }
        busy *= c->epochs;
        if (r == 0 || busy > out->stage_busy_s) {
            out->stage_busy_s = busy;
            out->busiest_stage = r;
        }
    }
    out->bubble_s = out->critical_path_s > out->stage_busy_s ? out->critical_path_s - out->stage_busy_s : 0.0;
}

rp_status rp_cost_pipeline_summary(const rp_cost *c, rp_pipeline_summary *out, rp_error *err)
{
    if (!c || !out) return rp_fail(err, RP_EINVAL, "cost: evaluator and output are required");
    if (!c->st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    pipeline_summary(c, c->st, out);
    return RP_OK;
}

const double *rp_cost_attention_breakdown(const rp_cost *c) { return c && c->st ? c->st->attn : NULL; }
const double *rp_cost_expert_breakdown(const rp_cost *c) { return c && c->st ? c->st->expert : NULL; }
const double *rp_cost_dispatch_breakdown(const rp_cost *c) { return c && c->st ? c->st->dispatch : NULL; }
const double *rp_cost_combine_breakdown(const rp_cost *c) { return c && c->st ? c->st->dispatch : NULL; }

double rp_cost_current_s(const rp_cost *c) { return c && c->st ? c->st->step_s : NAN; }

rp_status rp_cost_current_summary(const rp_cost *c, rp_cost_summary *out, rp_error *err)
{
    if (!c || !out) return rp_fail(err, RP_EINVAL, "cost: evaluator and output are required");
    if (!c->st) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    cost_summary(c, c->st, out);
    return RP_OK;
}

double rp_cost_layer_s(const rp_cost *c, int32_t mb, int32_t layer)
{
    if (!c || !c->st || mb < 0 || mb >= c->st->M || layer < 0 || layer >= c->L) return NAN;
    const double *t = c->st->layer_t + ((size_t)mb * c->L + layer) * c->LW;
    double worst = t[0];
    for (int32_t q = 1; q < c->NQ; q++)
        if (t[q] > worst) worst = t[q];
    return worst;
}

rp_side rp_cost_layer_straggler(const rp_cost *c, int32_t mb, int32_t layer, int32_t *gpu)
{
    int32_t g = -1;
    rp_side side = RP_SIDE_ATTENTION;
    if (c && c->st && mb >= 0 && mb < c->st->M && layer >= 0 && layer < c->L)
        side = layer_straggler(c, c->st, mb, layer, summary_domain(c, c->st), &g, NULL);
    if (gpu) *gpu = g;
    return side;
}

int64_t rp_cost_operations(const rp_cost *c) { return c ? c->ops : 0; }

size_t rp_cost_bytes(const rp_cost *c)
{
    if (!c) return 0;
    size_t total = sizeof *c + (size_t)c->G * sizeof *c->gpu_node + 2 * (size_t)c->slot_table_n * sizeof(double);
    if (c->st) total += c->st->bytes + c->sc.bytes;
    if (c->packed) total += c->packed->bytes;
    return total;
}

/* ---- JSON ------------------------------------------------------------------------ */

static void sb_array(text_buf *b, const double *v, size_t n, size_t stride)
{
    text_put(b, "[");
    for (size_t i = 0; i < n; i++) text_put(b, "%s%.17g", i ? "," : "", v[i * stride]);
    text_put(b, "]");
}

rp_status rp_cost_breakdown_json(const rp_cost *c, char **text, size_t *len, rp_error *err)
{
    if (!c || !text) return rp_fail(err, RP_EINVAL, "cost: evaluator and output are required");
    const cost_state *s = c->st;
    if (!s) return rp_fail(err, RP_EINVAL, "cost: no plan has been evaluated yet");
    const int32_t M = s->M, L = c->L, G = c->G;
    rp_cost_summary sum;
    cost_summary(c, s, &sum);
    const rp_backward *bw = &rp_config_hardware(c->cfg)->backward;
    text_buf b = {c->ctx, NULL, 0, 0, false};
    text_put(&b, "{\n\"summary\": {\"step_s\": %.17g, \"lower_bound_s\": %.17g, \"ratio\": %.17g, "
              "\"attention_s\": %.17g, \"dispatch_s\": %.17g, \"expert_s\": %.17g, \"combine_s\": %.17g, "
              "\"grad_reduce_s\": %.17g, \"extra_copy_s\": %.17g, \"attention_imbalance\": %.17g, "
              "\"expert_imbalance\": %.17g, \"straggler\": {\"gpu\": %d, \"microbatch\": %d, "
              "\"layer\": %d, \"side\": \"%s\"}",
              sum.step_s, sum.lower_bound_s, sum.ratio, sum.attention_s, sum.dispatch_s, sum.expert_s,
              sum.combine_s, sum.grad_reduce_s, sum.extra_copy_s, sum.attention_imbalance,
              sum.expert_imbalance, sum.straggler_gpu, sum.straggler_mb, sum.straggler_layer,
              cost_side_name(sum.straggler_side));
    if (c->PP > 1) { /* PP 1 documents keep their keys */
        rp_pipeline_summary pipe;
        pipeline_summary(c, s, &pipe);
        text_put(&b, ", \"pipeline\": {\"stages\": %d, \"critical_path_s\": %.17g, \"busiest_stage\": %d, "
                  "\"stage_busy_s\": %.17g, \"bubble_s\": %.17g}",
                  pipe.stages, pipe.critical_path_s, pipe.busiest_stage, pipe.stage_busy_s, pipe.bubble_s);
    }
    text_put(&b, "},\n");
    static const char *const sync_names[] = {"group", "global"}, *const overlap_names[] = {"none", "layer"},
                             *const dedup_names[] = {"choice", "gpu", "node"};
    const rp_execution *xe = rp_config_execution(c->cfg);
    text_put(&b, "\"execution\": {\"executor\": \"%s\", \"sync\": \"%s\", \"overlap\": \"%s\", "
              "\"dispatch_dedup\": \"%s\", \"dispatch_bytes_per_element\": %d, \"combine_bytes_per_element\": %d, "
              "\"host_us_per_layer\": %.17g},\n",
              rp_executor_name(xe->executor), sync_names[c->sync], overlap_names[c->overlap], dedup_names[c->dedup],
              xe->dispatch_bytes_per_element, xe->combine_bytes_per_element, xe->host_s_per_layer * 1e6);
    /* what the replica gradient reduction carries per layer: under "group" the EP group's
     * one all-reduce of [R, params] (routepack.torch's buffer, R experts) */
    static const char *const grad_names[] = {"pairwise", "group", "holders"};
    text_put(&b, "\"replica_grad\": {\"form\": \"%s\", \"bytes_per_element\": %d, \"layers\": [",
              grad_names[c->grad_form], xe->replica_grad_bytes_per_element);
    double *row = rp_alloc(c->ctx, ((size_t)c->G + (size_t)c->ep) * sizeof *row);
    for (int32_t l = 0; row && l < c->L; l++) {
        const int32_t *off = s->rep_off + (size_t)l * (c->E + 1), *rank = s->rep_rank + (size_t)l * s->S;
        const int32_t R = cost_grad_experts(c, s, l, off);
        double *sent = row + c->G;
        cost_grad_layer(c, s, l, off, rank, row, sent);
        text_put(&b, "%s{\"experts\": %d, \"bytes\": %.17g, \"sent_bytes\": [", l ? ", " : "", R, R * c->grad_bytes);
        for (int32_t j = 0; j < c->ep; j++) text_put(&b, "%s%.17g", j ? ", " : "", sent[j]);
        text_put(&b, "]}");
    }
    if (!row) b.failed = true;
    rp_free(c->ctx, row);
    text_put(&b, "]},\n");
    text_put(&b, "\"shape\": {\"num_gpus\": %d, \"num_microbatches\": %d, \"num_layers\": %d, "
              "\"num_experts\": %d, \"ep_size\": %d, \"backward\": {\"attention\": %.17g, \"projections\": %.17g, "
              "\"experts\": %.17g, \"token_linear\": %.17g, \"communication\": %.17g, \"fixed\": %.17g}, "
              "\"split_rule\": \"%s\"},\n",
              G, M, L, c->E, c->ep, bw->attention, bw->projections, bw->experts, bw->token_linear,
              bw->communication, bw->fixed, c->rule == RP_SPLIT_EVEN ? "even" : "locality");
    text_put(&b, "\"layers\": [");
    const int32_t dom = summary_domain(c, s); /* each layer's straggler: in the critical domain */
    for (int32_t m = 0; m < M; m++) {
        double amax = 0;
        for (int32_t g = 0; g < G; g++)
            if (s->attn[(size_t)g * M + m] > amax) amax = s->attn[(size_t)g * M + m];
        for (int32_t l = 0; l < L; l++) {
            size_t ml = (size_t)m * L + l;
            phase_max p = domain_phases(c, s, m, l, -1);
            int32_t gpu;
            rp_side side = layer_straggler(c, s, m, l, dom, &gpu, NULL);
            text_put(&b, "%s\n {\"microbatch\": %d, \"layer\": %d, \"time_s\": %.17g, \"attention_s\": %.17g, "
                      "\"dense_s\": %.17g, \"dense_backward_s\": %.17g, \"dispatch_s\": %.17g, \"expert_s\": %.17g, "
                      "\"combine_s\": %.17g, \"lower_bound_s\": %.17g, \"straggler_gpu\": %d, \"straggler_side\": \"%s\"",
                      ml ? "," : "", m, l, rp_cost_layer_s(c, m, l), amax, p.df, p.db, p.d, p.x, p.d,
                      cost_bound_layer(c, s, m, l), gpu, cost_side_name(side));
            if (c->sync == RP_SYNC_GROUP) {
                text_put(&b, ", \"group_time_s\": ");
                sb_array(&b, s->layer_t + ml * c->LW, (size_t)c->NQ, 1);
            }
            text_put(&b, "}");
        }
    }
    text_put(&b, "],\n\"attention\": [");
    for (int32_t g = 0; g < G; g++) {
        text_put(&b, "%s\n ", g ? "," : "");
        sb_array(&b, s->attn + (size_t)g * M, (size_t)M, 1);
    }
    /* compute: forward and backward compute of one GPU for one (microbatch, layer): the
     * dense phase both ways and the experts at their multiplier (what a device times) */
    text_put(&b, "],\n\"compute\": [");
    for (int32_t m = 0; m < M; m++) {
        text_put(&b, "%s\n [", m ? "," : "");
        for (int32_t l = 0; l < L; l++) {
            text_put(&b, "%s\n  [", l ? "," : "");
            for (int32_t g = 0; g < G; g++) {
                size_t cell = (size_t)g * M + m;
                double v = s->dense_f[cell] + s->dense_b[cell] +
                           (1.0 + c->bwd.experts) * s->expert[((size_t)m * L + l) * G + g];
                text_put(&b, "%s%.17g", g ? "," : "", v);
            }
            text_put(&b, "]");
        }
        text_put(&b, "]");
    }
    const char *names[3] = {"expert", "dispatch", "combine"};
    const double *arrays[3] = {s->expert, s->dispatch, s->dispatch};
    for (int k = 0; k < 3; k++) {
        text_put(&b, "],\n\"%s\": [", names[k]);
        for (int32_t m = 0; m < M; m++) {
            text_put(&b, "%s\n [", m ? "," : "");
            for (int32_t l = 0; l < L; l++) {
                text_put(&b, "%s\n  ", l ? "," : "");
                sb_array(&b, arrays[k] + ((size_t)m * L + l) * G, (size_t)G, 1);
            }
            text_put(&b, "]");
        }
    }
    text_put(&b, "]\n}\n");
    if (b.failed) {
        rp_free(c->ctx, b.data);
        return rp_fail_nomem(err, "the cost breakdown JSON");
    }
    *text = b.data;
    if (len) *len = b.len;
    return RP_OK;
}
