/* The scheduler's hot swap (a staged policy takes over at a step boundary after a dry
 * run, agreed across ranks), staging, and demotion after steps in a row that fell back. */
#include "sched_impl.h"

#include <string.h>

/* Dry-run the staged set on the previous step's inputs (this step's when there is none),
 * in a fresh copy of it that is thrown away afterwards. */
static rp_status dry_run(rp_sched *s, step_inputs *now, bool *ok, char *reason, size_t reason_len, rp_error *err)
{
    step_inputs in;
    memset(&in, 0, sizeof in);
    rp_cost *cost = NULL;
    policy_set dry;
    memset(&dry, 0, sizeof dry);
    rp_status st = RP_OK;
    in.s = s;
    in.placement = s->current && rp_plan_has_placement(s->current) ? s->current : s->initial;
    if (s->prev_batch) {
        RP_CHECK_GOTO(rp_cost_new(s->ctx, s->cfg, s->prev_batch, s->prev_stats, s->opts.split, &cost, err), st, out);
        in.step = s->last_step;
        in.batch = s->prev_batch;
        in.stats = s->prev_stats;
        in.cost = cost;
        if (s->hist_cap > 0) sched_fill_history(s, &in, 1);
    } else {
        in.step = now->step;
        in.batch = now->batch;
        in.stats = now->stats;
        in.cost = now->cost;
        in.history = now->history;
    }
    /* any failure of the dry run, the engine's out-of-memory included, refuses the
     * staged policy (dropped, with the reason): were it an error of the step, a staged
     * policy that fails every time would fail every later step */
    rp_error le;
    if (sched_set_reload(s, &s->staged, &dry, &le) != RP_OK) {
        *ok = false;
        sched_textf(reason, reason_len, "the dry run of policy '%s' failed: it did not load again: %s", s->staged.name,
              le.text);
        goto out;
    }
    run_result r;
    sched_run_set(s, &dry, &in, &r);
    *ok = r.plan != NULL;
    if (!*ok) sched_textf(reason, reason_len, "the dry run of policy '%s' failed: %s", s->staged.name, r.reason);
    rp_plan_free(r.plan);
out:
    sched_set_free(&dry);
    sched_inputs_release(&in);
    rp_cost_free(cost);
    return st;
}

/* Whether a staged policy takes over at this step. A due policy is dry-run (in a copy
 * thrown away afterwards) and, when that passes, loaded afresh from its source with its
 * init run, here, before the ranks agree, so that once they agree to swap nothing local
 * can stop one of them, and the policy that runs carries nothing from the dry run. `local` is
 * the step's status so far: with several ranks a failed rank still takes part and the
 * step fails on every rank. */
rp_status sched_decide_swap(rp_sched *s, step_inputs *in, rp_status local, swap_decision *decision, char *reason,
                             size_t reason_len, rp_error *err)
{
    *decision = SWAP_NONE;
    reason[0] = '\0';
    bool due = local == RP_OK && s->staged.count > 0 && (s->staged_at < 0 || in->step >= s->staged_at);
    bool ok = false;
    if (due) {
        local = dry_run(s, in, &ok, reason, reason_len, err);
        if (local == RP_OK && ok) {
            policy_set fresh;
            rp_error ie;
            if (sched_set_reload(s, &s->staged, &fresh, &ie) != RP_OK) {
                ok = false;
                sched_textf(reason, reason_len, "policy '%s': %s", s->staged.name, ie.text);
            } else {
                sched_set_free(&s->staged); /* staged_at stays */
                s->staged = fresh;
            }
        }
    }
    if (!sched_multi_rank(s)) {
        if (local != RP_OK) return local;
        if (due) *decision = ok ? SWAP_DO : SWAP_REFUSE;
        return RP_OK;
    }
    unsigned char mine[RECORD];
    const unsigned char *all = NULL;
    memset(mine, 0, sizeof mine);
    mine[0] = due;
    mine[1] = ok;
    sched_put_status(mine, local);
    sched_put_u64(mine + 8, due ? s->staged.hash : 0);
    rp_status st = sched_gather(s, mine, &all, err);
    if (st != RP_OK) return st;
    st = sched_ranks_failure(s, all, local, in->step, "before the policy ran", err);
    if (st != RP_OK) return st;
    bool all_due = true, all_ok = true, same = true;
    int32_t failed_rank = -1, other_rank = -1;
    for (int32_t r = 0; r < s->comm.size; r++) {
        const unsigned char *rec = all + (size_t)r * RECORD;
        all_due &= rec[0] != 0;
        if (rec[0] && !rec[1] && failed_rank < 0) failed_rank = r;
        all_ok &= rec[1] != 0;
        if (sched_get_u64(rec + 8) != sched_get_u64(all + 8) && other_rank < 0) other_rank = r;
        same &= sched_get_u64(rec + 8) == sched_get_u64(all + 8);
    }
    if (!due) *decision = SWAP_NONE;
    else if (!all_due) *decision = SWAP_WAIT;
    else if (!same) {
        *decision = SWAP_REFUSE;
        sched_textf(reason, reason_len, "ranks staged different policies (rank %d's differs from rank 0's); no rank swaps",
              (int)other_rank);
    } else if (!all_ok) {
        *decision = SWAP_REFUSE;
        if (ok) sched_textf(reason, reason_len, "the dry run failed on rank %d; no rank swaps", (int)failed_rank);
    } else {
        *decision = SWAP_DO;
    }
    return RP_OK;
}

/* Count the step's outcome and demote the running set after demote_after steps in a row
 * that fell back on every rank (so every rank demotes at the same step): to the set the
 * last hot swap replaced, else to RP_SCHED_DEMOTE_TO. Runs after the step committed: a
 * replacement that cannot be loaded leaves the running set and says so. */
void sched_demote_if_failing(rp_sched *s, rp_step_report *rep)
{
    bool failed = rep->ranks_fell_back >= (sched_multi_rank(s) ? s->comm.size : 1);
    s->failed_steps = failed ? s->failed_steps + 1 : 0;
    rep->failed_steps = s->failed_steps;
    if (s->opts.demote_after < 0 || s->failed_steps < s->opts.demote_after) return;
    policy_set next;
    memset(&next, 0, sizeof next);
    if (s->previous.count > 0) {
        next = s->previous;
        memset(&s->previous, 0, sizeof s->previous);
    } else {
        if (strcmp(s->running.name, RP_SCHED_DEMOTE_TO) == 0) return; /* nothing safer to run */
        rp_error e;
        if (sched_load_set(s, RP_SCHED_DEMOTE_TO, NULL, NULL, NULL, &next, &e) != RP_OK) {
            sched_textf(rep->demote_error, sizeof rep->demote_error, "%s", e.text);
            return;
        }
    }
    sched_set_free(&s->running);
    s->running = next;
    s->failed_steps = 0;
    rep->demoted = true;
    sched_textf(rep->demoted_to, sizeof rep->demoted_to, "%s", s->running.name);
}

/* ---- staging ---------------------------------------------------------------------------- */

rp_status rp_sched_stage_policy(rp_sched *s, const char *name_or_path, const char *source, int64_t at_step,
                                rp_error *err)
{
    if (!s) return rp_fail(err, RP_EINVAL, "sched: no scheduler");
    s->errmsg[0] = '\0';
    rp_error local;
    if (!err) err = &local;
    if ((!name_or_path || !*name_or_path) && !source)
        return sched_fail_keep(s, rp_fail(err, RP_EINVAL, "sched: stage a policy by name, path or source text"), err);
    if (at_step < -1)
        return sched_fail_keep(s, rp_fail(err, RP_EINVAL, "sched: at_step is %lld; give a step >= 0 or -1 for the next step",
                                    (long long)at_step),
                         err);
    policy_set ps;
    memset(&ps, 0, sizeof ps);
    rp_status st;
    if (source) {
        rp_policy *pol = NULL;
        size_t len = strlen(source);
        st = rp_policy_load(s->ctx, s->cfg, source, len, name_or_path, &s->limits, NULL, false, &pol, err);
        if (st == RP_OK && s->running.count == 1 && strcmp(s->running.pol[0]->info.name, pol->info.name) == 0 &&
            strcmp(s->running.pol[0]->params_json, "{}") != 0) {
            /* the same policy, edited: its params carry over */
            rp_policy_free(pol);
            pol = NULL;
            st = rp_policy_load(s->ctx, s->cfg, source, len, name_or_path, &s->limits,
                                s->running.pol[0]->params_json, false, &pol, err);
        }
        if (st == RP_OK) {
            ps.pol[ps.count++] = pol;
            st = sched_init_policy(s, pol, 0, err);
            if (st == RP_OK) sched_set_describe(&ps);
        }
    } else {
        st = sched_load_set(s, name_or_path, NULL, NULL, &s->running, &ps, err);
    }
    if (st != RP_OK) {
        sched_set_free(&ps);
        return sched_fail_keep(s, st, err);
    }
    sched_set_free(&s->staged);
    s->staged = ps;
    s->staged_at = at_step;
    return RP_OK;
}
