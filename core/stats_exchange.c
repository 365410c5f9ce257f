/* Statistics between ranks: the versioned little-endian serialised form of rp_stats
 * (layout in routepack/stats.h), its fully checked reader, and the merge of per-rank
 * parts into the whole step's statistics in global sequence order. */
#include "stats_internal.h"

#include <stdio.h>
#include <string.h>

static const unsigned char MAGIC[8] = {'R', 'P', 'S', 'T', 'A', 'T', 'S', '\0'};
#define HEADER RP_STATS_WIRE_HEADER_BYTES

/* ---- little-endian fields ------------------------------------------------------- */

static bool host_little_endian(void)
{
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static void put_le(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* One count of `width` bytes: LE (the wire) or native (an rp_stats). */
static uint32_t count_at(const unsigned char *row, size_t i, int width, bool le)
{
    switch (width) {
    case 1: return row[i];
    case 2:
        if (le) return (uint32_t)get_le(row + 2 * i, 2);
        return stats_u16_at(row, i);
    case 4:
        if (le) return (uint32_t)get_le(row + 4 * i, 4);
        return stats_u32_at(row, i);
    default: return 0;
    }
}

/* Sum of one row of `n` little-endian counts of `width` bytes, and the bitwise OR of its
 * counts so far in *bits (the check needs only the width the largest count takes, and the
 * OR takes the same: it is 0, below 2^8 or below 2^16 exactly when the largest count is,
 * and it costs one vector operation where an unsigned maximum costs four with SSE2): one
 * loop per width, with plain loads on a little-endian host, so the compiler vectorizes it
 * (the reader runs it over every count of every rank's part). */
static int64_t row_sum_or(const unsigned char *row, int32_t n, int width, uint32_t *bits)
{
    uint64_t sum = 0;
    uint32_t b = 0;
    if (width == 1) {
        /* 32-bit sums in the vector lanes (n <= STATS_MAX_EXPERTS counts of at most
         * 2^16 - 1 fit), widened once per row */
        uint32_t s32 = 0;
        for (int32_t e = 0; e < n; e++) {
            uint32_t c = row[e];
            s32 += c;
            b |= c;
        }
        sum = s32;
    } else if (host_little_endian() && width == 2) {
        uint32_t s32 = 0;
        for (int32_t e = 0; e < n; e++) {
            uint32_t c = stats_u16_at(row, (size_t)e);
            s32 += c;
            b |= c;
        }
        sum = s32;
    } else if (host_little_endian() && width == 4) {
        for (int32_t e = 0; e < n; e++) {
            uint32_t c = stats_u32_at(row, (size_t)e);
            sum += c;
            b |= c;
        }
    } else {
        for (int32_t e = 0; e < n; e++) {
            uint32_t c = count_at(row, (size_t)e, width, true);
            sum += c;
            b |= c;
        }
    }
    *bits |= b;
    return (int64_t)sum;
}

/* The largest of `n` little-endian counts of `width` bytes (for a message). */
static uint32_t block_max(const unsigned char *blk, size_t n, int width)
{
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t c = count_at(blk, i, width, true);
        m = c > m ? c : m;
    }
    return m;
}

/* ---- a part: an rp_stats, or checked bytes ------------------------------------------ */

typedef struct part {
    int32_t num_seqs, num_layers, num_experts, top_k;
    int64_t num_tokens;
    const uint8_t *width;
    const unsigned char *hist;  /* each sequence's block, back to back */
    uint64_t hist_bytes;
    bool le;                    /* counts little-endian (the wire) rather than native */
} part;

static void part_of_stats(const rp_stats *s, part *p)
{
    *p = (part){s->num_seqs, s->num_layers, s->num_experts, s->top_k, s->num_tokens,
                s->width, s->hist, s->offset[s->num_seqs], false};
}

/* The model limits of a config (core/config.c), and the most layer x expert cells a
 * header may declare when no sequence has counts (then no byte vouches for the shape). */
#define STATS_MAX_LAYERS 65536
#define STATS_MAX_EXPERTS 65536
#define STATS_MAX_EMPTY_CELLS ((int64_t)1 << 24)

static int width_needed(uint32_t max_count)
{
    return max_count == 0 ? 0 : max_count <= UINT8_MAX ? 1 : max_count <= UINT16_MAX ? 2 : 4;
}

/* Check serialised bytes and describe them as a part. `who` prefixes messages. */
static rp_status part_of_bytes(const void *bytes, size_t len, const char *who, part *p, rp_error *err)
{
    const unsigned char *b = bytes;
    if (!b && len > 0) return rp_fail(err, RP_EINVAL, "%sstatistics: no bytes", who);
    if (len < HEADER) {
        rp_fail(err, RP_EFORMAT, "%sstatistics: %zu bytes, shorter than the %d-byte header (truncated?)", who, len,
                HEADER);
        if (err) err->offset = (int64_t)len;
        return RP_EFORMAT;
    }
    if (memcmp(b, MAGIC, sizeof MAGIC) != 0) {
        rp_fail(err, RP_EFORMAT, "%sstatistics: wrong magic (not serialised rp_stats)", who);
        if (err) err->offset = 0;
        return RP_EFORMAT;
    }
    uint32_t version = (uint32_t)get_le(b + 8, 4), header = (uint32_t)get_le(b + 12, 4);
    if (version != RP_STATS_WIRE_VERSION) {
        rp_fail(err, version > RP_STATS_WIRE_VERSION ? RP_ENOTSUP : RP_EFORMAT,
                "%sstatistics: format version %u, this build reads version %d", who, version, RP_STATS_WIRE_VERSION);
        if (err) err->offset = 8;
        return version > RP_STATS_WIRE_VERSION ? RP_ENOTSUP : RP_EFORMAT;
    }
    if (header != HEADER) {
        rp_fail(err, RP_EFORMAT, "%sstatistics: header of %u bytes, version 1 has %d", who, header, HEADER);
        if (err) err->offset = 12;
        return RP_EFORMAT;
    }
    if (get_le(b + 56, 8) != 0) {
        rp_fail(err, RP_EFORMAT, "%sstatistics: the reserved header field is not 0", who);
        if (err) err->offset = 56;
        return RP_EFORMAT;
    }
    p->num_seqs = (int32_t)get_le(b + 16, 4);
    p->num_layers = (int32_t)get_le(b + 20, 4);
    p->num_experts = (int32_t)get_le(b + 24, 4);
    p->top_k = (int32_t)get_le(b + 28, 4);
    p->num_tokens = (int64_t)get_le(b + 32, 8);
    p->hist_bytes = get_le(b + 40, 8);
    p->le = true;
    if (p->num_seqs < 0 || p->num_layers < 1 || p->num_experts < 1 || p->top_k < 1 || p->num_tokens < 0)
        return rp_fail(err, RP_EINVAL,
                       "%sstatistics: %d sequences, %d layers, %d experts, top-%d, %lld tokens (sequences and "
                       "tokens must be >= 0, the others >= 1)",
                       who, p->num_seqs, p->num_layers, p->num_experts, p->top_k, (long long)p->num_tokens);
    int64_t cells, expect, choices;
    if (rp_mul_overflow(p->num_layers, p->num_experts, &cells) || p->hist_bytes > (uint64_t)INT64_MAX / 2 ||
        rp_add_overflow(HEADER + (int64_t)p->num_seqs, (int64_t)p->hist_bytes, &expect) ||
        rp_mul_overflow(p->num_tokens, p->top_k, &choices))
        return rp_fail(err, RP_ERANGE, "%sstatistics: sizes in the header overflow", who);
    /* The work of reading (and merging) must follow from the bytes, not from the
     * header's word: the model limits of a config, and layers x experts no larger than
     * the histogram bytes (a sequence with counts stores every cell at least once), or,
     * when no sequence has counts, than STATS_MAX_EMPTY_CELLS. Zero-width sequences are
     * never expanded below. */
    if (p->num_layers > STATS_MAX_LAYERS || p->num_experts > STATS_MAX_EXPERTS || p->top_k > p->num_experts)
        return rp_fail(err, RP_EINVAL,
                       "%sstatistics: %d layers, %d experts, top-%d: outside the model limits (layers and experts "
                       "at most %d, top-k at most the experts)",
                       who, p->num_layers, p->num_experts, p->top_k, STATS_MAX_LAYERS);
    if (p->hist_bytes > 0 ? (uint64_t)cells > p->hist_bytes : cells > STATS_MAX_EMPTY_CELLS) {
        rp_fail(err, RP_EFORMAT,
                "%sstatistics: %d layers x %d experts cannot be described by %llu histogram bytes", who,
                p->num_layers, p->num_experts, (unsigned long long)p->hist_bytes);
        if (err) err->offset = 20;
        return RP_EFORMAT;
    }
    if ((uint64_t)expect != len) {
        rp_fail(err, RP_EFORMAT,
                "%sstatistics: the header says %d sequences and %llu histogram bytes (%lld bytes in all), but %zu "
                "bytes were given",
                who, p->num_seqs, (unsigned long long)p->hist_bytes, (long long)expect, len);
        if (err) err->offset = expect < (int64_t)len ? expect : (int64_t)len;
        return RP_EFORMAT;
    }
    uint64_t want = get_le(b + 48, 8), got = rp_hash64(b + HEADER, len - HEADER, 0);
    if (want != got) {
        rp_fail(err, RP_ECHECKSUM, "%sstatistics: payload XXH64 %016llx does not match the header's %016llx", who,
                (unsigned long long)got, (unsigned long long)want);
        if (err) err->offset = 48;
        return RP_ECHECKSUM;
    }
    p->width = b + HEADER;
    p->hist = b + HEADER + p->num_seqs;
    /* widths, then each sequence's block: canonical width, equal layer sums */
    uint64_t pos = 0;
    int64_t total = 0;
    for (int32_t s = 0; s < p->num_seqs; s++) {
        const int w = p->width[s];
        if (w != 0 && w != 1 && w != 2 && w != 4) {
            rp_fail(err, RP_EFORMAT, "%sstatistics: sequence %d has count width %d; widths are 0, 1, 2 or 4", who,
                    s, w);
            if (err) err->offset = HEADER + s, err->sequence = s;
            return RP_EFORMAT;
        }
        if (w > 0 && (uint64_t)cells > (p->hist_bytes - pos) / (uint64_t)w) {
            rp_fail(err, RP_EFORMAT, "%sstatistics: the widths need more than the %llu histogram bytes given", who,
                    (unsigned long long)p->hist_bytes);
            if (err) err->offset = HEADER + s, err->sequence = s;
            return RP_EFORMAT;
        }
        const uint64_t size = (uint64_t)cells * (uint64_t)w;
        const unsigned char *blk = p->hist + pos;
        uint32_t bits = 0;
        int64_t first_sum = 0;
        for (int32_t l = 0; w > 0 && l < p->num_layers; l++) { /* width 0: no counts, nothing to read */
            const unsigned char *row = blk + (size_t)l * (size_t)p->num_experts * (size_t)w;
            const int64_t sum = row_sum_or(row, p->num_experts, w, &bits);
            if (l == 0) first_sum = sum;
            if (sum != first_sum || sum % p->top_k != 0) {
                rp_fail(err, RP_EFORMAT,
                        "%sstatistics: sequence %d routes %lld choices at layer %d but %lld at layer 0 (every layer "
                        "routes length x top-%d)",
                        who, s, (long long)sum, l, (long long)first_sum, p->top_k);
                if (err) err->offset = (int64_t)(HEADER + p->num_seqs + pos), err->sequence = s;
                return RP_EFORMAT;
            }
        }
        if (width_needed(bits) != w) {
            const uint32_t max = block_max(blk, (size_t)cells, w);
            rp_fail(err, RP_EFORMAT,
                    "%sstatistics: sequence %d is stored %d bytes a count but its largest count %u needs %d", who, s,
                    w, max, width_needed(max));
            if (err) err->offset = HEADER + s, err->sequence = s;
            return RP_EFORMAT;
        }
        if (rp_add_overflow(total, first_sum, &total))
            return rp_fail(err, RP_ERANGE, "%sstatistics: the counts overflow a 64-bit sum", who);
        pos += size;
    }
    if (pos != p->hist_bytes) {
        rp_fail(err, RP_EFORMAT, "%sstatistics: the widths account for %llu histogram bytes, the header says %llu",
                who, (unsigned long long)pos, (unsigned long long)p->hist_bytes);
        if (err) err->offset = 40;
        return RP_EFORMAT;
    }
    if (total != choices) {
        rp_fail(err, RP_EFORMAT,
                "%sstatistics: the counts route %lld choices a layer, but %lld tokens x top-%d is %lld", who,
                (long long)total, (long long)p->num_tokens, p->top_k, (long long)choices);
        if (err) err->offset = 32;
        return RP_EFORMAT;
    }
    return RP_OK;
}

/* ---- merging parts ------------------------------------------------------------------- */

/* Build the merged statistics from checked parts. */
static rp_status merge_parts(rp_context *ctx, int32_t num_parts, const part *parts, const int32_t *const *ids,
                             int32_t num_seqs, rp_stats *reuse, rp_stats **out, rp_error *err)
{
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "stats merge: context and output are required");
    if (num_parts < 1 || num_seqs < 0)
        return rp_fail(err, RP_EINVAL, "stats merge: %d parts and %d sequences (parts must be >= 1)", num_parts,
                       num_seqs);
    const part *p0 = &parts[0];
    for (int32_t i = 1; i < num_parts; i++) {
        const part *p = &parts[i];
        if (p->num_layers != p0->num_layers || p->num_experts != p0->num_experts || p->top_k != p0->top_k)
            return rp_fail(err, RP_EINVAL,
                           "stats merge: part %d has %d layers, %d experts, top-%d; part 0 has %d, %d, top-%d", i,
                           p->num_layers, p->num_experts, p->top_k, p0->num_layers, p0->num_experts, p0->top_k);
    }
    const int32_t L = p0->num_layers, E = p0->num_experts;
    const size_t cells = (size_t)L * (size_t)E;
    rp_status st = RP_OK;
    rp_stats *m = NULL;
    uint32_t *acc = NULL; /* [cells]: partial loads (below) */
    int32_t narrow = 0;
    /* where each global id comes from: part and index (-1: not yet seen) */
    int32_t *src_part = rp_alloc(ctx, sizeof(int32_t) * ((size_t)num_seqs + 1));
    uint64_t *src_off = rp_alloc(ctx, sizeof(uint64_t) * ((size_t)num_seqs + 1));
    if (!src_part || !src_off) {
        st = rp_fail_nomem(err, "the merge's sequence map");
        goto out;
    }
    for (int32_t g = 0; g < num_seqs; g++) src_part[g] = -1;
    int64_t tokens = 0;
    for (int32_t i = 0; i < num_parts; i++) {
        const part *p = &parts[i];
        if (p->num_seqs > 0 && (!ids || !ids[i])) {
            st = rp_fail(err, RP_EINVAL, "stats merge: part %d has %d sequences but no global ids", i, p->num_seqs);
            goto out;
        }
        if (rp_add_overflow(tokens, p->num_tokens, &tokens)) {
            st = rp_fail(err, RP_ERANGE, "stats merge: the parts' token counts overflow");
            goto out;
        }
        uint64_t pos = 0;
        for (int32_t s = 0; s < p->num_seqs; s++) {
            const int32_t g = ids[i][s];
            if (g < 0 || g >= num_seqs) {
                st = rp_fail(err, RP_EINVAL,
                             "stats merge: part %d sequence %d has global sequence id %d, outside [0, %d)", i, s, g,
                             num_seqs);
                if (err) err->sequence = g;
                goto out;
            }
            if (src_part[g] >= 0) {
                st = rp_fail(err, RP_EINVAL, "stats merge: global sequence id %d is in parts %d and %d", g,
                             src_part[g], i);
                if (err) err->sequence = g;
                goto out;
            }
            src_part[g] = i;
            src_off[g] = pos;
            pos += cells * p->width[s];
        }
    }
    for (int32_t g = 0; g < num_seqs; g++)
        if (src_part[g] < 0) {
            st = rp_fail(err, RP_EINVAL, "stats merge: global sequence id %d is in no part (%d parts, %d sequences)",
                         g, num_parts, num_seqs);
            if (err) err->sequence = g;
            goto out;
        }

    /* widths and offsets in global order; the index of a sequence inside its part is
     * found again from its offset's width, so keep each part's width by id */
    m = rp_calloc(ctx, 1, sizeof *m);
    if (!m) {
        st = rp_fail_nomem(err, "merged statistics");
        goto out;
    }
    m->ctx = ctx;
    m->num_seqs = num_seqs;
    m->num_layers = L;
    m->num_experts = E;
    m->top_k = p0->top_k;
    m->num_tokens = tokens;
    m->expert_load = rp_calloc(ctx, cells, sizeof(int64_t));
    m->width = rp_alloc(ctx, (size_t)num_seqs + 1);
    m->offset = rp_alloc(ctx, ((size_t)num_seqs + 1) * sizeof(uint64_t));
    acc = rp_calloc(ctx, cells, sizeof *acc);
    if (!m->expert_load || !m->width || !m->offset || !acc) {
        st = rp_fail_nomem(err, "merged statistics");
        goto out;
    }
    for (int32_t i = 0; i < num_parts; i++)
        for (int32_t s = 0; s < parts[i].num_seqs; s++) m->width[ids[i][s]] = parts[i].width[s];
    uint64_t pos = 0;
    for (int32_t g = 0; g < num_seqs; g++) {
        m->offset[g] = pos;
        pos += cells * m->width[g];
    }
    m->offset[num_seqs] = pos;
    if (pos > SIZE_MAX / 2) {
        st = rp_fail(err, RP_ERANGE, "stats merge: %llu histogram bytes overflow memory", (unsigned long long)pos);
        goto out;
    }
    if (reuse && reuse->ctx == ctx && reuse->hist_cap >= (size_t)pos && reuse->hist_cap > 0) {
        /* the earlier merge's histogram bytes, already faulted in (nothing below fails,
         * so `reuse` is whole on every error) */
        m->hist = reuse->hist;
        m->hist_cap = reuse->hist_cap;
        reuse->hist = NULL;
        reuse->hist_cap = 0;
    } else {
        m->hist = rp_alloc(ctx, (size_t)pos);
        if (!m->hist) {
            st = rp_fail_nomem(err, "merged statistics");
            goto out;
        }
        m->hist_cap = (size_t)pos;
    }
    const bool native_le = host_little_endian();
    for (int32_t g = 0; g < num_seqs; g++) {
        const part *p = &parts[src_part[g]];
        const int w = m->width[g];
        const size_t size = cells * (size_t)w;
        const unsigned char *from = p->hist + src_off[g];
        unsigned char *to = m->hist + m->offset[g];
        /* the loads are sums of the counts, as the scan makes them: the 1- and 2-byte
         * sequences' in 32-bit partial sums (as rp_stats_microbatch_loads sums), which
         * vectorize where 64-bit sums widened every count; those are copied and summed
         * in one pass (stats_copy_add_narrow) */
        const bool as_is = !p->le || native_le || w == 1;
        if (as_is && w > 0 && w < 4) stats_copy_add_narrow(acc, to, from, w, cells);
        else if (as_is) memcpy(to, from, size);
        else
            for (size_t c = 0; c < cells; c++) {
                uint32_t v = count_at(from, c, w, true);
                if (w == 2) stats_u16_put(to, c, v);
                else memcpy(to + 4 * c, &v, 4);
            }
        if (w == 4)
            for (size_t c = 0; c < cells; c++) m->expert_load[c] += stats_u32_at(to, c);
        else if (w > 0) {
            if (!as_is) stats_add_narrow(acc, to, w, cells);
            if (++narrow == STATS_NARROW_MAX) {
                stats_flush_loads(m->expert_load, acc, cells);
                narrow = 0;
            }
        }
    }
    stats_flush_loads(m->expert_load, acc, cells);
    m->bytes = sizeof *m + cells * sizeof(int64_t) + ((size_t)num_seqs + 1) +
               ((size_t)num_seqs + 1) * sizeof(uint64_t) + (size_t)pos;
    *out = m;
    m = NULL;
out:
    rp_stats_free(m);
    rp_free(ctx, src_part);
    rp_free(ctx, src_off);
    rp_free(ctx, acc);
    return st;
}

/* ---- the calls ---------------------------------------------------------------------- */

size_t rp_stats_serialized_bytes(const rp_stats *stats)
{
    return HEADER + (size_t)stats->num_seqs + (size_t)stats->offset[stats->num_seqs];
}

rp_status rp_stats_serialize(const rp_stats *stats, void *buf, size_t buf_bytes, rp_error *err)
{
    if (!stats || !buf) return rp_fail(err, RP_EINVAL, "stats serialise: statistics and buffer are required");
    const size_t need = rp_stats_serialized_bytes(stats);
    if (buf_bytes < need)
        return rp_fail(err, RP_ERANGE, "stats serialise: the buffer has %zu bytes, the statistics need %zu",
                       buf_bytes, need);
    unsigned char *b = buf;
    const int32_t n = stats->num_seqs;
    const uint64_t H = stats->offset[n];
    const size_t cells = (size_t)stats->num_layers * (size_t)stats->num_experts;
    memset(b, 0, HEADER);
    memcpy(b, MAGIC, sizeof MAGIC);
    put_le(b + 8, RP_STATS_WIRE_VERSION, 4);
    put_le(b + 12, HEADER, 4);
    put_le(b + 16, (uint32_t)n, 4);
    put_le(b + 20, (uint32_t)stats->num_layers, 4);
    put_le(b + 24, (uint32_t)stats->num_experts, 4);
    put_le(b + 28, (uint32_t)stats->top_k, 4);
    put_le(b + 32, (uint64_t)stats->num_tokens, 8);
    put_le(b + 40, H, 8);
    memcpy(b + HEADER, stats->width, (size_t)n);
    unsigned char *hist = b + HEADER + n;
    if (host_little_endian()) {
        memcpy(hist, stats->hist, (size_t)H);
    } else {
        for (int32_t s = 0; s < n; s++) {
            const int w = stats->width[s];
            const unsigned char *from = stats->hist + stats->offset[s];
            unsigned char *to = hist + stats->offset[s];
            for (size_t c = 0; c < cells; c++) put_le(to + c * (size_t)w, count_at(from, c, w, false), w);
        }
    }
    put_le(b + 48, rp_hash64(b + HEADER, (size_t)n + (size_t)H, 0), 8);
    return RP_OK;
}

rp_status rp_stats_deserialize(rp_context *ctx, const void *bytes, size_t len, rp_stats **out, rp_error *err)
{
    const void *one[1] = {bytes};
    return rp_stats_merge_serialized(ctx, 1, one, &len, NULL, -1, out, err);
}

static rp_status merge_serialized(rp_context *ctx, int32_t num_parts, const void *const *bytes, const size_t *lens,
                                  const int32_t *const *global_ids, int32_t num_seqs, rp_stats *reuse,
                                  rp_stats **out, rp_error *err);

rp_status rp_stats_merge_serialized(rp_context *ctx, int32_t num_parts, const void *const *bytes,
                                    const size_t *lens, const int32_t *const *global_ids, int32_t num_seqs,
                                    rp_stats **out, rp_error *err)
{
    return merge_serialized(ctx, num_parts, bytes, lens, global_ids, num_seqs, NULL, out, err);
}

rp_status rp_stats_merge_serialized_reusing(rp_context *ctx, int32_t num_parts, const void *const *bytes,
                                            const size_t *lens, const int32_t *const *global_ids, int32_t num_seqs,
                                            rp_stats **stats, rp_error *err)
{
    if (!stats) return rp_fail(err, RP_EINVAL, "stats merge: the statistics to reuse (*stats, or NULL) are required");
    rp_stats *merged = NULL;
    rp_status st = merge_serialized(ctx, num_parts, bytes, lens, global_ids, num_seqs, *stats, &merged, err);
    if (st != RP_OK) return st;
    rp_stats_free(*stats);
    *stats = merged;
    return RP_OK;
}

static rp_status merge_serialized(rp_context *ctx, int32_t num_parts, const void *const *bytes, const size_t *lens,
                                  const int32_t *const *global_ids, int32_t num_seqs, rp_stats *reuse,
                                  rp_stats **out, rp_error *err)
{
    /* num_seqs -1 with no ids: rp_stats_deserialize (one part, identity order) */
    const bool identity = num_seqs == -1 && !global_ids && num_parts == 1;
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "stats merge: context and output are required");
    if (num_parts < 1 || !bytes || !lens)
        return rp_fail(err, RP_EINVAL, "stats merge: %d parts (must be >= 1) and their bytes and lengths", num_parts);
    part *parts = rp_alloc(ctx, sizeof(part) * (size_t)num_parts);
    int32_t *iota = NULL;
    if (!parts) return rp_fail_nomem(err, "the merge's parts");
    rp_status st = RP_OK;
    for (int32_t i = 0; i < num_parts; i++) {
        char who[32] = "";
        if (!identity) snprintf(who, sizeof who, "part %d: ", i);
        RP_CHECK_GOTO(part_of_bytes(bytes[i], lens[i], who, &parts[i], err), st, out);
    }
    if (identity) {
        num_seqs = parts[0].num_seqs;
        iota = rp_alloc(ctx, sizeof(int32_t) * ((size_t)num_seqs + 1));
        if (!iota) {
            st = rp_fail_nomem(err, "statistics");
            goto out;
        }
        for (int32_t s = 0; s < num_seqs; s++) iota[s] = s;
        const int32_t *const ids[1] = {iota};
        st = merge_parts(ctx, 1, parts, ids, num_seqs, reuse, out, err);
    } else {
        st = merge_parts(ctx, num_parts, parts, global_ids, num_seqs, reuse, out, err);
    }
out:
    rp_free(ctx, parts);
    rp_free(ctx, iota);
    return st;
}

rp_status rp_stats_merge(rp_context *ctx, int32_t num_parts, const rp_stats *const *parts,
                         const int32_t *const *global_ids, int32_t num_seqs, rp_stats **out, rp_error *err)
{
    if (!ctx || !out) return rp_fail(err, RP_EINVAL, "stats merge: context and output are required");
    if (num_parts < 1 || !parts)
        return rp_fail(err, RP_EINVAL, "stats merge: %d parts, must be >= 1", num_parts);
    for (int32_t i = 0; i < num_parts; i++)
        if (!parts[i]) return rp_fail(err, RP_EINVAL, "stats merge: part %d is NULL", i);
    part *ps = rp_alloc(ctx, sizeof(part) * (size_t)num_parts);
    if (!ps) return rp_fail_nomem(err, "the merge's parts");
    for (int32_t i = 0; i < num_parts; i++) part_of_stats(parts[i], &ps[i]);
    rp_status st = merge_parts(ctx, num_parts, ps, global_ids, num_seqs, NULL, out, err);
    rp_free(ctx, ps);
    return st;
}

/* ---- against a batch -------------------------------------------------------------------- */

int32_t rp_stats_top_k(const rp_stats *stats) { return stats->top_k; }
int64_t rp_stats_num_tokens(const rp_stats *stats) { return stats->num_tokens; }

rp_status rp_stats_check_batch(const rp_stats *stats, const rp_batch *batch, rp_error *err)
{
    if (!stats || !batch) return rp_fail(err, RP_EINVAL, "stats: statistics and batch are required");
    const int32_t n = rp_batch_num_seqs(batch);
    if (stats->num_seqs != n || stats->num_tokens != rp_batch_num_tokens(batch))
        return rp_fail(err, RP_EINVAL,
                       "stats: the statistics have %d sequences and %lld tokens, but the batch has %d and %lld",
                       stats->num_seqs, (long long)stats->num_tokens, n, (long long)rp_batch_num_tokens(batch));
    /* Every layer of a sequence sums to the same (statistics keep that invariant, and
     * the reader checks it), so layer 0 tells the length. */
    const int32_t E = stats->num_experts;
    for (int32_t s = 0; s < n; s++) {
        const int64_t sum = stats_row_sum(stats->hist + stats->offset[s], E, stats->width[s]);
        const int64_t len = rp_batch_seq_len(batch, s);
        if (sum != len * stats->top_k) {
            rp_fail(err, RP_EINVAL,
                    "stats: sequence %d routes %lld choices a layer, but the batch gives it %lld tokens x top-%d "
                    "= %lld (statistics of another batch, or sequences in another order?)",
                    s, (long long)sum, (long long)len, stats->top_k, (long long)(len * stats->top_k));
            if (err) err->sequence = s;
            return RP_EINVAL;
        }
    }
    return RP_OK;
}

/* ---- a copy, for the scheduler's last-step inputs ---------------------------------------- */

rp_status stats_copy(rp_context *ctx, const rp_stats *stats, rp_stats **out, rp_error *err)
{
    /* Field by field, one memcpy each: the statistics are already checked and in their
     * final layout, so nothing is re-read count by count (the merge's path did, at a
     * third of a step's planning time at the reference scale). */
    const int32_t n = stats->num_seqs;
    const size_t cells = (size_t)stats->num_layers * (size_t)stats->num_experts;
    const size_t hist_bytes = (size_t)stats->offset[n];
    rp_stats *c = rp_calloc(ctx, 1, sizeof *c);
    if (!c) return rp_fail_nomem(err, "a copy of the statistics");
    *c = *stats;
    c->ctx = ctx;
    c->hist_cap = 0;
    c->expert_load = rp_alloc(ctx, cells * sizeof(int64_t));
    c->width = rp_alloc(ctx, (size_t)n + 1);
    c->offset = rp_alloc(ctx, ((size_t)n + 1) * sizeof(uint64_t));
    c->hist = rp_alloc(ctx, hist_bytes > 0 ? hist_bytes : 1);
    if (!c->expert_load || !c->width || !c->offset || !c->hist) {
        rp_stats_free(c);
        return rp_fail_nomem(err, "a copy of the statistics");
    }
    memcpy(c->expert_load, stats->expert_load, cells * sizeof(int64_t));
    memcpy(c->width, stats->width, (size_t)n);
    c->width[n] = 0;
    memcpy(c->offset, stats->offset, ((size_t)n + 1) * sizeof(uint64_t));
    memcpy(c->hist, stats->hist, hist_bytes);
    c->bytes = sizeof *c + cells * sizeof(int64_t) + ((size_t)n + 1) + ((size_t)n + 1) * sizeof(uint64_t) + hist_bytes;
    *out = c;
    return RP_OK;
}

rp_status stats_copy_reusing(rp_context *ctx, const rp_stats *stats, rp_stats **spare, rp_stats **out, rp_error *err)
{
    rp_stats *c = *spare;
    const int32_t n = stats->num_seqs;
    if (!c || c->ctx != ctx || c->num_seqs != n || c->num_layers != stats->num_layers ||
        c->num_experts != stats->num_experts) {
        rp_stats_free(c);
        *spare = NULL;
        return stats_copy(ctx, stats, out, err);
    }
    /* the spare's arrays have the right sizes but the histograms' bytes: fit those (a
     * realloc within memory already touched mostly), then copy as stats_copy does */
    const size_t cells = (size_t)stats->num_layers * (size_t)stats->num_experts;
    const size_t hist_bytes = (size_t)stats->offset[n];
    if ((size_t)c->offset[n] != hist_bytes) {
        unsigned char *h = rp_realloc(ctx, c->hist, hist_bytes > 0 ? hist_bytes : 1);
        if (!h) return rp_fail_nomem(err, "a copy of the statistics");
        c->hist = h;
    }
    c->top_k = stats->top_k;
    c->num_tokens = stats->num_tokens;
    memcpy(c->expert_load, stats->expert_load, cells * sizeof(int64_t));
    memcpy(c->width, stats->width, (size_t)n);
    memcpy(c->offset, stats->offset, ((size_t)n + 1) * sizeof(uint64_t));
    memcpy(c->hist, stats->hist, hist_bytes);
    c->bytes = sizeof *c + cells * sizeof(int64_t) + ((size_t)n + 1) + ((size_t)n + 1) * sizeof(uint64_t) + hist_bytes;
    *out = c;
    *spare = NULL;
    return RP_OK;
}
