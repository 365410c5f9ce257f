/* Moving one round of a migration into staging: the headers (each copy's identity and
 * source checksum, and the header's own checksum), the transfers, and the header checks
 * at the destination. The experts themselves are checked once, as the commit writes them
 * into their slots (migrate_commit.c), against the source checksums the headers carry. */
#include "migrate_internal.h"

#include <inttypes.h>

#define HEADER_MAGIC 0x52504d4947484452ULL /* "RPMIGHDR" */
/* A header, one per (sender, receiver) pair and round: HEADER_WORDS words (magic, plan
 * hash, call, round, source GPU, destination GPU, copies), then per copy HEADER_COPY
 * words (layer << 32 | expert, version, checksum), then the header's own checksum
 * (rp_hash of every word before it), so that a damaged header is told apart from a
 * damaged expert. */
#define HEADER_WORDS 7
#define HEADER_COPY 3
#define HEADER_SEED 0x686561646572ULL /* "header" */

/* Ops of one round, with what each op carries (for naming a failure). */
typedef struct round_ops {
    rp_transport_op *ops;
    int64_t *op_transfer;   /* transfer index, -1 for a header */
    int32_t n, cap;
    uint64_t *send_hdr, *recv_hdr;  /* host copies of the headers, concatenated */
    unsigned char *hdr_mem;         /* transport memory for all headers of the round */
    int64_t hdr_words_send, hdr_words_recv;
} round_ops;

static bool push_op(exec *x, round_ops *ro, rp_transport_op op, int64_t transfer)
{
    if (ro->n == ro->cap) {
        int32_t cap = ro->cap ? ro->cap * 2 : 64;
        rp_transport_op *o = rp_realloc(x->ctx, ro->ops, (size_t)cap * sizeof *o);
        if (!o) return false;
        ro->ops = o;
        int64_t *ot = rp_realloc(x->ctx, ro->op_transfer, (size_t)cap * sizeof *ot);
        if (!ot) return false;
        ro->op_transfer = ot;
        ro->cap = cap;
    }
    ro->ops[ro->n] = op;
    ro->op_transfer[ro->n] = transfer;
    ro->n++;
    return true;
}

static int32_t msg_tag(const exec *x, int32_t round, int64_t index)
{
    return (int32_t)((x->call * 4099u + (uint64_t)round * 257u + (uint64_t)index) & 0x7fff);
}

/* The data messages of one transfer: each tensor of the expert, split into pieces the
 * transport can carry; a send reads the tensors of `slot`, a receive writes staging
 * laid out like them. */
static bool push_data(exec *x, round_ops *ro, int64_t transfer, int32_t peer_rank, bool send, int32_t slot,
                      int32_t round, int64_t *index)
{
    const rp_migration_transfer *tr = &x->tr[transfer];
    int32_t count = 0;
    const rp_tensor *ts = rp_registry_tensors(x->reg, tr->layer, slot, &count);
    size_t off = 0;
    for (int32_t i = 0; i < count; i++)
        for (size_t done = 0; done < ts[i].bytes;) {
            size_t n = ts[i].bytes - done;
            if (n > x->t->max_message_bytes) n = x->t->max_message_bytes;
            void *buf = send ? (unsigned char *)ts[i].data + done
                             : x->staging + x->w.stage_off[transfer] + off + done;
            rp_transport_op op = {peer_rank, msg_tag(x, round, (*index)++), send, true, buf, n};
            if (!push_op(x, ro, op, transfer)) return false;
            done += n;
            if (done == ts[i].bytes) off += ts[i].bytes;
        }
    return true;
}

static void round_ops_free(exec *x, round_ops *ro, bool keep_memory)
{
    rp_free(x->ctx, ro->ops);
    rp_free(x->ctx, ro->op_transfer);
    rp_free(x->ctx, ro->send_hdr);
    rp_free(x->ctx, ro->recv_hdr);
    if (ro->hdr_mem && !keep_memory) x->t->vt->free(x->t, ro->hdr_mem);
    memset(ro, 0, sizeof *ro);
}

/* Name the transfer behind a failed op in this rank's record. */
static void note_op(exec *x, round_ops *ro, int32_t round, int32_t failed, rp_status st, const rp_error *e,
                    const int64_t *first_from, const int64_t *first_to)
{
    if (failed < 0 || failed >= ro->n) {
        note(&x->mine, st, round, -1, -1, -1, "round %d: %s", round, inner(e));
        return;
    }
    const rp_transport_op *op = &ro->ops[failed];
    int64_t tr_i = ro->op_transfer[failed];
    int32_t peer_gpu = x->base + op->peer;
    if (tr_i < 0) tr_i = (op->send ? first_to : first_from)[op->peer]; /* a header: the pair's first copy */
    const rp_migration_transfer *tr = tr_i >= 0 ? &x->tr[tr_i] : NULL;
    if (!tr) {
        note(&x->mine, st, round, -1, -1, peer_gpu, "round %d, %s rank %d: %s", round, op->send ? "to" : "from",
             op->peer, inner(e));
        return;
    }
    note(&x->mine, st, round, tr->layer, tr->expert, peer_gpu, "layer %d expert %d %s rank %d: %s", tr->layer,
         tr->expert, op->send ? "to" : "from", op->peer, inner(e));
}

static uint64_t hash_words(const void *data, size_t bytes, uint64_t seed)
{
    rp_hash_state st;
    rp_hash_init(&st, seed);
    rp_hash_update(&st, data, bytes);
    return rp_hash_final(&st);
}

/* Words of the header for `copies` copies (0: no header). */
static int64_t header_words(int64_t copies)
{
    return copies ? HEADER_WORDS + HEADER_COPY * copies + 1 : 0;
}

/* Check the header from transport rank `p`: its own checksum first (a damaged header
 * is not a damaged expert), then that it is a header of this call and round between
 * these ranks, then that each copy it announces is the expert the plan sends, at the
 * agreed version. Failures go into x->mine. */
static bool check_header(exec *x, int32_t round, int32_t p, const uint64_t *h, int64_t count, int64_t first_transfer)
{
    const rp_migration_transfer *first = &x->tr[first_transfer];
    const int32_t src = x->base + p;
    const int64_t n = header_words(count) - 1;
    uint64_t sum = hash_words(h, (size_t)n * 8, HEADER_SEED);
    if (sum != h[n]) {
        note(&x->mine, RP_ETRANSPORT, round, first->layer, -1, src, "round %d: the header from rank %d is corrupt "
             "(header checksum 0x%016" PRIx64 " computed, 0x%016" PRIx64 " sent); no expert was checked", round, p,
             sum, h[n]);
        return false;
    }
    if (h[0] != HEADER_MAGIC) {
        note(&x->mine, RP_ETRANSPORT, round, first->layer, -1, src, "round %d: the message from rank %d where its "
             "header belongs is not a migration header", round, p);
        return false;
    }
    if (h[2] != x->call) {
        note(&x->mine, RP_ETRANSPORT, round, first->layer, -1, src, "round %d: the header from rank %d belongs to "
             "migration call %" PRIu64 ", and this is call %" PRIu64 ": a late message of an earlier call, refused",
             round, p, h[2], x->call);
        return false;
    }
    if (h[1] != rp_migration_plan_hash(x->mp) || h[3] != (uint64_t)round || h[4] != (uint64_t)src ||
        h[5] != (uint64_t)x->gpu || h[6] != (uint64_t)count) {
        note(&x->mine, RP_ETRANSPORT, round, first->layer, first->expert, src, "layer %d expert %d from rank %d: the "
             "header from rank %d is not for this round", first->layer, first->expert, p, p);
        return false;
    }
    int64_t i = 0;
    for (int64_t k = x->w.round_recv[round]; k < x->w.round_recv[round + 1]; k++) {
        const rp_migration_transfer *tr = &x->tr[x->w.recv[k]];
        if (tr->src_gpu != src) continue;
        const uint64_t *c = h + HEADER_WORDS + HEADER_COPY * i++;
        int32_t layer = (int32_t)(uint32_t)(c[0] >> 32), expert = (int32_t)(uint32_t)c[0];
        if (layer != tr->layer || expert != tr->expert) {
            note(&x->mine, RP_EPLAN, round, tr->layer, tr->expert, src, "layer %d expert %d from rank %d: rank %d "
                 "sent layer %d's expert %d (its slot's identity)", tr->layer, tr->expert, p, p, layer, expert);
            return false;
        }
        if (c[1] != x->version) {
            note(&x->mine, RP_EPLAN, round, tr->layer, tr->expert, src, "layer %d expert %d from rank %d: it is at "
                 "version %" PRIu64 ", but the agreed version is %" PRIu64, tr->layer, tr->expert, p, c[1],
                 x->version);
            return false;
        }
    }
    return true;
}

/* Fault injection (tests): staged bytes change after they arrived, before the commit.
 * The transfer it hits: the round's first copy inside this GPU, else its first receive. */
static int64_t staged_fault_target(exec *x, int32_t round)
{
    const rank_work *w = &x->w;
    const int64_t num_local = w->round_local[round + 1] - w->round_local[round];
    const int64_t num_recv = w->round_recv[round + 1] - w->round_recv[round];
    if (rp_transport_fault_at(x->t, RP_FAULT_SITE_STAGED, NULL) != RP_FAULT_CORRUPT_STAGING || num_local + num_recv == 0)
        return -1;
    return num_local > 0 ? w->local[w->round_local[round]] : w->recv[w->round_recv[round]];
}

static void corrupt_staged(exec *x, int64_t i, double deadline)
{
    rp_transport *t = x->t;
    rp_error e;
    unsigned char *byte = x->staging + x->w.stage_off[i] + x->tr[i].bytes / 2, v = 0;
    if (t->vt->to_host(t, &v, byte, 1, deadline, &e) == RP_OK) {
        v ^= 0xff;
        t->vt->from_host(t, byte, &v, 1, deadline, &e);
    }
}

/* Wait for this round's sends that read `layer`'s slot `slot`, before it is written. */
static rp_status wait_sends_from(exec *x, const round_ops *ro, int32_t layer, int32_t slot, double deadline,
                                 int32_t *failed, rp_error *e)
{
    for (int32_t j = 0; j < ro->n; j++) {
        if (!ro->ops[j].send || ro->op_transfer[j] < 0) continue;
        const rp_migration_transfer *tr = &x->tr[ro->op_transfer[j]];
        if (tr->layer != layer || tr->src_slot != slot) continue;
        rp_status st = x->t->vt->wait_op(x->t, j, deadline, failed, e);
        if (st != RP_OK) return st;
    }
    return RP_OK;
}

/* Commit transfer i (migrate_commit_transfer) once the sends of this round that read
 * any slot it writes are done; the staged-corruption fault hits it first where it is the
 * target. Returns false when a wait failed (noted). */
static bool commit_when_sources_sent(exec *x, round_ops *ro, int32_t round, int64_t i, int64_t corrupt,
                                     double deadline, const int64_t *recv_first, const int64_t *send_first)
{
    const rank_work *w = &x->w;
    rp_error e;
    rp_error_clear(&e);
    int32_t failed = -1;
    for (int64_t k = w->round_writes[round]; k < w->round_writes[round + 1]; k++) {
        const rp_migration_write *wr = &x->wr[w->writes[k]];
        if (wr->transfer != i) continue;
        if (wait_sends_from(x, ro, wr->layer, wr->slot, deadline, &failed, &e) != RP_OK) {
            note_op(x, ro, round, failed, e.status, &e, recv_first, send_first);
            return false;
        }
    }
    if (i == corrupt) corrupt_staged(x, i, deadline);
    migrate_commit_transfer(x, round, i, deadline);
    return true;
}

/* Each received transfer's source checksum (want_sum), from its peer's header in
 * ro->recv_hdr, whose copies come in the order this rank posted their receives; cursor
 * [P] is scratch. */
static void read_want_sums(exec *x, const round_ops *ro, int32_t round, const int64_t *recv_hoff, int64_t *cursor)
{
    const rank_work *w = &x->w;
    memset(cursor, 0, (size_t)x->t->size * sizeof *cursor);
    for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++) {
        int32_t p = x->tr[w->recv[k]].src_gpu - x->base;
        w->want_sum[w->recv[k]] = ro->recv_hdr[recv_hoff[p] + HEADER_WORDS + HEADER_COPY * cursor[p]++ + 2];
    }
}

/* The commit as the round's experts arrive (t->wait_each: host memory, single ops
 * waited on): each header as it arrives, checked; then each received transfer as its
 * messages complete, written into its slots and checked there (migrate_commit_transfer)
 * while later ones are still on the way, once the sends that read those slots are done;
 * then the copies inside this GPU. A header or a slot that fails its check stops the
 * commits (noted in x->mine), and the caller still waits for the whole batch, so that
 * no peer waits for a rank that left. cursor [P] is scratch. Returns false when a wait
 * failed (noted). */
static bool commit_as_arrived(exec *x, round_ops *ro, int32_t round, double deadline, const int64_t *recv_count,
                              const int64_t *recv_hoff, const int64_t *recv_first, const int64_t *send_first,
                              int64_t *cursor)
{
    rank_work *w = &x->w;
    rp_transport *t = x->t;
    rp_error e;
    rp_error_clear(&e);
    int32_t failed = -1;
    for (int32_t j = 0; j < ro->n; j++) { /* the headers */
        if (ro->ops[j].send || ro->op_transfer[j] >= 0) continue;
        int32_t p = ro->ops[j].peer;
        if (t->vt->wait_op(t, j, deadline, &failed, &e) != RP_OK) {
            note_op(x, ro, round, failed, e.status, &e, recv_first, send_first);
            return false;
        }
        uint64_t *h = ro->recv_hdr + recv_hoff[p];
        if (t->vt->to_host(t, h, ro->ops[j].buf, ro->ops[j].bytes, deadline, &e) != RP_OK) {
            note(&x->mine, e.status, round, -1, -1, -1, "round %d: reading the header from rank %d: %s", round, p,
                 inner(&e));
            return true;
        }
        if (!check_header(x, round, p, h, recv_count[p], recv_first[p])) return true;
    }
    read_want_sums(x, ro, round, recv_hoff, cursor);
    const int64_t corrupt = staged_fault_target(x, round);
    /* Each received transfer once its last message is in, in the order they were posted. */
    for (int32_t j = 0; j < ro->n; j++) {
        int64_t i = ro->op_transfer[j];
        if (ro->ops[j].send || i < 0) continue;
        if (t->vt->wait_op(t, j, deadline, &failed, &e) != RP_OK) {
            note_op(x, ro, round, failed, e.status, &e, recv_first, send_first);
            return false;
        }
        if (j + 1 < ro->n && ro->op_transfer[j + 1] == i && !ro->ops[j + 1].send) continue; /* more of it */
        if (x->mine.status != RP_OK) continue; /* a failed check stops the commits; the batch still drains */
        if (!commit_when_sources_sent(x, ro, round, i, corrupt, deadline, recv_first, send_first)) return false;
    }
    for (int64_t k = w->round_local[round]; k < w->round_local[round + 1] && x->mine.status == RP_OK; k++)
        if (!commit_when_sources_sent(x, ro, round, w->local[k], corrupt, deadline, recv_first, send_first))
            return false;
    return true;
}

/* Move one round into staging and check its headers; failures go into x->mine. Where
 * the transport waits for single ops (t->wait_each) it also commits the round, each
 * expert as it arrives (x->committed). */
void migrate_run_round(exec *x, int32_t round, double deadline)
{
    const rank_work *w = &x->w;
    rp_transport *t = x->t;
    const int32_t P = t->size;
    round_ops ro = {0};
    sum_batch src_sums = {0};
    rp_error e;
    rp_error_clear(&e);
    x->committed = false;
    int64_t *send_count = rp_calloc(x->ctx, (size_t)P, sizeof(int64_t));
    int64_t *recv_count = rp_calloc(x->ctx, (size_t)P, sizeof(int64_t));
    int64_t *send_first = rp_alloc(x->ctx, (size_t)P * sizeof(int64_t));
    int64_t *recv_first = rp_alloc(x->ctx, (size_t)P * sizeof(int64_t));
    int64_t *send_hoff = rp_calloc(x->ctx, (size_t)P + 1, sizeof(int64_t)); /* header word offsets */
    int64_t *recv_hoff = rp_calloc(x->ctx, (size_t)P + 1, sizeof(int64_t));
    int64_t *msg_index = rp_calloc(x->ctx, (size_t)P, sizeof(int64_t));
    if (!send_count || !recv_count || !send_first || !recv_first || !send_hoff || !recv_hoff || !msg_index) {
        note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's message lists", round);
        goto out;
    }
    for (int32_t p = 0; p < P; p++) send_first[p] = recv_first[p] = -1;
    for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++) {
        int32_t p = x->tr[w->send[k]].dst_gpu - x->base;
        if (send_first[p] < 0) send_first[p] = w->send[k];
        send_count[p]++;
    }
    for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++) {
        int32_t p = x->tr[w->recv[k]].src_gpu - x->base;
        if (recv_first[p] < 0) recv_first[p] = w->recv[k];
        recv_count[p]++;
    }
    for (int32_t p = 0; p < P; p++) {
        send_hoff[p + 1] = send_hoff[p] + header_words(send_count[p]);
        recv_hoff[p + 1] = recv_hoff[p] + header_words(recv_count[p]);
    }
    ro.hdr_words_send = send_hoff[P];
    ro.hdr_words_recv = recv_hoff[P];
    int64_t hdr_words = ro.hdr_words_send + ro.hdr_words_recv;
    ro.send_hdr = rp_alloc(x->ctx, (size_t)(ro.hdr_words_send + 1) * 8);
    ro.recv_hdr = rp_alloc(x->ctx, (size_t)(ro.hdr_words_recv + 1) * 8);
    if (hdr_words > 0) ro.hdr_mem = t->vt->alloc(t, (size_t)hdr_words * 8);
    if (!ro.send_hdr || !ro.recv_hdr || (hdr_words > 0 && !ro.hdr_mem)) {
        note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's headers", round);
        goto out;
    }

    /* Checksums at the source, from the live slots, into each peer's header. */
    for (int32_t p = 0; p < P; p++) {
        if (!send_count[p]) continue;
        uint64_t *h = ro.send_hdr + send_hoff[p];
        h[0] = HEADER_MAGIC;
        h[1] = rp_migration_plan_hash(x->mp);
        h[2] = x->call;
        h[3] = (uint64_t)round;
        h[4] = (uint64_t)x->gpu;
        h[5] = (uint64_t)(x->base + p);
        h[6] = (uint64_t)send_count[p];
    }
    /* One batch: every expert this rank sends, then the slot of every copy inside it
     * (what the commit compares the slots it writes with). */
    const int64_t num_send = w->round_send[round + 1] - w->round_send[round];
    const int64_t num_local = w->round_local[round + 1] - w->round_local[round];
    {
        int64_t parts = 0;
        int32_t count = 0;
        for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++) {
            rp_registry_tensors(x->reg, x->tr[w->send[k]].layer, x->tr[w->send[k]].src_slot, &count);
            parts += count;
        }
        for (int64_t k = w->round_local[round]; k < w->round_local[round + 1]; k++) {
            rp_registry_tensors(x->reg, x->tr[w->local[k]].layer, x->tr[w->local[k]].src_slot, &count);
            parts += count;
        }
        if (!batch_alloc(x, &src_sums, num_send + num_local, parts)) {
            note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's checksum lists", round);
            goto out;
        }
    }
    for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++)
        batch_add_slot(x, &src_sums, x->tr[w->send[k]].layer, x->tr[w->send[k]].src_slot);
    for (int64_t k = w->round_local[round]; k < w->round_local[round + 1]; k++)
        batch_add_slot(x, &src_sums, x->tr[w->local[k]].layer, x->tr[w->local[k]].src_slot);
    if (batch_run(x, &src_sums, deadline, &e) != RP_OK) {
        const rp_migration_transfer *tr = &x->tr[num_send > 0 ? w->send[w->round_send[round]]
                                                              : w->local[w->round_local[round]]];
        note(&x->mine, e.status, round, tr->layer, tr->expert, -1, "round %d: checksumming the %d experts of "
             "this rank's slots to send or copy failed (layer %d expert %d is the first): %s", round, src_sums.n,
             tr->layer, tr->expert, inner(&e));
        goto out;
    }
    {
        int64_t *fill = msg_index; /* reuse as per-peer checksum cursor, reset below */
        for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++) {
            int32_t p = x->tr[w->send[k]].dst_gpu - x->base;
            const rp_migration_transfer *tr = &x->tr[w->send[k]];
            rp_slot_identity id;
            rp_registry_identity(x->reg, tr->layer, tr->src_slot, &id, NULL);
            uint64_t *c = ro.send_hdr + send_hoff[p] + HEADER_WORDS + HEADER_COPY * fill[p]++;
            c[0] = (uint64_t)(uint32_t)id.layer << 32 | (uint32_t)id.expert;
            c[1] = id.version;
            c[2] = src_sums.sums[k - w->round_send[round]];
        }
        for (int32_t p = 0; p < P; p++)
            if (send_count[p]) {
                uint64_t *h = ro.send_hdr + send_hoff[p];
                int64_t n = header_words(send_count[p]) - 1;
                h[n] = hash_words(h, (size_t)n * 8, HEADER_SEED);
            }
        memset(msg_index, 0, (size_t)P * sizeof(int64_t));
    }
    for (int64_t j = 0; j < num_local; j++) /* what a copy inside this GPU must stage */
        w->want_sum[w->local[w->round_local[round] + j]] = src_sums.sums[num_send + j];

    /* Receives first, so that a wait that fails names what was not received. */
    for (int32_t p = 0; p < P; p++) {
        if (!recv_count[p]) continue;
        unsigned char *hbuf = ro.hdr_mem + (size_t)(ro.hdr_words_send + recv_hoff[p]) * 8;
        rp_transport_op op = {p, msg_tag(x, round, msg_index[p]++), false, false, hbuf,
                              (size_t)header_words(recv_count[p]) * 8};
        if (!push_op(x, &ro, op, -1)) goto nomem;
        for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++) {
            const rp_migration_transfer *tr = &x->tr[w->recv[k]];
            if (tr->src_gpu - x->base != p) continue;
            /* The receiving side lays the expert out as its own slots do (same layout
             * on every rank, agreed before moving): use any local slot's tensors. */
            if (!push_data(x, &ro, w->recv[k], p, false, 0, round, &msg_index[p])) goto nomem;
        }
    }
    memset(msg_index, 0, (size_t)P * sizeof(int64_t));
    for (int32_t p = 0; p < P; p++) {
        if (!send_count[p]) continue;
        unsigned char *hbuf = ro.hdr_mem + (size_t)send_hoff[p] * 8;
        if (t->vt->from_host(t, hbuf, ro.send_hdr + send_hoff[p], (size_t)header_words(send_count[p]) * 8,
                             deadline, &e) != RP_OK) {
            note(&x->mine, e.status, round, -1, -1, x->base + p, "round %d: preparing the header for rank %d: %s",
                 round, p, inner(&e));
            goto out;
        }
        rp_transport_op op = {p, msg_tag(x, round, msg_index[p]++), true, false, hbuf,
                              (size_t)header_words(send_count[p]) * 8};
        if (!push_op(x, &ro, op, -1)) goto nomem;
        for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++) {
            const rp_migration_transfer *tr = &x->tr[w->send[k]];
            if (tr->dst_gpu - x->base != p) continue;
            if (!push_data(x, &ro, w->send[k], p, true, tr->src_slot, round, &msg_index[p])) goto nomem;
        }
    }

    /* Copies inside this GPU, through staging, before the batch starts (on NCCL a copy
     * waits for the stream, which would then wait for the batch); checked with the
     * received experts as the commit writes them. */
    for (int64_t k = w->round_local[round]; k < w->round_local[round + 1]; k++) {
        int64_t i = w->local[k];
        const rp_migration_transfer *tr = &x->tr[i];
        int32_t count = 0;
        const rp_tensor *ts = rp_registry_tensors(x->reg, tr->layer, tr->src_slot, &count);
        size_t off = 0;
        for (int32_t j = 0; j < count; j++) {
            if (t->vt->copy(t, x->staging + x->w.stage_off[i] + off, ts[j].data, ts[j].bytes, deadline, &e) != RP_OK) {
                note(&x->mine, e.status, round, tr->layer, tr->expert, x->gpu, "layer %d expert %d: copying it from "
                     "slot %d into staging failed: %s", tr->layer, tr->expert, tr->src_slot, inner(&e));
                goto out;
            }
            off += ts[j].bytes;
        }
    }
    int32_t failed = -1;
    bool started = false;
    if (ro.n > 0) {
        started = true;
        rp_status st = t->vt->start(t, ro.ops, ro.n, &failed, &e);
        if (st != RP_OK) {
            note_op(x, &ro, round, failed, st, &e, recv_first, send_first);
            goto finish;
        }
    }
    if (started && t->wait_each) {
        x->committed = true;
        if (!commit_as_arrived(x, &ro, round, deadline, recv_count, recv_hoff, recv_first, send_first, msg_index))
            goto finish;
    }
    if (started) {
        rp_status st = t->vt->wait(t, deadline, &failed, &e);
        if (st != RP_OK) {
            note_op(x, &ro, round, failed, st, &e, recv_first, send_first);
            goto finish;
        }
        if (x->committed) goto finish;
    }
    /* Check every header; each received expert's source checksum is what the commit
     * compares its slot with. */
    if (ro.hdr_words_recv > 0 &&
        t->vt->to_host(t, ro.recv_hdr, ro.hdr_mem + (size_t)ro.hdr_words_send * 8, (size_t)ro.hdr_words_recv * 8,
                       deadline, &e) != RP_OK) {
        note(&x->mine, e.status, round, -1, -1, -1, "round %d: reading the received headers: %s", round, inner(&e));
        goto finish;
    }
    for (int32_t p = 0; p < P; p++) {
        if (!recv_count[p]) continue;
        if (!check_header(x, round, p, ro.recv_hdr + recv_hoff[p], recv_count[p], recv_first[p])) goto finish;
    }
    read_want_sums(x, &ro, round, recv_hoff, msg_index);
    {
        int64_t i = staged_fault_target(x, round);
        if (i >= 0) corrupt_staged(x, i, deadline);
    }
finish:
    if (started && !t->vt->finish(t)) x->buffers_in_use = true;
    goto out;
nomem:
    note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's message lists", round);
out:
    round_ops_free(x, &ro, x->buffers_in_use);
    batch_free(x, &src_sums);
    rp_free(x->ctx, send_count);
    rp_free(x->ctx, recv_count);
    rp_free(x->ctx, send_first);
    rp_free(x->ctx, recv_first);
    rp_free(x->ctx, send_hoff);
    rp_free(x->ctx, recv_hoff);
    rp_free(x->ctx, msg_index);
}

