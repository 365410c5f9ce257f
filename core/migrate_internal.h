/* The migration executor's private contract: the records ranks exchange, one rank's
 * share of the plan, the state of one execution, the helpers its files share, and the
 * steps each file holds (migrate_exec.c: the agreement and the loop over rounds;
 * migrate_round.c: moving one round into staging and checking its headers;
 * migrate_commit.c: the commit, its check of the bytes and its undo). */
#ifndef RP_MIGRATE_INTERNAL_H
#define RP_MIGRATE_INTERNAL_H

#include "transport.h"

#include <stdio.h>
#include <string.h>

#define RECORD_MAGIC 0x52504d4947524543ULL /* "RPMIGREC" */
#define RECORD_TEXT 440

/* Which exchange a record is for: ranks compare it, so a rank one exchange ahead or
 * behind is a failure every rank sees alike. */
#define EXCHANGE_AGREE 0
#define EXCHANGE_DECIDE(round) (1 + (round))

/* What each rank tells the others, before moving (agreement) and after each round's
 * commit and its check (decision). Fixed layout; all ranks run the same build
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
    unsigned char *own;       /* [num layers] the layers of this GPU's pipeline stage */
    uint64_t call;            /* this call's number, the same on every rank */
    rp_migration_transfer *tr; /* [num transfers] */
    rp_migration_write *wr;    /* [num writes] */
    rank_work w;
    unsigned char *staging;
    size_t staging_bytes;
    bool own_staging;
    unsigned char *undo;       /* transport memory, w.undo_bytes */
    bool buffers_in_use;       /* the transport may still write staging or headers */
    bool committed;            /* this round's writes were done as its experts arrived */
    uint64_t version;          /* the weights' version, agreed by every rank */
    exec_record mine;
} exec;

static inline void note(exec_record *rec, rp_status status, int32_t round, int32_t layer, int32_t expert,
                        int32_t peer, const char *fmt, ...) RP_PRINTF(7, 8);

/* Record this rank's first failure (later ones are consequences). */
static inline void note(exec_record *rec, rp_status status, int32_t round, int32_t layer, int32_t expert,
                        int32_t peer, const char *fmt, ...)
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
static inline const char *inner(const rp_error *e)
{
    const char *s = e->text;
    return strncmp(s, "transport: ", 11) == 0 ? s + 11 : s;
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
static inline bool batch_alloc(exec *x, sum_batch *b, int64_t experts, int64_t parts)
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

static inline void batch_free(exec *x, sum_batch *b)
{
    rp_free(x->ctx, b->part_ptr);
    rp_free(x->ctx, b->part_bytes);
    rp_free(x->ctx, b->part_begin);
    rp_free(x->ctx, b->sums);
    memset(b, 0, sizeof *b);
}

static inline void batch_add_part(sum_batch *b, const void *ptr, size_t bytes)
{
    int32_t p = b->part_begin[b->n + 1]++;
    b->part_ptr[p] = ptr;
    b->part_bytes[p] = bytes;
}

/* The expert held in a slot: its tensors in registration order. */
static inline void batch_add_slot(exec *x, sum_batch *b, int32_t layer, int32_t slot)
{
    int32_t count = 0;
    const rp_tensor *ts = rp_registry_tensors(x->reg, layer, slot, &count);
    b->part_begin[b->n + 1] = b->part_begin[b->n];
    for (int32_t i = 0; i < count; i++) batch_add_part(b, ts[i].data, ts[i].bytes);
    b->n++;
}

/* The staged copy of a transfer: one contiguous part (the checksum does not see where
 * parts begin and end, so it equals the slot's). */
static inline void batch_add_staged(exec *x, sum_batch *b, int64_t transfer)
{
    b->part_begin[b->n + 1] = b->part_begin[b->n];
    batch_add_part(b, x->staging + x->w.stage_off[transfer], (size_t)x->tr[transfer].bytes);
    b->n++;
}

static inline rp_status batch_run(exec *x, sum_batch *b, double deadline, rp_error *err)
{
    if (b->n == 0) return RP_OK;
    return x->t->vt->checksum(x->t, b->part_ptr, b->part_bytes, b->part_begin, b->n, b->sums, deadline, err);
}

/* Move one round into staging and check its headers (migrate_round.c); failures go
 * into x->mine. */
void migrate_run_round(exec *x, int32_t round, double deadline);
/* Write the round's slots so that it can be undone, and check them against their
 * sources (migrate_commit.c); failures go into x->mine. */
void migrate_commit_round(exec *x, int32_t round, double deadline);
/* The commit of one staged transfer, as it arrives (t->wait_each); false: failed, in
 * x->mine. */
bool migrate_commit_transfer(exec *x, int32_t round, int64_t transfer, double deadline);
/* Put back what migrate_commit_round (or migrate_commit_transfer) wrote. */
rp_status migrate_undo_round(exec *x, int32_t round, double deadline, rp_error *err);
/* The round stays: its slots take their experts' identity; the result counts it. */
void migrate_keep_round(exec *x, int32_t round, rp_migration_result *res);

#endif
