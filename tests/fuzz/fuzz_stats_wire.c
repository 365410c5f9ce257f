/* Fuzzes the reader of serialised routing statistics, what the ranks exchange every step
 * (rp_stats_deserialize, rp_stats_merge_serialized; layout in routepack/stats.h). Each
 * input is read as it is and once more with its payload checksum made right, so the
 * mutations reach the checks behind it. Statistics that read back must serialise to the
 * same bytes (the form is canonical) and merge, as one part, into the same statistics. */
#include "fuzz_util.h"
#include "stats_internal.h"

#define HEADER RP_STATS_WIRE_HEADER_BYTES

static void read_back(const uint8_t *bytes, size_t len)
{
    rp_context *ctx = fuzz_context();
    rp_stats *stats = NULL;
    rp_error err;
    if (rp_stats_deserialize(ctx, bytes, len, &stats, &err) != RP_OK) return;
    size_t n = rp_stats_serialized_bytes(stats);
    FUZZ_REQUIRE(n == len, "statistics read from %zu bytes serialise to %zu", len, n);
    uint8_t *again = malloc(n);
    FUZZ_REQUIRE(again, "out of memory");
    FUZZ_REQUIRE(rp_stats_serialize(stats, again, n, &err) == RP_OK, "serialise: %s", err.text);
    FUZZ_REQUIRE(memcmp(again, bytes, n) == 0, "statistics serialise to other bytes than they were read from");
    free(again);

    int32_t num_seqs = rp_stats_num_seqs(stats);
    int32_t *ids = malloc(((size_t)num_seqs + 1) * sizeof *ids);
    FUZZ_REQUIRE(ids, "out of memory");
    for (int32_t s = 0; s < num_seqs; s++) ids[s] = s;
    const void *parts[1] = {bytes};
    const int32_t *part_ids[1] = {ids};
    rp_stats *merged = NULL;
    FUZZ_REQUIRE(rp_stats_merge_serialized(ctx, 1, parts, &len, part_ids, num_seqs, &merged, &err) == RP_OK,
                 "one part that deserialises does not merge: %s", err.text);
    FUZZ_REQUIRE(stats_same(stats, merged), "one part merges into other statistics");
    rp_stats_free(merged);
    free(ids);
    rp_stats_free(stats);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* No shape is skipped: the reader bounds its work by the bytes (layers x experts at
     * most the histogram bytes, or 2^24 cells when no sequence has counts). */
    read_back(data, size);
    if (size >= HEADER) {
        uint8_t *fixed = malloc(size);
        FUZZ_REQUIRE(fixed, "out of memory");
        memcpy(fixed, data, size);
        uint64_t sum = rp_hash64(fixed + HEADER, size - HEADER, 0);
        for (int i = 0; i < 8; i++) fixed[48 + i] = (uint8_t)(sum >> (8 * i));
        read_back(fixed, size);
        free(fixed);
    }
    return 0;
}
