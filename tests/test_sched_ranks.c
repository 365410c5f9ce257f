/* The distributed step, ranks simulated by threads over an in-process rp_comm
 * (test_comm_hub.h): rp_sched_step_stats from merged statistics plans exactly as
 * rp_sched_step does; each rank holding only its own sequences' routing gets the plan a
 * single process gets; a policy that fails (or hits its limit) on one rank leaves every
 * rank on the same plan with the same report; an error on one rank (a bad id, a failed
 * allocation at any point of the step, a failed collective) makes the step fail on every
 * rank, leaves every plan as it was, and never hangs a rank. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_comm_hub.h"
#include "test_util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEPS 4
#define MAX_RANKS 4

static rp_config *cfg;
static rp_batch *batches[STEPS];
static rp_routing routings[STEPS];
static void *ids[STEPS];
static uint64_t ref_hash[STEPS];     /* single process, rp_sched_step */
static double ref_step_s[STEPS];
static const char *POLICY = "token_kk+eplb";

static uint64_t rng_state = 0x2545F4914F6CDD1DULL;
static uint32_t rnd(uint32_t n) { return (uint32_t)((xorshift64(&rng_state) >> 11) % n); }

/* ---- a rank's part of a step ---------------------------------------------------------- */

/* The global ids rank r holds at step t: sequences dealt round robin after a shuffle
 * that depends on the step only (the same on every rank). */
static int32_t rank_ids(int t, int r, int P, int32_t *out)
{
    const int32_t n = rp_batch_num_seqs(batches[t]);
    int32_t *perm = malloc(sizeof *perm * (size_t)n);
    uint64_t st = 0x9E3779B97F4A7C15ULL ^ (uint64_t)(t + 1);
    for (int32_t s = 0; s < n; s++) perm[s] = s;
    for (int32_t i = n - 1; i > 0; i--) {
        int32_t j = (int32_t)((xorshift64(&st) >> 11) % (uint64_t)(i + 1)), x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    int32_t m = 0;
    for (int32_t i = r; i < n; i += P) out[m++] = perm[i];
    free(perm);
    return m;
}

/* Statistics of the sequences `gids` of step t, computed from their routing alone (a
 * copy of just those ids, as a rank holds them). */
static rp_status local_stats(rp_context *ctx, int t, const int32_t *gids, int32_t m, rp_stats **out, rp_error *err)
{
    const rp_batch *b = batches[t];
    const rp_routing *r = &routings[t];
    const size_t rec = (size_t)r->num_layers * (size_t)r->top_k * (size_t)r->width;
    const int64_t *cu = rp_batch_cu_seqlens(b);
    int32_t *pl = calloc((size_t)m + 1, sizeof *pl), *rl = calloc((size_t)m + 1, sizeof *rl);
    int32_t *grp = calloc((size_t)m + 1, sizeof *grp);
    int64_t tokens = 0;
    for (int32_t i = 0; i < m; i++) {
        pl[i] = rp_batch_prompt_lens(b)[gids[i]];
        rl[i] = rp_batch_response_lens(b)[gids[i]];
        tokens += rp_batch_seq_len(b, gids[i]);
    }
    unsigned char *local = malloc((size_t)tokens * rec + 1), *p = local;
    for (int32_t i = 0; i < m; i++) {
        size_t n = (size_t)(cu[gids[i] + 1] - cu[gids[i]]) * rec;
        memcpy(p, (const unsigned char *)r->base + (size_t)cu[gids[i]] * rec, n);
        p += n;
    }
    rp_batch *lb = NULL;
    rp_routing lr;
    rp_routing_packed(&lr, r->width, r->num_layers, r->top_k, local);
    rp_status st = rp_batch_new(ctx, m, pl, rl, grp, &lb, err);
    if (st == RP_OK) st = rp_stats_compute(ctx, lb, &lr, rp_config_model(cfg)->num_experts, 1, out, err);
    rp_batch_free(lb);
    free(local);
    free(pl);
    free(rl);
    free(grp);
    return st;
}

static rp_status rp_fail_text(rp_error *err, rp_status st, const char *text)
{
    snprintf(err->text, sizeof err->text, "%s", text);
    err->status = st;
    return st;
}

/* What a distributed trainer does before the step: its part's bytes and ids go to
 * every rank (an allgather of the sizes, then of the padded parts and ids), and every
 * rank merges them into the whole step's statistics. */
/* The whole step's statistics from every rank's part; into *whole's storage when it
 * holds an earlier merge (rp_stats_merge_serialized_reusing). */
static rp_status exchange(rp_context *ctx, const rp_comm *c, int t, rp_stats **whole, rp_error *err)
{
    const int P = c->size > 0 && c->size <= MAX_RANKS ? c->size : 1;
    const int32_t n = rp_batch_num_seqs(batches[t]);
    int32_t *mine = malloc(sizeof *mine * (size_t)n);
    int32_t m = rank_ids(t, c->rank, P, mine);
    rp_stats *part = NULL;
    rp_status st = local_stats(ctx, t, mine, m, &part, err);
    if (st != RP_OK) {
        free(mine);
        return st;
    }
    uint64_t size[2] = {rp_stats_serialized_bytes(part), (uint64_t)m}, sizes[2 * MAX_RANKS];
    if (c->allgather(c->ud, size, sizeof size, sizes) != RP_OK) {
        free(mine);
        rp_stats_free(part);
        return rp_fail_text(err, RP_ETRANSPORT, "exchange: allgather failed");
    }
    uint64_t most = 0;
    for (int q = 0; q < P; q++) most = sizes[2 * q] + 4 * sizes[2 * q + 1] > most ? sizes[2 * q] + 4 * sizes[2 * q + 1] : most;
    unsigned char *buf = calloc(1, (size_t)most), *all = calloc((size_t)(P > 0 ? P : 1), (size_t)most);
    rp_stats_serialize(part, buf, size[0], err);
    memcpy(buf + size[0], mine, 4 * (size_t)m);
    if (c->allgather(c->ud, buf, most, all) != RP_OK) {
        free(buf);
        free(all);
        free(mine);
        rp_stats_free(part);
        return rp_fail_text(err, RP_ETRANSPORT, "exchange: allgather failed");
    }
    const void *bytes[MAX_RANKS];
    size_t lens[MAX_RANKS];
    const int32_t *gids[MAX_RANKS];
    int32_t *id_copies[MAX_RANKS];
    for (int q = 0; q < P; q++) {
        bytes[q] = all + (size_t)q * most;
        lens[q] = sizes[2 * q];
        id_copies[q] = malloc(4 * sizes[2 * q + 1] + 4);
        memcpy(id_copies[q], all + (size_t)q * most + lens[q], 4 * sizes[2 * q + 1]);
        gids[q] = id_copies[q];
    }
    st = rp_stats_merge_serialized_reusing(ctx, P, bytes, lens, gids, n, whole, err);
    for (int q = 0; q < P; q++) free(id_copies[q]);
    free(buf);
    free(all);
    free(mine);
    rp_stats_free(part);
    return st;
}

/* ---- ranks on threads --------------------------------------------------------------------- */

typedef struct rank_run {
    comm_hub *hub;
    hub_rank me;
    int rank;
    bool distributed;          /* statistics from the exchange and rp_sched_step_stats */
    bool take;                 /* ... rp_sched_step_stats_take, each merge into the spare it returns */
    int64_t max_instructions;  /* 0: the default */
    int bad_step;              /* this rank's routing has a bad id at this step (-1: none) */
    long fail_alloc_at;        /* fail this allocation of the step `fail_step` (0: none) */
    int fail_step;
    const char *stage;         /* a policy staged for step 2 */
    /* results */
    rp_status st[STEPS];
    uint64_t hash[STEPS], plan_before[STEPS], plan_after[STEPS];
    int fallback[STEPS], fell_back[STEPS], from_rank[STEPS], swapped[STEPS];
    double step_s[STEPS];
    char error[STEPS][RP_ERROR_TEXT];
    int setup_failed;
    long leaked;
} rank_run;

static uint64_t hash_of(const rp_plan *p) { return p ? rp_plan_hash(p) : 0; }

static void *rank_main(void *arg)
{
    rank_run *rr = arg;
    counting cnt = {0};
    rp_context *ctx = NULL;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_context_new(counting_alloc, &cnt, &ctx) != RP_OK) {
        rr->setup_failed = 1;
        return NULL;
    }
    rp_comm c = hub_comm(rr->hub, &rr->me, rr->rank);
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = POLICY;
    o.num_threads = 1;
    o.comm = &c;
    o.max_instructions = rr->max_instructions;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) {
        rr->setup_failed = 1;
        diag("rank %d: %s", rr->rank, err.text);
    }
    if (s && rr->stage && rp_sched_stage_policy(s, rr->stage, NULL, 2, &err) != RP_OK) rr->setup_failed = 1;
    rp_stats *spare = NULL;
    for (int t = 0; t < STEPS && s; t++) {
        const rp_plan *plan = NULL;
        const rp_step_report *rep = NULL;
        rr->plan_before[t] = hash_of(rp_sched_plan(s));
        rp_stats *whole = rr->take ? spare : NULL;
        spare = NULL;
        rp_status st = RP_OK;
        if (rr->distributed) st = exchange(ctx, &c, t, &whole, &err);
        if (t == rr->fail_step && rr->fail_alloc_at) cnt.fail_at = cnt.calls + rr->fail_alloc_at;
        if (rr->distributed) {
            if (st == RP_OK && rr->take) st = rp_sched_step_stats_take(s, t, batches[t], &whole, &plan, &rep, &err);
            else if (st == RP_OK) st = rp_sched_step_stats(s, t, batches[t], whole, &plan, &rep, &err);
        } else if (t == rr->bad_step) {
            /* this rank's copy of the routing has an id out of range */
            const rp_routing *r = &routings[t];
            size_t n = (size_t)rp_batch_num_tokens(batches[t]) * r->num_layers * r->top_k * r->width;
            unsigned char *bad = malloc(n);
            memcpy(bad, r->base, n);
            bad[n - 1] = 0xff;
            rp_routing br;
            rp_routing_packed(&br, r->width, r->num_layers, r->top_k, bad);
            st = rp_sched_step(s, t, batches[t], &br, &plan, &rep, &err);
            free(bad);
        } else {
            st = rp_sched_step(s, t, batches[t], &routings[t], &plan, &rep, &err);
        }
        cnt.fail_at = 0;
        if (rr->take) spare = whole; /* the scheduler's spare (or, refused, the merge): the next merge's storage */
        else rp_stats_free(whole);
        rr->st[t] = st;
        rr->plan_after[t] = hash_of(rp_sched_plan(s));
        if (st == RP_OK) {
            rr->hash[t] = rp_plan_hash(plan);
            rr->fallback[t] = rep->fallback;
            rr->fell_back[t] = rep->ranks_fell_back;
            rr->from_rank[t] = rep->plan_from_rank;
            rr->swapped[t] = rep->swapped;
            rr->step_s[t] = rep->cost.step_s;
        } else {
            snprintf(rr->error[t], sizeof rr->error[t], "%s", err.text);
            if (st == RP_ETRANSPORT && strstr(err.text, "allgather")) break; /* the trainer stops here */
        }
    }
    rp_stats_free(spare);
    rp_sched_free(s);
    /* blocks (LuaJIT under-reports some sizes it frees, test_util.h), less the context */
    rr->leaked = cnt.blocks - 1;
    rp_context_free(ctx);
    return NULL;
}

/* Run P ranks to the end; false when the hub broke (a rank waited in vain: a hang). */
static bool run_ranks(rank_run *runs, int P)
{
    comm_hub hub;
    hub_init(&hub, P, 20);
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < P; r++) {
        runs[r].hub = &hub;
        runs[r].rank = r;
        pthread_create(&th[r], NULL, rank_main, &runs[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    bool fine = !hub.broken && !hub.mismatch;
    if (!fine) diag("hub: %s", hub.broken ? "a rank waited in vain (timeout)" : "ranks entered different collectives");
    hub_destroy(&hub);
    return fine;
}

static void runs_init(rank_run *runs, int P)
{
    memset(runs, 0, sizeof *runs * (size_t)P);
    for (int r = 0; r < P; r++) runs[r].bad_step = runs[r].fail_step = -1;
}

/* Every rank has the same outcome at every step: status, plan in use, report. */
static bool ranks_alike(const rank_run *runs, int P)
{
    for (int r = 0; r < P; r++) {
        if (runs[r].setup_failed) return false;
        for (int t = 0; t < STEPS; t++) {
            const rank_run *a = &runs[0], *b = &runs[r];
            if (a->st[t] != b->st[t] || a->plan_after[t] != b->plan_after[t] || a->hash[t] != b->hash[t] ||
                a->fell_back[t] != b->fell_back[t] || a->from_rank[t] != b->from_rank[t] ||
                a->swapped[t] != b->swapped[t] || a->step_s[t] != b->step_s[t]) {
                diag("rank %d differs from rank 0 at step %d: status %d/%d, plan %016llx/%016llx", r, t,
                     (int)a->st[t], (int)b->st[t], (unsigned long long)a->plan_after[t],
                     (unsigned long long)b->plan_after[t]);
                return false;
            }
        }
    }
    return true;
}

/* ---- the tests ------------------------------------------------------------------------------ */

static void reference(rp_context *ctx)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = POLICY;
    o.num_threads = 1;
    rp_sched *a = NULL, *b = NULL;
    rp_error err;
    rp_sched_new(ctx, cfg, &o, &a, &err);
    rp_sched_new(ctx, cfg, &o, &b, &err);
    int same = 1;
    for (int t = 0; t < STEPS; t++) {
        const rp_plan *pa, *pb;
        const rp_step_report *ra, *rb;
        rp_stats *st = NULL;
        if (rp_sched_step(a, t, batches[t], &routings[t], &pa, &ra, &err) != RP_OK) diag("ref: %s", err.text);
        ref_hash[t] = rp_plan_hash(pa);
        ref_step_s[t] = ra->cost.step_s;
        rp_stats_compute(ctx, batches[t], &routings[t], rp_config_model(cfg)->num_experts, 1, &st, &err);
        if (rp_sched_step_stats(b, t, batches[t], st, &pb, &rb, &err) != RP_OK) diag("stats: %s", err.text);
        same &= rp_plan_hash(pb) == ref_hash[t] && rb->cost.step_s == ra->cost.step_s &&
                rb->policy_work == ra->policy_work && rb->experts_moved == ra->experts_moved;
        rp_stats_free(st);
    }
    ok(same, "rp_sched_step_stats plans %d steps exactly as rp_sched_step (plan hash, cost, work, moves)", STEPS);

    /* statistics that do not describe the batch are refused, and nothing changes */
    rp_stats *st = NULL;
    const rp_plan *p;
    const rp_step_report *r;
    rp_stats_compute(ctx, batches[0], &routings[0], rp_config_model(cfg)->num_experts, 1, &st, &err);
    uint64_t before = rp_plan_hash(rp_sched_plan(b));
    ok(rp_sched_step_stats(b, STEPS, batches[1], st, &p, &r, &err) == RP_EINVAL, "another batch's statistics are "
       "refused");
    like(err.text, "the batch", "and the message says they do not match the batch");
    ok(rp_plan_hash(rp_sched_plan(b)) == before, "and the plan in use stays");
    ok(rp_sched_step_stats(b, STEPS, batches[0], NULL, &p, &r, &err) == RP_EINVAL, "no statistics is refused");

    /* rp_sched_step_stats_take: the statistics taken, an earlier step's returned */
    rp_sched *c = NULL;
    rp_sched_new(ctx, cfg, &o, &c, &err);
    int taken = 1;
    rp_stats *given[STEPS] = {NULL};
    for (int t = 0; t < STEPS; t++) {
        rp_stats *mine = NULL;
        const rp_plan *pc;
        const rp_step_report *rc;
        rp_stats_compute(ctx, batches[t], &routings[t], rp_config_model(cfg)->num_experts, 1, &mine, &err);
        given[t] = mine;
        if (rp_sched_step_stats_take(c, t, batches[t], &mine, &pc, &rc, &err) != RP_OK) diag("take: %s", err.text);
        /* step 0 has nothing to give back; step t gives back step t - 1's, which it kept until now */
        taken &= rp_plan_hash(pc) == ref_hash[t] && rc->cost.step_s == ref_step_s[t] &&
                 mine == (t >= 1 ? given[t - 1] : NULL);
        rp_stats_free(mine);
    }
    ok(taken, "rp_sched_step_stats_take plans the same %d steps and gives back the step before's statistics",
       STEPS);
    uint64_t kept = rp_plan_hash(rp_sched_plan(c));
    rp_stats *held = st;
    ok(rp_sched_step_stats_take(c, STEPS, batches[1], &held, &p, &r, &err) == RP_EINVAL && held == st &&
           rp_plan_hash(rp_sched_plan(c)) == kept,
       "another batch's statistics are refused, stay the caller's, and the plan in use stays");
    ok(rp_sched_step_stats_take(c, STEPS, batches[0], NULL, &p, &r, &err) == RP_EINVAL, "no statistics is refused");
    rp_stats *none = NULL;
    ok(rp_sched_step_stats_take(c, STEPS, batches[0], &none, &p, &r, &err) == RP_EINVAL, "... nor NULL statistics");
    rp_sched_free(c);
    rp_stats_free(st);
    rp_sched_free(a);
    rp_sched_free(b);
}

static void test_distributed(void)
{
    for (int P = 2; P <= 4; P++) {
        rank_run runs[MAX_RANKS];
        runs_init(runs, P);
        for (int r = 0; r < P; r++) runs[r].distributed = true;
        bool fine = run_ranks(runs, P);
        int match = 1;
        for (int r = 0; r < P; r++)
            for (int t = 0; t < STEPS; t++) match &= runs[r].st[t] == RP_OK && runs[r].hash[t] == ref_hash[t];
        ok(fine && ranks_alike(runs, P) && match,
           "%d ranks, each with its own sequences' routing only: every rank plans every step exactly as one "
           "process with the whole routing", P);
    }
    /* the same without the scheduler's copy: it takes each merge and returns an earlier
     * one, which the next merge fills (no leak, no double free: the counting allocator) */
    const int P = 3;
    rank_run runs[MAX_RANKS];
    runs_init(runs, P);
    for (int r = 0; r < P; r++) runs[r].distributed = runs[r].take = true;
    bool fine = run_ranks(runs, P);
    int match = 1;
    long leaked = 0;
    for (int r = 0; r < P; r++) {
        leaked += runs[r].leaked;
        for (int t = 0; t < STEPS; t++) match &= runs[r].st[t] == RP_OK && runs[r].hash[t] == ref_hash[t];
    }
    ok(fine && ranks_alike(runs, P) && match && leaked == 0,
       "rp_sched_step_stats_take on %d ranks, merging into the statistics it returns: the same plans, nothing leaked "
       "(%ld blocks)", P, leaked);
}

static void test_policy_fails_on_one_rank(void)
{
    const int P = 3;
    rank_run runs[MAX_RANKS];
    runs_init(runs, P);
    runs[1].max_instructions = 100; /* rank 1's policy hits its limit at every step */
    bool fine = run_ranks(runs, P);
    int as_ref = 1, report = 1;
    for (int r = 0; r < P; r++)
        for (int t = 0; t < STEPS; t++) {
            as_ref &= runs[r].st[t] == RP_OK && runs[r].hash[t] == ref_hash[t];
            report &= runs[r].fell_back[t] == 1 && runs[r].from_rank[t] == 0 && runs[r].fallback[t] == (r == 1);
        }
    ok(fine && ranks_alike(runs, P), "a policy that fails on rank 1 only: every rank, same status, same plan, same "
       "report at every step");
    ok(as_ref, "and that plan is rank 0's policy's (the single-process plan)");
    ok(report, "every report says one rank fell back and the plan came from rank 0; rank 1's says it fell back");

    runs_init(runs, P);
    for (int r = 0; r < P; r++) runs[r].max_instructions = 100;
    fine = run_ranks(runs, P);
    int all_fell = 1;
    for (int r = 0; r < P; r++)
        for (int t = 0; t < STEPS; t++) all_fell &= runs[r].st[t] == RP_OK && runs[r].fallback[t] && runs[r].fell_back[t] == P;
    ok(fine && ranks_alike(runs, P) && all_fell, "a policy that fails on every rank: every rank falls back to the "
       "same plan");

    runs_init(runs, P);
    for (int r = 0; r < P; r++) runs[r].distributed = true;
    runs[2].max_instructions = 100;
    fine = run_ranks(runs, P);
    as_ref = 1;
    for (int r = 0; r < P; r++)
        for (int t = 0; t < STEPS; t++) as_ref &= runs[r].st[t] == RP_OK && runs[r].hash[t] == ref_hash[t];
    ok(fine && ranks_alike(runs, P) && as_ref, "the same from statistics (rp_sched_step_stats), rank 2 failing");
}

static void test_error_on_one_rank(void)
{
    const int P = 3;
    rank_run runs[MAX_RANKS];
    runs_init(runs, P);
    runs[2].bad_step = 1; /* rank 2's routing has a bad id at step 1 */
    bool fine = run_ranks(runs, P);
    ok(fine, "a bad id on rank 2 at step 1: no rank hangs");
    int failed = 1, kept = 1, after = 1;
    for (int r = 0; r < P; r++) {
        failed &= runs[r].st[1] == RP_ERANGE;
        kept &= runs[r].plan_after[1] == runs[r].plan_before[1];
        after &= runs[r].st[2] == RP_OK && runs[r].st[3] == RP_OK;
    }
    ok(failed && ranks_alike(runs, P), "step 1 fails on every rank with rank 2's status (RP_ERANGE)");
    like(runs[0].error[1], "rank 2 failed", "rank 0's message names rank 2");
    like(runs[2].error[1], "expert id", "rank 2's message is its own");
    ok(kept, "no rank changes its plan");
    ok(after, "and the next steps run on every rank");
}

/* Fail the N-th allocation of a step on one rank, for N along the whole step. */
static void test_alloc_failure_on_one_rank(void)
{
    const int P = 3;
    int fine = 1, alike = 1, kept = 1, runs_n = 0, failures = 0, leaks = 0;
    for (long n = 1; n < 40000; n += n < 64 ? 1 : n / 8) {
        for (int mode = 0; mode < 3; mode++) { /* routing; statistics copied; statistics taken */
            const bool distributed = mode > 0;
            rank_run runs[MAX_RANKS];
            runs_init(runs, P);
            for (int r = 0; r < P; r++) {
                runs[r].distributed = distributed;
                runs[r].take = mode == 2;
                runs[r].stage = distributed ? "attn_kk+eplb" : NULL;
            }
            runs[1].fail_step = 2;
            runs[1].fail_alloc_at = n;
            fine &= run_ranks(runs, P);
            alike &= ranks_alike(runs, P);
            for (int r = 0; r < P; r++) {
                if (runs[r].st[2] != RP_OK) kept &= runs[r].plan_after[2] == runs[r].plan_before[2];
                if (runs[r].leaked) {
                    if (!leaks) diag("rank %d leaked %ld blocks (allocation %ld, %s, step status %d)", r,
                                     runs[r].leaked, n, distributed ? "distributed" : "routing", (int)runs[r].st[2]);
                    leaks++;
                }
            }
            failures += runs[1].st[2] != RP_OK;
            runs_n++;
        }
    }
    ok(fine, "an allocation failing on rank 1 at any of %d points of a step: no rank hangs", runs_n);
    ok(alike, "every rank ends each step with the same status and plan (%d of the runs failed the step)", failures);
    ok(kept, "a failed step leaves every rank's plan as it was");
    is_int(leaks, 0, "nothing leaks on any rank");
}

static void test_transport_failure(void)
{
    /* a collective that fails on one rank is an error there; the others see the hub's
     * timeout rather than hanging (the hub models a transport that notices) */
    const int P = 2;
    rank_run runs[MAX_RANKS];
    runs_init(runs, P);
    comm_hub hub;
    hub_init(&hub, P, 2);
    hub.fail_rank = 1;
    hub.fail_at = 3; /* step 1's first gather */
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < P; r++) {
        runs[r].hub = &hub;
        runs[r].rank = r;
        pthread_create(&th[r], NULL, rank_main, &runs[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    ok(runs[1].st[1] == RP_ETRANSPORT, "a failed allgather is RP_ETRANSPORT on its rank");
    like(runs[1].error[1], "allgather across 2 ranks failed", "and says so");
    ok(runs[0].st[1] != RP_OK && runs[0].plan_after[1] == runs[0].plan_before[1], "the other rank's step fails too "
       "and keeps its plan");
    hub_destroy(&hub);
}

int main(void)
{
    rp_context *ctx = NULL;
    rp_gen *gen = NULL;
    rp_error err;
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK ||
        rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK ||
        rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK) {
        diag("setup: %s", err.text);
        return 1;
    }
    for (int t = 0; t < STEPS; t++)
        if (!(ids[t] = gen_step_copy(gen, t, &batches[t], &routings[t], &err))) {
            diag("gen: %s", err.text);
            return 1;
        }
    (void)rnd;
    reference(ctx);
    test_distributed();
    test_policy_fails_on_one_rank();
    test_error_on_one_rank();
    test_transport_failure();
    test_alloc_failure_on_one_rank();
    for (int t = 0; t < STEPS; t++) {
        rp_batch_free(batches[t]);
        free(ids[t]);
    }
    rp_gen_free(gen);
    rp_config_free(cfg);
    rp_context_free(ctx);
    return tap_done();
}
