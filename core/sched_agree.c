/* The scheduler's multi-rank agreement (docs/distributed.md): the records the ranks
 * gather, the broadcast of the agreed plan, and the agreement of one step. */
#include "sched_impl.h"

#include <stdio.h>
#include <string.h>

/* ---- multi-rank agreement (docs/distributed.md) ------------------------------------------
 * Every rank reaches every collective of a step whatever happens to it locally: a local
 * error travels in the rank's record, and then every rank returns an error and nothing
 * changes anywhere. The buffers the collectives use are allocated with the scheduler,
 * so no allocation can keep a rank away from one. */

void sched_put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

uint64_t sched_get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}


bool sched_multi_rank(const rp_sched *s) { return s->has_comm && s->comm.size > 1; }

void sched_put_status(unsigned char *rec, rp_status st)
{
    for (int i = 0; i < 4; i++) rec[4 + i] = (unsigned char)((uint32_t)st >> (8 * i));
}

static rp_status get_status(const unsigned char *rec)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)rec[4 + i] << (8 * i);
    /* a code this build does not know is still a failure */
    return v <= (uint32_t)RP_EPLAN ? (rp_status)v : RP_ETRANSPORT;
}

/* Allgather one record per rank; *all points into the scheduler's buffer. */
rp_status sched_gather(rp_sched *s, const unsigned char *mine, const unsigned char **all, rp_error *err)
{
    rp_status st = s->comm.allgather(s->comm.ud, mine, RECORD, s->gather_buf);
    if (st != RP_OK)
        return rp_fail(err, RP_ETRANSPORT, "sched: allgather across %d ranks failed: %s", s->comm.size,
                       rp_strerror(st));
    *all = s->gather_buf;
    return RP_OK;
}

/* After a gather: this rank's own error (its message is in err), else the status of the
 * lowest rank that failed, else RP_OK. */
rp_status sched_ranks_failure(rp_sched *s, const unsigned char *all, rp_status mine, int64_t step, const char *phase,
                               rp_error *err)
{
    if (mine != RP_OK) return mine;
    for (int32_t q = 0; q < s->comm.size; q++) {
        rp_status st = get_status(all + (size_t)q * RECORD);
        if (st != RP_OK)
            return rp_fail(err, st, "sched: step %lld: rank %d failed %s (%s); no rank changes its plan",
                           (long long)step, (int)q, phase, rp_strerror(st));
    }
    return RP_OK;
}

/* Every rank takes rank `root`'s plan: its JSON length, then the text in pieces. A root
 * that cannot write its plan sends length 0 and every rank fails; a rank that cannot
 * hold or parse the text still receives every piece and returns its error (the caller
 * agrees on the outcome afterwards). */
static rp_status take_plan_of(rp_sched *s, int32_t root, rp_plan **plan, rp_error *err)
{
    char *text = NULL;
    size_t len = 0;
    rp_status st = RP_OK;
    const bool is_root = s->comm.rank == root;
    unsigned char lenbuf[8];
    memset(lenbuf, 0, sizeof lenbuf);
    if (is_root) {
        st = rp_plan_to_json(*plan, &text, &len, err);
        sched_put_u64(lenbuf, st == RP_OK ? (uint64_t)len : 0);
    }
    rp_status cst = s->comm.bcast(s->comm.ud, lenbuf, sizeof lenbuf, root);
    if (cst != RP_OK) {
        st = rp_fail(err, RP_ETRANSPORT, "sched: broadcasting the plan's length from rank %d failed", root);
        goto out;
    }
    const uint64_t n = sched_get_u64(lenbuf);
    if (n == 0 || n > ((uint64_t)1 << 40)) {
        if (st == RP_OK)
            st = rp_fail(err, RP_ETRANSPORT, "sched: rank %d sent a plan of %llu bytes (it could not write its plan)",
                         root, (unsigned long long)n);
        goto out;
    }
    rp_status local = RP_OK;
    if (!is_root) {
        text = rp_alloc(s->ctx, (size_t)n + 1);
        if (!text) local = rp_fail_nomem(err, "the broadcast plan");
    }
    for (uint64_t at = 0; at < n; at += PLAN_CHUNK) {
        const size_t piece = n - at < PLAN_CHUNK ? (size_t)(n - at) : PLAN_CHUNK;
        if (is_root) memcpy(s->chunk_buf, text + at, piece);
        cst = s->comm.bcast(s->comm.ud, s->chunk_buf, piece, root);
        if (cst != RP_OK) {
            st = rp_fail(err, RP_ETRANSPORT, "sched: broadcasting the plan from rank %d failed", root);
            goto out;
        }
        if (!is_root && text) memcpy(text + at, s->chunk_buf, piece);
    }
    if (local != RP_OK) {
        st = local;
        goto out;
    }
    if (!is_root) {
        text[n] = '\0';
        char name[64];
        snprintf(name, sizeof name, "<plan of rank %d>", (int)root);
        rp_plan *theirs = NULL;
        RP_CHECK_GOTO(rp_plan_parse(s->ctx, s->cfg, text, (size_t)n, name, &theirs, err), st, out);
        rp_plan_free(*plan);
        *plan = theirs;
    }
out:
    if (text) {
        if (is_root) rp_text_free(rp_plan_context(*plan), text);
        else rp_free(s->ctx, text);
    }
    return st;
}

/* Every rank runs the same plan: the ranks gather (status, fallback, plan hash); any
 * failure fails the step on every rank; when hashes or fallback flags differ, the lowest
 * rank whose own policy succeeded (rank 0 when none did) broadcasts its plan, and a
 * third gather makes sure every rank took it before any commits. */
rp_status sched_agree(rp_sched *s, step_inputs *in, rp_status local, rp_plan **plan, rp_step_report *rep,
                       sched_migration_next *migration, rp_error *err)
{
    unsigned char mine[RECORD];
    const unsigned char *all = NULL;
    memset(mine, 0, sizeof mine);
    mine[0] = rep->fallback;
    sched_put_status(mine, local);
    sched_put_u64(mine + 8, local == RP_OK ? rp_plan_hash(*plan) : 0);
    rp_status st = sched_gather(s, mine, &all, err);
    if (st != RP_OK) return st;
    st = sched_ranks_failure(s, all, local, in->step, "while planning", err);
    if (st != RP_OK) return st;
    bool disagree = false;
    int32_t winner = -1, fell_back = 0;
    for (int32_t q = 0; q < s->comm.size; q++) {
        const unsigned char *rec = all + (size_t)q * RECORD;
        if (sched_get_u64(rec + 8) != sched_get_u64(all + 8) || rec[0] != all[0]) disagree = true;
        if (rec[0]) fell_back++;
        else if (winner < 0) winner = q; /* the lowest rank whose policy succeeded */
    }
    rep->ranks_fell_back = fell_back;
    rep->plan_from_rank = winner < 0 ? 0 : winner;
    if (!disagree) return RP_OK;
    rep->ranks_disagreed = true;
    local = take_plan_of(s, rep->plan_from_rank, plan, err);
    if (local == RP_OK && s->comm.rank != rep->plan_from_rank) local = sched_judge(s, in, *plan, rep, migration, err);
    sched_put_status(mine, local);
    st = sched_gather(s, mine, &all, err);
    if (st != RP_OK) return st;
    return sched_ranks_failure(s, all, local, in->step, "taking the agreed plan", err);
}
