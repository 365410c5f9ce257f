/* The migration executor: agree on the plan and on what every slot holds, move each
 * round's expert copies into staging with checksums, agree on success, commit by
 * swapping staging with the slots, check the slots, and agree again: keep the round, or
 * undo it on every rank. */
#include "transport.h"

#include "routepack/checksum.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---- executor -------------------------------------------------------------------- */

#define RECORD_MAGIC 0x52504d4947524543ULL /* "RPMIGREC" */
#define HEADER_MAGIC 0x52504d4947484452ULL /* "RPMIGHDR" */
/* A header, one per (sender, receiver) pair and round: HEADER_WORDS words (magic, plan
 * hash, call, round, source GPU, destination GPU, copies), then per copy HEADER_COPY
 * words (layer << 32 | expert, version, checksum), then the header's own checksum
 * (rp_hash of every word before it), so that a damaged header is told apart from a
 * damaged expert. */
#define HEADER_WORDS 7
#define HEADER_COPY 3
#define HEADER_SEED 0x686561646572ULL /* "header" */
#define RECORD_TEXT 440

/* Which exchange a record is for: ranks compare it, so a rank one exchange ahead or
 * behind is a failure every rank sees alike. */
#define EXCHANGE_AGREE 0
#define EXCHANGE_DECIDE(round) (1 + 2 * (round))
#define EXCHANGE_COMMIT(round) (2 + 2 * (round))

/* What each rank tells the others, before moving (agreement), after each round's
 * checks (decision) and after each commit. Fixed layout; all ranks run the same build
 * on the same architecture. */
typedef struct exec_record {
    uint64_t magic;
    uint64_t plan_hash, layout_hash, calls;
    uint64_t version;      /* of this rank's weights (agreement; when has_version) */
    int32_t rank, status, round, layer, expert, peer;
    int32_t exchange, has_version;
    char text[RECORD_TEXT];
} exec_record;
_Static_assert(sizeof(exec_record) == RP_EXCHANGE_RECORD_BYTES, "exec_record is exchanged verbatim");

/* One rank's view of the plan: its copies in, out and inside, per round. */
typedef struct rank_work {
    int64_t *recv, *send, *local, *writes; /* transfer / write indices, plan order */
    int64_t num_recv, num_send, num_local, num_writes;
    int64_t *round_recv, *round_send, *round_local, *round_writes; /* [R + 1] offsets */
    int64_t *stage_off;   /* [num transfers] staging offset of a transfer this rank receives */
    /* The commit: the first write of each staged transfer swaps staging with its slot;
     * each further write of it copies the slot's old bytes to undo memory first. */
    int64_t *primary;     /* [num transfers] the write that swaps, -1 */
    int64_t *undo_off;    /* [num writes of this rank] undo offset of a further write, -1 */
    int32_t *parts_done;  /* [num writes of this rank] tensors written so far this round */
    uint64_t *want_sum;   /* [num transfers] checksum at the source of a transfer staged here */
    int64_t undo_bytes;   /* the most undo memory one round needs */
} rank_work;

typedef struct exec {
    rp_context *ctx;
    const rp_migration_plan *mp;
    rp_registry *reg;          /* the executor sets the identity of the slots it writes */
    rp_transport *t;
    double timeout_s;
    int32_t gpu, base;        /* this rank's GPU; GPU of transport rank 0 */
    uint64_t call;            /* this call's number, the same on every rank */
    rp_migration_transfer *tr; /* [num transfers] */
    rp_migration_write *wr;    /* [num writes] */
    rank_work w;
    unsigned char *staging;
    size_t staging_bytes;
    bool own_staging;
    unsigned char *undo;       /* transport memory, w.undo_bytes */
    bool buffers_in_use;       /* the transport may still write staging or headers */
    uint64_t version;          /* the weights' version, agreed by every rank */
    exec_record mine;
} exec;

static void note(exec_record *rec, rp_status status, int32_t round, int32_t layer, int32_t expert, int32_t peer,
                 const char *fmt, ...) RP_PRINTF(7, 8);

/* Record this rank's first failure (later ones are consequences). */
static void note(exec_record *rec, rp_status status, int32_t round, int32_t layer, int32_t expert, int32_t peer,
                 const char *fmt, ...)
{
    if (rec->status != RP_OK) return;
    rec->status = status;
    rec->round = round;
    rec->layer = layer;
    rec->expert = expert;
    rec->peer = peer;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rec->text, sizeof rec->text, fmt, ap);
    va_end(ap);
}

/* The transport's message without its "transport: " prefix, for nesting. */
static const char *inner(const rp_error *e)
{
    const char *s = e->text;
    return strncmp(s, "transport: ", 11) == 0 ? s + 11 : s;
}

static uint64_t layout_hash(const rp_registry *reg)
{
    rp_hash_state st;
    rp_hash_init(&st, 0x6c61796f7574ULL); /* "layout" */
    for (int32_t l = 0; l < rp_registry_num_layers(reg); l++) {
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
        for (int32_t k = 0; k < rp_registry_num_slots(x->reg); k++) {
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
        note(me, RP_EINVAL, -1, -1, -1, -1, "the transport has %d ranks, but the plan has %d GPUs in EP groups of %d",
             t->size, G, ep);
        return false;
    }
    x->gpu = x->base + t->rank;
    const int32_t slots = rp_migration_plan_num_slots(mp, x->gpu % ep);
    if (rp_registry_num_layers(reg) != rp_migration_plan_num_layers(mp) || rp_registry_num_slots(reg) != slots) {
        note(me, RP_EINVAL, -1, -1, -1, -1,
             "the registry has %d layers and %d slots, but GPU %d has %d layers and %d slots in the plan",
             rp_registry_num_layers(reg), rp_registry_num_slots(reg), x->gpu, rp_migration_plan_num_layers(mp), slots);
        return false;
    }
    rp_error e;
    rp_error_clear(&e);
    if (rp_registry_check(reg, &e) != RP_OK) {
        note(me, e.status, -1, -1, -1, -1, "%s", e.text);
        return false;
    }
    for (int32_t l = 0; l < rp_registry_num_layers(reg); l++) {
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

/* Experts to checksum in one transport call (on NCCL one rp_gpu_checksum call for them all):
 * each expert's parts in transport memory, laid out as rp_transport_vtable.checksum
 * takes them. */
typedef struct sum_batch {
    const void **part_ptr;
    size_t *part_bytes;
    int32_t *part_begin; /* [n + 1] */
    uint64_t *sums;      /* [n] after batch_run */
    int32_t n;
} sum_batch;

/* Room for `experts` experts of `parts` parts in all. */
static bool batch_alloc(exec *x, sum_batch *b, int64_t experts, int64_t parts)
{
    memset(b, 0, sizeof *b);
    if (experts >= INT32_MAX || parts >= INT32_MAX) return false;
    b->part_ptr = rp_alloc(x->ctx, (size_t)(parts + 1) * sizeof *b->part_ptr);
    b->part_bytes = rp_alloc(x->ctx, (size_t)(parts + 1) * sizeof *b->part_bytes);
    b->part_begin = rp_alloc(x->ctx, (size_t)(experts + 1) * sizeof *b->part_begin);
    b->sums = rp_alloc(x->ctx, (size_t)(experts + 1) * sizeof *b->sums);
    if (!b->part_ptr || !b->part_bytes || !b->part_begin || !b->sums) return false;
    b->part_begin[0] = 0;
    return true;
}

static void batch_free(exec *x, sum_batch *b)
{
    rp_free(x->ctx, b->part_ptr);
    rp_free(x->ctx, b->part_bytes);
    rp_free(x->ctx, b->part_begin);
    rp_free(x->ctx, b->sums);
    memset(b, 0, sizeof *b);
}

static void batch_add_part(sum_batch *b, const void *ptr, size_t bytes)
{
    int32_t p = b->part_begin[b->n + 1]++;
    b->part_ptr[p] = ptr;
    b->part_bytes[p] = bytes;
}

/* The expert held in a slot: its tensors in registration order. */
static void batch_add_slot(exec *x, sum_batch *b, int32_t layer, int32_t slot)
{
    int32_t count = 0;
    const rp_tensor *ts = rp_registry_tensors(x->reg, layer, slot, &count);
    b->part_begin[b->n + 1] = b->part_begin[b->n];
    for (int32_t i = 0; i < count; i++) batch_add_part(b, ts[i].data, ts[i].bytes);
    b->n++;
}

/* The staged copy of a transfer: one contiguous part (the checksum does not see where
 * parts begin and end, so it equals the slot's). */
static void batch_add_staged(exec *x, sum_batch *b, int64_t transfer)
{
    b->part_begin[b->n + 1] = b->part_begin[b->n];
    batch_add_part(b, x->staging + x->w.stage_off[transfer], (size_t)x->tr[transfer].bytes);
    b->n++;
}

static rp_status batch_run(exec *x, sum_batch *b, double deadline, rp_error *err)
{
    if (b->n == 0) return RP_OK;
    return x->t->vt->checksum(x->t, b->part_ptr, b->part_bytes, b->part_begin, b->n, b->sums, deadline, err);
}

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

/* Move one round into staging and check it; failures go into x->mine. */
static void run_round(exec *x, int32_t round, double deadline)
{
    const rank_work *w = &x->w;
    rp_transport *t = x->t;
    const int32_t P = t->size;
    round_ops ro = {0};
    sum_batch src_sums = {0}, staged_sums = {0};
    rp_error e;
    rp_error_clear(&e);
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
     * (compared with its staged copy after the round). */
    const int64_t num_send = w->round_send[round + 1] - w->round_send[round];
    const int64_t num_local = w->round_local[round + 1] - w->round_local[round];
    const int64_t num_recv = w->round_recv[round + 1] - w->round_recv[round];
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
        if (!batch_alloc(x, &src_sums, num_send + num_local, parts) ||
            !batch_alloc(x, &staged_sums, num_local + num_recv, num_local + num_recv)) {
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
     * received experts below. */
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
    if (started) {
        rp_status st = t->vt->wait(t, deadline, &failed, &e);
        if (st != RP_OK) {
            note_op(x, &ro, round, failed, st, &e, recv_first, send_first);
            goto finish;
        }
    }
    /* Check every header, then every received expert against its source checksum. */
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
    /* One batch: every copy inside this GPU, then every received expert, as staged. */
    for (int64_t k = w->round_local[round]; k < w->round_local[round + 1]; k++)
        batch_add_staged(x, &staged_sums, w->local[k]);
    for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++)
        batch_add_staged(x, &staged_sums, w->recv[k]);
    if (batch_run(x, &staged_sums, deadline, &e) != RP_OK) {
        const rp_migration_transfer *tr = &x->tr[num_local > 0 ? w->local[w->round_local[round]]
                                                               : w->recv[w->round_recv[round]]];
        note(&x->mine, e.status, round, tr->layer, tr->expert, tr->src_gpu, "round %d: checksumming the %d staged "
             "experts failed (layer %d expert %d is the first): %s", round, staged_sums.n, tr->layer, tr->expert,
             inner(&e));
        goto finish;
    }
    for (int64_t j = 0; j < num_local; j++) {
        const rp_migration_transfer *tr = &x->tr[w->local[w->round_local[round] + j]];
        uint64_t before = src_sums.sums[num_send + j], after = staged_sums.sums[j];
        if (before != after) {
            note(&x->mine, RP_ECHECKSUM, round, tr->layer, tr->expert, x->gpu,
                 "layer %d expert %d: checksum mismatch after copying it from slot %d (0x%016" PRIx64
                 " staged, 0x%016" PRIx64 " in the slot)", tr->layer, tr->expert, tr->src_slot, after, before);
            goto finish;
        }
    }
    memset(msg_index, 0, (size_t)P * sizeof(int64_t));
    for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++) {
        const rp_migration_transfer *tr = &x->tr[w->recv[k]];
        int32_t p = tr->src_gpu - x->base;
        uint64_t want = ro.recv_hdr[recv_hoff[p] + HEADER_WORDS + HEADER_COPY * msg_index[p]++ + 2];
        w->want_sum[w->recv[k]] = want;
        uint64_t got = staged_sums.sums[num_local + (k - w->round_recv[round])];
        if (got != want) {
            note(&x->mine, RP_ECHECKSUM, round, tr->layer, tr->expert, tr->src_gpu,
                 "layer %d expert %d from rank %d: checksum mismatch (0x%016" PRIx64 " received, 0x%016" PRIx64
                 " sent)", tr->layer, tr->expert, p, got, want);
            goto finish;
        }
    }
    /* Fault injection (tests): the staged bytes change after they were checked. */
    if (rp_transport_fault_at(t, RP_FAULT_SITE_STAGED, NULL) == RP_FAULT_CORRUPT_STAGING && num_local + num_recv > 0) {
        int64_t i = num_local > 0 ? w->local[w->round_local[round]] : w->recv[w->round_recv[round]];
        unsigned char *byte = x->staging + w->stage_off[i] + x->tr[i].bytes / 2, v = 0;
        if (t->vt->to_host(t, &v, byte, 1, deadline, &e) == RP_OK) {
            v ^= 0xff;
            t->vt->from_host(t, byte, &v, 1, deadline, &e);
        }
    }
finish:
    if (started && !t->vt->finish(t)) x->buffers_in_use = true;
    goto out;
nomem:
    note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's message lists", round);
out:
    round_ops_free(x, &ro, x->buffers_in_use);
    batch_free(x, &src_sums);
    batch_free(x, &staged_sums);
    rp_free(x->ctx, send_count);
    rp_free(x->ctx, recv_count);
    rp_free(x->ctx, send_first);
    rp_free(x->ctx, recv_first);
    rp_free(x->ctx, send_hoff);
    rp_free(x->ctx, recv_hoff);
    rp_free(x->ctx, msg_index);
}

/* A write of the commit: the slot's tensors and where its staged copy lies. */
static const rp_tensor *write_slot(exec *x, int64_t k, const rp_migration_write **wr, unsigned char **staged,
                                   int32_t *count)
{
    *wr = &x->wr[x->w.writes[k]];
    *staged = x->staging + x->w.stage_off[(*wr)->transfer];
    return rp_registry_tensors(x->reg, (*wr)->layer, (*wr)->slot, count);
}

/* Write a round's staged experts into this rank's slots, so that it can be undone:
 * each further write of a transfer first keeps the slot's old bytes in undo memory and
 * copies the staged expert in; then the first write of each transfer swaps staging
 * with its slot (staging then holds the old bytes). Then every written slot is
 * checksummed against its source. Failures go into x->mine; parts_done says what to
 * undo. */
static void commit_round(exec *x, int32_t round, double deadline)
{
    rank_work *w = &x->w;
    rp_transport *t = x->t;
    rp_error e;
    rp_error_clear(&e);
    sum_batch sums = {0};
    const int64_t k0 = w->round_writes[round], k1 = w->round_writes[round + 1];
    for (int64_t k = k0; k < k1; k++) w->parts_done[k] = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t k = k0; k < k1; k++) {
            const rp_migration_write *wr;
            unsigned char *staged;
            int32_t count = 0;
            const rp_tensor *ts = write_slot(x, k, &wr, &staged, &count);
            bool swap = w->undo_off[k] < 0;
            if (swap != (pass == 1)) continue;
            if (rp_transport_fault_at(t, RP_FAULT_SITE_COMMIT_WRITE, NULL) == RP_FAULT_COMMIT_FAIL) {
                note(&x->mine, RP_ETRANSPORT, round, wr->layer, x->tr[wr->transfer].expert, x->gpu, "layer %d slot "
                     "%d: writing expert %d into it failed (injected fault)", wr->layer, wr->slot,
                     x->tr[wr->transfer].expert);
                return;
            }
            size_t off = 0;
            for (int32_t j = 0; j < count; j++) {
                rp_status st = RP_OK;
                if (swap) {
                    st = t->vt->swap(t, ts[j].data, staged + off, ts[j].bytes, deadline, &e);
                } else {
                    unsigned char *keep = x->undo + w->undo_off[k] + off;
                    st = t->vt->copy(t, keep, ts[j].data, ts[j].bytes, deadline, &e);
                    if (st == RP_OK) st = t->vt->copy(t, ts[j].data, staged + off, ts[j].bytes, deadline, &e);
                }
                if (st != RP_OK) {
                    note(&x->mine, st, round, wr->layer, x->tr[wr->transfer].expert, x->gpu, "layer %d slot %d: "
                         "writing expert %d into it failed: %s", wr->layer, wr->slot, x->tr[wr->transfer].expert,
                         inner(&e));
                    return;
                }
                w->parts_done[k] = j + 1;
                off += ts[j].bytes;
            }
        }
    /* The destination now holds what its source sent: checked in the slots themselves,
     * so that staging changed after the check, or a write gone wrong, is caught. */
    int64_t parts = 0;
    for (int64_t k = k0; k < k1; k++) {
        int32_t count = 0;
        rp_registry_tensors(x->reg, x->wr[w->writes[k]].layer, x->wr[w->writes[k]].slot, &count);
        parts += count;
    }
    if (!batch_alloc(x, &sums, k1 - k0, parts)) {
        note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's commit checksum lists", round);
        goto out;
    }
    for (int64_t k = k0; k < k1; k++) batch_add_slot(x, &sums, x->wr[w->writes[k]].layer, x->wr[w->writes[k]].slot);
    if (batch_run(x, &sums, deadline, &e) != RP_OK) {
        note(&x->mine, e.status, round, -1, -1, -1, "round %d: checksumming the %d written slots failed: %s", round,
             sums.n, inner(&e));
        goto out;
    }
    for (int64_t k = k0; k < k1; k++) {
        const rp_migration_write *wr = &x->wr[w->writes[k]];
        const rp_migration_transfer *tr = &x->tr[wr->transfer];
        uint64_t got = sums.sums[k - k0], want = w->want_sum[wr->transfer];
        if (got != want) {
            note(&x->mine, RP_ECHECKSUM, round, wr->layer, tr->expert, tr->src_gpu, "layer %d slot %d: after the "
                 "commit it does not hold expert %d (checksum 0x%016" PRIx64 " in the slot, 0x%016" PRIx64 " at the "
                 "source): its staged copy changed after it was checked", wr->layer, wr->slot, tr->expert, got, want);
            goto out;
        }
    }
out:
    batch_free(x, &sums);
}

/* Put back what commit_round wrote this round: swap the first writes back, copy the
 * further ones from undo memory, in the reverse order. */
static rp_status undo_round(exec *x, int32_t round, double deadline, rp_error *err)
{
    rank_work *w = &x->w;
    rp_transport *t = x->t;
    for (int pass = 1; pass >= 0; pass--)
        for (int64_t k = w->round_writes[round]; k < w->round_writes[round + 1]; k++) {
            const rp_migration_write *wr;
            unsigned char *staged;
            int32_t count = 0;
            const rp_tensor *ts = write_slot(x, k, &wr, &staged, &count);
            bool swap = w->undo_off[k] < 0;
            if (swap != (pass == 1)) continue;
            size_t off = 0;
            for (int32_t j = 0; j < w->parts_done[k]; j++) {
                rp_status st = swap ? t->vt->swap(t, ts[j].data, staged + off, ts[j].bytes, deadline, err)
                                    : t->vt->copy(t, ts[j].data, x->undo + w->undo_off[k] + off, ts[j].bytes,
                                                  deadline, err);
                if (st != RP_OK) {
                    rp_transport_break(t, "undoing a commit failed");
                    return rp_fail(err, st, "restoring layer %d slot %d failed (%s): this layer's weights on rank %d "
                                   "are inconsistent, end the job", wr->layer, wr->slot, inner(err), t->rank);
                }
                off += ts[j].bytes;
            }
            w->parts_done[k] = 0;
        }
    return RP_OK;
}

/* The round stays: its slots take their experts' identity; the result counts it. */
static void keep_round(exec *x, int32_t round, rp_migration_result *res)
{
    const rank_work *w = &x->w;
    for (int64_t k = w->round_writes[round]; k < w->round_writes[round + 1]; k++) {
        const rp_migration_write *wr = &x->wr[w->writes[k]];
        rp_slot_identity id = {wr->layer, x->tr[wr->transfer].expert, x->version};
        rp_registry_set_identity(x->reg, wr->layer, wr->slot, &id, NULL);
        res->slots_written++;
    }
    for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++) res->bytes_sent += x->tr[w->send[k]].bytes;
    for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++)
        res->bytes_received += x->tr[w->recv[k]].bytes;
    for (int64_t k = w->round_local[round]; k < w->round_local[round + 1]; k++)
        res->bytes_local += x->tr[w->local[k]].bytes;
    res->rounds_committed++;
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
    x.mine.layout_hash = reg ? layout_hash(reg) : 0;
    local_checks(&x, opts);
    res->num_rounds = mp ? rp_migration_plan_num_rounds(mp) : 0;
    res->staging_bytes = (int64_t)x.staging_bytes + x.w.undo_bytes;

    rp_status st = RP_OK;
    const int32_t P = t->size;
    exec_record *all = t->records;

    /* (1) Agree: same plan, same tensor layout, same call, same version of the weights,
     * every slot holding what the plan says, nothing wrong locally. */
    rp_error e;
    st = exchange(&x, EXCHANGE_AGREE, rp_now_s() + timeout, all, &e);
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
        if (i > 0 && all[i].layout_hash != all[0].layout_hash) {
            st = rp_fail(err, RP_EPLAN, "migration: rank %d's registry lays out the expert tensors differently from "
                         "rank 0's (layout hash 0x%016" PRIx64 " against 0x%016" PRIx64 "); nothing moved", i,
                         all[i].layout_hash, all[0].layout_hash);
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
        run_round(&x, round, deadline);
        if (t->broken) {
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
        /* (4) Agree on the outcome. Ranks that failed fast wait for slow ones up to one
         * more timeout, so a rank that timed out still reaches this exchange in time. */
        double stall = 0.0;
        rp_fault_kind fault = rp_transport_fault_at(t, RP_FAULT_SITE_DECISION, &stall);
        if (fault == RP_FAULT_STALL_DECISION) sleep_s(stall);
        st = exchange(&x, EXCHANGE_DECIDE(round), deadline + timeout, all, &e);
        if (st == RP_OK && fault == RP_FAULT_LOSE_DECISION)
            st = rp_fail(&e, RP_ETIMEOUT, "transport: rank %d lost the exchange's answer (injected fault)", t->rank);
        if (st != RP_OK) {
            rp_transport_break(t, "the decision exchange of a migration failed");
            st = rp_fail(err, st, "migration: rank %d could not learn whether round %d succeeded on every rank (%s); "
                         "it wrote nothing of it, and no rank keeps it without this rank's confirmation: the transport "
                         "is unusable, end the job", t->rank, round, inner(&e));
            res->failed_rank = t->rank;
            goto out;
        }
        bad = pick_failure(all, P);
        if (bad) {
            char committed[96] = "nothing was written, every weight is as before";
            if (res->rounds_committed > 0)
                snprintf(committed, sizeof committed, "rounds 0 to %d stay committed (their layers are in the target "
                         "placement)", res->rounds_committed - 1);
            st = rp_fail(err, (rp_status)bad->status, "migration: rank %d: %s; round %d was rolled back on every rank "
                         "(no slot of it was written); %s", bad->rank, bad->text, round, committed);
            report(res, err, bad);
            goto out;
        }
        /* (5) Every rank succeeded: commit, so that it can be undone, and check the
         * slots. (6) Agree on that: keep the round only if every rank wrote and checked
         * it; else every rank restores it. A rank that cannot learn the answer restores
         * it too: a round stays only where every rank confirmed it. */
        double commit_deadline = rp_now_s() + timeout;
        commit_round(&x, round, commit_deadline);
        fault = rp_transport_fault_at(t, RP_FAULT_SITE_COMMIT_EXCHANGE, NULL);
        st = exchange(&x, EXCHANGE_COMMIT(round), commit_deadline + timeout, all, &e);
        if (st == RP_OK && fault == RP_FAULT_LOSE_COMMIT)
            st = rp_fail(&e, RP_ETIMEOUT, "transport: rank %d lost the exchange's answer (injected fault)", t->rank);
        if (st != RP_OK) {
            rp_transport_break(t, "the commit exchange of a migration failed");
            rp_error ue;
            rp_error_clear(&ue);
            bool undone = undo_round(&x, round, rp_now_s() + timeout, &ue) == RP_OK;
            st = rp_fail(err, st, "migration: rank %d could not learn whether round %d committed on every rank (%s); "
                         "%s, but other ranks may have kept theirs (the registry's slot identities say what each slot "
                         "holds): the transport is unusable, end the job", t->rank, round, inner(&e),
                         undone ? "it restored its own slots of that round" : ue.text);
            res->failed_rank = t->rank;
            goto out;
        }
        bad = pick_failure(all, P);
        if (bad) {
            rp_error ue;
            rp_error_clear(&ue);
            rp_status ust = undo_round(&x, round, rp_now_s() + timeout, &ue);
            char committed[96] = "nothing was written, every weight is as before";
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
        keep_round(&x, round, res);
    }
    st = RP_OK;
out:
    if (x.own_staging && !x.buffers_in_use) t->vt->free(t, x.staging);
    if (x.undo) t->vt->free(t, x.undo);
    if (x.buffers_in_use)
        rp_transport_break(t, "a receive could not be cancelled; its staging memory was left to it");
    rp_free(x.ctx, x.tr);
    rp_free(x.ctx, x.wr);
    work_free(x.ctx, &x.w);
    res->seconds = rp_now_s() - t0;
    return st;
}
