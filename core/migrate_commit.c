/* The commit of a migration round ("write, check, then decide"): staged experts swapped
 * into their slots (further slots of one staged copy through undo memory) and checked
 * there against their source checksums, the one check at the destination; then every
 * rank's outcome is exchanged, and the undo runs on every rank when any failed. */
#include "migrate_internal.h"

#include <inttypes.h>

/* A write of the commit: the slot's tensors and where its staged copy lies. */
static const rp_tensor *write_slot(exec *x, int64_t k, const rp_migration_write **wr, unsigned char **staged,
                                   int32_t *count)
{
    *wr = &x->wr[x->w.writes[k]];
    *staged = x->staging + x->w.stage_off[(*wr)->transfer];
    return rp_registry_tensors(x->reg, (*wr)->layer, (*wr)->slot, count);
}

/* Compare write k's slot checksum `got` with its source's; a mismatch goes into x->mine. */
static bool check_write(exec *x, int32_t round, int64_t k, uint64_t got)
{
    const rp_migration_write *wr = &x->wr[x->w.writes[k]];
    const rp_migration_transfer *tr = &x->tr[wr->transfer];
    uint64_t want = x->w.want_sum[wr->transfer];
    if (got == want) return true;
    if (tr->src_gpu == x->gpu)
        note(&x->mine, RP_ECHECKSUM, round, wr->layer, tr->expert, x->gpu, "layer %d expert %d: checksum mismatch "
             "after copying it from slot %d into slot %d (0x%016" PRIx64 " written, 0x%016" PRIx64 " in the "
             "source slot)", wr->layer, tr->expert, tr->src_slot, wr->slot, got, want);
    else
        note(&x->mine, RP_ECHECKSUM, round, wr->layer, tr->expert, tr->src_gpu, "layer %d expert %d from rank %d: "
             "checksum mismatch (0x%016" PRIx64 " received, 0x%016" PRIx64 " sent)", wr->layer, tr->expert,
             tr->src_gpu - x->base, got, want);
    return false;
}

/* Write k: its slot's tensors take the staged expert, part by part. The first write of
 * a transfer swaps staging with its slot (staging then holds the old bytes); a further
 * one keeps the slot's old bytes in undo memory and copies the staged expert in. With
 * `cs` (host memory, t->host_direct), the bytes the slot now holds are fed to it as they
 * are written, a swap's chunk by chunk while in cache. parts_done says what to undo;
 * returns false with the failure in x->mine. */
static bool write_one(exec *x, int32_t round, int64_t k, rp_checksum_state *cs, double deadline)
{
    rank_work *w = &x->w;
    rp_transport *t = x->t;
    const rp_migration_write *wr;
    unsigned char *staged;
    int32_t count = 0;
    const rp_tensor *ts = write_slot(x, k, &wr, &staged, &count);
    const int32_t expert = x->tr[wr->transfer].expert;
    if (rp_transport_fault_at(t, RP_FAULT_SITE_COMMIT_WRITE, NULL) == RP_FAULT_COMMIT_FAIL) {
        note(&x->mine, RP_ETRANSPORT, round, wr->layer, expert, x->gpu, "layer %d slot %d: writing expert %d into "
             "it failed (injected fault)", wr->layer, wr->slot, expert);
        return false;
    }
    rp_error e;
    rp_error_clear(&e);
    size_t off = 0;
    for (int32_t j = 0; j < count; j++) {
        rp_status st = RP_OK;
        if (w->undo_off[k] < 0 && cs) {
            rp_transport_swap_sum_host(ts[j].data, staged + off, ts[j].bytes, cs);
        } else if (w->undo_off[k] < 0) {
            st = t->vt->swap(t, ts[j].data, staged + off, ts[j].bytes, deadline, &e);
        } else {
            st = t->vt->copy(t, x->undo + w->undo_off[k] + off, ts[j].data, ts[j].bytes, deadline, &e);
            if (st == RP_OK) st = t->vt->copy(t, ts[j].data, staged + off, ts[j].bytes, deadline, &e);
            if (st == RP_OK && cs) rp_checksum_update(cs, ts[j].data, ts[j].bytes);
        }
        if (st != RP_OK) {
            note(&x->mine, st, round, wr->layer, expert, x->gpu, "layer %d slot %d: writing expert %d into it "
                 "failed: %s", wr->layer, wr->slot, expert, inner(&e));
            return false;
        }
        w->parts_done[k] = j + 1;
        off += ts[j].bytes;
    }
    return true;
}

/* The commit of one staged transfer as soon as its bytes are in staging (host memory,
 * t->wait_each: migrate_run_round calls it as each expert arrives, while later ones are
 * still on the way): its further writes first, then its first write (write_one), each
 * slot checksummed as it is written and compared with the source's checksum (want_sum)
 * at once. parts_done says what to undo; returns false with the failure in x->mine. */
bool migrate_commit_transfer(exec *x, int32_t round, int64_t transfer, double deadline)
{
    const rank_work *w = &x->w;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t k = w->round_writes[round]; k < w->round_writes[round + 1]; k++) {
            if (x->wr[w->writes[k]].transfer != transfer || (w->undo_off[k] < 0) != (pass == 1)) continue;
            rp_checksum_state cs;
            rp_checksum_init(&cs);
            if (!write_one(x, round, k, &cs, deadline) || !check_write(x, round, k, rp_checksum_final(&cs)))
                return false;
        }
    return true;
}

/* Write a round's staged experts into this rank's slots, so that it can be undone: the
 * further writes of each transfer first, then the first writes (write_one). Then every
 * written slot is checksummed against its source (the header's checksum, or the source
 * slot's for a copy inside this GPU): in host memory (t->host_direct) a swapped slot is
 * checksummed during its swap, one pass over its bytes; the other writes (and every
 * write in memory the transport reaches through callbacks) in one batch afterwards.
 * This is the destination's only check of the bytes: a message damaged on the way,
 * staging changed before the commit, or a write gone wrong. Failures go into x->mine;
 * parts_done says what to undo. */
void migrate_commit_round(exec *x, int32_t round, double deadline)
{
    rank_work *w = &x->w;
    rp_error e;
    rp_error_clear(&e);
    sum_batch sums = {0};
    const int64_t k0 = w->round_writes[round], k1 = w->round_writes[round + 1];
    const bool fused = x->t->host_direct;
    /* [k1 - k0] the checksum of a slot swapped with its fused check (fused only) */
    uint64_t *swapped_sum = fused ? rp_alloc(x->ctx, (size_t)(k1 - k0 + 1) * sizeof *swapped_sum) : NULL;
    if (fused && !swapped_sum) {
        note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's commit checksums", round);
        return;
    }
    for (int64_t k = k0; k < k1; k++) w->parts_done[k] = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t k = k0; k < k1; k++) {
            bool swap = w->undo_off[k] < 0;
            if (swap != (pass == 1)) continue;
            if (swap && fused) {
                rp_checksum_state cs;
                rp_checksum_init(&cs);
                if (!write_one(x, round, k, &cs, deadline)) goto out;
                swapped_sum[k - k0] = rp_checksum_final(&cs);
            } else if (!write_one(x, round, k, NULL, deadline)) {
                goto out;
            }
        }
    /* The destination now holds what its source sent: checked in the slots themselves. */
    int64_t parts = 0;
    for (int64_t k = k0; k < k1; k++) {
        if (fused && w->undo_off[k] < 0) continue; /* checked during its swap */
        int32_t count = 0;
        rp_registry_tensors(x->reg, x->wr[w->writes[k]].layer, x->wr[w->writes[k]].slot, &count);
        parts += count;
    }
    if (!batch_alloc(x, &sums, k1 - k0, parts)) {
        note(&x->mine, RP_ENOMEM, round, -1, -1, -1, "no memory for round %d's commit checksum lists", round);
        goto out;
    }
    for (int64_t k = k0; k < k1; k++)
        if (!(fused && w->undo_off[k] < 0)) batch_add_slot(x, &sums, x->wr[w->writes[k]].layer, x->wr[w->writes[k]].slot);
    if (batch_run(x, &sums, deadline, &e) != RP_OK) {
        note(&x->mine, e.status, round, -1, -1, -1, "round %d: checksumming the %d written slots failed: %s", round,
             sums.n, inner(&e));
        goto out;
    }
    for (int64_t k = k0, b = 0; k < k1; k++) {
        uint64_t got = fused && w->undo_off[k] < 0 ? swapped_sum[k - k0] : sums.sums[b++];
        if (!check_write(x, round, k, got)) goto out;
    }
out:
    batch_free(x, &sums);
    rp_free(x->ctx, swapped_sum);
}

/* Put back what commit_round wrote this round: swap the first writes back, copy the
 * further ones from undo memory, in the reverse order. */
rp_status migrate_undo_round(exec *x, int32_t round, double deadline, rp_error *err)
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
void migrate_keep_round(exec *x, int32_t round, rp_migration_result *res)
{
    const rank_work *w = &x->w;
    for (int64_t k = w->round_writes[round]; k < w->round_writes[round + 1]; k++) {
        const rp_migration_write *wr = &x->wr[w->writes[k]];
        rp_slot_identity id = {wr->layer, x->tr[wr->transfer].expert, x->version};
        rp_registry_set_identity(x->reg, wr->layer, wr->slot, &id, NULL);
        res->slots_written++;
    }
    for (int64_t k = w->round_send[round]; k < w->round_send[round + 1]; k++)
        res->bytes_sent += x->tr[w->send[k]].bytes;
    for (int64_t k = w->round_recv[round]; k < w->round_recv[round + 1]; k++)
        res->bytes_received += x->tr[w->recv[k]].bytes;
    for (int64_t k = w->round_local[round]; k < w->round_local[round + 1]; k++)
        res->bytes_local += x->tr[w->local[k]].bytes;
    res->rounds_committed++;
}

