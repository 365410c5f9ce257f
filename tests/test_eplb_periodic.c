/* The eplb_periodic baseline (policies/eplb_periodic.lua): it re-places only every
 * `interval` steps (at the first step too when at_start), from the loads of a window of
 * recorded steps, and relabels EP ranks so that residents stay; between rebalances
 * nothing migrates. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define STEPS 8
static gen_steps fx; /* the fixture (tests/test_util.h); the names below are its parts */
static rp_context *ctx;
static rp_config *cfg;
static rp_batch **batches;
static rp_routing *routings;
static const char *tmp;

/* One run of `steps` steps: each step's placement (copied), migration bytes and
 * experts moved. */
typedef struct run {
    rp_plan *plan[STEPS];
    double bytes[STEPS];
    int32_t moved[STEPS];
    bool ok;
} run;

static void run_policy(const char *policy, const char *params, run *r)
{
    memset(r, 0, sizeof *r);
    rp_sched *s = gen_steps_sched(&fx, policy, params, NULL);
    r->ok = s != NULL;
    for (int t = 0; t < STEPS && r->ok; t++) {
        const rp_plan *p = NULL;
        const rp_step_report *rep = NULL;
        rp_error err;
        if (rp_sched_step(s, t, batches[t], &routings[t], &p, &rep, &err) != RP_OK || rep->fallback) {
            diag("%s step %d: %s", policy, t, rep && rep->fallback ? rep->fallback_reason : err.text);
            r->ok = false;
            break;
        }
        rp_plan_copy(p, &r->plan[t], NULL);
        r->bytes[t] = rep->migration_bytes;
        r->moved[t] = rep->experts_moved;
    }
    rp_sched_free(s);
}

static void run_free(run *r)
{
    for (int t = 0; t < STEPS; t++) rp_plan_free(r->plan[t]);
}

static bool same_placement(const rp_plan *a, const rp_plan *b)
{
    if (!a || !b) return false;
    for (int32_t l = 0; l < rp_plan_num_layers(a); l++)
        if (memcmp(rp_plan_phy2log(a, l), rp_plan_phy2log(b, l), (size_t)rp_plan_total_slots(a) * 4) != 0)
            return false;
    return true;
}

/* The placements as sets of expert sets per EP rank, ignoring rank labels and slot
 * order: a sorted list of each rank's sorted expert list, per layer. */
static int cmp_int(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_row(const void *a, const void *b)
{
    return memcmp(a, b, 32 * sizeof(int32_t));
}

static bool same_up_to_labels(const rp_plan *a, const rp_plan *b)
{
    if (!a || !b) return false;
    const int32_t *begin = rp_plan_slot_begin(a);
    const int32_t ep = rp_plan_ep_size(a);
    for (int32_t l = 0; l < rp_plan_num_layers(a); l++) {
        int32_t ra[64][32], rb[64][32];
        memset(ra, 0x7f, sizeof ra);
        memset(rb, 0x7f, sizeof rb);
        for (int32_t j = 0; j < ep && j < 64; j++) {
            int32_t na = 0, nb = 0;
            for (int32_t k = begin[j]; k < begin[j + 1] && k - begin[j] < 32; k++) {
                if (rp_plan_phy2log(a, l)[k] >= 0) ra[j][na++] = rp_plan_phy2log(a, l)[k];
                if (rp_plan_phy2log(b, l)[k] >= 0) rb[j][nb++] = rp_plan_phy2log(b, l)[k];
            }
            qsort(ra[j], 32, sizeof(int32_t), cmp_int);
            qsort(rb[j], 32, sizeof(int32_t), cmp_int);
        }
        qsort(ra, (size_t)ep, sizeof ra[0], cmp_row);
        qsort(rb, (size_t)ep, sizeof rb[0], cmp_row);
        if (memcmp(ra, rb, (size_t)ep * sizeof ra[0]) != 0) return false;
    }
    return true;
}

static const char *write_file(const char *name, const char *text)
{
    static char paths[4][512];
    static int n;
    char *p = paths[n++ % 4];
    snprintf(p, 512, "%s/%s", tmp, name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
    return p;
}

static void test_interval(void)
{
    run r;
    run_policy("token_kk+eplb_periodic", "{\"eplb_periodic\": {\"interval\": 3}}", &r);
    bool held = r.ok, moved_at = r.ok;
    for (int t = 0; t < STEPS && r.ok; t++) {
        bool due = t % 3 == 0; /* steps 0, 3, 6 */
        if (!due) held &= r.bytes[t] == 0 && r.moved[t] == 0 && same_placement(r.plan[t], r.plan[t - 1]);
        else moved_at &= r.moved[t] > 0;
    }
    ok(held, "interval 3: between rebalances the placement stays and nothing migrates");
    ok(moved_at, "interval 3: it re-places at steps 0, 3 and 6");
    run_free(&r);

    run_policy("token_kk+eplb_periodic", "{\"eplb_periodic\": {\"interval\": 5, \"at_start\": false}}", &r);
    bool waited = r.ok;
    for (int t = 0; t < 5 && r.ok; t++) waited &= r.bytes[t] == 0;
    ok(waited && r.moved[5] > 0,
       "at_start false: the contiguous placement stays for `interval` steps, the first rebalance is at step 5");
    run_free(&r);
}

/* A probe that does what the window should: EPLB on the sum of the last `w` steps'
 * loads (from ctx.history, this step's included), every step. */
static const char *window_probe(int w)
{
    static char src[2048];
    snprintf(src, sizeof src,
             "return {name = 'window_probe', version = '1.0.0', api = 1, description = 'probe',\n"
             "plan = function(ctx)\n"
             "  local placement = {}\n"
             "  for l = 0, ctx.model.num_layers - 1 do\n"
             "    local sum, now = {}, ctx.stats.expert_load(l)\n"
             "    for e = 0, ctx.model.num_experts - 1 do sum[e + 1] = now[e] end\n"
             "    for i = 1, math.min(%d - 1, #ctx.history) do\n"
             "      local h = ctx.history[i].expert_load(l)\n"
             "      for e = 0, ctx.model.num_experts - 1 do sum[e + 1] = sum[e + 1] + h[e] end\n"
             "    end\n"
             "    placement[l + 1] = rp.place(sum, nil, {mode = 'hierarchical', groups = 1})\n"
             "  end\n"
             "  return {placement = placement}\n"
             "end}\n",
             w);
    return write_file("window_probe.lua", src);
}

static void test_window(void)
{
    run a, b, one;
    run_policy("token_kk+eplb_periodic", "{\"eplb_periodic\": {\"interval\": 1, \"window\": 3}}", &a);
    char spec[600];
    snprintf(spec, sizeof spec, "token_kk+%s", window_probe(3));
    run_policy(spec, NULL, &b);
    bool same = a.ok && b.ok;
    for (int t = 0; t < STEPS && same; t++) same &= same_up_to_labels(a.plan[t], b.plan[t]);
    ok(same, "window 3: every rebalance places EPLB's replica sets for the loads of the last 3 steps");
    run_policy("token_kk+eplb_periodic", "{\"eplb_periodic\": {\"interval\": 1, \"window\": 1}}", &one);
    bool differs = false;
    for (int t = 2; t < STEPS && one.ok && a.ok; t++) differs |= !same_up_to_labels(a.plan[t], one.plan[t]);
    ok(differs, "a window of 1 step places differently");
    run_free(&a);
    run_free(&b);

    /* current = false: the window holds past steps only, so the first rebalance after
     * the start is EPLB on the previous steps' loads */
    run_policy("token_kk+eplb_periodic",
               "{\"eplb_periodic\": {\"interval\": 1, \"window\": 1, \"current\": false}}", &b);
    bool lagged = b.ok && one.ok;
    for (int t = 1; t < STEPS && lagged; t++) lagged &= same_up_to_labels(b.plan[t], one.plan[t - 1]);
    ok(lagged, "current false: step t places what a window of step t-1 alone places");
    ok(b.ok && b.bytes[0] == 0, "current false, at the first step: nothing recorded yet, the placement stays");
    run_free(&b);
    run_free(&one);
}

static void test_residents(void)
{
    run per, eplb;
    run_policy("token_kk+eplb_periodic", "{\"eplb_periodic\": {\"interval\": 1, \"window\": 1}}", &per);
    run_policy("token_kk+eplb", NULL, &eplb);
    bool sets = per.ok && eplb.ok, fewer = sets, strictly = false;
    double total_per = 0, total_eplb = 0;
    for (int t = 0; t < STEPS && sets; t++) {
        sets &= same_up_to_labels(per.plan[t], eplb.plan[t]);
        if (t == 0) continue; /* from the same contiguous start both relabel-free */
        fewer &= per.bytes[t] <= eplb.bytes[t];
        strictly |= per.bytes[t] < eplb.bytes[t];
        total_per += per.bytes[t];
        total_eplb += eplb.bytes[t];
    }
    ok(sets, "interval 1, window 1: EPLB's replica sets every step (what token_kk+eplb places)");
    ok(fewer && strictly,
       "EP ranks relabelled to keep residents: it moves %.1f GB over steps 1-7 where token_kk+eplb moves %.1f GB",
       total_per / 1e9, total_eplb / 1e9);
    run_free(&per);
    run_free(&eplb);
}

static void test_checkpoint(void)
{
    /* the window lives in ctx.state: a scheduler restored from a checkpoint after step 3
     * rebalances at step 4 exactly as the original does */
    const char *params = "{\"eplb_periodic\": {\"interval\": 4, \"window\": 6}}";
    rp_sched *a = gen_steps_sched(&fx, "token_kk+eplb_periodic", params, NULL), *b = gen_steps_sched(&fx, "token_kk+eplb_periodic", params, NULL);
    const rp_plan *pa = NULL, *pb = NULL;
    const rp_step_report *ra = NULL, *rb = NULL;
    rp_error err;
    bool good = a && b;
    for (int t = 0; t < 4 && good; t++) good = rp_sched_step(a, t, batches[t], &routings[t], &pa, &ra, &err) == RP_OK;
    char *state = NULL;
    size_t len = 0;
    good = good && rp_sched_save_state(a, &state, &len, &err) == RP_OK &&
           rp_sched_load_state(b, state, len, &err) == RP_OK;
    if (!good) diag("%s", err.text);
    rp_text_free(ctx, state);
    good = good && rp_sched_step(a, 4, batches[4], &routings[4], &pa, &ra, &err) == RP_OK &&
           rp_sched_step(b, 4, batches[4], &routings[4], &pb, &rb, &err) == RP_OK;
    ok(good && ra->experts_moved > 0 && same_placement(pa, pb),
       "the window survives a checkpoint: the restored scheduler's rebalance at step 4 is the same");
    rp_sched_free(a);
    rp_sched_free(b);
}

int main(void)
{
    rp_error err;
    if (!gen_steps_load(&fx, "eplb-periodic", STEPS, &err)) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    ctx = fx.ctx, cfg = fx.cfg, batches = fx.batches, routings = fx.routings, tmp = fx.tmp;
    test_interval();
    test_window();
    test_residents();
    test_checkpoint();
    gen_steps_free(&fx);
    return tap_done();
}
