/* The step API's migration plan executed by the in-process transport (8 ranks as
 * threads) over registries of random host weights: after every step every slot holds
 * exactly the bytes of the expert the plan in use puts there; a fault rolls back, the
 * scheduler told of it keeps the old placement (or, with rounds, the committed layers)
 * and the next step migrates from there; misuse of the API is refused. */
#include "routepack/routepack.h"
#include "transport_fault.h"
#include "tap.h"
#include "test_util.h"

#include <pthread.h>
#include <string.h>

#define STEPS 4
#define MAX_G 8
#define MAX_T 3

static rp_context *ctx;
static rp_config *cfg;
static rp_batch *batches[STEPS];
static rp_routing routings[STEPS];
static uint8_t *ids[STEPS];
static uint64_t rng = 0x9e3779b97f4a7c15ULL;

static void make_batches(void)
{
    rp_gen *gen = NULL;
    rp_error err;
    if (rp_gen_load(ctx, RP_SOURCE_DIR "/examples/gen-small.json", &gen, &err) != RP_OK) {
        diag("gen: %s", err.text);
        exit(1);
    }
    for (int t = 0; t < STEPS; t++) {
        if (!(ids[t] = gen_step_copy(gen, t, &batches[t], &routings[t], &err))) {
            diag("gen: %s", err.text);
            exit(1);
        }
    }
    rp_gen_free(gen);
}

/* ---- the trainer's side: reference weights, slots, registries, transports ---- */

typedef struct world {
    int G, ep, L, E, slots;
    int count[64];                 /* tensors per expert at each layer */
    size_t size[64][MAX_T];
    int64_t expert_bytes[64];
    unsigned char **reference;     /* [L * E]: each expert's bytes, tensors back to back */
    unsigned char *mem[MAX_G];     /* [L][slots]: each slot's tensors back to back */
    unsigned char *want[MAX_G];    /* what each slot must hold */
    size_t *offset;                /* [L * slots]: a slot's offset, the same on every GPU */
    size_t total;
    rp_registry *reg[MAX_G];
    rp_local_hub *hub;
    rp_transport *t[MAX_G];
} world;

static int world_init(world *w)
{
    memset(w, 0, sizeof *w);
    const rp_topology *topo = rp_config_topology(cfg);
    w->G = topo->num_gpus;
    w->ep = topo->ep_size;
    w->L = rp_config_model(cfg)->num_layers;
    w->E = rp_config_model(cfg)->num_experts;
    w->slots = topo->slots[0]; /* the same on every GPU of this config */
    if (w->G > MAX_G || w->L > 64) return -1;
    for (int l = 0; l < w->L; l++) {
        w->count[l] = 1 + (int)(xorshift64(&rng) % MAX_T);
        for (int t = 0; t < w->count[l]; t++) {
            w->size[l][t] = 1 + xorshift64(&rng) % 40;
            w->expert_bytes[l] += (int64_t)w->size[l][t];
        }
    }
    w->reference = calloc((size_t)w->L * w->E, sizeof *w->reference);
    for (int l = 0; l < w->L; l++)
        for (int e = 0; e < w->E; e++) {
            unsigned char *r = malloc((size_t)w->expert_bytes[l]);
            for (int64_t i = 0; i < w->expert_bytes[l]; i++) r[i] = (unsigned char)xorshift64(&rng);
            w->reference[l * w->E + e] = r;
        }
    w->offset = calloc((size_t)w->L * w->slots, sizeof(size_t));
    for (int l = 0; l < w->L; l++)
        for (int k = 0; k < w->slots; k++) {
            w->offset[l * w->slots + k] = w->total;
            w->total += (size_t)w->expert_bytes[l];
        }
    /* the weights start where trainers start them: the contiguous placement */
    rp_plan *start = NULL;
    if (rp_plan_new(ctx, cfg, 1, &start, NULL) != RP_OK || rp_plan_set_contiguous(start, NULL) != RP_OK) return -1;
    const int32_t *sb = rp_plan_slot_begin(start);
    for (int g = 0; g < w->G; g++) {
        int j = g % w->ep;
        w->mem[g] = malloc(w->total);
        w->want[g] = malloc(w->total);
        for (size_t i = 0; i < w->total; i++) w->mem[g][i] = (unsigned char)xorshift64(&rng); /* junk */
        if (rp_registry_new(ctx, w->L, w->slots, &w->reg[g], NULL) != RP_OK) return -1;
        for (int l = 0; l < w->L; l++)
            for (int k = 0; k < w->slots; k++) {
                unsigned char *slot = w->mem[g] + w->offset[l * w->slots + k];
                int32_t e = rp_plan_phy2log(start, l)[sb[j] + k];
                if (e >= 0) memcpy(slot, w->reference[l * w->E + e], (size_t)w->expert_bytes[l]);
                rp_tensor ts[MAX_T];
                size_t at = 0;
                for (int t = 0; t < w->count[l]; t++) {
                    ts[t] = (rp_tensor){slot + at, w->size[l][t], RP_MEMORY_HOST};
                    at += w->size[l][t];
                }
                if (rp_registry_set(w->reg[g], l, k, ts, w->count[l], NULL) != RP_OK) return -1;
            }
        if (rp_registry_set_placement(w->reg[g], start, j, 0, NULL) != RP_OK) return -1;
        memcpy(w->want[g], w->mem[g], w->total);
    }
    rp_plan_free(start);
    if (rp_local_hub_new(ctx, w->G, &w->hub, NULL) != RP_OK) return -1;
    for (int g = 0; g < w->G; g++)
        if (rp_transport_local_new(w->hub, g, &w->t[g], NULL) != RP_OK) return -1;
    return 0;
}

static void world_free(world *w)
{
    for (int g = 0; g < MAX_G; g++) {
        rp_transport_free(w->t[g]);
        rp_registry_free(w->reg[g]);
        free(w->mem[g]);
        free(w->want[g]);
    }
    rp_local_hub_free(w->hub);
    for (int i = 0; w->reference && i < w->L * w->E; i++) free(w->reference[i]);
    free(w->reference);
    free(w->offset);
}

/* What every slot must hold under `plan`: its expert's bytes; an empty slot keeps what
 * it had (the executor never touches it). */
static void world_expect(world *w, const rp_plan *plan)
{
    const int32_t *sb = rp_plan_slot_begin(plan);
    for (int g = 0; g < w->G; g++)
        for (int l = 0; l < w->L; l++)
            for (int k = 0; k < w->slots; k++) {
                int32_t e = rp_plan_phy2log(plan, l)[sb[g % w->ep] + k];
                if (e >= 0)
                    memcpy(w->want[g] + w->offset[l * w->slots + k], w->reference[l * w->E + e],
                           (size_t)w->expert_bytes[l]);
            }
}

/* Slots whose bytes differ from what they must hold. */
static int world_bad_slots(const world *w)
{
    int bad = 0;
    for (int g = 0; g < w->G; g++)
        for (int i = 0; i < w->L * w->slots; i++) {
            int l = i / w->slots;
            bad += memcmp(w->mem[g] + w->offset[i], w->want[g] + w->offset[i], (size_t)w->expert_bytes[l]) != 0;
        }
    return bad;
}

typedef struct rank_run {
    const rp_migration_plan *mp;
    rp_registry *reg;
    rp_transport *t;
    rp_migration_exec_options opts;
    rp_status st;
    rp_error err;
    rp_migration_result res;
} rank_run;

static void *rank_main(void *arg)
{
    rank_run *r = arg;
    r->st = rp_migration_execute(r->mp, r->reg, r->t, &r->opts, &r->res, &r->err);
    return NULL;
}

/* One call on every rank (a thread each); true when every rank returned the same status
 * and message. */
static bool execute(world *w, const rp_migration_plan *mp, double timeout_s, rank_run *runs)
{
    pthread_t th[MAX_G];
    for (int g = 0; g < w->G; g++) {
        memset(&runs[g], 0, sizeof runs[g]);
        runs[g].mp = mp;
        runs[g].reg = w->reg[g];
        runs[g].t = w->t[g];
        rp_migration_exec_defaults(&runs[g].opts);
        runs[g].opts.timeout_s = timeout_s;
        rp_error_clear(&runs[g].err);
    }
    for (int g = 0; g < w->G; g++) pthread_create(&th[g], NULL, rank_main, &runs[g]);
    for (int g = 0; g < w->G; g++) pthread_join(th[g], NULL);
    bool same = true;
    for (int g = 1; g < w->G; g++)
        same &= runs[g].st == runs[0].st && strcmp(runs[g].err.text, runs[0].err.text) == 0 &&
                runs[g].res.rounds_committed == runs[0].res.rounds_committed;
    return same;
}

static rp_sched *make_sched(const world *w, int64_t budget)
{
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) {
        diag("rp_sched_new: %s", err.text);
        return NULL;
    }
    rp_migration_options mo = {w->expert_bytes, budget};
    if (rp_sched_set_migration_options(s, &mo, &err) != RP_OK) {
        diag("migration options: %s", err.text);
        rp_sched_free(s);
        return NULL;
    }
    return s;
}

static bool step(rp_sched *s, int t, const rp_plan **plan, const rp_step_report **rep)
{
    rp_error err;
    if (rp_sched_step(s, t, batches[t % STEPS], &routings[t % STEPS], plan, rep, &err) != RP_OK) {
        diag("step %d: %s", t, err.text);
        return false;
    }
    return true;
}

static bool same_rows(const rp_plan *a, const rp_plan *b, int layer)
{
    return memcmp(rp_plan_phy2log(a, layer), rp_plan_phy2log(b, layer),
                  (size_t)rp_plan_total_slots(a) * sizeof(int32_t)) == 0;
}

static bool same_placement(const rp_plan *a, const rp_plan *b)
{
    for (int l = 0; l < rp_plan_num_layers(a); l++)
        if (!same_rows(a, b, l)) return false;
    return true;
}

/* ---- every step's migration, executed ---- */

static void test_steps(void)
{
    world w;
    rp_sched *s = NULL;
    if (world_init(&w) != 0 || !(s = make_sched(&w, 0))) {
        ok(0, "setup");
        world_free(&w);
        return;
    }
    int migrations = 0, bad_steps = 0, inconsistent = 0, not_minimal = 0, failed = 0;
    int64_t moved_total = 0;
    for (int t = 0; t < 3 * STEPS; t++) {
        const rp_plan *plan;
        const rp_step_report *rep;
        if (!step(s, t, &plan, &rep)) {
            failed++;
            continue;
        }
        const rp_migration_plan *mp = rp_sched_migration(s);
        if (mp) {
            rp_migration_summary sum;
            rp_migration_plan_summary(mp, &sum);
            if (rep->migration_bytes != (double)sum.moved_bytes || rep->migration_s != sum.predicted_s)
                inconsistent++;
            if (sum.moved_bytes != sum.min_bytes) not_minimal++;
            moved_total += sum.moved_bytes;
            rank_run runs[MAX_G];
            if (!execute(&w, mp, 10.0, runs) || runs[0].st != RP_OK) {
                diag("step %d: migration: %s", t, runs[0].err.text);
                failed++;
            }
            migrations++;
        } else if (rep->migration_bytes != 0 || rep->experts_moved != 0) {
            inconsistent++;
        }
        world_expect(&w, plan);
        if (world_bad_slots(&w) != 0) bad_steps++;
    }
    ok(failed == 0, "12 steps of token_kk+eplb, each step's migration executed on 8 ranks");
    ok(migrations >= 4, "the placement changed in %d steps (%.3g kB moved in all)", migrations, moved_total / 1e3);
    is_int(bad_steps, 0, "after every step every slot holds exactly its expert's bytes");
    is_int(inconsistent, 0, "the report's migration bytes and time are the migration plan's");
    is_int(not_minimal, 0, "every migration moves the minimum bytes");
    rp_sched_free(s);
    world_free(&w);
}

/* ---- a fault: rollback, the scheduler told, the next step migrates from the old ---- */

/* Step until one changes the placement; the placement in effect before it goes to *before. */
static const rp_migration_plan *step_to_migration(rp_sched *s, world *w, int *t, rp_plan **before,
                                                  const rp_plan **plan)
{
    for (int tries = 0; tries < 3 * STEPS; tries++, (*t)++) {
        rp_plan_free(*before);
        *before = NULL;
        if (rp_sched_plan(s)) {
            rp_plan_copy(rp_sched_plan(s), before, NULL);
        } else if (rp_plan_new(ctx, cfg, 1, before, NULL) == RP_OK) {
            rp_plan_set_contiguous(*before, NULL); /* before the first step */
        }
        const rp_step_report *rep;
        if (!step(s, *t, plan, &rep)) return NULL;
        const rp_migration_plan *mp = rp_sched_migration(s);
        if (mp) {
            (*t)++;
            return mp;
        }
        world_expect(w, *plan);
    }
    return NULL;
}

static void test_fault(rp_fault_kind kind, const char *name)
{
    world w;
    rp_sched *s = NULL;
    if (world_init(&w) != 0 || !(s = make_sched(&w, 0))) {
        ok(0, "setup");
        world_free(&w);
        return;
    }
    int t = 0;
    rp_plan *before = NULL, *old = NULL;
    const rp_plan *plan = NULL;
    const rp_step_report *rep;
    /* a first migration that succeeds, so the old placement is not the contiguous one */
    const rp_migration_plan *mp = step_to_migration(s, &w, &t, &before, &plan);
    rank_run runs[MAX_G];
    bool fine = mp && execute(&w, mp, 10.0, runs) && runs[0].st == RP_OK;
    if (fine) world_expect(&w, plan);
    mp = fine ? step_to_migration(s, &w, &t, &before, &plan) : NULL;
    if (!mp || !before) {
        ok(0, "%s: two steps that change the placement", name);
        rp_plan_free(before);
        rp_sched_free(s);
        world_free(&w);
        return;
    }
    /* the first rank that sends something between GPUs fails its first payload */
    int sender = -1;
    for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp) && sender < 0; i++) {
        rp_migration_transfer tr;
        rp_migration_plan_transfer(mp, i, &tr, NULL);
        if (tr.src_gpu != tr.dst_gpu) sender = tr.src_gpu;
    }
    rp_fault f = {kind, 0, 30.0, false};
    if (sender >= 0) rp_transport_set_fault(w.t[sender], &f);
    bool same = execute(&w, mp, 0.5, runs);
    ok(sender >= 0 && same && runs[0].st != RP_OK && runs[0].res.rounds_committed == 0,
       "%s on rank %d: every rank fails alike (%s)", name, sender, rp_strerror(runs[0].st));
    is_int(world_bad_slots(&w), 0, "%s: every weight is as before the step", name);
    rp_error err;
    ok(rp_sched_migration_failed(s, &runs[0].res, &err) == RP_OK, "%s: the scheduler is told", name);
    ok(rp_sched_plan(s) == plan && same_placement(plan, before),
       "%s: the plan in use is back on the old placement (the same pointer)", name);
    ok(rp_plan_validate(plan, cfg, batches[(t - 1) % STEPS], &err) == RP_OK, "%s: and is valid for its batch", name);
    ok(rp_sched_migration(s) == NULL, "%s: no migration is left to execute", name);
    ok(rp_sched_migration_failed(s, &runs[0].res, &err) == RP_EINVAL, "%s: reporting it twice is refused", name);
    like(err.text, "no migration to roll back", "%s: and says why", name);
    /* the next step plans from the old placement, and its migration succeeds */
    rp_transport_set_fault(w.t[sender], NULL);
    rp_plan_copy(plan, &old, NULL);
    int tries = 0;
    do {
        mp = step(s, t++, &plan, &rep) ? rp_sched_migration(s) : NULL;
    } while (!mp && ++tries < 2 * STEPS && same_placement(plan, old));
    rp_migration_plan *again = NULL;
    rp_migration_options mo = {w.expert_bytes, 0};
    ok(mp && rp_migration_plan_new(ctx, cfg, old, plan, &mo, &again, &err) == RP_OK &&
           rp_migration_plan_hash(again) == rp_migration_plan_hash(mp),
       "%s: the next step's migration starts from the old placement", name);
    ok(mp && execute(&w, mp, 10.0, runs) && runs[0].st == RP_OK, "%s: and succeeds", name);
    world_expect(&w, plan);
    is_int(world_bad_slots(&w), 0, "%s: every slot holds its expert's bytes again", name);
    rp_migration_plan_free(again);
    rp_plan_free(before);
    rp_plan_free(old);
    rp_sched_free(s);
    world_free(&w);
}

/* With a staging budget a fault in a later round leaves the earlier rounds committed:
 * the scheduler keeps their layers in the new placement and the rest in the old. */
static void test_fault_later_round(void)
{
    world w;
    rp_sched *s = NULL;
    int64_t budget = 0;
    if (world_init(&w) == 0)
        for (int l = 0; l < w.L; l++)
            if (w.slots * w.expert_bytes[l] > budget) budget = w.slots * w.expert_bytes[l];
    if (budget == 0 || !(s = make_sched(&w, budget))) {
        ok(0, "setup");
        world_free(&w);
        return;
    }
    int t = 0, rounds = 0, sender = -1, round = -1;
    int64_t nth = 0;
    rp_plan *before = NULL;
    const rp_plan *plan = NULL;
    const rp_migration_plan *mp = NULL;
    rank_run runs[MAX_G];
    /* execute migrations until one has a rank that sends in a round after the first */
    for (int k = 0; k < 6 && sender < 0; k++) {
        mp = step_to_migration(s, &w, &t, &before, &plan);
        if (!mp) break;
        rounds = rp_migration_plan_num_rounds(mp);
        for (int g = 0; g < w.G && sender < 0; g++) {
            int64_t sent = 0;
            for (int64_t i = 0; i < rp_migration_plan_num_transfers(mp); i++) {
                rp_migration_transfer tr;
                rp_migration_plan_transfer(mp, i, &tr, NULL);
                if (tr.src_gpu != g || tr.dst_gpu == g) continue;
                if (tr.round > 0) {
                    sender = g, round = tr.round, nth = sent; /* payloads go out round by round */
                    break;
                }
                sent += w.count[tr.layer];
            }
        }
        if (sender >= 0) break;
        if (!execute(&w, mp, 10.0, runs) || runs[0].st != RP_OK) break;
        world_expect(&w, plan);
    }
    if (sender < 0) {
        ok(0, "a migration of several rounds with a send after the first (%d rounds)", rounds);
        rp_plan_free(before);
        rp_sched_free(s);
        world_free(&w);
        return;
    }
    rp_fault f = {RP_FAULT_CORRUPT, nth, 0, false};
    rp_transport_set_fault(w.t[sender], &f);
    bool same = execute(&w, mp, 5.0, runs);
    ok(same && runs[0].st == RP_ECHECKSUM && runs[0].res.rounds_committed == round,
       "a corrupt copy in round %d of %d: rounds before it commit on every rank", round, rounds);
    rp_error err;
    ok(rp_sched_migration_failed(s, &runs[0].res, &err) == RP_OK, "the scheduler is told");
    int wrong = 0;
    for (int l = 0; l < w.L; l++) {
        int r = rp_migration_plan_layer_round(mp, l);
        /* r < round: committed, so the plan's rows (now in use) were not touched */
        if (r >= round && !same_rows(plan, before, l)) wrong++;
    }
    is_int(wrong, 0, "the layers of the failed rounds are back on the old placement");
    world_expect(&w, plan);
    is_int(world_bad_slots(&w), 0, "every slot holds what the plan in use says (committed layers: the new expert)");
    const rp_step_report *rep;
    mp = step(s, t++, &plan, &rep) ? rp_sched_migration(s) : NULL;
    rp_transport_set_fault(w.t[sender], NULL);
    bool done = !mp || (execute(&w, mp, 10.0, runs) && runs[0].st == RP_OK);
    world_expect(&w, plan);
    ok(done && world_bad_slots(&w) == 0, "the next step migrates from there and every slot is right");
    rp_plan_free(before);
    rp_sched_free(s);
    world_free(&w);
}

/* ---- misuse ---- */

static void test_refusals(void)
{
    world w;
    rp_sched *s = NULL;
    if (world_init(&w) != 0 || !(s = make_sched(&w, 0))) {
        ok(0, "setup");
        world_free(&w);
        return;
    }
    rp_error err;
    rp_migration_result res;
    memset(&res, 0, sizeof res);
    ok(rp_sched_migration(s) == NULL, "no migration before the first step");
    ok(rp_sched_migration_failed(s, &res, &err) == RP_EINVAL, "nothing to roll back before the first step");
    int64_t bytes[64];
    memcpy(bytes, w.expert_bytes, sizeof bytes);
    bytes[3] = 0;
    rp_migration_options mo = {bytes, 0};
    ok(rp_sched_set_migration_options(s, &mo, &err) == RP_EINVAL, "expert bytes of 0 are refused");
    like(err.text, "expert_bytes[3] is 0", "and the message names the layer");
    mo = (rp_migration_options){w.expert_bytes, -1};
    ok(rp_sched_set_migration_options(s, &mo, &err) == RP_EINVAL, "a negative budget is refused");
    /* a budget below one layer's need fails the step, which changes nothing */
    mo = (rp_migration_options){w.expert_bytes, 1};
    ok(rp_sched_set_migration_options(s, &mo, &err) == RP_OK, "a tiny budget is accepted for later steps");
    const rp_plan *plan;
    const rp_step_report *rep;
    ok(rp_sched_step(s, 0, batches[0], &routings[0], &plan, &rep, &err) == RP_ERANGE,
       "a step whose migration does not fit the budget fails");
    like(err.text, "sched: step 0: migration: the staging budget of 1 bytes", "and says so");
    ok(rp_sched_plan(s) == NULL, "and the scheduler is as it was");
    mo = (rp_migration_options){w.expert_bytes, 0};
    rp_sched_set_migration_options(s, &mo, &err);
    ok(step(s, 0, &plan, &rep) && rp_sched_migration(s), "with no budget the first step migrates from contiguous");
    ok(rp_sched_migration_failed(s, NULL, &err) == RP_EINVAL, "a missing result is refused");
    res.rounds_committed = 5;
    ok(rp_sched_migration_failed(s, &res, &err) == RP_EINVAL, "rounds_committed beyond the plan's is refused");
    like(err.text, "says 5 rounds committed, but the step's migration has 1", "and says so");
    ok(rp_sched_migration(s) != NULL, "refusals leave the migration open");
    ok(rp_sched_step(s, 1, NULL, &routings[1], &plan, &rep, &err) == RP_EINVAL && rp_sched_migration(s) == NULL,
       "a step call, even one that fails, closes the last step's migration");
    ok(rp_sched_migration_failed(s, &res, &err) == RP_EINVAL, "which then cannot be reported failed");
    /* NULL options: the model's bytes, which this registry does not hold */
    ok(rp_sched_set_migration_options(s, NULL, &err) == RP_OK, "NULL options restore the defaults");
    const rp_migration_plan *mp = NULL;
    for (int t = 1; t < 1 + 2 * STEPS && !mp; t++) mp = step(s, t, &plan, &rep) ? rp_sched_migration(s) : NULL;
    ok(mp && rp_migration_plan_expert_bytes(mp, 0) != w.expert_bytes[0],
       "with the defaults the plan uses the model's expert bytes");
    rank_run runs[MAX_G];
    ok(mp && execute(&w, mp, 10.0, runs) && runs[0].st == RP_EINVAL && world_bad_slots(&w) == 0,
       "which the executor refuses for this registry before anything moves");
    rp_sched_free(s);
    world_free(&w);
}

/* ---- allocation failures in steps that migrate and a rollback ---- */

static int chaos_run(long fail_at, counting *c, const world *w)
{
    memset(c, 0, sizeof *c);
    c->fail_at = fail_at;
    rp_context *cx = NULL;
    if (rp_context_new(counting_alloc, c, &cx) != RP_OK) return 0;
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    int done = 0;
    rp_migration_options mo = {w->expert_bytes, 0};
    if (rp_sched_new(cx, cfg, &o, &s, &err) == RP_OK && rp_sched_set_migration_options(s, &mo, &err) == RP_OK)
        for (int t = 0; t < 3; t++) {
            const rp_plan *plan;
            const rp_step_report *rep;
            if (rp_sched_step(s, t, batches[t], &routings[t], &plan, &rep, &err) != RP_OK) continue;
            done++;
            rp_migration_result res;
            memset(&res, 0, sizeof res);
            if (t == 1 && rp_sched_migration(s)) rp_sched_migration_failed(s, &res, &err);
        }
    rp_sched_free(s);
    rp_context_free(cx);
    return done;
}

static void test_allocation_failures(void)
{
    world w;
    if (world_init(&w) != 0) {
        ok(0, "setup");
        world_free(&w);
        return;
    }
    counting c;
    int done = chaos_run(0, &c, &w);
    long total = c.calls;
    ok(done == 3 && c.blocks == 0, "a clean run: 3 steps, %ld allocations, none left", total);
    long leaks = 0, runs = 0;
    for (long n = 1; n <= total; n += 97) {
        chaos_run(n, &c, &w);
        runs++;
        if (c.blocks != 0) leaks++;
    }
    ok(leaks == 0, "failing one of %ld allocations (%ld runs) never crashes or leaks", total, runs);
    world_free(&w);
}

int main(void)
{
    rp_error err;
    rp_context_new(NULL, NULL, &ctx);
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    unsetenv("RP_POLICY_PATH");
    make_batches();
    test_steps();
    test_fault(RP_FAULT_CORRUPT, "corrupt");
    test_fault(RP_FAULT_SEND_FAIL, "send failure");
    test_fault(RP_FAULT_DROP, "drop");
    test_fault_later_round();
    test_refusals();
    test_allocation_failures();
    for (int t = 0; t < STEPS; t++) {
        rp_batch_free(batches[t]);
        free(ids[t]);
    }
    rp_config_free(cfg);
    rp_context_free(ctx);
    return tap_done();
}
