/* Calibrated synthetic batches (routepack/gen.h): the generator handle and one step
 * at a time: the drift of the routing model, the groups' domains and lengths, then
 * the routing ids (gen_routing.c). */
#include "gen_internal.h"

#include <math.h>
#include <string.h>

struct rp_gen {
    rp_context *ctx;
    gen_settings settings;
    gen_model model;
    rp_gen_info info;
    /* the random walk at step drift_step (-1: not computed) */
    int32_t drift_step;
    double *drift_x;      /* [domains x L x E] offsets of the log base weights */
    double *drift_y;      /* [domains] offsets of the log mixture weights */
    double *alpha;        /* [domains x L x E] Dirichlet parameters of the step */
    double *mixture;      /* [domains] */
    void *ids;            /* the last step's routing ids, reused */
    size_t ids_bytes;
};

rp_status rp_gen_parse(rp_context *ctx, const char *text, size_t len, const char *name,
                       const char *base_dir, rp_gen **out, rp_error *err)
{
    if (!ctx || !text || !out) return rp_fail(err, RP_EINVAL, "gen: NULL argument");
    rp_gen *g = rp_calloc(ctx, 1, sizeof *g);
    if (!g) return rp_fail_nomem(err, "a generator");
    g->ctx = ctx;
    g->drift_step = -1;
    rp_status st;
    RP_CHECK_GOTO(gen_settings_parse(ctx, text, len, name, base_dir ? base_dir : ".", &g->settings, err),
                  st, fail);
    RP_CHECK_GOTO(gen_model_build(ctx, &g->settings, &g->model, err), st, fail);
    const gen_settings *s = &g->settings;
    size_t dle = (size_t)s->source.num_domains * (size_t)s->num_layers * (size_t)s->num_experts;
    g->drift_x = rp_calloc(ctx, dle, sizeof(double));
    g->alpha = rp_alloc(ctx, dle * sizeof(double));
    g->drift_y = rp_calloc(ctx, (size_t)s->source.num_domains, sizeof(double));
    g->mixture = rp_alloc(ctx, (size_t)s->source.num_domains * sizeof(double));
    if (!g->drift_x || !g->alpha || !g->drift_y || !g->mixture) {
        st = rp_fail_nomem(err, "a generator");
        goto fail;
    }
    rp_gen_info *info = &g->info;
    info->num_steps = s->steps;
    info->num_seqs = s->num_prompts * s->group_size;
    info->num_layers = s->num_layers;
    info->num_experts = s->num_experts;
    info->top_k = s->top_k;
    info->width = s->width;
    info->seed = s->seed;
    info->concentration = s->concentration;
    info->num_prompts = s->num_prompts;
    info->group_size = s->group_size;
    info->prompt_cap = s->prompt.cap;
    info->response_cap = s->response.cap;
    info->prompt_clip_mass = gen_lengths_clip_mass(&s->prompt);
    info->response_clip_mass = gen_lengths_clip_mass(&s->response);
    info->locality = s->locality;
    info->layer_correlation = s->layer_correlation;
    info->drift = s->drift;
    info->num_domains = s->source.num_domains;
    info->calibration_error = g->model.calibration_error;
    *out = g;
    return RP_OK;
fail:
    rp_gen_free(g);
    return st;
}

rp_status rp_gen_load(rp_context *ctx, const char *path, rp_gen **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "gen: NULL argument");
    char *text = NULL;
    size_t len;
    rp_status st = rp_read_file(ctx, path, &text, &len, err);
    if (st != RP_OK) return st;
    /* data files resolve against the settings file's directory */
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) : 0;
    char *dir = rp_alloc(ctx, dir_len + 2);
    if (!dir) {
        rp_free(ctx, text);
        return rp_fail_nomem(err, path);
    }
    if (!slash) strcpy(dir, ".");
    else if (dir_len == 0) strcpy(dir, "/");
    else {
        memcpy(dir, path, dir_len);
        dir[dir_len] = '\0';
    }
    st = rp_gen_parse(ctx, text, len, path, dir, out, err);
    rp_free(ctx, dir);
    rp_free(ctx, text);
    return st;
}

void rp_gen_free(rp_gen *g)
{
    if (!g) return;
    rp_context *ctx = g->ctx;
    gen_model_free(ctx, &g->model);
    gen_settings_free(ctx, &g->settings);
    rp_free(ctx, g->drift_x);
    rp_free(ctx, g->drift_y);
    rp_free(ctx, g->alpha);
    rp_free(ctx, g->mixture);
    rp_free(ctx, g->ids);
    rp_free(ctx, g);
}

const rp_gen_info *rp_gen_get_info(const rp_gen *g)
{
    return &g->info;
}

void rp_gen_set_seed(rp_gen *g, uint64_t seed)
{
    g->settings.seed = seed;
    g->info.seed = seed;
    g->drift_step = -1;
}

rp_status rp_gen_set_steps(rp_gen *g, int32_t steps, rp_error *err)
{
    if (steps < 1 || steps > GEN_MAX_STEPS)
        return rp_fail(err, RP_ERANGE, "gen: step count must be in [1, %d], got %d", GEN_MAX_STEPS, steps);
    g->settings.steps = steps;
    g->info.num_steps = steps;
    return RP_OK;
}

rp_status rp_gen_target_load(const rp_gen *g, int32_t layer, double *share, rp_error *err)
{
    const gen_settings *s = &g->settings;
    if (layer < 0 || layer >= s->num_layers)
        return rp_fail(err, RP_ERANGE, "gen: layer %d is out of range [0, %d)", layer, s->num_layers);
    int32_t ne = s->num_experts;
    for (int32_t e = 0; e < ne; e++) share[e] = 0;
    for (int32_t d = 0; d < s->source.num_domains; d++) {
        const double *t = g->model.domains[d].target + (size_t)layer * ne;
        double w = s->source.domains[d].weight / s->top_k;
        for (int32_t e = 0; e < ne; e++) share[e] += w * t[e];
    }
    return RP_OK;
}

/* The random walk in log space (docs/gen.md): x_s = (1 - reversion) x_{s-1} + drift z_s,
 * z_s ~ N(0, 1) from the stream of step s, for every (domain, layer, expert) base
 * weight and every domain's mixture weight. Step s needs the walk up to s; the state
 * of the last step asked for is kept, so consecutive steps cost one increment. */
static void drift_to(rp_gen *g, int32_t step)
{
    const gen_settings *s = &g->settings;
    int32_t nd = s->source.num_domains;
    size_t le = (size_t)s->num_layers * (size_t)s->num_experts;
    if (s->drift == 0) return; /* the offsets stay 0 */
    if (g->drift_step < 0 || g->drift_step > step) {
        memset(g->drift_x, 0, (size_t)nd * le * sizeof(double));
        memset(g->drift_y, 0, (size_t)nd * sizeof(double));
        g->drift_step = 0;
    }
    double keep = 1 - s->drift_reversion;
    for (int32_t t = g->drift_step + 1; t <= step; t++) {
        for (int32_t d = 0; d < nd; d++) {
            gen_rng rng;
            gen_rng_stream(&rng, s->seed, GEN_TAG_DRIFT, (uint64_t)t, (uint64_t)d);
            double *x = g->drift_x + (size_t)d * le;
            for (size_t i = 0; i < le; i++) x[i] = keep * x[i] + s->drift * gen_normal(&rng);
            g->drift_y[d] = keep * g->drift_y[d] + s->drift * gen_normal(&rng);
        }
    }
    g->drift_step = step;
}

/* Dirichlet parameters and mixture of a step, from the drifted log weights. */
static void step_parameters(rp_gen *g)
{
    const gen_settings *s = &g->settings;
    int32_t nd = s->source.num_domains, ne = s->num_experts;
    size_t le = (size_t)s->num_layers * (size_t)ne;
    double total = 0;
    for (int32_t d = 0; d < nd; d++) {
        double w = s->source.domains[d].weight;
        g->mixture[d] = w > 0 ? w * exp(g->drift_y[d]) : 0;
        total += g->mixture[d];
        const double *lb = g->model.domains[d].log_base;
        const double *x = g->drift_x + (size_t)d * le;
        double *alpha = g->alpha + (size_t)d * le;
        for (int32_t l = 0; l < s->num_layers; l++) {
            size_t at = (size_t)l * ne;
            double top = -INFINITY, sum = 0;
            for (int32_t e = 0; e < ne; e++) {
                alpha[at + e] = lb[at + e] + x[at + e];
                if (alpha[at + e] > top) top = alpha[at + e];
            }
            for (int32_t e = 0; e < ne; e++) sum += alpha[at + e] = exp(alpha[at + e] - top);
            for (int32_t e = 0; e < ne; e++) {
                double a = s->concentration * alpha[at + e] / sum;
                alpha[at + e] = a > 1e-300 ? a : 1e-300;
            }
        }
    }
    for (int32_t d = 0; d < nd; d++) g->mixture[d] /= total;
}

rp_status rp_gen_step(rp_gen *g, int32_t step, rp_batch **batch, rp_routing *routing, rp_error *err)
{
    if (!g || !batch || !routing) return rp_fail(err, RP_EINVAL, "gen: NULL argument");
    if (step < 0) return rp_fail(err, RP_EINVAL, "gen: step %d is negative", step);
    rp_context *ctx = g->ctx;
    const gen_settings *s = &g->settings;
    int32_t np = s->num_prompts, gs = s->group_size, ns = np * gs, nd = s->source.num_domains;
    int32_t *group_domain = rp_alloc(ctx, (size_t)np * sizeof(int32_t));
    int32_t *prompt = rp_alloc(ctx, (size_t)ns * sizeof(int32_t));
    int32_t *response = rp_alloc(ctx, (size_t)ns * sizeof(int32_t));
    int32_t *group = rp_alloc(ctx, (size_t)ns * sizeof(int32_t));
    rp_batch *b = NULL;
    rp_status st = RP_OK;
    if (!group_domain || !prompt || !response || !group) {
        st = rp_fail_nomem(err, "a generated step");
        goto out;
    }
    drift_to(g, step);
    step_parameters(g);

    /* groups: domain and the shared prompt; each response its own length */
    for (int32_t p = 0; p < np; p++) {
        gen_rng rng;
        gen_rng_stream(&rng, s->seed, GEN_TAG_GROUP, (uint64_t)step, (uint64_t)p);
        double u = gen_uniform(&rng);
        int32_t d = 0;
        while (d < nd - 1 && (u -= g->mixture[d]) >= 0) d++;
        while (g->mixture[d] == 0 && d > 0) d--; /* rounding never picks an absent domain */
        group_domain[p] = d;
        int32_t plen = gen_lengths_draw(&s->prompt, &rng);
        for (int32_t i = 0; i < gs; i++) {
            int32_t seq = p * gs + i;
            gen_rng r2;
            gen_rng_stream(&r2, s->seed, GEN_TAG_RESPONSE, (uint64_t)step, (uint64_t)seq);
            prompt[seq] = plen;
            response[seq] = gen_lengths_draw(&s->response, &r2);
            group[seq] = p;
        }
    }
    RP_CHECK_GOTO(rp_batch_new(ctx, ns, prompt, response, group, &b, err), st, out);

    int64_t tokens = rp_batch_num_tokens(b), ids, bytes;
    if (rp_mul_overflow(tokens, (int64_t)s->num_layers * s->top_k, &ids) ||
        rp_mul_overflow(ids, (int64_t)s->width, &bytes) || (uint64_t)bytes > SIZE_MAX / 2) {
        st = rp_fail(err, RP_ERANGE, "gen: step %d has %lld tokens x %d layers x top-%d ids, too many to hold",
                     step, (long long)tokens, s->num_layers, s->top_k);
        goto out;
    }
    if ((size_t)bytes > g->ids_bytes || !g->ids) {
        /* the old ids are dead (the view is valid until the next call): no copy */
        rp_free(ctx, g->ids);
        g->ids_bytes = 0;
        void *grown = g->ids = rp_alloc(ctx, (size_t)bytes ? (size_t)bytes : 1);
        if (!grown) {
            st = rp_fail(err, RP_ENOMEM, "gen: out of memory allocating %lld bytes of routing ids for step %d",
                         (long long)bytes, step);
            goto out;
        }
        g->ids = grown;
        g->ids_bytes = (size_t)bytes;
    }
    gen_step_job job = {s, &g->model, s->seed, step, g->alpha, group_domain, rp_batch_cu_seqlens(b),
                        rp_batch_prompt_lens(b), g->ids};
    RP_CHECK_GOTO(gen_routing_run(ctx, &job, s->threads, err), st, out);
    rp_routing_packed(routing, s->width, s->num_layers, s->top_k, g->ids);
    *batch = b;
    b = NULL;
out:
    rp_batch_free(b);
    rp_free(ctx, group_domain);
    rp_free(ctx, prompt);
    rp_free(ctx, response);
    rp_free(ctx, group);
    return st;
}
