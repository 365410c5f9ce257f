/* What keeping ctx.state after every successful call costs a policy: eplb_periodic on the
 * bundled example (examples/gen-example.json on config-small.json) is stepped STEPS (8) times,
 * then the engine's copy of its ctx.state (policy_keep_state, core/policy_state.c) is
 * taken REPS times, timed in this thread's CPU time; prints the median, the spread
 * (least, largest), the state's entries and the copy's bytes. The same source builds
 * against a tree whose keep made a JSON copy (before issue 32's compact one), so the two
 * can be run interleaved. Usage: bench_state_keep [reps] [policy]. */
#include "policy_state.h"
#include "sched_internal.h"
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STEPS 8

static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : 101;
    const char *policy = argc > 2 ? argv[2] : "eplb_periodic";
    if (reps < 1) reps = 1;
    gen_steps fx;
    rp_error err;
    if (!gen_steps_load_from(&fx, "bench-keep", "gen-example.json", STEPS, &err)) {
        fprintf(stderr, "setup: %s\n", err.text);
        return 1;
    }
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = policy;
    o.num_threads = 1;
    rp_sched *s = NULL;
    if (rp_sched_new(fx.ctx, fx.cfg, &o, &s, &err) != RP_OK) {
        fprintf(stderr, "rp_sched_new: %s\n", err.text);
        return 1;
    }
    for (int t = 0; t < STEPS; t++) {
        const rp_plan *p;
        const rp_step_report *rep;
        if (rp_sched_step(s, t, fx.batches[t], &fx.routings[t], &p, &rep, &err) != RP_OK) {
            fprintf(stderr, "step %d: %s\n", t, err.text);
            return 1;
        }
    }
    sched_fields f;
    sched_fields_of(s, &f);
    rp_policy *pol = f.running->pol[0];
    double *took = calloc((size_t)reps, sizeof *took);
    for (int r = 0; r < reps; r++) {
        double t0 = thread_cpu_s();
        if (policy_keep_state(pol, NULL, &err) != RP_OK) {
            fprintf(stderr, "keep: %s\n", err.text);
            return 1;
        }
        took[r] = thread_cpu_s() - t0;
    }
    qsort(took, (size_t)reps, sizeof *took, by_value);
    rp_state_work w = {0};
    rp_status st;
    json_t *j = policy_state_encode(pol, INT64_MAX, &w, &st, &err);
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    printf("%s: keeping ctx.state (%zu tables, %zu entries; %zu bytes as checkpoint JSON): median %.3f ms, "
           "least %.3f, largest %.3f (thread CPU, %d reps)\n",
           policy, w.tables, w.entries, text ? strlen(text) : 0, took[reps / 2] * 1e3, took[0] * 1e3,
           took[reps - 1] * 1e3, reps);
    free(text);
    json_decref(j);
    free(took);
    rp_sched_free(s);
    gen_steps_free(&fx);
    return 0;
}
