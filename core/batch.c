/* Batches: sequence lengths, group ids and token offsets of one step. */
#include "internal.h"
#include "routepack/batch.h"

#include <string.h>

struct rp_batch {
    rp_context *ctx;
    int32_t num_seqs;
    int32_t max_seq_len;
    int32_t *prompt_len;
    int32_t *response_len;
    int32_t *group_id;
    int64_t *cu_seqlens;
};

rp_status rp_batch_new(rp_context *ctx, int32_t num_seqs, const int32_t *prompt_len,
                       const int32_t *response_len, const int32_t *group_id,
                       rp_batch **out, rp_error *err)
{
    if (num_seqs < 0) return rp_fail(err, RP_EINVAL, "batch: sequence count %d is negative", num_seqs);
    if (num_seqs > 0 && (!prompt_len || !response_len))
        return rp_fail(err, RP_EINVAL, "batch: prompt and response lengths are required");
    for (int32_t s = 0; s < num_seqs; s++) {
        if (prompt_len[s] < 0 || response_len[s] < 0) {
            rp_fail(err, RP_EINVAL, "batch: sequence %d has a negative length (prompt %d, response %d)",
                    s, prompt_len[s], response_len[s]);
            if (err) err->sequence = s;
            return RP_EINVAL;
        }
        if (prompt_len[s] > INT32_MAX - response_len[s]) {
            rp_fail(err, RP_ERANGE, "batch: sequence %d is longer than 2^31-1 tokens", s);
            if (err) err->sequence = s;
            return RP_ERANGE;
        }
    }
    rp_batch *b = rp_calloc(ctx, 1, sizeof *b);
    size_t n = (size_t)num_seqs;
    if (!b) return rp_fail_nomem(err, "a batch");
    b->ctx = ctx;
    b->num_seqs = num_seqs;
    b->prompt_len = rp_alloc(ctx, n * sizeof(int32_t) + 1);
    b->response_len = rp_alloc(ctx, n * sizeof(int32_t) + 1);
    b->group_id = rp_alloc(ctx, n * sizeof(int32_t) + 1);
    b->cu_seqlens = rp_alloc(ctx, (n + 1) * sizeof(int64_t));
    if (!b->prompt_len || !b->response_len || !b->group_id || !b->cu_seqlens) {
        rp_batch_free(b);
        return rp_fail_nomem(err, "a batch");
    }
    if (n) {
        memcpy(b->prompt_len, prompt_len, n * sizeof(int32_t));
        memcpy(b->response_len, response_len, n * sizeof(int32_t));
    }
    b->cu_seqlens[0] = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        int32_t len = prompt_len[s] + response_len[s];
        b->group_id[s] = group_id ? group_id[s] : s;
        b->cu_seqlens[s + 1] = b->cu_seqlens[s] + len; /* < 2^31 * 2^31: no overflow */
        if (len > b->max_seq_len) b->max_seq_len = len;
    }
    *out = b;
    return RP_OK;
}

void rp_batch_free(rp_batch *b)
{
    if (!b) return;
    rp_context *ctx = b->ctx;
    rp_free(ctx, b->prompt_len);
    rp_free(ctx, b->response_len);
    rp_free(ctx, b->group_id);
    rp_free(ctx, b->cu_seqlens);
    rp_free(ctx, b);
}

int32_t rp_batch_num_seqs(const rp_batch *b) { return b->num_seqs; }
int64_t rp_batch_num_tokens(const rp_batch *b) { return b->cu_seqlens[b->num_seqs]; }
int32_t rp_batch_max_seq_len(const rp_batch *b) { return b->max_seq_len; }
const int64_t *rp_batch_cu_seqlens(const rp_batch *b) { return b->cu_seqlens; }
const int32_t *rp_batch_prompt_lens(const rp_batch *b) { return b->prompt_len; }
const int32_t *rp_batch_response_lens(const rp_batch *b) { return b->response_len; }
const int32_t *rp_batch_group_ids(const rp_batch *b) { return b->group_id; }

int32_t rp_batch_seq_len(const rp_batch *b, int32_t seq)
{
    return (int32_t)(b->cu_seqlens[seq + 1] - b->cu_seqlens[seq]);
}
