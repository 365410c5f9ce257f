/* Routing traces: round trips of every id width and input layout, the byte layout of
 * docs/formats.md, every kind of bad file (each with its message and offset), the
 * writer's all-or-nothing appends, and allocation failures. */
#include "internal.h"
#include "routing_access.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static char tmpdir[64];

/* A path in the test's directory; the 8 most recent stay valid (copy longer-lived ones). */
static const char *tmp(const char *name) { return temp_path(tmpdir, name); }

static int64_t pad64(int64_t n) { return (n + 63) / 64 * 64; }

/* ---- test data: deterministic batches and ids ---- */

static int32_t id_of(int64_t step, int32_t seq, int64_t tok, int32_t layer, int32_t choice,
                     int32_t num_experts)
{
    uint64_t x = (uint64_t)step * 1000003u + (uint64_t)seq * 10007u + (uint64_t)tok * 101u +
                 (uint64_t)layer * 13u + (uint64_t)choice;
    x ^= x >> 17;
    x *= 0x9E3779B97F4A7C15ULL;
    x ^= x >> 29;
    return (int32_t)(x % (uint64_t)num_experts);
}

static rp_batch *make_batch(rp_context *ctx, int64_t step, int32_t num_seqs)
{
    int32_t prompt[64], response[64], group[64];
    for (int32_t s = 0; s < num_seqs; s++) {
        prompt[s] = (int32_t)((s * 7 + step) % 5);
        response[s] = (int32_t)((s * 3 + step * 2) % 6 + 1);
        group[s] = s / 2 + 100;
    }
    if (num_seqs > 1) prompt[1] = response[1] = 0; /* an empty sequence */
    rp_batch *b = NULL;
    rp_batch_new(ctx, num_seqs, prompt, response, group, &b, NULL);
    return b;
}

static void store_id(void *base, rp_id_width width, int64_t index, int32_t v)
{
    switch (width) {
    case RP_ID_U8: ((uint8_t *)base)[index] = (uint8_t)v; break;
    case RP_ID_U16: ((uint16_t *)base)[index] = (uint16_t)v; break;
    default: ((int32_t *)base)[index] = v; break;
    }
}

enum { LAYOUT_PACKED, LAYOUT_PER_SEQ, LAYOUT_PER_LAYER, LAYOUT_STRIDED, NUM_LAYOUTS };
static const char *const layout_names[] = {"packed", "per-sequence", "per-layer", "strided"};

/* A routing view in one layout and the memory behind it. */
typedef struct view {
    rp_routing r;
    void *mem[64];
    int num_mem;
    const void *bases[64];
} view;

static void view_free(view *v)
{
    for (int i = 0; i < v->num_mem; i++) free(v->mem[i]);
    v->num_mem = 0;
}

static void *view_alloc(view *v, size_t bytes)
{
    void *p = calloc(bytes ? bytes : 1, 1);
    v->mem[v->num_mem++] = p;
    return p;
}

/* The ids of id_of(step, ...) in `layout`. */
static void make_view(view *v, int layout, const rp_batch *b, int64_t step, rp_id_width width,
                      int32_t L, int32_t K, int32_t E)
{
    memset(v, 0, sizeof *v);
    int32_t n = rp_batch_num_seqs(b);
    const int64_t *cu = rp_batch_cu_seqlens(b);
    int64_t T = rp_batch_num_tokens(b);
    switch (layout) {
    case LAYOUT_PACKED: {
        void *ids = view_alloc(v, (size_t)(T * L * K) * width);
        rp_routing_packed(&v->r, width, L, K, ids);
        break;
    }
    case LAYOUT_PER_SEQ:
        for (int32_t s = 0; s < n; s++)
            v->bases[s] = view_alloc(v, (size_t)((cu[s + 1] - cu[s]) * L * K) * width);
        rp_routing_per_seq(&v->r, width, L, K, v->bases, n);
        break;
    case LAYOUT_PER_LAYER:
        for (int32_t l = 0; l < L; l++) v->bases[l] = view_alloc(v, (size_t)(T * K) * width);
        rp_routing_per_layer(&v->r, width, L, K, v->bases);
        break;
    default: {
        /* [token][choice][layer] with 3 ids of padding after each token */
        void *ids = view_alloc(v, (size_t)(T * (L * K + 3)) * width);
        rp_routing_packed(&v->r, width, L, K, ids);
        v->r.token_stride = L * K + 3;
        v->r.layer_stride = 1;
        v->r.k_stride = L;
        break;
    }
    }
    for (int32_t s = 0; s < n; s++)
        for (int32_t l = 0; l < L; l++) {
            const void *at = rp_routing_at(&v->r, cu, s, l);
            for (int64_t t = 0; t < cu[s + 1] - cu[s]; t++)
                for (int32_t j = 0; j < K; j++)
                    store_id((void *)at, width, t * v->r.token_stride + j * v->r.k_stride,
                             id_of(step, s, t, l, j, E));
        }
}

/* Set the id of (seq, tok, layer, choice) in a view. */
static void poke(view *v, const rp_batch *b, int32_t s, int64_t t, int32_t l, int32_t j, int32_t id)
{
    const void *at = rp_routing_at(&v->r, rp_batch_cu_seqlens(b), s, l);
    store_id((void *)at, v->r.width, t * v->r.token_stride + j * v->r.k_stride, id);
}

/* A trace of `steps` steps (step indexes 10, 11, ...), packed. */
static rp_status write_trace(rp_context *ctx, const char *path, int steps, int32_t nseq,
                             rp_id_width width, int32_t L, int32_t K, int32_t E)
{
    rp_trace_writer *w;
    rp_error err;
    rp_status st = rp_trace_writer_open(ctx, path, E, &w, &err);
    for (int i = 0; i < steps && st == RP_OK; i++) {
        rp_batch *b = make_batch(ctx, i, nseq);
        view v;
        make_view(&v, LAYOUT_PACKED, b, 10 + i, width, L, K, E);
        st = rp_trace_writer_append(w, 10 + i, b, &v.r, &err);
        view_free(&v);
        rp_batch_free(b);
    }
    rp_status cst = rp_trace_writer_close(w, &err);
    if (st != RP_OK) diag("write_trace: %s", err.text);
    return st != RP_OK ? st : cst;
}

/* Every step of `t` holds id_of(step index) and make_batch(i)'s lengths. */
static int check_contents(rp_context *ctx, rp_trace *t, int32_t nseq, int32_t E, int64_t first_step)
{
    int good = 1;
    for (int32_t i = 0; i < rp_trace_num_steps(t); i++) {
        rp_batch *b = NULL, *want = make_batch(ctx, i, nseq);
        rp_routing r;
        rp_error err;
        if (rp_trace_read_step(t, i, &b, &r, &err) != RP_OK) {
            diag("read step %d: %s", i, err.text);
            good = 0;
            rp_batch_free(want);
            continue;
        }
        int32_t n = rp_batch_num_seqs(b);
        good &= n == nseq && rp_batch_num_tokens(b) == rp_batch_num_tokens(want);
        for (int32_t s = 0; good && s < n; s++)
            good &= rp_batch_prompt_lens(b)[s] == rp_batch_prompt_lens(want)[s] &&
                    rp_batch_response_lens(b)[s] == rp_batch_response_lens(want)[s] &&
                    rp_batch_group_ids(b)[s] == rp_batch_group_ids(want)[s];
        const int64_t *cu = rp_batch_cu_seqlens(b);
        good &= r.layout == RP_ROUTING_PACKED && r.k_stride == 1 && r.layer_stride == r.top_k &&
                r.token_stride == (int64_t)r.num_layers * r.top_k;
        for (int32_t s = 0; good && s < n; s++)
            for (int64_t tok = 0; tok < cu[s + 1] - cu[s]; tok++)
                for (int32_t l = 0; l < r.num_layers; l++)
                    for (int32_t j = 0; j < r.top_k; j++)
                        good &= rp_id_load(r.base, r.width,
                                           (cu[s] + tok) * r.token_stride + l * r.top_k + j) ==
                                id_of(first_step + i, s, tok, l, j, E);
        rp_batch_free(b);
        rp_batch_free(want);
    }
    return good;
}

/* ---- round trips ---- */

static void test_round_trip(rp_context *ctx)
{
    static const struct { rp_id_width width; int32_t E; } widths[] = {
        {RP_ID_U8, 60}, {RP_ID_U8, 256}, {RP_ID_U16, 1000}, {RP_ID_U16, 65536}, {RP_ID_I32, 70000}};
    const int32_t L = 3, K = 2, NSEQ = 6;
    for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
        for (int layout = 0; layout < NUM_LAYOUTS; layout++) {
            char path[512];
            snprintf(path, sizeof path, "%s", tmp("rt.rpt"));
            rp_trace_writer *w;
            rp_error err;
            rp_status st = rp_trace_writer_open(ctx, path, widths[wi].E, &w, &err);
            for (int i = 0; i < 3 && st == RP_OK; i++) {
                rp_batch *b = make_batch(ctx, i, NSEQ);
                view v;
                make_view(&v, layout, b, 10 + i, widths[wi].width, L, K, widths[wi].E);
                st = rp_trace_writer_append(w, 10 + i, b, &v.r, &err);
                view_free(&v);
                rp_batch_free(b);
            }
            rp_status cst = rp_trace_writer_close(w, &err);
            rp_trace *t = NULL;
            if (st == RP_OK && cst == RP_OK) st = rp_trace_open(ctx, path, 0, &t, &err);
            if (!ok(st == RP_OK && cst == RP_OK, "%d-byte ids, %d experts, %s layout: write 3 steps, open",
                    (int)widths[wi].width, widths[wi].E, layout_names[layout])) {
                diag("%s", err.text);
                continue;
            }
            int good = rp_trace_num_steps(t) == 3;
            for (int32_t i = 0; good && i < 3; i++) {
                const rp_trace_step_info *s = rp_trace_step(t, i);
                good &= s->step == 10 + i && s->num_seqs == NSEQ && s->num_layers == L &&
                        s->top_k == K && s->num_experts == widths[wi].E &&
                        s->width == widths[wi].width && s->offset % 64 == 0 &&
                        s->payload_offset % 64 == 0 && s->payload_bytes % 64 == 0;
            }
            good &= check_contents(ctx, t, NSEQ, widths[wi].E, 10);
            ok(good, "%d-byte ids, %s layout: steps, lengths, group ids and every id read back",
               (int)widths[wi].width, layout_names[layout]);
            is_int(rp_trace_validate(t, &err), RP_OK, "%d-byte ids, %s layout: validates",
                   (int)widths[wi].width, layout_names[layout]);
            rp_trace_close(t);
        }
    }

    /* empty steps: no sequences, and sequences with no tokens */
    rp_trace_writer *w;
    rp_error err;
    rp_batch *b0, *b1;
    int32_t zeros[3] = {0, 0, 0};
    rp_batch_new(ctx, 0, NULL, NULL, NULL, &b0, NULL);
    rp_batch_new(ctx, 3, zeros, zeros, NULL, &b1, NULL);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, NULL);
    rp_status st = rp_trace_writer_open(ctx, tmp("empty.rpt"), 8, &w, &err);
    if (st == RP_OK) st = rp_trace_writer_append(w, 0, b0, &r, &err);
    if (st == RP_OK) st = rp_trace_writer_append(w, 1, b1, &r, &err);
    rp_trace_writer_close(w, NULL);
    rp_trace *t = NULL;
    if (st == RP_OK) st = rp_trace_open(ctx, tmp("empty.rpt"), 0, &t, &err);
    ok(st == RP_OK && rp_trace_num_steps(t) == 2 && rp_trace_step(t, 0)->payload_bytes == 0 &&
       rp_trace_step(t, 1)->num_tokens == 0, "steps without sequences or tokens round-trip");
    if (t) {
        rp_batch *b = NULL;
        is_int(rp_trace_read_step(t, 1, &b, &r, &err), RP_OK, "read a step of empty sequences");
        ok(b && rp_batch_num_seqs(b) == 3 && rp_batch_num_tokens(b) == 0, "its batch is 3 empty sequences");
        rp_batch_free(b);
        is_int(rp_trace_validate(t, &err), RP_OK, "empty steps validate");
    }
    rp_trace_close(t);
    rp_batch_free(b0);
    rp_batch_free(b1);

    /* large ids and a step above the 64 MiB checksum chunk and the 4 MiB write buffer */
    const int32_t NS = 17, LL = 8, KK = 8;
    int32_t lens[17], none[17] = {0};
    for (int i = 0; i < NS; i++) lens[i] = 65536;
    rp_batch *big;
    rp_batch_new(ctx, NS, lens, none, NULL, &big, NULL);
    int64_t T = rp_batch_num_tokens(big), count = T * LL * KK;
    uint8_t *ids = malloc((size_t)count);
    for (int64_t i = 0; i < count; i++) ids[i] = (uint8_t)(i * 2654435761u >> 24) % 200;
    rp_routing_packed(&r, RP_ID_U8, LL, KK, ids);
    st = rp_trace_writer_open(ctx, tmp("big.rpt"), 200, &w, &err);
    if (st == RP_OK) st = rp_trace_writer_append(w, 0, big, &r, &err);
    rp_trace_writer_close(w, NULL);
    t = NULL;
    if (st == RP_OK) st = rp_trace_open(ctx, tmp("big.rpt"), 0, &t, &err);
    ok(st == RP_OK && rp_trace_step(t, 0)->payload_bytes > (64 << 20), "a 68 MiB step writes and verifies");
    if (t) {
        rp_routing got;
        rp_batch *b = NULL;
        rp_trace_read_step(t, 0, &b, &got, &err);
        ok(b && memcmp(got.base, ids, (size_t)count) == 0, "its ids read back");
        rp_batch_free(b);
        int64_t payload = rp_trace_step(t, 0)->payload_offset;
        int64_t ids_at = payload + 3 * 128; /* 17 int32 lengths pad to 128 bytes */
        rp_trace_close(t);
        /* an id past the first 64 MiB of the payload, with a correct checksum */
        int64_t index = (int64_t)16 * 65536 * 64 + 5 * 64 + 3 * 8 + 7; /* seq 16 tok 5 layer 3 choice 7 */
        int fd = open(tmp("big.rpt"), O_RDWR);
        unsigned char bad = 250;
        ok(ids_at + index > payload + (64 << 20), "the bad id lies beyond the first checksum chunk");
        if (pwrite(fd, &bad, 1, ids_at + index) != 1) diag("pwrite failed");
        size_t size;
        unsigned char *buf = slurp(tmp("big.rpt"), &size);
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx",
                 (unsigned long long)rp_hash64(buf + payload, size - (size_t)payload, 0));
        char *at = strstr((char *)buf + 16, "\"checksum\":\"");
        if (at && pwrite(fd, hex, 16, (at - (char *)buf) + 12) != 16) diag("pwrite failed");
        close(fd);
        free(buf);
        t = NULL;
        st = rp_trace_open(ctx, tmp("big.rpt"), 0, &t, &err);
        is_int(st, RP_OK, "the patched big trace opens (ids are not scanned at open)");
        if (t) {
            is_int(rp_trace_validate(t, &err), RP_ERANGE, "validate finds the bad id past 64 MiB");
            char want[1200];
            snprintf(want, sizeof want, "step 0 sequence 16 token 5 layer 3 choice 7 has expert id 250, "
                     "but the model has 200 experts (byte %lld)", (long long)(ids_at + index));
            like(err.text, want, "its position across chunk boundaries");
            is_int(err.offset, ids_at + index, "err.offset is the id's byte");
            rp_trace_close(t);
        }
    }
    unlink(tmp("big.rpt"));
    free(ids);
    rp_batch_free(big);
}

/* The bytes are what docs/formats.md says. */
static void test_layout_bytes(rp_context *ctx)
{
    char path[512];
    snprintf(path, sizeof path, "%s", tmp("bytes.rpt"));
    if (write_trace(ctx, path, 2, 5, RP_ID_U16, 3, 2, 300) != RP_OK) {
        ok(0, "write the trace for the byte checks");
        return;
    }
    size_t size;
    unsigned char *buf = slurp(path, &size);
    int64_t block = 0;
    int good = 1, blocks = 0;
    while (good && block < (int64_t)size) {
        uint32_t hb, reserved;
        good &= memcmp(buf + block, "\x89RPT\r\n\x1a\n", 8) == 0;
        memcpy(&hb, buf + block + 8, 4);
        memcpy(&reserved, buf + block + 12, 4);
        good &= reserved == 0 && block % 64 == 0;
        json_error_t jerr;
        json_t *h = json_loadb((const char *)buf + block + 16, hb, 0, &jerr);
        good &= h != NULL && json_object_size(h) == 11;
        json_int_t nseq = json_integer_value(json_object_get(h, "num_seqs"));
        json_int_t ntok = json_integer_value(json_object_get(h, "num_tokens"));
        json_int_t pb = json_integer_value(json_object_get(h, "payload_bytes"));
        good &= !strcmp(json_string_value(json_object_get(h, "format")), "routepack-trace") &&
                json_integer_value(json_object_get(h, "version")) == 1 &&
                json_integer_value(json_object_get(h, "step")) == 10 + blocks &&
                json_integer_value(json_object_get(h, "id_width")) == 2;
        int64_t payload = block + pad64(16 + hb);
        for (int64_t p = block + 16 + hb; p < payload; p++) good &= buf[p] == 0;
        good &= pb == 3 * pad64(4 * nseq) + pad64(ntok * 3 * 2 * 2);
        char hex[17];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)rp_hash64(buf + payload, (size_t)pb, 0));
        good &= !strcmp(json_string_value(json_object_get(h, "checksum")), hex);
        /* prompt lengths first, then response lengths, group ids, ids */
        rp_batch *b = make_batch(ctx, blocks, 5);
        good &= memcmp(buf + payload, rp_batch_prompt_lens(b), 20) == 0 &&
                memcmp(buf + payload + pad64(20), rp_batch_response_lens(b), 20) == 0 &&
                memcmp(buf + payload + 2 * pad64(20), rp_batch_group_ids(b), 20) == 0;
        uint16_t first_id;
        memcpy(&first_id, buf + payload + 3 * pad64(20), 2);
        good &= first_id == id_of(10 + blocks, 0, 0, 0, 0, 300);
        rp_batch_free(b);
        json_decref(h);
        block = payload + pb;
        blocks++;
    }
    ok(good && blocks == 2 && block == (int64_t)size,
       "blocks: magic, header size, zero word, JSON header, zero padding, lengths, groups, ids, checksum");
    free(buf);
}

/* ---- bad files ---- */

static rp_status try_open(rp_context *ctx, const char *path, unsigned flags, rp_error *err)
{
    rp_trace *t = NULL;
    rp_status st = rp_trace_open(ctx, path, flags, &t, err);
    rp_trace_close(t);
    return st;
}

/* A copy of `buf` whose block at `block` has `from` replaced by `to` in its header,
 * re-padded. */
static unsigned char *edit_header(const unsigned char *buf, size_t size, int64_t block,
                                  const char *from, const char *to, size_t *out_size)
{
    uint32_t hb;
    memcpy(&hb, buf + block + 8, 4);
    char header[4096], edited[4096];
    memcpy(header, buf + block + 16, hb);
    header[hb] = '\0';
    char *at = strstr(header, from);
    if (!at) {
        diag("edit_header: '%s' not in %s", from, header);
        at = header + hb, from = "";
    }
    snprintf(edited, sizeof edited, "%.*s%s%s", (int)(at - header), header, to, at + strlen(from));
    uint32_t nhb = (uint32_t)strlen(edited);
    int64_t old_payload = block + pad64(16 + hb), new_payload = block + pad64(16 + nhb);
    *out_size = size - (size_t)old_payload + (size_t)new_payload;
    unsigned char *out = calloc(*out_size + 1, 1);
    memcpy(out, buf, (size_t)block + 16);
    memcpy(out + block + 8, &nhb, 4);
    memcpy(out + block + 16, edited, nhb);
    memcpy(out + new_payload, buf + old_payload, size - (size_t)old_payload);
    return out;
}

/* Recompute the checksum of the block at `block` (its payload as the header says). */
static void fix_checksum(unsigned char *buf, int64_t block, int64_t payload, int64_t payload_bytes)
{
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)rp_hash64(buf + payload, (size_t)payload_bytes, 0));
    char *at = strstr((char *)buf + block + 16, "\"checksum\":\"");
    if (at) memcpy(at + 12, hex, 16);
}

static void test_bad_files(rp_context *ctx)
{
    const int32_t E = 60, L = 3, K = 2, NSEQ = 5;
    char ref[512], bad[512];
    snprintf(ref, sizeof ref, "%s", tmp("ref.rpt"));
    snprintf(bad, sizeof bad, "%s", tmp("bad.rpt"));
    rp_error err;
    if (write_trace(ctx, ref, 2, NSEQ, RP_ID_U8, L, K, E) != RP_OK) {
        ok(0, "write the reference trace");
        return;
    }
    rp_trace *t;
    rp_trace_step_info s0, s1;
    if (rp_trace_open(ctx, ref, 0, &t, &err) != RP_OK) {
        ok(0, "open the reference trace: %s", err.text);
        return;
    }
    s0 = *rp_trace_step(t, 0);
    s1 = *rp_trace_step(t, 1);
    ok(rp_trace_step(t, 2) == NULL && rp_trace_step(t, -1) == NULL, "steps out of range are NULL");
    rp_batch *b = (rp_batch *)&s0; /* a sentinel: must stay untouched on error */
    rp_routing r;
    memset(&r, 0x5a, sizeof r);
    is_int(rp_trace_read_step(t, 2, &b, &r, &err), RP_EINVAL, "reading a step that does not exist");
    like(err.text, "step 2 does not exist (the trace has 2 steps)", "names the step count");
    rp_trace_close(t);
    size_t size;
    unsigned char *buf = slurp(ref, &size), *out;
    size_t out_size;
    int64_t end0 = s0.payload_offset + s0.payload_bytes, end1 = s1.payload_offset + s1.payload_bytes;
    ok(s1.offset == end0 && end1 == (int64_t)size, "blocks follow one another to the end of the file");
    char want[1200];

    /* magic */
    buf[1] = 'r';
    spit(bad, buf, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "wrong magic");
    like(err.text, "step block at byte 0: bad magic: not a routing trace", "wrong magic message");
    is_int(err.offset, 0, "wrong magic offset");
    buf[1] = 'R';
    buf[s1.offset + 7] = 'x';
    spit(bad, buf, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "wrong magic of the second step");
    snprintf(want, sizeof want, "step block at byte %lld: bad magic", (long long)s1.offset);
    like(err.text, want, "names the second block's offset");
    buf[s1.offset + 7] = '\n';
    /* CR LF -> LF: a text-mode copy */
    memcpy(out = malloc(size), buf, 4);
    memcpy(out + 4, buf + 5, size - 5);
    spit(bad, out, size - 1);
    free(out);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "line endings converted");
    like(err.text, "line endings were converted", "text-mode transfer is recognised");

    /* version */
    out = edit_header(buf, size, s1.offset, "\"version\":1", "\"version\":7", &out_size);
    spit(bad, out, out_size);
    free(out);
    is_int(try_open(ctx, bad, 0, &err), RP_ENOTSUP, "unknown version");
    snprintf(want, sizeof want, "%s: step block at byte %lld: unknown trace version 7 (this build reads version 1)",
             bad, (long long)s1.offset);
    is_str(err.text, want, "unknown version message, exactly");
    is_int(err.offset, s1.offset + 16, "unknown version offset is the header's");

    /* header keys and values */
    static const struct { const char *from, *to; rp_status st; const char *msg; } edits[] = {
        {"\"top_k\":2,", "", RP_EFORMAT, "header key 'top_k' is missing"},
        {"\"checksum\":", "\"extra\":1,\"checksum\":", RP_EFORMAT, "unknown header key 'extra'"},
        {"\"num_layers\":3", "\"num_layers\":\"3\"", RP_EFORMAT, "header key 'num_layers' must be an integer, got a string"},
        {"\"num_layers\":3", "\"num_layers\":3.0", RP_EFORMAT, "header key 'num_layers' must be an integer, got a real number"},
        {"\"step\":10", "\"step\":null", RP_EFORMAT, "header key 'step' must be an integer, got null"},
        {"\"num_layers\":3", "\"num_layers\":0", RP_ERANGE, "header key 'num_layers' is 0, must be in [1, 2147483647]"},
        {"\"num_seqs\":5", "\"num_seqs\":-5", RP_ERANGE, "header key 'num_seqs' is -5"},
        {"\"num_seqs\":5", "\"num_seqs\":2147483648", RP_ERANGE, "header key 'num_seqs' is 2147483648"},
        {"\"step\":10", "\"step\":-1", RP_ERANGE, "header key 'step' is -1"},
        {"\"top_k\":2", "\"top_k\":61", RP_ERANGE, "header key 'top_k' is 61, must be in [1, 60]"},
        {"\"id_width\":1", "\"id_width\":3", RP_ERANGE, "header key 'id_width' is 3, must be 1, 2 or 4"},
        {"\"id_width\":1", "\"id_width\":8", RP_ERANGE, "header key 'id_width' is 8"},
        {"\"num_experts\":60", "\"num_experts\":300", RP_ERANGE, "300 experts do not fit 1-byte ids (at most 256)"},
        {"\"format\":\"routepack-trace\"", "\"format\":\"routepack-plan\"", RP_EFORMAT, "header format is \"routepack-plan\", not \"routepack-trace\""},
        {"\"format\":\"routepack-trace\",", "", RP_EFORMAT, "header key 'format' is missing"},
        {"\"format\":\"routepack-trace\"", "\"format\":1", RP_EFORMAT, "header key 'format' must be a string, got an integer"},
        {"\"version\":1,", "", RP_EFORMAT, "header key 'version' is missing"},
        {"\"checksum\":\"", "\"checksum\":\"X", RP_EFORMAT, "header key 'checksum' must be 16 lowercase hex digits"},
        {"\"checksum\":\"", "\"checksum\":\"0", RP_EFORMAT, "must be 16 lowercase hex digits"},
        {"\"step\":10,", "\"step\":10,\"step\":11,", RP_EFORMAT, "header is not valid JSON: duplicate object key"},
        {"{", "[", RP_EFORMAT, "header is not valid JSON"},
        {"\"step\":10,", "\"step\":10,,", RP_EFORMAT, "header is not valid JSON"},
        {"\"num_tokens\":", "\"num_tokens\":4611686018427387904,\"x_\":", RP_EFORMAT, "unknown header key 'x_'"},
        {"\"payload_bytes\":", "\"payload_bytes\":64", RP_EFORMAT, "payload_bytes is 64"},
    };
    for (size_t c = 0; c < sizeof edits / sizeof edits[0]; c++) {
        out = edit_header(buf, size, 0, edits[c].from, edits[c].to, &out_size);
        spit(bad, out, out_size);
        free(out);
        is_int(try_open(ctx, bad, 0, &err), edits[c].st, "header edit %zu rejected (%s)", c, edits[c].msg);
        like(err.text, edits[c].msg, "header edit %zu: the reason", c);
    }
    /* the header is an array, not an object */
    {
        uint32_t hb;
        memcpy(&hb, buf + 8, 4);
        char header[1024];
        memcpy(header, buf + 16, hb);
        header[hb] = '\0';
        out = edit_header(buf, size, 0, header, "[1,2,3]", &out_size);
        spit(bad, out, out_size);
        free(out);
        is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a header that is not an object");
        like(err.text, "header is an array, not a JSON object", "not an object message");
    }
    /* sizes whose product overflows */
    char tokens[64];
    snprintf(tokens, sizeof tokens, "\"num_tokens\":%lld", (long long)s0.num_tokens);
    out = edit_header(buf, size, 0, tokens, "\"num_tokens\":1537228672809129302", &out_size);
    spit(bad, out, out_size);
    free(out);
    is_int(try_open(ctx, bad, 0, &err), RP_ERANGE, "tokens x layers x top-k x width overflowing 64 bits");
    like(err.text, "sizes overflow: 1537228672809129302 tokens x 3 layers x top-2 x 1-byte ids does not fit in 64 bits",
         "overflow message names the sizes");
    out = edit_header(buf, size, 0, tokens, "\"num_tokens\":1000000000", &out_size);
    spit(bad, out, out_size);
    free(out);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a token count that disagrees with payload_bytes");
    like(err.text, "make 6000000192", "payload_bytes mismatch gives the computed size");
    /* a huge but consistent payload_bytes: the file is too short */
    {
        char pb[64], npb[96];
        snprintf(pb, sizeof pb, "\"payload_bytes\":%lld", (long long)s0.payload_bytes);
        snprintf(npb, sizeof npb, "\"payload_bytes\":%lld", (long long)(6000000000LL + 192));
        unsigned char *o1 = edit_header(buf, size, 0, tokens, "\"num_tokens\":1000000000", &out_size);
        size_t s2;
        out = edit_header(o1, out_size, 0, pb, npb, &s2);
        spit(bad, out, s2);
        free(o1);
        free(out);
        is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a 6 GB payload in a small file");
        like(err.text, "truncated: the payload ends at byte", "truncation, not a crash");
    }
    /* a header exactly filling its 64-byte multiple: no padding */
    {
        uint32_t hb;
        memcpy(&hb, buf + 8, 4);
        char spaces[80];
        int n = (int)(pad64(16 + hb + 1) - 16 - hb);
        memset(spaces, ' ', (size_t)n);
        strcpy(spaces + n, "}");
        out = edit_header(buf, size, 0, "}", spaces, &out_size);
        spit(bad, out, out_size);
        free(out);
        is_int(try_open(ctx, bad, 0, &err), RP_OK, "a header without padding (whitespace fills it)");
    }

    /* the prefix */
    memcpy(out = malloc(size), buf, size);
    out[12] = 1;
    spit(bad, out, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a non-zero reserved word");
    like(err.text, "reserved field at byte 12 is 1, must be 0", "reserved word message");
    out[12] = 0;
    uint32_t huge = 1u << 30, zero = 0;
    memcpy(out + 8, &huge, 4);
    spit(bad, out, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a 1 GiB header size");
    like(err.text, "header size 1073741824 is out of range", "header size message");
    memcpy(out + 8, &zero, 4);
    spit(bad, out, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a zero header size");
    memcpy(out, buf, size);
    out[16 + 5] = '\0';
    spit(bad, out, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a NUL in the header");
    like(err.text, "header has a NUL byte at byte 21", "NUL message");
    memcpy(out, buf, size);
    out[s0.payload_offset - 1] = 7;
    spit(bad, out, size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "non-zero header padding");
    like(err.text, "header padding byte", "padding message");
    free(out);

    /* truncation at several offsets */
    static const char *const what[] = {"prefix", "header", "payload"};
    int64_t cuts[][2] = {
        {10, 0}, {16 + 5, 1}, {s0.payload_offset, 2}, {s0.payload_offset + 1, 2},
        {s0.payload_offset + 64, 2}, {end0 - 1, 2},
        {s1.offset + 3, -1}, {s1.offset + 15, 0}, {s1.offset + 40, 1}, {s1.payload_offset + 100, 2},
        {end1 - 1, 2},
    };
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        int64_t cut = cuts[c][0];
        spit(bad, buf, (size_t)cut);
        rp_status st = try_open(ctx, bad, 0, &err);
        int64_t block = cut >= s1.offset ? s1.offset : 0;
        const rp_trace_step_info *si = cut >= s1.offset ? &s1 : &s0;
        if (cuts[c][1] < 0) {
            /* fewer than 8 bytes of the next block: a partial magic reads as truncation */
            is_int(st, RP_EFORMAT, "truncated inside the second block's magic");
            like(err.text, "truncated: the block prefix", "partial magic is truncation");
            continue;
        }
        int64_t need = cuts[c][1] == 0 ? block + 16 : cuts[c][1] == 2 ? si->payload_offset + si->payload_bytes : -1;
        if (cuts[c][1] == 1) {
            uint32_t hb;
            memcpy(&hb, buf + block + 8, 4);
            need = block + 16 + hb;
        }
        snprintf(want, sizeof want, "step block at byte %lld: truncated: the %s ends at byte %lld, but the "
                 "file has %lld bytes (%lld missing)", (long long)block,
                 cuts[c][1] == 0 ? "block prefix" : what[cuts[c][1]], (long long)need, (long long)cut,
                 (long long)(need - cut));
        is_int(st, RP_EFORMAT, "cut at byte %lld (in the %s of step %d)", (long long)cut, what[cuts[c][1]],
               block ? 1 : 0);
        like(err.text, want, "cut at byte %lld: offset and bytes missing", (long long)cut);
        is_int(err.offset, cut, "cut at byte %lld: err.offset is the end of the file", (long long)cut);
    }
    /* trailing garbage and empty files */
    memcpy(out = malloc(size + 100), buf, size);
    memcpy(out + size, "garbage garbage garbage", 23);
    spit(bad, out, size + 23);
    free(out);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "trailing garbage after the last step");
    snprintf(want, sizeof want, "step block at byte %lld: bad magic: not the start of a step block", (long long)size);
    like(err.text, want, "trailing garbage message");
    spit(bad, buf, 0);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "an empty file");
    like(err.text, "empty file, not a routing trace", "empty file message");
    is_int(try_open(ctx, tmp("nonexistent.rpt"), 0, &err), RP_EIO, "a missing file");
    like(err.text, "nonexistent.rpt: cannot open", "missing file message");
    is_int(try_open(ctx, tmpdir, 0, &err), RP_EIO, "a directory");
    is_int(try_open(ctx, ref, 2, &err), RP_EINVAL, "unknown flags");

    /* steps of one trace share the shape: concatenating traces is how steps add up */
    write_trace(ctx, tmp("other.rpt"), 1, NSEQ, RP_ID_U8, L + 1, K, E);
    size_t other_size;
    unsigned char *other = slurp(tmp("other.rpt"), &other_size);
    memcpy(out = malloc(2 * size + other_size), buf, size);
    memcpy(out + size, buf, size);
    spit(bad, out, 2 * size);
    t = NULL;
    ok(rp_trace_open(ctx, bad, 0, &t, &err) == RP_OK && rp_trace_num_steps(t) == 4,
       "two traces concatenated are one trace of 4 steps");
    rp_trace_close(t);
    memcpy(out + size, other, other_size);
    spit(bad, out, size + other_size);
    is_int(try_open(ctx, bad, 0, &err), RP_EFORMAT, "a step with another shape");
    snprintf(want, sizeof want, "step block at byte %lld: shape 4 layers, 60 experts, top-2, 1-byte ids "
             "differs from the first step's 3 layers", (long long)size);
    like(err.text, want, "shape mismatch message");
    free(out);
    free(other);

    /* payload contents: checksum, lengths, ids */
    memcpy(out = malloc(size), buf, size);
    out[s1.payload_offset + s1.payload_bytes - 70] ^= 0x01;
    spit(bad, out, size);
    is_int(try_open(ctx, bad, 0, &err), RP_ECHECKSUM, "one flipped payload bit fails the checksum at open");
    like(err.text, "step 1 (block at byte", "checksum error names the step");
    like(err.text, "payload checksum mismatch", "checksum message");
    is_int(err.offset, s1.payload_offset, "checksum error offset is the payload's");
    t = NULL;
    is_int(rp_trace_open(ctx, bad, RP_TRACE_NO_VERIFY, &t, &err), RP_OK, "RP_TRACE_NO_VERIFY skips the checksum");
    if (t) {
        is_int(rp_trace_validate(t, &err), RP_ECHECKSUM, "rp_trace_validate catches it");
        like(err.text, "step 1 (block at byte", "validate names the step");
    }
    rp_trace_close(t);

    int32_t v;
    /* a prompt length one too long: the sum no longer matches */
    memcpy(out, buf, size);
    memcpy(&v, out + s0.payload_offset + 8, 4);
    v += 1;
    memcpy(out + s0.payload_offset + 8, &v, 4);
    fix_checksum(out, 0, s0.payload_offset, s0.payload_bytes);
    spit(bad, out, size);
    t = NULL;
    is_int(rp_trace_open(ctx, bad, 0, &t, &err), RP_OK, "lengths are not checked at open");
    if (t) {
        b = (rp_batch *)&s0;
        memset(&r, 0x5a, sizeof r);
        rp_routing r0 = r;
        is_int(rp_trace_read_step(t, 0, &b, &r, &err), RP_EFORMAT, "lengths that do not sum to the token count");
        snprintf(want, sizeof want, "step 0 sequence lengths sum to %lld tokens, but the header says %lld",
                 (long long)s0.num_tokens + 1, (long long)s0.num_tokens);
        like(err.text, want, "sum message");
        ok(b == (rp_batch *)&s0 && memcmp(&r, &r0, sizeof r) == 0, "nothing half-read is returned");
        is_int(rp_trace_validate(t, &err), RP_EFORMAT, "validate checks lengths");
        b = NULL;
        is_int(rp_trace_read_step(t, 1, &b, &r, &err), RP_OK, "the other step still reads");
        rp_batch_free(b);
    }
    rp_trace_close(t);
    /* a negative response length */
    memcpy(out, buf, size);
    int64_t lens_bytes = pad64(4 * NSEQ);
    v = -5;
    memcpy(out + s1.payload_offset + lens_bytes + 4 * 3, &v, 4);
    fix_checksum(out, s1.offset, s1.payload_offset, s1.payload_bytes);
    spit(bad, out, size);
    t = NULL;
    rp_trace_open(ctx, bad, 0, &t, &err);
    if (t) {
        b = NULL;
        is_int(rp_trace_read_step(t, 1, &b, &r, &err), RP_EFORMAT, "a negative length");
        snprintf(want, sizeof want, "step 1 sequence 3 has a negative response length -5 (byte %lld)",
                 (long long)(s1.payload_offset + lens_bytes + 12));
        like(err.text, want, "negative length message");
        is_int(err.sequence, 3, "err.sequence");
        ok(b == NULL, "no batch on error");
    } else {
        ok(0, "open with a negative length: %s", err.text);
    }
    rp_trace_close(t);
    /* sequence 3 of step 1 longer than 2^31-1 tokens */
    memcpy(out, buf, size);
    v = INT32_MAX;
    memcpy(out + s1.payload_offset + 4 * 3, &v, 4);
    memcpy(out + s1.payload_offset + lens_bytes + 4 * 3, &v, 4);
    fix_checksum(out, s1.offset, s1.payload_offset, s1.payload_bytes);
    spit(bad, out, size);
    t = NULL;
    rp_trace_open(ctx, bad, 0, &t, &err);
    if (t) {
        b = NULL;
        is_int(rp_trace_read_step(t, 1, &b, &r, &err), RP_EFORMAT, "a sequence over 2^31-1 tokens");
        like(err.text, "step 1 sequence 3 is longer than 2^31-1 tokens", "long sequence message");
    }
    rp_trace_close(t);

    /* an id out of range, with a correct checksum */
    rp_batch *b1 = make_batch(ctx, 1, NSEQ);
    const int64_t *cu = rp_batch_cu_seqlens(b1);
    int64_t ids_at = s1.payload_offset + 3 * lens_bytes;
    int64_t index = (cu[3] + 1) * L * K + 2 * K + 1; /* sequence 3, token 1, layer 2, choice 1 */
    memcpy(out, buf, size);
    out[ids_at + index] = 71;
    fix_checksum(out, s1.offset, s1.payload_offset, s1.payload_bytes);
    spit(bad, out, size);
    t = NULL;
    is_int(rp_trace_open(ctx, bad, 0, &t, &err), RP_OK, "ids are not scanned at open");
    if (t) {
        b = NULL;
        is_int(rp_trace_read_step(t, 1, &b, &r, &err), RP_OK, "nor by rp_trace_read_step");
        rp_batch_free(b);
        is_int(rp_trace_validate(t, &err), RP_ERANGE, "rp_trace_validate finds the id out of range");
        snprintf(want, sizeof want, "%s: step 1 sequence 3 token 1 layer 2 choice 1 has expert id 71, but "
                 "the model has 60 experts (byte %lld)", bad, (long long)(ids_at + index));
        is_str(err.text, want, "bad id message names step, sequence, token, layer, choice and byte");
        ok(err.sequence == 3 && err.expert == 71 && err.offset == ids_at + index, "bad id positions");
    }
    rp_trace_close(t);
    /* corruption beats a bad id: with both, the checksum is reported */
    out[ids_at + index] = 72;
    spit(bad, out, size);
    t = NULL;
    rp_trace_open(ctx, bad, RP_TRACE_NO_VERIFY, &t, &err);
    if (t) is_int(rp_trace_validate(t, &err), RP_ECHECKSUM, "a bad id in a corrupt payload reports the checksum");
    rp_trace_close(t);
    rp_batch_free(b1);
    free(out);
    free(buf);
}

/* ---- the writer ---- */

static void test_writer(rp_context *ctx)
{
    const int32_t E = 60, L = 4, K = 8;
    char path[512];
    snprintf(path, sizeof path, "%s", tmp("w.rpt"));
    rp_trace_writer *w;
    rp_error err;
    char want[1200];
    if (rp_trace_writer_open(ctx, path, E, &w, &err) != RP_OK) {
        ok(0, "open a writer: %s", err.text);
        return;
    }
    rp_batch *b = make_batch(ctx, 0, 6);
    view v;
    make_view(&v, LAYOUT_PACKED, b, 10, RP_ID_U8, L, K, E);
    is_int(rp_trace_writer_append(w, 10, b, &v.r, &err), RP_OK, "append step 10");
    int64_t size1 = file_size(path);
    view_free(&v);

    /* a bad id in each input layout; the last id of the step, so the rest was written */
    int32_t n = rp_batch_num_seqs(b);
    int64_t last_tok = rp_batch_seq_len(b, n - 1) - 1;
    for (int layout = 0; layout < NUM_LAYOUTS; layout++) {
        make_view(&v, layout, b, 11, RP_ID_U8, L, K, E);
        poke(&v, b, n - 1, last_tok, L - 1, K - 1, 61);
        is_int(rp_trace_writer_append(w, 11, b, &v.r, &err), RP_ERANGE, "%s layout: an id out of range is rejected",
               layout_names[layout]);
        snprintf(want, sizeof want, "%s: appending step 11: sequence %d token %lld layer %d choice %d has expert id "
                 "61, but the model has 60 experts", path, n - 1, (long long)last_tok, L - 1, K - 1);
        is_str(err.text, want, "%s layout: the message names the position", layout_names[layout]);
        ok(err.sequence == n - 1 && err.expert == 61, "%s layout: error positions", layout_names[layout]);
        is_int(file_size(path), size1, "%s layout: the partial step is truncated away", layout_names[layout]);
        view_free(&v);
    }
    /* shape and width must match the trace's */
    make_view(&v, LAYOUT_PER_LAYER, b, 11, RP_ID_I32, L, K, E);
    poke(&v, b, 0, 0, 0, 0, -3);
    is_int(rp_trace_writer_append(w, 11, b, &v.r, &err), RP_EINVAL, "another id width than the trace's");
    like(err.text, "shape 4 layers, top-8, 4-byte ids differs from the trace's 4 layers, top-8, 1-byte ids",
         "width mismatch message");
    view_free(&v);
    make_view(&v, LAYOUT_PACKED, b, 11, RP_ID_U8, L + 1, K, E);
    is_int(rp_trace_writer_append(w, 11, b, &v.r, &err), RP_EINVAL, "another layer count than the trace's");
    view_free(&v);
    make_view(&v, LAYOUT_PACKED, b, 11, RP_ID_U8, L, K, E);
    is_int(rp_trace_writer_append(w, -1, b, &v.r, &err), RP_EINVAL, "a negative step index");
    v.r.top_k = 61;
    is_int(rp_trace_writer_append(w, 11, b, &v.r, &err), RP_EINVAL, "top-k above the expert count");
    like(err.text, "appending step 11: routing: top-k 61 exceeds the 60 experts", "shape errors are prefixed");
    v.r.top_k = K;
    is_int(file_size(path), size1, "rejected appends leave the file as it was");
    is_int(rp_trace_writer_append(w, 11, b, &v.r, &err), RP_OK, "the writer still appends after errors");
    view_free(&v);
    is_int(rp_trace_writer_close(w, &err), RP_OK, "close");
    rp_trace *t = NULL;
    is_int(rp_trace_open(ctx, path, 0, &t, &err), RP_OK, "the trace opens");
    ok(t && rp_trace_num_steps(t) == 2 && rp_trace_step(t, 1)->step == 11, "it has exactly the 2 good steps");
    if (t) is_int(rp_trace_validate(t, &err), RP_OK, "and validates");
    rp_trace_close(t);

    /* a negative id in 4-byte ids, first in the gather path */
    rp_trace_writer_open(ctx, tmp("w4.rpt"), 70000, &w, &err);
    make_view(&v, LAYOUT_STRIDED, b, 0, RP_ID_I32, L, K, 70000);
    poke(&v, b, 2, 1, 3, 5, -3);
    is_int(rp_trace_writer_append(w, 0, b, &v.r, &err), RP_ERANGE, "a negative 4-byte id");
    like(err.text, "sequence 2 token 1 layer 3 choice 5 has expert id -3", "negative id message");
    is_int(file_size(tmp("w4.rpt")), 0, "the file is left empty");
    view_free(&v);
    make_view(&v, LAYOUT_PACKED, b, 0, RP_ID_U8, L, K, 60);
    is_int(rp_trace_writer_append(w, 0, b, &v.r, &err), RP_EINVAL, "1-byte ids for 70000 experts");
    like(err.text, "1-byte ids cannot hold the trace's 70000 experts (at most 256)", "width capacity message");
    view_free(&v);
    rp_trace_writer_close(w, NULL);

    /* a step above the 4 MiB write buffer, bad id at its very end */
    int32_t lens[2] = {150000, 150000}, zeros[2] = {0, 0};
    rp_batch *big;
    rp_batch_new(ctx, 2, lens, zeros, NULL, &big, NULL);
    make_view(&v, LAYOUT_PER_SEQ, big, 3, RP_ID_U8, L, K, E);
    poke(&v, big, 1, 149999, L - 1, K - 1, 200);
    rp_trace_writer_open(ctx, tmp("big.rpt"), E, &w, &err);
    rp_batch *small = make_batch(ctx, 0, 3);
    view sv;
    make_view(&sv, LAYOUT_PACKED, small, 0, RP_ID_U8, L, K, E);
    rp_trace_writer_append(w, 0, small, &sv.r, &err);
    int64_t before = file_size(tmp("big.rpt"));
    is_int(rp_trace_writer_append(w, 1, big, &v.r, &err), RP_ERANGE, "a 9.6 MB step with its last id bad");
    is_int(file_size(tmp("big.rpt")), before, "the chunks already written are truncated away");
    poke(&v, big, 1, 149999, L - 1, K - 1, 0);
    is_int(rp_trace_writer_append(w, 1, big, &v.r, &err), RP_OK, "the fixed step appends");
    is_int(rp_trace_writer_close(w, &err), RP_OK, "close");
    view_free(&v);
    view_free(&sv);
    t = NULL;
    ok(rp_trace_open(ctx, tmp("big.rpt"), 0, &t, &err) == RP_OK && rp_trace_num_steps(t) == 2,
       "the big trace opens with 2 steps");
    rp_trace_close(t);
    unlink(tmp("big.rpt"));
    rp_batch_free(big);
    rp_batch_free(small);

    /* appending to an existing trace */
    rp_trace_writer *aw;
    is_int(rp_trace_writer_open_append(ctx, path, 61, &aw, &err), RP_EINVAL, "append with another expert count");
    like(err.text, "the trace has 60 experts, not 61", "expert count message");
    is_int(rp_trace_writer_open_append(ctx, tmp("none.rpt"), 60, &aw, &err), RP_EIO, "append to a missing file");
    spit(tmp("junk.rpt"), "junk", 4);
    is_int(rp_trace_writer_open_append(ctx, tmp("junk.rpt"), 60, &aw, &err), RP_EFORMAT, "append to a non-trace");
    if (rp_trace_writer_open_append(ctx, path, 60, &aw, &err) == RP_OK) {
        int64_t size2 = file_size(path);
        make_view(&v, LAYOUT_PACKED, b, 12, RP_ID_U8, L, K + 1, E);
        is_int(rp_trace_writer_append(aw, 12, b, &v.r, &err), RP_EINVAL, "appended steps keep the trace's shape");
        is_int(file_size(path), size2, "the trace is unchanged");
        view_free(&v);
        make_view(&v, LAYOUT_PACKED, b, 12, RP_ID_U8, L, K, E);
        is_int(rp_trace_writer_append(aw, 12, b, &v.r, &err), RP_OK, "append a third step");
        view_free(&v);
        is_int(rp_trace_writer_close(aw, &err), RP_OK, "close the appending writer");
        t = NULL;
        ok(rp_trace_open(ctx, path, 0, &t, &err) == RP_OK && rp_trace_num_steps(t) == 3 &&
           rp_trace_step(t, 2)->step == 12, "the trace now has 3 steps");
        if (t) is_int(rp_trace_validate(t, &err), RP_OK, "and validates");
        rp_trace_close(t);
    } else {
        ok(0, "open for appending: %s", err.text);
    }

    /* write errors: a full disk, and a rollback that cannot truncate */
    if (access("/dev/full", W_OK) == 0 && rp_trace_writer_open(ctx, "/dev/full", E, &w, &err) == RP_OK) {
        make_view(&v, LAYOUT_PACKED, b, 0, RP_ID_U8, L, K, E);
        is_int(rp_trace_writer_append(w, 0, b, &v.r, &err), RP_EIO, "a full disk");
        like(err.text, "No space left on device", "write error message");
        like(err.text, "truncating the partial step away failed", "the failed rollback is reported");
        is_int(rp_trace_writer_append(w, 1, b, &v.r, &err), RP_EIO, "a broken writer refuses appends");
        is_int(rp_trace_writer_close(w, &err), RP_EIO, "and its close reports it");
        view_free(&v);
    } else {
        skip(5, "no /dev/full");
    }
    is_int(rp_trace_writer_open(ctx, tmpdir, E, &w, &err), RP_EIO, "a writer on a directory");
    is_int(rp_trace_writer_open(ctx, path, 0, &w, &err), RP_EINVAL, "a writer for 0 experts");
    is_int(rp_trace_writer_close(NULL, &err), RP_OK, "closing NULL");
    rp_batch_free(b);
}

/* ---- allocation failures ---- */

static void test_alloc_failures(rp_context *ctx)
{
    /* 20 steps: the step table grows twice */
    char path[512];
    snprintf(path, sizeof path, "%s", tmp("alloc.rpt"));
    write_trace(ctx, path, 20, 3, RP_ID_U8, 2, 2, 16);
    int cleanly = 1, opened = 0, failures = 0;
    for (long n = 1; n < 40; n++) {
        counting c = {0};
        rp_context *cc;
        rp_context_new(counting_alloc, &c, &cc);
        c.fail_at = n + 1;
        rp_trace *t = NULL;
        rp_error err;
        rp_status st = rp_trace_open(cc, path, 0, &t, &err);
        if (st == RP_OK) {
            opened++;
            cleanly &= rp_trace_num_steps(t) == 20;
            rp_batch *b = NULL;
            rp_routing r;
            st = rp_trace_read_step(t, 19, &b, &r, &err);
            cleanly &= st == RP_OK || (st == RP_ENOMEM && b == NULL);
            rp_batch_free(b);
            rp_trace_close(t);
        } else {
            failures++;
            cleanly &= st == RP_ENOMEM && t == NULL && strstr(err.text, "out of memory") != NULL;
        }
        rp_context_free(cc);
        cleanly &= c.live == 0;
    }
    ok(cleanly && opened > 0 && failures >= 4,
       "rp_trace_open and read_step fail cleanly with RP_ENOMEM at every allocation and leak nothing");

    cleanly = 1, opened = 0;
    for (long n = 1; n < 20; n++) {
        counting c = {0};
        rp_context *cc;
        rp_context_new(counting_alloc, &c, &cc);
        rp_batch *b = make_batch(cc, 0, 3);
        view v;
        make_view(&v, LAYOUT_PER_LAYER, b, 0, RP_ID_U8, 2, 2, 16);
        c.fail_at = c.calls + n;
        rp_trace_writer *w = NULL;
        rp_error err;
        rp_status st = rp_trace_writer_open(cc, tmp("walloc.rpt"), 16, &w, &err);
        if (st == RP_OK) {
            st = rp_trace_writer_append(w, 0, b, &v.r, &err);
            rp_trace_writer_close(w, NULL);
            if (st == RP_OK) opened++;
            else cleanly &= st == RP_ENOMEM && file_size(tmp("walloc.rpt")) == 0;
        } else {
            cleanly &= st == RP_ENOMEM;
        }
        view_free(&v);
        rp_batch_free(b);
        rp_context_free(cc);
        cleanly &= c.live == 0;
    }
    ok(cleanly && opened > 0, "the writer fails cleanly at every allocation and leaks nothing");
}

int main(void)
{
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "trace")) {
        printf("Bail out! mkdtemp failed\n");
        return 1;
    }
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    test_round_trip(ctx);
    test_layout_bytes(ctx);
    test_bad_files(ctx);
    test_writer(ctx);
    test_alloc_failures(ctx);
    rp_context_free(ctx);
    temp_dir_remove(tmpdir);
    return tap_done();
}
