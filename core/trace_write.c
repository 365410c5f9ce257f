/* Routing traces (.rpt): writing (streamed in chunks, checksummed, all or nothing per
 * step). The reader is core/trace.c; the format, byte by byte, is in docs/formats.md. */
#include "internal.h"
#include "routing_access.h"
#include "trace_format.h"
#include "routepack/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define WRITE_CHUNK ((size_t)4 << 20)  /* writer buffer */

struct rp_trace_writer {
    rp_context *ctx;
    char *path;
    int fd;
    int32_t num_experts;
    int64_t end;               /* file size: where the next block starts */
    int32_t num_steps;
    int32_t num_layers, top_k; /* of the trace's steps; 0 before the first */
    rp_id_width width;
    bool broken;               /* a failed rollback left a partial step behind */
    unsigned char *buf;        /* WRITE_CHUNK bytes, allocated at the first append */
};

/* Buffered, optionally hashed output at an explicit file position. */
typedef struct sink {
    rp_trace_writer *w;
    int64_t pos;   /* file position of buf[0] */
    size_t fill;
    bool hashing;  /* in the payload: hashed, and its progress reported */
    rp_hash_state hash;
    int64_t payload, payload_bytes; /* file position and size of the payload */
    int64_t reported;               /* payload bytes last reported, -1 before any */
    rp_error *err;
} sink;

/* Payload bytes written so far, through the context's progress hook. */
static void sink_progress(sink *s)
{
    if (!s->hashing || s->pos - s->payload == s->reported) return;
    s->reported = s->pos - s->payload;
    rp_progress(s->w->ctx, "writing", s->reported, s->payload_bytes);
}

static rp_status pwrite_all(rp_trace_writer *w, const void *data, size_t n, int64_t pos,
                            rp_error *err)
{
    const char *p = data;
    while (n > 0) {
        ssize_t got = pwrite(w->fd, p, n, (off_t)pos);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0)
            return rp_fail(err, RP_EIO, "write error at byte %" PRId64 ": %s", pos,
                           got < 0 ? strerror(errno) : "no progress");
        p += got;
        pos += got;
        n -= (size_t)got;
    }
    return RP_OK;
}

static rp_status sink_flush(sink *s)
{
    if (s->fill == 0) return RP_OK;
    if (s->hashing) rp_hash_update(&s->hash, s->w->buf, s->fill);
    rp_status st = pwrite_all(s->w, s->w->buf, s->fill, s->pos, s->err);
    s->pos += (int64_t)s->fill;
    s->fill = 0;
    if (st == RP_OK) sink_progress(s);
    return st;
}

static rp_status sink_put(sink *s, const void *data, size_t n)
{
    const unsigned char *p = data;
    while (n > 0) {
        size_t take = WRITE_CHUNK - s->fill < n ? WRITE_CHUNK - s->fill : n;
        if (p) memcpy(s->w->buf + s->fill, p, take), p += take;
        else memset(s->w->buf + s->fill, 0, take);
        s->fill += take;
        n -= take;
        if (s->fill == WRITE_CHUNK) {
            rp_status st = sink_flush(s);
            if (st != RP_OK) return st;
        }
    }
    return RP_OK;
}

/* Zero bytes up to the next multiple of ALIGN from `since` (a file position). */
static rp_status sink_pad(sink *s, int64_t since)
{
    int64_t at = s->pos + (int64_t)s->fill - since;
    return sink_put(s, NULL, (size_t)(trace_pad_to_align(at) - at));
}

/* Write caller memory without copying it into the buffer. */
static rp_status sink_direct(sink *s, const void *data, size_t n)
{
    rp_status st = sink_flush(s);
    if (st != RP_OK) return st;
    if (s->hashing) rp_hash_update(&s->hash, data, n);
    st = pwrite_all(s->w, data, n, s->pos, s->err);
    s->pos += (int64_t)n;
    if (st == RP_OK) sink_progress(s);
    return st;
}

/* "path: appending step K: <message of err>", keeping err's positions. */
static rp_status prefix_fail(rp_error *err, rp_status st, const rp_trace_writer *w, int64_t step)
{
    if (!err) return st;
    char msg[RP_ERROR_TEXT];
    snprintf(msg, sizeof msg, "%s", err->text);
    int64_t sequence = err->sequence, expert = err->expert, offset = err->offset;
    rp_fail(err, st, "%s: appending step %" PRId64 ": %s", w->path, step, msg);
    err->sequence = sequence, err->expert = expert, err->offset = offset;
    return st;
}

static rp_status bad_write_id(rp_error *err, int32_t seq, int64_t token, int32_t layer,
                              int64_t choice, int32_t id, int32_t num_experts)
{
    rp_fail(err, RP_ERANGE,
            "sequence %d token %" PRId64 " layer %d choice %" PRId64
            " has expert id %d, but the model has %d experts",
            seq, token, layer, choice, id, num_experts);
    if (err) err->sequence = seq, err->expert = id;
    return RP_ERANGE;
}

/* Ids of a contiguous run that is already in packed order (a dense packed array, or a
 * dense per-sequence array): checked and written in chunks straight from the caller's
 * memory. `first_token` is the run's first global token, for messages. */
static rp_status write_run(sink *s, const void *ids, int64_t count, const rp_routing *r,
                           const int64_t *cu, int32_t num_seqs, int64_t first_token)
{
    const size_t width = (size_t)r->width;
    const int64_t chunk = (int64_t)(WRITE_CHUNK / width);
    const int64_t per_token = (int64_t)r->num_layers * r->top_k;
    for (int64_t off = 0; off < count; off += chunk) {
        int64_t n = count - off < chunk ? count - off : chunk;
        const unsigned char *p = (const unsigned char *)ids + off * (int64_t)width;
        int64_t bad = trace_first_bad_id(p, r->width, n, (uint32_t)s->w->num_experts);
        if (bad >= 0) {
            int64_t index = off + bad, token = first_token + index / per_token;
            int64_t rest = index % per_token;
            int32_t seq = trace_seq_of_token(cu, num_seqs, token);
            return bad_write_id(s->err, seq, token - cu[seq], (int32_t)(rest / r->top_k),
                                rest % r->top_k, rp_id_load(p, r->width, bad), s->w->num_experts);
        }
        rp_status st = sink_direct(s, p, (size_t)n * width);
        if (st != RP_OK) return st;
    }
    return RP_OK;
}

/* Check, hash and write the gathered ids in the buffer; `*done` counts the ids of the
 * step written before them, to name the position of a bad one. */
static rp_status flush_gathered(sink *s, const rp_routing *r, const int64_t *cu, int32_t num_seqs,
                                int64_t *done)
{
    int64_t n = (int64_t)(s->fill / (size_t)r->width);
    int64_t bad = trace_first_bad_id(s->w->buf, r->width, n, (uint32_t)s->w->num_experts);
    if (bad >= 0) {
        int64_t per_token = (int64_t)r->num_layers * r->top_k, index = *done + bad;
        int64_t token = index / per_token, rest = index % per_token;
        int32_t seq = trace_seq_of_token(cu, num_seqs, token);
        return bad_write_id(s->err, seq, token - cu[seq], (int32_t)(rest / r->top_k),
                            rest % r->top_k, rp_id_load(s->w->buf, r->width, bad),
                            s->w->num_experts);
    }
    *done += n;
    return sink_flush(s);
}

/* Ids of any layout, gathered into the buffer in packed order: the k choices of one
 * (token, layer) are one copy when they are contiguous. Ids are checked a buffer at a
 * time, before the buffer is hashed and written. */
static rp_status write_gathered(sink *s, const rp_routing *r, const int64_t *cu,
                                int32_t num_seqs, const void **layer_at)
{
    const size_t width = (size_t)r->width;
    const size_t room_ids = WRITE_CHUNK / width;
    int64_t done = 0;
    rp_status st = sink_flush(s); /* the buffer then holds ids only */
    if (st != RP_OK) return st;
    for (int32_t q = 0; q < num_seqs; q++) {
        int64_t len = cu[q + 1] - cu[q];
        for (int32_t l = 0; l < r->num_layers; l++) layer_at[l] = rp_routing_at(r, cu, q, l);
        for (int64_t tok = 0; tok < len; tok++)
            for (int32_t l = 0; l < r->num_layers; l++) {
                const unsigned char *src = (const unsigned char *)layer_at[l] +
                                           tok * r->token_stride * (int64_t)width;
                for (int32_t j = 0; j < r->top_k;) {
                    size_t free_ids = room_ids - s->fill / width;
                    if (free_ids == 0) {
                        if ((st = flush_gathered(s, r, cu, num_seqs, &done)) != RP_OK) return st;
                        free_ids = room_ids;
                    }
                    size_t take = (size_t)(r->top_k - j) < free_ids ? (size_t)(r->top_k - j) : free_ids;
                    unsigned char *dst = s->w->buf + s->fill;
                    if (r->k_stride == 1) {
                        memcpy(dst, src + (size_t)j * width, take * width);
                    } else {
                        for (size_t x = 0; x < take; x++) {
                            const unsigned char *from = src + (j + (int64_t)x) * r->k_stride * (int64_t)width;
                            switch (width) {
                            case 1: dst[x] = *from; break;
                            case 2: memcpy(dst + 2 * x, from, 2); break;
                            default: memcpy(dst + 4 * x, from, 4); break;
                            }
                        }
                    }
                    s->fill += take * width;
                    j += (int32_t)take;
                }
            }
    }
    return flush_gathered(s, r, cu, num_seqs, &done);
}

static bool dense_strides(const rp_routing *r)
{
    return r->k_stride == 1 && r->layer_stride == r->top_k &&
           r->token_stride == (int64_t)r->num_layers * r->top_k;
}

static rp_status write_ids(sink *s, const rp_routing *r, const rp_batch *batch,
                           const void **layer_at)
{
    const int64_t *cu = rp_batch_cu_seqlens(batch);
    int32_t num_seqs = rp_batch_num_seqs(batch);
    int64_t per_token = (int64_t)r->num_layers * r->top_k;
    if (r->layout == RP_ROUTING_PACKED && dense_strides(r))
        return write_run(s, r->base, cu[num_seqs] * per_token, r, cu, num_seqs, 0);
    if (r->layout == RP_ROUTING_PER_SEQ && dense_strides(r)) {
        for (int32_t q = 0; q < num_seqs; q++) {
            rp_status st = write_run(s, r->bases[q], (cu[q + 1] - cu[q]) * per_token, r, cu,
                                     num_seqs, cu[q]);
            if (st != RP_OK) return st;
        }
        return RP_OK;
    }
    return write_gathered(s, r, cu, num_seqs, layer_at);
}

/* The writer without its file (allocated first: an allocation failure must not leave
 * a new, empty file behind). */
static rp_trace_writer *writer_new(rp_context *ctx, const char *path, int32_t num_experts)
{
    rp_trace_writer *w = rp_calloc(ctx, 1, sizeof *w);
    if (!w || !(w->path = rp_strdup(ctx, path))) {
        rp_free(ctx, w);
        return NULL;
    }
    w->ctx = ctx;
    w->fd = -1;
    w->num_experts = num_experts;
    return w;
}

static void writer_free(rp_trace_writer *w)
{
    rp_context *ctx = w->ctx;
    rp_free(ctx, w->buf);
    rp_free(ctx, w->path);
    rp_free(ctx, w);
}

rp_status rp_trace_writer_open(rp_context *ctx, const char *path, int32_t num_experts,
                               rp_trace_writer **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "trace writer: NULL argument");
    if (num_experts < 1)
        return rp_fail(err, RP_EINVAL, "%s: %d experts, must be >= 1", path, num_experts);
    rp_trace_writer *w = writer_new(ctx, path, num_experts);
    if (!w) return rp_fail_nomem(err, "a trace writer");
    w->fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (w->fd < 0) {
        rp_status st = rp_fail(err, RP_EIO, "%s: cannot create: %s", path, strerror(errno));
        writer_free(w);
        return st;
    }
    *out = w;
    return RP_OK;
}

rp_status rp_trace_writer_open_append(rp_context *ctx, const char *path, int32_t num_experts,
                                      rp_trace_writer **out, rp_error *err)
{
    if (!ctx || !path || !out) return rp_fail(err, RP_EINVAL, "trace writer: NULL argument");
    rp_trace *t = NULL;
    rp_trace_writer *w = NULL;
    rp_status st = rp_trace_open(ctx, path, RP_TRACE_NO_VERIFY, &t, err);
    if (st != RP_OK) return st;
    const rp_trace_step_info *first = &t->steps[0];
    int64_t size = (int64_t)t->map_bytes;
    struct stat sb;
    if (first->num_experts != num_experts) {
        st = rp_fail(err, RP_EINVAL, "%s: the trace has %d experts, not %d", path,
                     first->num_experts, num_experts);
    } else if (!(w = writer_new(ctx, path, num_experts))) {
        st = rp_fail_nomem(err, "a trace writer");
    } else if ((st = rp_file_open_regular(path, O_WRONLY, &w->fd, NULL, err)) != RP_OK) {
        w->fd = -1; /* replaced by a FIFO or device since it was read: refused, never blocks */
    } else if (fstat(w->fd, &sb) != 0 || sb.st_size != size) {
        st = rp_fail(err, RP_EIO, "%s: the file changed while it was opened for appending", path);
    } else {
        w->end = size;
        w->num_steps = t->num_steps;
        w->num_layers = first->num_layers;
        w->top_k = first->top_k;
        w->width = first->width;
        *out = w;
        w = NULL;
    }
    if (w) {
        if (w->fd >= 0) close(w->fd);
        writer_free(w);
    }
    rp_trace_close(t);
    return st;
}

/* The header text of a step, with a placeholder checksum, into buf (NUL-terminated);
 * its length, or 0 when jansson ran out of memory or the text does not fit. */
static size_t header_text(char *buf, size_t size, int64_t step, int32_t num_seqs,
                          int64_t num_tokens, const rp_routing *r, int32_t num_experts,
                          int64_t payload_bytes)
{
    json_t *h = json_object();
    if (!h) return 0;
    int bad = 0;
    bad |= json_object_set_new(h, "format", json_string("routepack-trace"));
    bad |= json_object_set_new(h, "version", json_integer(RP_TRACE_VERSION));
    bad |= json_object_set_new(h, "step", json_integer(step));
    bad |= json_object_set_new(h, "num_seqs", json_integer(num_seqs));
    bad |= json_object_set_new(h, "num_tokens", json_integer(num_tokens));
    bad |= json_object_set_new(h, "num_layers", json_integer(r->num_layers));
    bad |= json_object_set_new(h, "num_experts", json_integer(num_experts));
    bad |= json_object_set_new(h, "top_k", json_integer(r->top_k));
    bad |= json_object_set_new(h, "id_width", json_integer((int)r->width));
    bad |= json_object_set_new(h, "payload_bytes", json_integer(payload_bytes));
    bad |= json_object_set_new(h, "checksum", json_string("0000000000000000"));
    size_t n = bad ? 0 : json_dumpb(h, buf, size - 1, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (n == 0 || n >= size) return 0;
    buf[n] = '\0';
    return n;
}

rp_status rp_trace_writer_append(rp_trace_writer *w, int64_t step, const rp_batch *batch,
                                 const rp_routing *routing, rp_error *err)
{
    if (!w || !batch || !routing) return rp_fail(err, RP_EINVAL, "trace writer: NULL argument");
    if (w->broken)
        return rp_fail(err, RP_EIO, "%s: an earlier failed append could not be undone; the "
                       "file is not a valid trace", w->path);
    rp_status st = RP_OK;
    char header[1024];
    const void **layer_at = NULL;
    int64_t start = w->end;
    sink s = {.w = w, .pos = start, .err = err, .reported = -1};

    if (step < 0) return rp_fail(err, RP_EINVAL, "%s: step index %" PRId64 " is negative", w->path, step);
    st = rp_routing_check_shape(routing, batch, w->num_experts, err);
    if (st != RP_OK) return prefix_fail(err, st, w, step);
    if (w->num_experts > rp_id_width_capacity(routing->width))
        return rp_fail(err, RP_EINVAL, "%s: appending step %" PRId64 ": %d-byte ids cannot hold "
                       "the trace's %d experts (at most %" PRId64 ")", w->path, step,
                       (int)routing->width, w->num_experts, rp_id_width_capacity(routing->width));
    if (w->num_layers &&
        (routing->num_layers != w->num_layers || routing->top_k != w->top_k || routing->width != w->width))
        return rp_fail(err, RP_EINVAL, "%s: appending step %" PRId64 ": shape %d layers, top-%d, "
                       "%d-byte ids differs from the trace's %d layers, top-%d, %d-byte ids",
                       w->path, step, routing->num_layers, routing->top_k, (int)routing->width,
                       w->num_layers, w->top_k, (int)w->width);
    int32_t num_seqs = rp_batch_num_seqs(batch);
    int64_t num_tokens = rp_batch_num_tokens(batch);
    layout lay;
    if (!trace_compute_layout(num_seqs, num_tokens, routing->num_layers, routing->top_k,
                        routing->width, &lay))
        return rp_fail(err, RP_ERANGE, "%s: appending step %" PRId64 ": %" PRId64 " tokens x %d "
                       "layers x top-%d x %d-byte ids overflow 64 bits", w->path, step, num_tokens,
                       routing->num_layers, routing->top_k, (int)routing->width);
    if (!w->buf && !(w->buf = rp_alloc(w->ctx, WRITE_CHUNK)))
        return rp_fail_nomem(err, "the trace writer's buffer");
    if (!(layer_at = rp_alloc(w->ctx, (size_t)routing->num_layers * sizeof *layer_at)))
        return rp_fail_nomem(err, "the trace writer's layer table");
    size_t header_bytes = header_text(header, sizeof header, step, num_seqs, num_tokens, routing,
                                      w->num_experts, lay.payload_bytes);
    if (header_bytes == 0) {
        st = rp_fail_nomem(err, "a trace header");
        goto out;
    }
    const char *placeholder = strstr(header, "\"checksum\":\"0000000000000000\"");
    int64_t checksum_at = start + PREFIX_BYTES + (placeholder - header) + 12;
    /* from here on the file changes: any failure truncates it back to `start` */
    unsigned char prefix[PREFIX_BYTES] = {0};
    uint32_t hb = (uint32_t)header_bytes;
    memcpy(prefix, TRACE_MAGIC, sizeof TRACE_MAGIC);
    memcpy(prefix + 8, &hb, 4);
    RP_CHECK_GOTO(sink_put(&s, prefix, sizeof prefix), st, rollback);
    RP_CHECK_GOTO(sink_put(&s, header, header_bytes), st, rollback);
    RP_CHECK_GOTO(sink_pad(&s, start), st, rollback);
    RP_CHECK_GOTO(sink_flush(&s), st, rollback);
    s.hashing = true;
    rp_hash_init(&s.hash, 0);
    int64_t payload = s.pos;
    s.payload = payload;
    s.payload_bytes = lay.payload_bytes;
    const int32_t *arrays[3] = {rp_batch_prompt_lens(batch), rp_batch_response_lens(batch),
                                rp_batch_group_ids(batch)};
    for (int a = 0; a < 3; a++) {
        RP_CHECK_GOTO(sink_put(&s, arrays[a], (size_t)num_seqs * 4), st, rollback);
        RP_CHECK_GOTO(sink_pad(&s, payload), st, rollback);
    }
    RP_CHECK_GOTO(write_ids(&s, routing, batch, layer_at), st, rollback);
    RP_CHECK_GOTO(sink_pad(&s, payload), st, rollback);
    RP_CHECK_GOTO(sink_flush(&s), st, rollback);
    char hex[CHECKSUM_DIGITS + 1];
    snprintf(hex, sizeof hex, "%016" PRIx64, rp_hash_final(&s.hash));
    RP_CHECK_GOTO(pwrite_all(w, hex, CHECKSUM_DIGITS, checksum_at, err), st, rollback);
    sink_progress(&s); /* done == total, also for an empty payload */
    w->end = s.pos;
    w->num_steps++;
    w->num_layers = routing->num_layers;
    w->top_k = routing->top_k;
    w->width = routing->width;
    goto out;
rollback:
    prefix_fail(err, st, w, step);
    while (ftruncate(w->fd, (off_t)start) != 0) {
        if (errno == EINTR) continue;
        w->broken = true;
        if (err)
            snprintf(err->text + strlen(err->text), sizeof err->text - strlen(err->text),
                     "; and truncating the partial step away failed: %s", strerror(errno));
        break;
    }
out:
    rp_free(w->ctx, layer_at);
    return st;
}

rp_status rp_trace_writer_close(rp_trace_writer *w, rp_error *err)
{
    if (!w) return RP_OK;
    rp_status st = RP_OK;
    if (close(w->fd) != 0) st = rp_fail(err, RP_EIO, "%s: close failed: %s", w->path, strerror(errno));
    else if (w->broken)
        st = rp_fail(err, RP_EIO, "%s: an earlier failed append could not be undone; the file "
                     "is not a valid trace", w->path);
    writer_free(w);
    return st;
}
