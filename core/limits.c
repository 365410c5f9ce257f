/* The microbatch caps of a config's limits: the largest token count a microbatch may
 * hold, and the check that every sequence of a batch fits one microbatch. One place, so
 * the scheduler, the baselines and the joint planner agree on the cap and a batch that
 * no plan can pack gets one message that names the config key to change. */
#include "internal.h"
#include "limits_internal.h"

#include <math.h>

int64_t rp_limits_token_cap(const rp_limits *lim)
{
    int64_t cap = lim->max_tokens_per_microbatch;
    if (lim->max_activation_bytes > 0 && lim->activation_bytes_per_token > 0) {
        /* the largest t with t * bytes_per_token <= max_activation_bytes, exactly in
         * the double arithmetic the checks use (the division may round either way) */
        double t = floor(lim->max_activation_bytes / lim->activation_bytes_per_token);
        int64_t mem = t >= (double)INT64_MAX ? INT64_MAX : (int64_t)t;
        while (mem > 0 && (double)mem * lim->activation_bytes_per_token > lim->max_activation_bytes) mem--;
        while (mem < cap && (double)(mem + 1) * lim->activation_bytes_per_token <= lim->max_activation_bytes)
            mem++;
        if (mem < cap) cap = mem;
    }
    return cap;
}

int32_t rp_limits_microbatch_step(const rp_config *cfg)
{
    const rp_trainer *tr = rp_config_trainer(cfg);
    return tr->mini_batches * tr->microbatch_multiple; /* <= 2^20 (config.c) */
}

int64_t rp_limits_least_microbatches(const rp_config *cfg, int64_t tokens)
{
    const int64_t per = (int64_t)rp_config_topology(cfg)->num_gpus * rp_limits_token_cap(rp_config_limits(cfg));
    const int64_t step = rp_limits_microbatch_step(cfg);
    int64_t M = (tokens + per - 1) / per;
    if (M < 1) M = 1;
    if (M % step != 0) M += step - M % step; /* verl's num_batches_divided_by, per mini-batch */
    return M;
}

rp_status rp_limits_check_batch(const rp_limits *lim, const rp_batch *batch, rp_error *err)
{
    const int32_t n = rp_batch_num_seqs(batch);
    int32_t longest = -1;
    for (int32_t s = 0; s < n; s++)
        if (longest < 0 || rp_batch_seq_len(batch, s) > rp_batch_seq_len(batch, longest)) longest = s;
    if (longest < 0) return RP_OK;
    const long long len = rp_batch_seq_len(batch, longest);
    rp_status st = RP_OK;
    if (len > lim->max_tokens_per_microbatch) {
        st = rp_fail(err, RP_ERANGE,
                     "sequence %d has %lld tokens, more than one microbatch holds "
                     "(limits.max_tokens_per_microbatch = %lld): no plan can pack this batch; "
                     "raise limits.max_tokens_per_microbatch to at least %lld",
                     longest, len, (long long)lim->max_tokens_per_microbatch, len);
    } else if (lim->max_activation_bytes > 0 &&
               (double)len * lim->activation_bytes_per_token > lim->max_activation_bytes) {
        st = rp_fail(err, RP_ERANGE,
                     "sequence %d needs %.0f bytes of activations (%lld tokens x "
                     "limits.activation_bytes_per_token = %g), more than one microbatch holds "
                     "(limits.max_activation_bytes = %.0f): no plan can pack this batch; raise "
                     "limits.max_activation_bytes to at least %.0f",
                     longest, (double)len * lim->activation_bytes_per_token, len,
                     lim->activation_bytes_per_token, lim->max_activation_bytes,
                     ceil((double)len * lim->activation_bytes_per_token));
    }
    if (st != RP_OK && err) err->sequence = longest;
    return st;
}

int64_t rp_limits_expected_microbatches(const rp_config *cfg, const rp_batch *b)
{
    /* what a plan runs: the fixed count, or the fewest the caps and the trainer's
     * mini-batches and microbatch multiple allow (the joint planner's first try) */
    int32_t fixed = rp_config_limits(cfg)->num_microbatches;
    return fixed > 0 ? fixed : rp_limits_least_microbatches(cfg, rp_batch_num_tokens(b));
}

