/* The migration executor: agree on the plan and on what every slot holds, then round
 * by round move the copies into staging and check their headers (migrate_round.c),
 * write them into their slots so that it can be undone and check the slots against the
 * source checksums (migrate_commit.c), and agree once: keep the round, or undo it on
 * every rank ("write, check, then decide"). */
#include "migrate_internal.h"

#include <inttypes.h>
#include <time.h>

/* The tensor layout of the layers this rank holds (`own`; NULL: every layer): ranks of
 * one pipeline stage compare it. */
static uint64_t layout_hash(const rp_registry *reg, const unsigned char *own)
{
    rp_hash_state st;
    rp_hash_init(&st, 0x6c61796f7574ULL); /* "layout" */
    for (int32_t l = 0; l < rp_registry_num_layers(reg); l++) {
        if (own && !own[l]) continue;
        int32_t count = 0;
        const rp_tensor *ts = rp_registry_tensors(reg, l, 0, &count);
        uint64_t v[2] = {(uint64_t)l, (uint64_t)count};
        rp_hash_update(&st, v, sizeof v);
        for (int32_t i = 0; i < count; i++) {
            uint64_t b[2] = {(uint64_t)ts[i].bytes, (uint64_t)ts[i].memory};
            rp_hash_update(&st, b, sizeof b);
        }
    }
    return rp_hash_final(&st);
}

static void work_free(rp_context *ctx, rank_work *w)
{
    rp_free(ctx, w->recv);
    rp_free(ctx, w->send);
    rp_free(ctx, w->local);
    rp_free(ctx, w->writes);
    rp_free(ctx, w->round_recv);
    rp_free(ctx, w->round_send);
    rp_free(ctx, w->round_local);
    rp_free(ctx, w->round_writes);
    rp_free(ctx, w->stage_off);
    rp_free(ctx, w->primary);
    rp_free(ctx, w->undo_off);
    rp_free(ctx, w->parts_done);
    rp_free(ctx, w->want_sum);
    memset(w, 0, sizeof *w);
}

/* Split the plan into this GPU's lists and staging offsets. */
static rp_status build_work(exec *x, rp_error *err)
{
    const rp_migration_plan *mp = x->mp;
    const int64_t T = rp_migration_plan_num_transfers(mp), W = rp_migration_plan_num_writes(mp);
    const int32_t R = rp_migration_plan_num_rounds(mp);
    rank_work *w = &x->w;
    x->tr = rp_alloc(x->ctx, (size_t)(T + 1) * sizeof *x->tr);
    x->wr = rp_alloc(x->ctx, (size_t)(W + 1) * sizeof *x->wr);
    w->recv = rp_alloc(x->ctx, (size_t)(T + 1) * sizeof(int64_t));
    w->send = rp_alloc(x->ctx, (size_t)(T + 1) * sizeof(int64_t));
    w->local = rp_alloc(x->ctx, (size_t)(T + 1) * sizeof(int64_t));
    w->writes = rp_alloc(x->ctx, (size_t)(W + 1) * sizeof(int64_t));
    w->round_recv = rp_calloc(x->ctx, (size_t)R + 1, sizeof(int64_t));
    w->round_send = rp_calloc(x->ctx, (size_t)R + 1, sizeof(int64_t));
    w->round_local = rp_calloc(x->ctx, (size_t)R + 1, sizeof(int64_t));
    w->round_writes = rp_calloc(x->ctx, (size_t)R + 1, sizeof(int64_t));
    w->stage_off = rp_alloc(x->ctx, (size_t)(T + 1) * sizeof(int64_t));
    w->primary = rp_alloc(x->ctx, (size_t)(T + 1) * sizeof(int64_t));
    w->want_sum = rp_calloc(x->ctx, (size_t)T + 1, sizeof(uint64_t));
    w->undo_off = rp_alloc(x->ctx, (size_t)(W + 1) * sizeof(int64_t));
    w->parts_done = rp_calloc(x->ctx, (size_t)W + 1, sizeof(int32_t));
    if (!x->tr || !x->wr || !w->recv || !w->send || !w->local || !w->writes || !w->round_recv || !w->round_send ||
        !w->round_local || !w->round_writes || !w->stage_off || !w->primary || !w->want_sum || !w->undo_off ||
        !w->parts_done)
        return rp_fail_nomem(err, "the migration's work lists");
    for (int64_t i = 0; i < T; i++) rp_migration_plan_transfer(mp, i, &x->tr[i], NULL);
    for (int64_t i = 0; i < W; i++) rp_migration_plan_write(mp, i, &x->wr[i], NULL);
    /* Transfers and writes come sorted by round, so the lists are too. */
    int64_t off = 0;
    int32_t round = -1;
    for (int64_t i = 0; i < T; i++) {
        const rp_migration_transfer *tr = &x->tr[i];
        w->stage_off[i] = -1;
        if (tr->round != round) {
            round = tr->round;
            off = 0;
        }
        if (tr->dst_gpu == x->gpu) {
            w->stage_off[i] = off;
            off += tr->bytes;
            if (tr->src_gpu == x->gpu) {
                w->local[w->num_local++] = i;
                w->round_local[tr->round + 1]++;
            } else {
                w->recv[w->num_recv++] = i;
                w->round_recv[tr->round + 1]++;
            }
        } else if (tr->src_gpu == x->gpu) {
            w->send[w->num_send++] = i;
            w->round_send[tr->round + 1]++;
        }
    }
    for (int64_t i = 0; i < W; i++)
        if (x->wr[i].gpu == x->gpu) {
            w->writes[w->num_writes++] = i;
            w->round_writes[x->tr[x->wr[i].transfer].round + 1]++;
        }
    for (int32_t r = 0; r < R; r++) {
        w->round_recv[r + 1] += w->round_recv[r];
        w->round_send[r + 1] += w->round_send[r];
        w->round_local[r + 1] += w->round_local[r];
        w->round_writes[r + 1] += w->round_writes[r];
    }
    /* Writes come in round order: the first of each transfer swaps, the others take
     * undo memory, counted per round. */
    for (int64_t i = 0; i < T; i++) w->primary[i] = -1;
    for (int32_t r = 0; r < R; r++) {
        int64_t undo = 0;
        for (int64_t k = w->round_writes[r]; k < w->round_writes[r + 1]; k++) {
            const rp_migration_write *wr = &x->wr[w->writes[k]];
            w->undo_off[k] = -1;
            if (w->primary[wr->transfer] < 0) {
                w->primary[wr->transfer] = k;
            } else {
                w->undo_off[k] = undo;
                undo += x->tr[wr->transfer].bytes;
            }
        }
        if (undo > w->undo_bytes) w->undo_bytes = undo;
    }
    return RP_OK;
}

/* Every slot of this rank holds what the plan's current placement says (where that
 * placement has an expert), at one version. */
static bool identity_checks(exec *x)
{
    exec_record *me = &x->mine;
    const int32_t ep_rank = x->gpu % rp_migration_plan_ep_size(x->mp);
    int32_t first_layer = -1, first_slot = -1;
    for (int32_t l = 0; l < rp_registry_num_layers(x->reg); l++)
        for (int32_t k = 0; k < rp_registry_num_slots(x->reg) && x->own[l]; k++) {
            int32_t want = rp_migration_plan_slot_expert(x->mp, l, ep_rank, k, false);
            if (want < 0) continue; /* an empty slot: its bytes are nobody's */
            rp_slot_identity id;
            rp_registry_identity(x->reg, l, k, &id, NULL);
            if (id.expert == RP_SLOT_UNKNOWN) {
                note(me, RP_EINVAL, -1, l, want, -1, "registry: layer %d slot %d has no identity (say what each slot "
                     "holds with rp_registry_set_placement or rp_registry_set_identity)", l, k);
                return false;
            }
            if (id.layer != l || id.expert != want) {
                note(me, RP_EPLAN, -1, l, want, -1, "layer %d slot %d holds layer %d's expert %d (its registry "
                     "identity), but the migration plan starts from expert %d there: the weights are not in the "
                     "plan's current placement (a plan made from another placement, or an earlier migration that "
                     "did not finish on every rank)", l, k, id.layer, id.expert, want);
                return false;
            }
            if (first_layer < 0) {
                first_layer = l;
                first_slot = k;
                x->version = id.version;
            } else if (id.version != x->version) {
                note(me, RP_EINVAL, -1, l, want, -1, "layer %d slot %d is at version %" PRIu64 ", but layer %d slot "
                     "%d at %" PRIu64 ": every expert must be at the same version (rp_registry_set_version)", l, k,
                     id.version, first_layer, first_slot, x->version);
                return false;
            }
        }
    me->version = x->version;
    me->has_version = first_layer >= 0;
    return true;
}

/* Checks before anything moves; the first problem goes into the agreement record
 * (returns false) so that every rank reports it. */
static bool local_checks(exec *x, const rp_migration_exec_options *opts)
{
    exec_record *me = &x->mine;
    const rp_migration_plan *mp = x->mp;
    const rp_registry *reg = x->reg;
    const rp_transport *t = x->t;
    if (!mp) {
        note(me, RP_EINVAL, -1, -1, -1, -1, "no migration plan");
        return false;
    }
    if (!reg) {
        note(me, RP_EINVAL, -1, -1, -1, -1, "no registry");
        return false;
    }
    const int32_t G = rp_migration_plan_num_gpus(mp), ep = rp_migration_plan_ep_size(mp);
    const int32_t PP = rp_migration_plan_num_stages(mp);
    if (t->size == G) {
        x->base = 0;
    } else if (t->size == ep && opts->ep_group >= 0 && opts->ep_group < G / ep) {
        x->base = opts->ep_group * ep;
    } else if (t->size == ep) {
        note(me, RP_EINVAL, -1, -1, -1, -1,
             "the transport spans %d ranks (one EP group), but options.ep_group is %d; it must be 0 to %d", t->size,
             opts->ep_group, G / ep - 1);
        return false;
    } else {
        char stages[128] = "";
        if (PP > 1)
            snprintf(stages, sizeof stages, " (%d pipeline stages of %d: a transport spans every stage's GPUs)", PP,
                     G / PP);
        note(me, RP_EINVAL, -1, -1, -1, -1, "the transport has %d ranks, but the plan has %d GPUs%s in EP groups of %d",
             t->size, G, stages, ep);
        return false;
    }
    x->gpu = x->base + t->rank;
    /* Under PP this GPU holds only its stage's layers (rp_migration_plan_layer_stage). */
    const int32_t L = rp_migration_plan_num_layers(mp);
    x->own = rp_alloc(x->ctx, (size_t)L + 1);
    if (!x->own) {
        note(me, RP_ENOMEM, -1, -1, -1, -1, "no memory for the list of this rank's layers");
        return false;
    }
    for (int32_t l = 0; l < L; l++) x->own[l] = rp_migration_plan_layer_stage(mp, l) == x->gpu / (G / PP);
    const int32_t slots = rp_migration_plan_num_slots(mp, x->gpu % ep);
    if (rp_registry_num_layers(reg) != rp_migration_plan_num_layers(mp) || rp_registry_num_slots(reg) != slots) {
        note(me, RP_EINVAL, -1, -1, -1, -1,
             "the registry has %d layers and %d slots, but GPU %d has %d layers and %d slots in the plan",
             rp_registry_num_layers(reg), rp_registry_num_slots(reg), x->gpu, rp_migration_plan_num_layers(mp), slots);
        return false;
    }
    rp_error e;
    rp_error_clear(&e);
    if (registry_check_layers(reg, x->own, &e) != RP_OK) {
        note(me, e.status, -1, -1, -1, -1, "%s", e.text);
        return false;
    }
    for (int32_t l = 0; l < rp_registry_num_layers(reg); l++) {
        if (!x->own[l]) continue;
        int64_t have = rp_registry_expert_bytes(reg, l), want = rp_migration_plan_expert_bytes(mp, l);
        if (have != want) {
            note(me, RP_EINVAL, -1, l, -1, -1,
                 "the registry's layer %d experts are %lld bytes, but the migration plan was made for %lld (pass "
                 "rp_registry_expert_bytes to rp_migration_options.expert_bytes)", l, (long long)have,
                 (long long)want);
            return false;
        }
        int32_t count = 0;
        const rp_tensor *ts = rp_registry_tensors(reg, l, 0, &count);
        for (int32_t i = 0; i < count; i++)
            if (ts[i].memory != t->memory) {
                note(me, RP_ENOTSUP, -1, l, -1, -1,
                     "the %s transport moves %s memory, but the registry's layer %d tensor %d is %s memory",
                     t->vt->name, t->memory == RP_MEMORY_HOST ? "host" : "CUDA", l, i,
                     ts[i].memory == RP_MEMORY_HOST ? "host" : "CUDA");
                return false;
            }
    }
    if (!identity_checks(x)) return false;
    rp_error_clear(&e);
    if (build_work(x, &e) != RP_OK) {
        note(me, e.status, -1, -1, -1, -1, "%s", e.text);
        return false;
    }
    if (x->w.undo_bytes > 0) {
        if ((uint64_t)x->w.undo_bytes > SIZE_MAX ||
            !(x->undo = x->t->vt->alloc(x->t, (size_t)x->w.undo_bytes))) {
            note(me, RP_ENOMEM, -1, -1, -1, -1, "no memory for %lld bytes to undo a commit with (a staged copy "
                 "that fills several slots keeps their old bytes there)", (long long)x->w.undo_bytes);
            return false;
        }
    }
    rp_migration_gpu gs;
    rp_migration_plan_gpu(mp, x->gpu, &gs, NULL);
    if (opts->staging) {
        if (opts->staging_bytes < (uint64_t)gs.staging_bytes) {
            note(me, RP_ERANGE, -1, -1, -1, -1, "the staging buffer given holds %zu bytes, but GPU %d needs %lld",
                 opts->staging_bytes, x->gpu, (long long)gs.staging_bytes);
            return false;
        }
        x->staging = opts->staging;
        x->staging_bytes = opts->staging_bytes;
    } else if (gs.staging_bytes > 0) {
        if ((uint64_t)gs.staging_bytes > SIZE_MAX) {
            note(me, RP_ERANGE, -1, -1, -1, -1, "%lld bytes of staging do not fit this machine",
                 (long long)gs.staging_bytes);
            return false;
        }
        x->staging = x->t->vt->alloc(x->t, (size_t)gs.staging_bytes);
        if (!x->staging) {
            note(me, RP_ENOMEM, -1, -1, -1, -1, "no memory for %lld bytes of staging", (long long)gs.staging_bytes);
            return false;
        }
        x->staging_bytes = (size_t)gs.staging_bytes;
        x->own_staging = true;
    }
    return true;
}

/* The failure every rank reports: a cause before its consequences (timeouts usually
 * follow another rank's failure), then the lowest rank. */
static const exec_record *pick_failure(const exec_record *all, int32_t n)
{
    const exec_record *best = NULL;
    for (int32_t i = 0; i < n; i++) {
        if (all[i].status == RP_OK) continue;
        if (!best || (best->status == RP_ETIMEOUT && all[i].status != RP_ETIMEOUT)) best = &all[i];
    }
    return best;
}

void rp_migration_exec_defaults(rp_migration_exec_options *opts)
{
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->timeout_s = 60.0;
    opts->ep_group = -1;
}

/* Exchange this rank's record (the exchange named in it) and check every record that
 * came back. Every rank sees the same records, so every rank decides alike; a problem
 * with the records themselves becomes the first failure of the lowest rank that sent a
 * wrong one. Returns the exchange's status (not the records' verdict). */
static rp_status exchange(exec *x, int32_t which, double deadline, exec_record *all, rp_error *e)
{
    rp_transport *t = x->t;
    x->mine.exchange = which;
    rp_error_clear(e);
    rp_status st = t->vt->allgather(t, &x->mine, all, sizeof x->mine, deadline, e);
    if (st != RP_OK) return st;
    for (int32_t i = 0; i < t->size; i++) {
        all[i].text[RECORD_TEXT - 1] = '\0';
        if (all[i].magic != RECORD_MAGIC || all[i].rank != i || all[i].exchange != which) {
            exec_record *r = &all[i];
            memset(r, 0, sizeof *r);
            r->magic = RECORD_MAGIC;
            r->rank = i;
            r->round = r->layer = r->expert = r->peer = -1;
            r->exchange = which;
            note(r, RP_ETRANSPORT, -1, -1, -1, -1, "it sent a malformed record, or one of another exchange");
        }
    }
    return RP_OK;
}

/* The failure of `bad` on this rank's result and error. */
static void report(rp_migration_result *res, rp_error *err, const exec_record *bad)
{
    if (err) err->expert = bad->expert;
    res->failed_rank = bad->rank;
    res->failed_layer = bad->layer;
    res->failed_expert = bad->expert;
    res->failed_peer = bad->peer;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {}
}

rp_status rp_migration_execute(const rp_migration_plan *mp, rp_registry *reg, rp_transport *t,
                               const rp_migration_exec_options *opts, rp_migration_result *result, rp_error *err)
{
    const double t0 = rp_now_s();
    rp_migration_result res_local, *res = result ? result : &res_local;
    memset(res, 0, sizeof *res);
    res->failed_rank = res->failed_layer = res->failed_expert = res->failed_peer = -1;
    if (!t) return rp_fail(err, RP_EINVAL, "migration: no transport");
    if (t->broken)
        return rp_fail(err, RP_ETRANSPORT, "migration: the %s transport is unusable after an earlier failure (%s)",
                       t->vt->name, t->broken_why);
    rp_migration_exec_options defaults;
    rp_migration_exec_defaults(&defaults);
    if (!opts) opts = &defaults;
    double timeout = opts->timeout_s > 0 ? opts->timeout_s : 60.0;
    if (!(timeout < 1e9)) timeout = 1e9;
    /* the exchanges wait for the slowest rank: their own bound (see the header) */
    double exchange_timeout = opts->exchange_timeout_s > 0 ? opts->exchange_timeout_s : timeout;
    if (!(exchange_timeout < 1e9)) exchange_timeout = 1e9;

    /* Nothing below allocates before the agreement except what local_checks notes in
     * this rank's record: every local problem reaches every rank through the exchange,
     * whose room the transport took when it was created. */
    exec x;
    memset(&x, 0, sizeof x);
    x.ctx = t->ctx;
    x.mp = mp;
    x.reg = reg;
    x.t = t;
    x.timeout_s = timeout;
    x.mine.magic = RECORD_MAGIC;
    x.mine.rank = t->rank;
    x.mine.round = x.mine.layer = x.mine.expert = x.mine.peer = -1;
    x.call = t->calls;
    x.mine.calls = x.call;
    x.mine.plan_hash = rp_migration_plan_hash(mp);
    local_checks(&x, opts);
    x.mine.layout_hash = reg ? layout_hash(reg, x.own) : 0;
    res->num_rounds = mp ? rp_migration_plan_num_rounds(mp) : 0;
    res->staging_bytes = (int64_t)x.staging_bytes + x.w.undo_bytes;

    rp_status st = RP_OK;
    const int32_t P = t->size;
    exec_record *all = t->records;

    /* (1) Agree: same plan, same tensor layout, same call, same version of the weights,
     * every slot holding what the plan says, nothing wrong locally. */
    rp_error e;
    st = exchange(&x, EXCHANGE_AGREE, rp_now_s() + exchange_timeout, all, &e);
    if (st != RP_OK) {
        rp_fail(err, st, "migration: rank %d: the agreement exchange failed (%s); nothing moved", t->rank, inner(&e));
        goto out;
    }
    uint64_t max_calls = 0;
    for (int32_t i = 0; i < P; i++)
        if (all[i].calls > max_calls) max_calls = all[i].calls;
    t->calls = max_calls + 1; /* ranks that fell out of step agree again next call */
    const exec_record *bad = pick_failure(all, P);
    if (bad) {
        st = rp_fail(err, (rp_status)bad->status, "migration: rank %d: %s; nothing moved", bad->rank, bad->text);
        report(res, err, bad);
        res->failed_expert = res->failed_peer = -1;
        goto out;
    }
    int32_t versioned = -1; /* the first rank that holds an expert */
    for (int32_t i = 0; i < P; i++) {
        if (i > 0 && all[i].plan_hash != all[0].plan_hash) {
            st = rp_fail(err, RP_EPLAN, "migration: rank %d has plan hash 0x%016" PRIx64 ", rank 0 has 0x%016" PRIx64
                         "; nothing moved", i, all[i].plan_hash, all[0].plan_hash);
            res->failed_rank = i;
            goto out;
        }
        /* under PP the first rank of the same stage: the stages hold other layers */
        const int32_t stage_gpus = rp_migration_plan_num_gpus(mp) / rp_migration_plan_num_stages(mp);
        const int32_t first = i - (x.base + i) % stage_gpus > 0 ? i - (x.base + i) % stage_gpus : 0;
        if (i > first && all[i].layout_hash != all[first].layout_hash) {
            st = rp_fail(err, RP_EPLAN, "migration: rank %d's registry lays out the expert tensors differently from "
                         "rank %d's (layout hash 0x%016" PRIx64 " against 0x%016" PRIx64 "); nothing moved", i, first,
                         all[i].layout_hash, all[first].layout_hash);
            res->failed_rank = i;
            goto out;
        }
        if (i > 0 && all[i].calls != all[0].calls) {
            st = rp_fail(err, RP_EPLAN, "migration: rank %d is at migration call %" PRIu64 ", rank 0 at %" PRIu64
                         " (a rank skipped a call); nothing moved", i, all[i].calls, all[0].calls);
            res->failed_rank = i;
            goto out;
        }
        if (!all[i].has_version) continue;
        if (versioned < 0) {
            versioned = i;
        } else if (all[i].version != all[versioned].version) {
            st = rp_fail(err, RP_EPLAN, "migration: rank %d's experts are at version %" PRIu64 ", rank %d's at %"
                         PRIu64 " (a rank missed an update of its weights); nothing moved", i, all[i].version,
                         versioned, all[versioned].version);
            res->failed_rank = i;
            goto out;
        }
    }
    x.version = versioned >= 0 ? all[versioned].version : 0;
    /* From here every rank runs the same rounds under the same call number. */

    const int32_t R = rp_migration_plan_num_rounds(mp);
    for (int32_t round = 0; round < R; round++) {
        /* (2)-(3) Move into staging, check checksums. */
        double deadline = rp_now_s() + timeout;
        for (int64_t k = x.w.round_writes[round]; k < x.w.round_writes[round + 1]; k++) x.w.parts_done[k] = 0;
        migrate_run_round(&x, round, deadline);
        if (t->broken) {
            /* what it committed as the experts arrived goes back first */
            rp_error ue;
            if (x.committed && migrate_undo_round(&x, round, rp_now_s() + timeout, &ue) != RP_OK)
                note(&x.mine, ue.status, round, -1, -1, -1, "%s", ue.text);
            /* This rank cannot take part in the decision, so no rank can complete it,
             * nor the commit exchange that keeps a round; the others time out. */
            st = rp_fail(err, x.mine.status != RP_OK ? (rp_status)x.mine.status : RP_ETRANSPORT,
                         "migration: rank %d: %s; the %s transport is unusable (%s), so no rank can commit round %d: "
                         "end the job", t->rank, x.mine.status != RP_OK ? x.mine.text : "failed", t->vt->name,
                         t->broken_why, round);
            report(res, err, &x.mine);
            res->failed_rank = t->rank;
            goto out;
        }
        /* (4) Write and check: a rank whose round went well so far writes the round
         * into its slots so that it can be undone, checking each slot against its
         * source checksum (the destination's one pass over the bytes); where the
         * transport waits for single messages, run_round did this as each expert
         * arrived. */
        if (x.mine.status == RP_OK && !x.committed) migrate_commit_round(&x, round, rp_now_s() + timeout);
        /* (5) Decide: one exchange. Keep the round only if every rank wrote and checked
         * it; else every rank restores what it wrote. A rank that cannot learn the
         * answer restores its slots too: a round stays only where every rank confirmed
         * it. Ranks that failed fast wait for slow ones up to one exchange timeout past
         * the round's deadline (or past their own commit, if later), so a rank that
         * timed out still reaches this exchange in time. */
        double now = rp_now_s();
        double stall = 0.0;
        rp_fault_kind fault = rp_transport_fault_at(t, RP_FAULT_SITE_DECISION, &stall);
        if (fault == RP_FAULT_STALL_DECISION) sleep_s(stall);
        st = exchange(&x, EXCHANGE_DECIDE(round), (now > deadline ? now : deadline) + exchange_timeout, all, &e);
        if (st == RP_OK && fault == RP_FAULT_LOSE_DECISION)
            st = rp_fail(&e, RP_ETIMEOUT, "transport: rank %d lost the exchange's answer (injected fault)", t->rank);
        if (st != RP_OK) {
            rp_transport_break(t, "the decision exchange of a migration failed");
            rp_error ue;
            rp_error_clear(&ue);
            bool undone = migrate_undo_round(&x, round, rp_now_s() + timeout, &ue) == RP_OK;
            if (x.mine.status != RP_OK)
                /* its failure was in its record: no rank that read it keeps the round,
                 * and no rank keeps it without reading it */
                st = rp_fail(err, (rp_status)x.mine.status, "migration: rank %d: %s; it could not learn the other "
                             "ranks' outcome of round %d (%s), but no rank keeps that round without this rank's "
                             "confirmation; %s: the transport is unusable, end the job", t->rank, x.mine.text, round,
                             inner(&e), undone ? "its own slots of that round are as before" : ue.text);
            else
                st = rp_fail(err, st, "migration: rank %d could not learn whether round %d committed on every rank "
                             "(%s); %s, but other ranks may have kept theirs (the registry's slot identities say what "
                             "each slot holds): the transport is unusable, end the job", t->rank, round, inner(&e),
                             undone ? "it restored its own slots of that round" : ue.text);
            if (x.mine.status != RP_OK) report(res, err, &x.mine);
            res->failed_rank = t->rank;
            goto out;
        }
        bad = pick_failure(all, P);
        if (bad) {
            rp_error ue;
            rp_error_clear(&ue);
            rp_status ust = migrate_undo_round(&x, round, rp_now_s() + timeout, &ue);
            char committed[96] = "every weight is as before";
            if (res->rounds_committed > 0)
                snprintf(committed, sizeof committed, "rounds 0 to %d stay committed (their layers are in the target "
                         "placement)", res->rounds_committed - 1);
            if (ust != RP_OK)
                st = rp_fail(err, (rp_status)bad->status, "migration: rank %d: %s; round %d was being rolled back on "
                             "every rank, but on rank %d %s", bad->rank, bad->text, round, t->rank, ue.text);
            else
                st = rp_fail(err, (rp_status)bad->status, "migration: rank %d: %s; round %d was rolled back on every "
                             "rank (the slots it wrote were restored); %s", bad->rank, bad->text, round, committed);
            report(res, err, bad);
            goto out;
        }
        migrate_keep_round(&x, round, res);
    }
    st = RP_OK;
out:
    if (x.own_staging && !x.buffers_in_use) t->vt->free(t, x.staging);
    if (x.undo) t->vt->free(t, x.undo);
    if (x.buffers_in_use)
        rp_transport_break(t, "a receive could not be cancelled; its staging memory was left to it");
    rp_free(x.ctx, x.tr);
    rp_free(x.ctx, x.wr);
    rp_free(x.ctx, x.own);
    work_free(x.ctx, &x.w);
    res->seconds = rp_now_s() - t0;
    return st;
}
