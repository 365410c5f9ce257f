/* The migration executor under the faults that used to go untested, 4 ranks as threads
 * over the in-process transport with fault injection (transport_fault.h): one rank out
 * of memory at every allocation while its peers are live, header faults, short and late
 * messages, a rank that stops responding mid-round, a stall in the decision exchange,
 * exchanges that complete on some ranks only, two faults at once, a failure during the
 * commit, staging corrupted before the commit. Every test checks the same status on every
 * rank, committed rounds kept, the failed round leaving every rank's old bytes (and slot
 * identities) intact, and the transports usable where docs/migration.md says so. Also
 * the slot identity API and the executor's checks of it. */
#include "migrate_scene.h"

#include <stdatomic.h>

/* ---- checks shared by every test ---- */

/* What a slot must claim: the target where its layer moved and the target fills it,
 * else what it held. */
static int identity_bad(const scene *s, unsigned moved)
{
    int bad = 0;
    const int32_t *sb = rp_plan_slot_begin(s->cur);
    for (int g = 0; g < NR; g++)
        for (int l = 0; l < s->lay.L; l++)
            for (int k = 0; k < s->gpu[g].slots; k++) {
                int32_t c = rp_plan_phy2log(s->cur, l)[sb[s->gpu[g].ep_rank] + k];
                int32_t t = rp_plan_phy2log(s->tgt, l)[sb[s->gpu[g].ep_rank] + k];
                int32_t want = (moved >> l & 1) && t >= 0 ? t : c;
                rp_slot_identity id;
                rp_registry_identity(s->gpu[g].reg, l, k, &id, NULL);
                bad += id.layer != l || id.expert != want;
            }
    return bad;
}

/* Same status on every rank (and the same message when `same_text`); bytes and
 * identities as `moved` says; transports usable as `usable` says. */
static void check_outcome(const char *name, scene *s, const rank_run *runs, rp_status want, unsigned moved,
                          bool same_text, bool usable)
{
    bool same = true;
    for (int g = 0; g < NR; g++) {
        same &= runs[g].st == want;
        if (same_text) same &= strcmp(runs[g].err.text, runs[0].err.text) == 0;
    }
    ok(same, "%s: every rank returns %s%s", name, rp_strerror(want), same_text ? " with the same message" : "");
    if (!same)
        for (int g = 0; g < NR; g++) diag("rank %d: %s: %s", g, rp_strerror(runs[g].st), runs[g].err.text);
    is_int(scene_bad_slots(s, moved), 0, "%s: committed rounds hold the target, the rest every old byte", name);
    is_int(identity_bad(s, moved), 0, "%s: every slot's identity says what it holds", name);
    bool u = true;
    for (int g = 0; g < NR; g++) u &= rp_transport_usable(s->t[g]) == usable;
    ok(u, "%s: the transports are %s", name, usable ? "still usable" : "unusable, as documented");
}

/* Run the scene's migration again without faults on fresh transports when the old ones
 * are gone: it completes. */
static void check_retry(const char *name, scene *s)
{
    rank_run runs[NR];
    bool fresh = false;
    for (int g = 0; g < NR; g++) fresh |= !rp_transport_usable(s->t[g]);
    if (fresh) {
        for (int g = 0; g < NR; g++) rp_transport_free(s->t[g]);
        rp_local_hub_free(s->hub);
        rp_local_hub_new(s->ctx, NR, &s->hub, NULL);
        for (int g = 0; g < NR; g++) rp_transport_local_new(s->hub, g, &s->t[g], NULL);
    }
    for (int g = 0; g < NR; g++) rp_transport_set_fault(s->t[g], NULL);
    scene_runs(s, runs, 10.0);
    run_all(runs, NR);
    bool all = true;
    for (int g = 0; g < NR; g++) all &= runs[g].st == RP_OK;
    if (!all) diag("retry: %s", runs[0].err.text);
    unsigned every = (1u << s->lay.L) - 1;
    ok(all && scene_bad_slots(s, every) == 0 && identity_bad(s, every) == 0,
       "%s: then the same migration completes%s", name, fresh ? " on new transports" : "");
}

/* Layer rows where every rank sends and receives at every layer. */
static int rotate_scene(scene *s, rp_context *ctx, int L, int64_t budget_layers)
{
    const int ep = 4, slots = 3, E = 10, S = ep * slots;
    int32_t cur[3 * 12], tgt[3 * 12];
    for (int l = 0; l < L; l++) w_random_layer(cur + l * S, S, E);
    w_rotate(cur, tgt, L, ep, slots);
    if (scene_init(s, ctx, 2, 2, ep, slots, L, E, cur, tgt, 100, 0) != 0) return -1;
    if (budget_layers > 0) { /* the smallest budget: several rounds */
        rp_migration_summary sum;
        rp_migration_plan_summary(s->mp, &sum);
        rp_migration_plan_free(s->mp);
        s->mp = NULL;
        rp_migration_options o = {s->lay.bytes, sum.min_budget_bytes};
        if (rp_migration_plan_new(ctx, s->cfg, s->cur, s->tgt, &o, &s->mp, NULL) != RP_OK) return -1;
    }
    return 0;
}

/* One layer where each GPU receives one expert into two of its slots (the commit keeps
 * the second slot's old bytes in undo memory) and another into one. */
static int replica_scene(scene *s, rp_context *ctx)
{
    const int32_t cur[12] = {0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5};
    const int32_t tgt[12] = {3, 3, 4, 0, 0, 1, 5, 5, 3, 2, 2, 1};
    return scene_init(s, ctx, 2, 2, 4, 3, 1, 6, cur, tgt, 100, 0);
}

static void fault_all(scene *s, int rank, rp_fault f)
{
    for (int g = 0; g < NR; g++) rp_transport_set_fault(s->t[g], NULL);
    rp_transport_set_fault(s->t[rank], &f);
}

/* ---- out of memory on one rank, every allocation in turn, peers live ---- */

typedef struct oom {
    atomic_long live, calls;
    long fail_at;
    int rank;
} oom;

static void *oom_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    oom *c = ud;
    if (new_size == 0) {
        if (ptr) atomic_fetch_sub(&c->live, (long)old_size);
        free(ptr);
        return NULL;
    }
    if (scene_thread_rank == c->rank && atomic_fetch_add(&c->calls, 1) + 1 == c->fail_at) return NULL;
    void *p = realloc(ptr, new_size);
    if (p) atomic_fetch_add(&c->live, (long)new_size - (ptr ? (long)old_size : 0));
    return p;
}

static void test_oom_one_rank(void)
{
    oom c;
    atomic_init(&c.live, 0);
    atomic_init(&c.calls, 0);
    c.fail_at = 0;
    c.rank = 2;
    rp_context *ctx;
    rp_context_new(oom_alloc, &c, &ctx);
    scene s;
    if (replica_scene(&s, ctx) != 0) {
        ok(0, "oom scene setup");
        scene_free(&s);
        rp_context_free(ctx);
        return;
    }
    int failures = 0, same = 0, intact = 0, clean = 0;
    bool done = false;
    for (long n = 1; n < 400 && !done; n++) {
        atomic_store(&c.calls, 0);
        c.fail_at = n;
        rank_run runs[NR];
        scene_runs(&s, runs, 0.3);
        run_all(runs, NR);
        c.fail_at = 0;
        if (runs[2].st == RP_OK) {
            done = true;
            bool all = true;
            for (int g = 0; g < NR; g++) all &= runs[g].st == RP_OK;
            ok(all && scene_bad_slots(&s, 1) == 0 && identity_bad(&s, 1) == 0,
               "oom on rank 2: after %d failures the migration completes on every rank", failures);
            break;
        }
        failures++;
        bool s_same = true, usable = true;
        for (int g = 0; g < NR; g++) {
            s_same &= runs[g].st == RP_ENOMEM && strcmp(runs[g].err.text, runs[2].err.text) == 0;
            usable &= rp_transport_usable(s.t[g]);
        }
        if (s_same) same++;
        else
            for (int g = 0; g < NR; g++) diag("allocation %ld: rank %d: %s", n, g, runs[g].err.text);
        if (scene_bad_slots(&s, 0) == 0 && identity_bad(&s, 0) == 0) intact++;
        if (usable) clean++;
    }
    ok(failures > 10, "oom on rank 2: %d of its allocations failed in turn", failures);
    is_int(same, failures, "oom on rank 2: every rank returned RP_ENOMEM with rank 2's message, every time");
    is_int(intact, failures, "oom on rank 2: every rank's old bytes and identities intact, every time");
    is_int(clean, failures, "oom on rank 2: every transport stayed usable, every time");
    scene_free(&s);
    rp_context_free(ctx);
    is_int(atomic_load(&c.live), 0, "oom on rank 2: everything was freed (no failure leaked)");
}

/* ---- messages: headers, short, late ---- */

static void test_header_faults(rp_context *ctx)
{
    struct { rp_fault_kind kind; rp_status want; const char *name, *text; } cases[] = {
        {RP_FAULT_CORRUPT, RP_ETRANSPORT, "corrupt header", "is corrupt (header checksum"},
        {RP_FAULT_SHORT, RP_ETRANSPORT, "short header", "arrived from rank"},
        {RP_FAULT_DROP, RP_ETIMEOUT, "dropped header", "before the deadline"},
        {RP_FAULT_SEND_FAIL, RP_ETRANSPORT, "header send failure", "injected fault"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        scene s;
        if (rotate_scene(&s, ctx, 2, 0) != 0) {
            ok(0, "header scene setup");
            scene_free(&s);
            continue;
        }
        int rank = w_sender(s.mp, (int)i % NR);
        fault_all(&s, rank, (rp_fault){cases[i].kind, 0, 30.0, true});
        rank_run runs[NR];
        scene_runs(&s, runs, 0.3);
        run_all(runs, NR);
        check_outcome(cases[i].name, &s, runs, cases[i].want, 0, true, true);
        like(runs[0].err.text, cases[i].text, "%s: the error says what happened", cases[i].name);
        if (cases[i].kind == RP_FAULT_CORRUPT) {
            ok(!strstr(runs[0].err.text, "checksum mismatch"), "corrupt header: not reported as an expert's checksum");
            ok(runs[0].res.failed_expert == -1, "corrupt header: no expert is blamed");
        }
        check_retry(cases[i].name, &s);
        scene_free(&s);
    }
}

static void test_short_payload(rp_context *ctx)
{
    scene s;
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "short scene setup");
        scene_free(&s);
        return;
    }
    int rank = w_sender(s.mp, 3);
    fault_all(&s, rank, (rp_fault){RP_FAULT_SHORT, 0, 0, false});
    rank_run runs[NR];
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    check_outcome("short message", &s, runs, RP_ETRANSPORT, 0, true, true);
    char text[64];
    snprintf(text, sizeof text, "bytes arrived from rank %d where", rank);
    like(runs[0].err.text, text, "short message: the sizes are named");
    check_retry("short message", &s);
    scene_free(&s);
}

/* A header that arrives only after its call failed, then meets a later call with the
 * same tags (tags repeat every 32768 calls): refused as stale, on every rank. */
static void test_late_message(rp_context *ctx)
{
    scene s;
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "late scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, w_sender(s.mp, 0), (rp_fault){RP_FAULT_LATE, 0, 0.7, true});
    rank_run runs[NR];
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    check_outcome("late header, its own call", &s, runs, RP_ETIMEOUT, 0, true, true);
    struct timespec ts = {0, 500000000L}; /* until it has arrived */
    nanosleep(&ts, NULL);
    uint64_t first = s.t[0]->calls - 1;
    for (int g = 0; g < NR; g++) s.t[g]->calls = first + 32768; /* the same tags as the failed call */
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    check_outcome("late header, a later call", &s, runs, RP_ETRANSPORT, 0, true, true);
    char text[160];
    snprintf(text, sizeof text, "belongs to migration call %llu, and this is call %llu: a late message of an earlier "
             "call, refused", (unsigned long long)first, (unsigned long long)first + 32768);
    like(runs[0].err.text, text, "late header: recognised by its call number");
    check_retry("late header", &s);
    scene_free(&s);
}

/* ---- ranks that stop ---- */

static void test_stalls(rp_context *ctx)
{
    /* Mid-round, shorter than the decision exchange waits: a timeout everywhere. */
    scene s;
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "stall scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, w_sender(s.mp, 2), (rp_fault){RP_FAULT_STALL, 0, 0.75, false});
    rank_run runs[NR];
    scene_runs(&s, runs, 0.5);
    run_all(runs, NR);
    check_outcome("rank 2 stalls mid-round", &s, runs, RP_ETIMEOUT, 0, true, true);
    check_retry("rank 2 stalls mid-round", &s);

    /* Mid-round, past every wait (as a rank that stopped): the others give up in the
     * decision exchange; the hub is gone, nothing was written anywhere. */
    scene_free(&s);
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "stall scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, w_sender(s.mp, 1), (rp_fault){RP_FAULT_STALL, 0, 1.2, false});
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    check_outcome("rank 1 stops responding mid-round", &s, runs, RP_ETIMEOUT, 0, false, false);
    check_retry("rank 1 stops responding mid-round", &s);
    scene_free(&s);

    /* Before the decision exchange (after its commit), longer than the others wait:
     * nobody learns the outcome, every rank restores what it wrote. */
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "stall scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, 3, (rp_fault){RP_FAULT_STALL_DECISION, 0, 1.2, false});
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    check_outcome("rank 3 stalls in the decision exchange", &s, runs, RP_ETIMEOUT, 0, false, false);
    like(runs[0].err.text, "could not learn whether round 0 committed on every rank", "decision stall: the error says so");
    like(runs[0].err.text, "it restored its own slots of that round", "decision stall: and that it restored its slots");
    check_retry("rank 3 stalls in the decision exchange", &s);
    scene_free(&s);

    /* A short stall there is only slow. */
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "stall scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, 3, (rp_fault){RP_FAULT_STALL_DECISION, 0, 0.1, false});
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    check_outcome("rank 3 is slow to decide", &s, runs, RP_OK, 1 | 2, true, true);
    scene_free(&s);
}

/* An exchange that completes on the other ranks only (MPI's can). */
static void test_lost_exchanges(rp_context *ctx)
{
    /* After a failure of its own: rank 3's record told the others, so no rank keeps
     * the round; every rank restores what it wrote, rank 3 says it cannot have been kept. */
    scene s;
    if (replica_scene(&s, ctx) != 0) {
        ok(0, "lost-exchange scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, 3, (rp_fault){RP_FAULT_CORRUPT_STAGING, 0, 0, false});
    rp_transport_add_fault(s.t[3], &(rp_fault){RP_FAULT_LOSE_DECISION, 0, 0, false});
    rank_run runs[NR];
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    ok(runs[0].st == RP_ECHECKSUM && runs[1].st == RP_ECHECKSUM && runs[2].st == RP_ECHECKSUM &&
       runs[3].st == RP_ECHECKSUM, "decision lost after rank 3's own failure: every rank reports it");
    like(runs[3].err.text, "no rank keeps that round without this rank's confirmation",
         "decision lost after a failure: rank 3 knows nobody kept the round");
    like(runs[0].err.text, "rolled back on every rank (the slots it wrote were restored)",
         "decision lost after a failure: the others restored their slots");
    is_int(scene_bad_slots(&s, 0), 0, "decision lost after a failure: every rank's old bytes are back");
    is_int(identity_bad(&s, 0), 0, "decision lost after a failure: every slot's identity says what it holds");
    ok(!rp_transport_usable(s.t[3]) && rp_transport_usable(s.t[0]),
       "decision lost after a failure: rank 3's transport is unusable, the others' are not");
    check_retry("decision lost after rank 3's own failure", &s);
    scene_free(&s);

    /* The decision exchange is the one window: ranks 0-2 keep the round, rank 3, which
     * wrote and checked it, restores its slots: weights differ from the plan on some
     * ranks, and the slot identities say so; the same plan run again is refused before
     * anything moves. */
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "lost-exchange scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, 3, (rp_fault){RP_FAULT_LOSE_DECISION, 0, 0, false});
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    ok(runs[0].st == RP_OK && runs[1].st == RP_OK && runs[2].st == RP_OK && runs[3].st == RP_ETIMEOUT,
       "decision lost on rank 3: ranks 0-2 kept the round, rank 3 reports the uncertainty");
    like(runs[3].err.text, "end the job", "decision lost: rank 3 says to end the job");
    ok(!rp_transport_usable(s.t[3]), "decision lost: rank 3's transport is unusable");
    int bad_identity = 0, bad_bytes = 0;
    for (int g = 0; g < NR; g++) {
        bad_bytes += w_gpu_bad_slots(&s.gpu[g], s.tgt, g < 3 ? 3 : 0);
        const int32_t *sb = rp_plan_slot_begin(s.cur);
        for (int l = 0; l < 2; l++)
            for (int k = 0; k < s.gpu[g].slots; k++) {
                rp_slot_identity id;
                rp_registry_identity(s.gpu[g].reg, l, k, &id, NULL);
                int32_t c = rp_plan_phy2log(s.cur, l)[sb[s.gpu[g].ep_rank] + k];
                int32_t t = rp_plan_phy2log(s.tgt, l)[sb[s.gpu[g].ep_rank] + k];
                int32_t want = g < 3 && t >= 0 ? t : c; /* a slot the target leaves empty keeps its expert */
                bad_identity += id.expert != want;
            }
    }
    ok(bad_bytes == 0 && bad_identity == 0,
       "decision lost: each rank's slots hold, and their identities name, what that rank kept");
    /* The same plan again, on new transports: refused on every rank, nothing moves. */
    for (int g = 0; g < NR; g++) rp_transport_free(s.t[g]);
    rp_local_hub_free(s.hub);
    rp_local_hub_new(ctx, NR, &s.hub, NULL);
    for (int g = 0; g < NR; g++) rp_transport_local_new(s.hub, g, &s.t[g], NULL);
    unsigned char *before[NR];
    for (int g = 0; g < NR; g++) {
        before[g] = malloc(s.gpu[g].total);
        memcpy(before[g], s.gpu[g].mem, s.gpu[g].total);
    }
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    ok(same_outcome(runs, NR) && runs[0].st == RP_EPLAN,
       "rerun after a partial commit: every rank refuses with RP_EPLAN and the same message");
    like(runs[0].err.text, "migration: rank 0: layer 0 slot 0 holds layer 0's expert",
         "rerun: the error names the rank, slot and the expert it holds");
    like(runs[0].err.text, "but the migration plan starts from expert", "rerun: and the expert the plan expected");
    like(runs[0].err.text, "nothing moved", "rerun: nothing moved");
    bool unchanged = true;
    for (int g = 0; g < NR; g++) {
        unchanged &= memcmp(before[g], s.gpu[g].mem, s.gpu[g].total) == 0;
        free(before[g]);
    }
    ok(unchanged, "rerun: every byte on every rank is as it was");
    scene_free(&s);
}

/* ---- two faults at once ---- */

static void test_two_faults(rp_context *ctx)
{
    scene s;
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "two-fault scene setup");
        scene_free(&s);
        return;
    }
    /* On two ranks: a corrupt expert from rank 1, a failed send on rank 3. */
    int a = w_sender(s.mp, 1), b = w_sender(s.mp, a == 3 ? 2 : 3);
    fault_all(&s, a, (rp_fault){RP_FAULT_CORRUPT, 0, 0, false});
    rp_transport_set_fault(s.t[b], &(rp_fault){RP_FAULT_SEND_FAIL, 0, 0, false});
    rank_run runs[NR];
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    check_outcome("faults on ranks 1 and 3", &s, runs, runs[0].st, 0, true, true);
    ok(runs[0].st == RP_ECHECKSUM || runs[0].st == RP_ETRANSPORT, "faults on ranks 1 and 3: a cause is reported, "
       "not a timeout (%s)", rp_strerror(runs[0].st));
    check_retry("faults on ranks 1 and 3", &s);
    /* On one rank: a dropped header, and a failing write armed for the first commit. */
    scene_free(&s);
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "two-fault scene setup");
        scene_free(&s);
        return;
    }
    int c = w_sender(s.mp, 2);
    fault_all(&s, c, (rp_fault){RP_FAULT_DROP, 0, 0, true});
    rp_transport_add_fault(s.t[c], &(rp_fault){RP_FAULT_COMMIT_FAIL, 0, 0, false});
    scene_runs(&s, runs, 0.3);
    run_all(runs, NR);
    /* Rank 2's own round went well, so it writes (and its write fails) while rank 2's
     * receiver waits for the header: a cause is reported over the timeout, every rank
     * restores what it wrote. */
    check_outcome("two faults on rank 2 (a dropped header, then a failing write)", &s, runs, RP_ETRANSPORT, 0, true,
                  true);
    like(runs[0].err.text, "writing expert", "two faults on rank 2: the failing write is the cause named");
    check_retry("two faults on rank 2", &s);
    scene_free(&s);
}

/* ---- the commit ---- */

static void test_commit_faults(rp_context *ctx)
{
    /* A write fails halfway through a rank's commit (after a further write and a swap):
     * every rank restores what it wrote. */
    scene s;
    if (replica_scene(&s, ctx) != 0) {
        ok(0, "commit scene setup");
        scene_free(&s);
        return;
    }
    rank_run runs[NR];
    fault_all(&s, 2, (rp_fault){RP_FAULT_COMMIT_FAIL, 2, 0, false});
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    check_outcome("a write fails during rank 2's commit", &s, runs, RP_ETRANSPORT, 0, true, true);
    like(runs[0].err.text, "rolled back on every rank (the slots it wrote were restored)",
         "commit failure: the error says every rank restored its slots");
    ok(runs[1].res.rounds_committed == 0 && runs[1].res.failed_rank == 2, "commit failure: the result names rank 2");
    check_retry("a write fails during rank 2's commit", &s);
    scene_free(&s);

    /* Staging corrupted after the data arrived, before the commit: the slots are
     * checked as the commit writes them, and every rank restores what it wrote. */
    if (replica_scene(&s, ctx) != 0) {
        ok(0, "commit scene setup");
        scene_free(&s);
        return;
    }
    fault_all(&s, 1, (rp_fault){RP_FAULT_CORRUPT_STAGING, 0, 0, false});
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    check_outcome("rank 1's staging corrupted before the commit", &s, runs, RP_ECHECKSUM, 0, true, true);
    like(runs[0].err.text, "checksum mismatch (0x", "corrupt staging: the slot's checksum differs from its source's");
    like(runs[0].err.text, "rolled back on every rank (the slots it wrote were restored)",
         "corrupt staging: and every rank restored what it wrote");
    rp_migration_gpu gs;
    rp_migration_plan_gpu(s.mp, 1, &gs, NULL);
    ok(runs[1].res.staging_bytes > gs.staging_bytes,
       "undo memory for the further writes is counted in the result's staging (%lld > %lld)",
       (long long)runs[1].res.staging_bytes, (long long)gs.staging_bytes);
    check_retry("rank 1's staging corrupted before the commit", &s);
    scene_free(&s);

    /* In the second of three rounds: the first stays, the second is restored. */
    if (rotate_scene(&s, ctx, 3, 1) != 0) {
        ok(0, "commit scene setup");
        scene_free(&s);
        return;
    }
    int64_t writes_round0 = 0;
    for (int64_t i = 0; i < rp_migration_plan_num_writes(s.mp); i++) {
        rp_migration_write w;
        rp_migration_plan_write(s.mp, i, &w, NULL);
        rp_migration_transfer t;
        rp_migration_plan_transfer(s.mp, w.transfer, &t, NULL);
        writes_round0 += w.gpu == 0 && t.round == 0;
    }
    fault_all(&s, 0, (rp_fault){RP_FAULT_COMMIT_FAIL, writes_round0 + 1, 0, false});
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    unsigned moved = 0;
    for (int l = 0; l < 3; l++)
        if (rp_migration_plan_layer_round(s.mp, l) == 0) moved |= 1u << l;
    ok(rp_migration_plan_num_rounds(s.mp) >= 2, "commit in a later round: %d rounds", rp_migration_plan_num_rounds(s.mp));
    check_outcome("a write fails in round 1's commit", &s, runs, RP_ETRANSPORT, moved, true, true);
    is_int(runs[2].res.rounds_committed, 1, "commit in a later round: round 0 stays committed");
    like(runs[0].err.text, "rounds 0 to 0 stay committed", "commit in a later round: the error says so");
    scene_free(&s);
}

/* ---- slot identity ---- */

static void test_identity_api(rp_context *ctx)
{
    rp_registry *reg = NULL;
    rp_registry_new(ctx, 2, 3, &reg, NULL);
    rp_slot_identity id;
    rp_error err;
    ok(rp_registry_identity(reg, 1, 2, &id, &err) == RP_OK && id.layer == 1 && id.expert == RP_SLOT_UNKNOWN,
       "identity: a new registry's slots are unknown");
    ok(rp_registry_set_identity(reg, 0, 1, &(rp_slot_identity){0, 5, 9}, &err) == RP_OK &&
       rp_registry_identity(reg, 0, 1, &id, NULL) == RP_OK && id.expert == 5 && id.version == 9,
       "identity: set and read back");
    is_int(rp_registry_set_identity(reg, 2, 0, &(rp_slot_identity){0, 1, 0}, &err), RP_EINVAL,
           "identity: a layer out of range is refused");
    like(err.text, "layer 2 slot 0 is out of range", "identity: the indices are named");
    is_int(rp_registry_set_identity(reg, 0, 0, &(rp_slot_identity){7, 1, 0}, &err), RP_EINVAL,
           "identity: naming a layer the registry does not have is refused");
    is_int(rp_registry_set_identity(reg, 0, 0, &(rp_slot_identity){0, -3, 0}, &err), RP_EINVAL,
           "identity: an expert below RP_SLOT_UNKNOWN is refused");
    rp_registry_identity(reg, 0, 1, &id, NULL);
    ok(id.expert == 5, "identity: a refused call changes nothing");
    rp_registry_set_version(reg, 42);
    rp_registry_identity(reg, 0, 1, &id, NULL);
    ok(id.version == 42, "identity: rp_registry_set_version sets every slot's version");
    rp_config *cfg = w_config(ctx, 1, 2, 2, 3, 2, 4);
    int32_t rows[12] = {0, 1, -1, 2, 3, 0, 3, 2, 1, 0, 1, 2};
    rp_plan *p = w_plan(ctx, cfg, rows);
    ok(rp_registry_set_placement(reg, p, 1, 3, &err) == RP_OK && rp_registry_identity(reg, 1, 2, &id, NULL) == RP_OK &&
       id.layer == 1 && id.expert == 2 && id.version == 3, "identity: rp_registry_set_placement from a plan");
    is_int(rp_registry_set_placement(reg, p, 2, 0, &err), RP_EINVAL, "identity: an EP rank out of range is refused");
    rp_registry *small = NULL;
    rp_registry_new(ctx, 2, 2, &small, NULL);
    is_int(rp_registry_set_placement(small, p, 0, 0, &err), RP_EINVAL, "identity: a plan of another shape is refused");
    like(err.text, "the registry has 2 layers and 2 slots, but EP rank 0 has 2 layers and 3 slots",
         "identity: both shapes are named");
    rp_registry_free(small);
    rp_plan_free(p);
    rp_config_free(cfg);
    rp_registry_free(reg);
}

static void test_identity_checks(rp_context *ctx)
{
    scene s;
    if (rotate_scene(&s, ctx, 2, 0) != 0) {
        ok(0, "identity scene setup");
        scene_free(&s);
        return;
    }
    rank_run runs[NR];
    const int32_t *sb = rp_plan_slot_begin(s.cur);
    int32_t e0 = rp_plan_phy2log(s.cur, 1)[sb[1] + 2];
    rp_slot_identity keep;
    rp_registry_identity(s.gpu[1].reg, 1, 2, &keep, NULL);

    /* A slot that claims another expert (as after a migration the plan does not know). */
    rp_registry_set_identity(s.gpu[1].reg, 1, 2, &(rp_slot_identity){1, (e0 + 1) % 10, 0}, NULL);
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    char text[200];
    snprintf(text, sizeof text, "migration: rank 1: layer 1 slot 2 holds layer 1's expert %d (its registry identity), "
             "but the migration plan starts from expert %d there", (e0 + 1) % 10, e0);
    ok(same_outcome(runs, NR) && runs[0].st == RP_EPLAN, "a slot holding another expert: every rank refuses");
    like(runs[0].err.text, text, "a slot holding another expert: the slot and both experts are named");
    ok(scene_intact(&s), "a slot holding another expert: nothing moved");

    /* The tensors of another layer registered at this one. */
    rp_registry_set_identity(s.gpu[1].reg, 1, 2, &(rp_slot_identity){0, e0, 0}, NULL);
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    ok(same_outcome(runs, NR) && runs[0].st == RP_EPLAN, "a slot holding another layer's expert: refused");
    like(runs[0].err.text, "layer 1 slot 2 holds layer 0's expert", "another layer: named");

    /* Never said. */
    rp_registry_set_identity(s.gpu[1].reg, 1, 2, &(rp_slot_identity){1, RP_SLOT_UNKNOWN, 0}, NULL);
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    ok(same_outcome(runs, NR) && runs[0].st == RP_EINVAL, "a slot without identity: refused");
    like(runs[0].err.text, "layer 1 slot 2 has no identity", "no identity: named");
    rp_registry_set_identity(s.gpu[1].reg, 1, 2, &keep, NULL);

    /* Versions: one slot behind on a rank, then a whole rank behind. */
    rp_slot_identity v;
    rp_registry_identity(s.gpu[2].reg, 0, 1, &v, NULL);
    v.version = 5;
    rp_registry_set_identity(s.gpu[2].reg, 0, 1, &v, NULL);
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    ok(same_outcome(runs, NR) && runs[0].st == RP_EINVAL, "one slot at another version: refused");
    like(runs[0].err.text, "layer 0 slot 1 is at version 5, but layer 0 slot 0 at 0", "one slot's version: named");
    for (int g = 0; g < NR; g++) rp_registry_set_version(s.gpu[g].reg, g == 3 ? 6 : 7);
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    ok(same_outcome(runs, NR) && runs[0].st == RP_EPLAN, "a rank at another version: refused");
    like(runs[0].err.text, "rank 3's experts are at version 6, rank 0's at 7", "a rank's version: named");
    ok(scene_intact(&s), "versions: nothing moved");

    /* Agreed: the migration runs, and written slots carry the version. */
    rp_registry_set_version(s.gpu[3].reg, 7);
    scene_runs(&s, runs, 2.0);
    run_all(runs, NR);
    check_outcome("identities agree", &s, runs, RP_OK, 3, true, true);
    rp_registry_identity(s.gpu[0].reg, 0, 0, &v, NULL);
    ok(v.version == 7, "a written slot keeps the agreed version");
    scene_free(&s);
}

/* Creating a hub and a transport fails cleanly at each allocation (the exchange room
 * is taken there), and the rank can be attached afterwards. */
static void test_transport_alloc(void)
{
    oom c;
    atomic_init(&c.live, 0);
    atomic_init(&c.calls, 0);
    c.rank = -1; /* this thread */
    rp_context *ctx;
    rp_context_new(oom_alloc, &c, &ctx);
    long base = atomic_load(&c.live);
    int failures = 0, clean = 0;
    for (long n = 1; n < 50; n++) {
        atomic_store(&c.calls, 0);
        c.fail_at = n;
        rp_local_hub *hub = NULL;
        rp_transport *t = NULL;
        rp_error err;
        rp_status st = rp_local_hub_new(ctx, NR, &hub, &err);
        if (st == RP_OK) st = rp_transport_local_new(hub, 1, &t, &err);
        c.fail_at = 0;
        bool reattach = true;
        if (st != RP_OK && hub) { /* the rank is free again */
            reattach = rp_transport_local_new(hub, 1, &t, NULL) == RP_OK;
        }
        rp_transport_free(t);
        rp_local_hub_free(hub);
        if (st == RP_OK) break;
        failures++;
        if (st == RP_ENOMEM && reattach && atomic_load(&c.live) == base) clean++;
        else diag("allocation %ld: %s", n, err.text);
    }
    ok(failures >= 4 && failures == clean, "creating a hub and transport: each of %d allocation failures is "
       "RP_ENOMEM, leaks nothing and leaves the rank free", failures);
    rp_context_free(ctx);
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_identity_api(ctx);
    test_identity_checks(ctx);
    test_header_faults(ctx);
    test_short_payload(ctx);
    test_late_message(ctx);
    test_stalls(ctx);
    test_lost_exchanges(ctx);
    test_two_faults(ctx);
    test_commit_faults(ctx);
    rp_context_free(ctx);
    test_oom_one_rank();
    test_transport_alloc();
    return tap_done();
}
