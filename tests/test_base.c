/* Base layer: status words, error reports, the allocator hook, XXH64, batches and
 * routing views. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <stdlib.h>

static void test_hash(void)
{
    /* Reference values of XXH64 with seed 0, from its specification's test vectors. */
    is_int(rp_hash64("", 0, 0), (long long)0xEF46DB3751D8E999ULL, "xxh64 of empty input");
    is_int(rp_hash64("abc", 3, 0), (long long)0x44BC2CF5AD770999ULL, "xxh64 of 'abc'");
    char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (char)(i * 31 + 7);
    uint64_t whole = rp_hash64(buf, sizeof buf, 42);
    rp_hash_state st;
    rp_hash_init(&st, 42);
    for (size_t off = 0, step = 1; off < sizeof buf; off += step, step = step * 3 % 37 + 1) {
        size_t n = off + step > sizeof buf ? sizeof buf - off : step;
        rp_hash_update(&st, buf + off, n);
    }
    is_int(rp_hash_final(&st), whole, "streaming hash equals one-shot hash over odd chunks");
    ok(rp_hash64(buf, sizeof buf, 1) != whole, "seed changes the hash");
}

static void test_alloc(void)
{
    counting c = {0};
    rp_context *ctx;
    is_int(rp_context_new(counting_alloc, &c, &ctx), RP_OK, "context with a custom allocator");
    void *p = rp_alloc(ctx, 100);
    ok(p && c.live > 100, "allocation goes through the hook");
    p = rp_realloc(ctx, p, 5000);
    ok(p != NULL, "realloc through the hook");
    rp_free(ctx, p);
    ok(rp_calloc(ctx, SIZE_MAX / 2, 4) == NULL, "calloc with an overflowing size fails");
    rp_context_free(ctx);
    is_int(c.live, 0, "everything allocated through the hook was freed");
}

static void test_errors(void)
{
    is_str(rp_strerror(RP_ECHECKSUM), "checksum mismatch", "strerror names codes");
    is_str(rp_strerror((rp_status)999), "unknown status", "strerror of an unknown code");
    rp_error err;
    rp_fail(&err, RP_EINVAL, "thing %d is bad", 7);
    is_int(err.status, RP_EINVAL, "rp_fail stores the status");
    is_str(err.text, "thing 7 is bad", "rp_fail formats the message");
    is_int(err.sequence, -1, "positions start unset");
    is_int(rp_fail(NULL, RP_EIO, "x"), RP_EIO, "rp_fail accepts a NULL report");
}

static void test_batch_and_routing(rp_context *ctx)
{
    int32_t prompt[3] = {2, 0, 1}, response[3] = {1, 0, 2}, groups[3] = {5, 5, 6};
    rp_batch *b;
    rp_error err;
    is_int(rp_batch_new(ctx, 3, prompt, response, groups, &b, &err), RP_OK, "batch of 3 sequences");
    is_int(rp_batch_num_tokens(b), 6, "token count is the sum of prompt and response");
    is_int(rp_batch_cu_seqlens(b)[2], 3, "cu_seqlens skips the empty sequence");
    is_int(rp_batch_seq_len(b, 2), 3, "sequence length");
    is_int(rp_batch_max_seq_len(b), 3, "longest sequence");
    is_int(rp_batch_group_ids(b)[1], 5, "group ids kept");

    /* 6 tokens x 2 layers x top-2, packed */
    uint8_t ids[6 * 2 * 2];
    for (int i = 0; i < 24; i++) ids[i] = (uint8_t)(i % 4);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, ids);
    is_int(rp_routing_check(&r, b, 4, &err), RP_OK, "packed routing within 4 experts");
    ids[3 * 4 + 1 * 2 + 1] = 9; /* token 3 (sequence 2 token 0), layer 1, choice 1 */
    is_int(rp_routing_check(&r, b, 4, &err), RP_ERANGE, "out-of-range id rejected");
    like(err.text, "sequence 2 token 0 layer 1 choice 1 has expert id 9, but the model has 4 experts",
         "error names sequence, token, layer, choice and id");
    is_int(err.sequence, 2, "error carries the sequence");
    is_int(err.expert, 9, "error carries the expert id");

    /* the same ids seen per sequence and per layer */
    uint16_t s0[3 * 2 * 2], s2[3 * 2 * 2];
    for (int i = 0; i < 12; i++) s0[i] = (uint16_t)(i % 3), s2[i] = 1;
    const void *seqs[3] = {s0, NULL, s2};
    rp_routing_per_seq(&r, RP_ID_U16, 2, 2, seqs, 3);
    is_int(rp_routing_check(&r, b, 3, &err), RP_OK, "per-sequence view, empty sequence without array");
    s2[11] = 3;
    is_int(rp_routing_check(&r, b, 3, &err), RP_ERANGE, "per-sequence view checks ids");
    like(err.text, "sequence 2 token 2 layer 1 choice 1", "per-sequence error position");
    rp_routing_per_seq(&r, RP_ID_U16, 2, 2, seqs, 2);
    is_int(rp_routing_check(&r, b, 3, &err), RP_EINVAL, "per-sequence view with the wrong count");

    int32_t l0[6 * 2], l1[6 * 2];
    for (int i = 0; i < 12; i++) l0[i] = 0, l1[i] = 1;
    const void *layers[2] = {l0, l1};
    rp_routing_per_layer(&r, RP_ID_I32, 2, 2, layers);
    is_int(rp_routing_check(&r, b, 2, &err), RP_OK, "per-layer view");
    l1[5] = -1;
    is_int(rp_routing_check(&r, b, 2, &err), RP_ERANGE, "negative id rejected");
    like(err.text, "sequence 0 token 2 layer 1 choice 1 has expert id -1", "per-layer error position");
    rp_batch_free(b);

    int32_t neg[1] = {-1};
    is_int(rp_batch_new(ctx, 1, neg, response, NULL, &b, &err), RP_EINVAL, "negative length rejected");
    like(err.text, "sequence 0 has a negative length", "negative length message");
    rp_batch_free(NULL);
}

static void test_batch_alloc_failures(void)
{
    int32_t prompt[2] = {1, 2}, response[2] = {3, 4};
    int cleanly = 1;
    for (long n = 1; n < 20; n++) {
        counting c = {0};
        rp_context *ctx;
        rp_context_new(counting_alloc, &c, &ctx);
        c.fail_at = n + 1; /* the context itself took call 1 */
        rp_batch *b = NULL;
        rp_status st = rp_batch_new(ctx, 2, prompt, response, NULL, &b, NULL);
        if (st == RP_OK) rp_batch_free(b);
        else if (st != RP_ENOMEM) cleanly = 0;
        rp_context_free(ctx);
        if (c.live != 0) cleanly = 0;
    }
    ok(cleanly, "batch creation fails cleanly at every allocation and leaks nothing");
}

/* rp_struct_size: what bindings check their mirrors against (python/tests/
 * test_struct_mirrors.py compares every ctypes mirror with it). */
static void test_struct_size(void)
{
    is_int((int)rp_struct_size("rp_execution"), (int)sizeof(rp_execution), "rp_execution's size");
    is_int((int)rp_struct_size("rp_trainer"), (int)sizeof(rp_trainer), "rp_trainer's size");
    is_int((int)rp_struct_size("rp_step_report"), (int)sizeof(rp_step_report), "rp_step_report's size");
    is_int((int)rp_struct_size("rp_comm"), (int)sizeof(rp_comm), "rp_comm's size");
    is_int((int)rp_struct_size("rp_no_such_struct"), 0, "0 for a name it does not know");
    is_int((int)rp_struct_size(NULL), 0, "0 for NULL");
}

int main(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_hash();
    test_alloc();
    test_errors();
    test_struct_size();
    test_batch_and_routing(ctx);
    test_batch_alloc_failures();
    rp_context_free(ctx);
    return tap_done();
}
