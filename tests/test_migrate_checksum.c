/* The checksum the migration executor compares: the streaming form of
 * rp_checksum_expert (core/checksum_internal.h, used where bytes arrive in pieces, as
 * NCCL's host fallback reads them) and the host transports' checksum callback, both
 * against rp_checksum_expert of the same bytes. */
#include "routepack/routepack.h"
#include "checksum_internal.h"
#include "transport.h"
#include "tap.h"

#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static unsigned char *random_bytes(size_t n)
{
    unsigned char *p = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)rnd(256);
    return p;
}

static void test_stream(void)
{
    const size_t sizes[] = {0, 1, 31, 4095, 4096, 4097, 8192, 12293, 100000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        const size_t n = sizes[k];
        unsigned char *p = random_bytes(n);
        const uint64_t want = rp_checksum_bytes(p, n);
        int good = 0;
        const int tries = 20;
        for (int r = 0; r < tries; r++) {
            rp_checksum_state st;
            rp_checksum_init(&st);
            size_t done = 0;
            while (done < n) {
                /* pieces from empty to several blocks, so they split blocks anywhere */
                size_t piece = r % 4 == 0 ? (size_t)rnd(9) : (size_t)rnd(3 * RP_CHECKSUM_BLOCK);
                if (piece > n - done) piece = n - done;
                rp_checksum_update(&st, p + done, piece);
                done += piece;
            }
            good += rp_checksum_final(&st) == want && rp_checksum_final(&st) == want;
        }
        is_int(good, tries, "stream: %zu bytes fed in %d random cuttings give rp_checksum_bytes", n, tries);
        free(p);
    }
    /* final leaves the state as it was: more bytes continue the same expert */
    unsigned char *p = random_bytes(10000);
    rp_checksum_state st;
    rp_checksum_init(&st);
    rp_checksum_update(&st, p, 5000);
    is_int(rp_checksum_final(&st), rp_checksum_bytes(p, 5000), "stream: final after 5000 bytes");
    rp_checksum_update(&st, p + 5000, 5000);
    is_int(rp_checksum_final(&st), rp_checksum_bytes(p, 10000), "stream: bytes fed after a final continue the expert");
    rp_checksum_init(&st);
    is_int(rp_checksum_final(&st), (long long)0xEF46DB3751D8E999ULL, "stream: nothing fed: XXH64 of nothing");
    free(p);
}

/* The local and MPI transports' callback: several experts of several parts in one call. */
static void test_host_callback(void)
{
    rp_context *ctx;
    rp_context_new(NULL, NULL, &ctx);
    rp_local_hub *hub = NULL;
    rp_transport *t = NULL;
    rp_local_hub_new(ctx, 1, &hub, NULL);
    rp_transport_local_new(hub, 0, &t, NULL);
    unsigned char *mem = random_bytes(30000);
    /* expert 0: three parts with an empty one between; expert 1: no parts; expert 2:
     * one part; expert 3: the bytes of expert 0 gathered into one part */
    const void *ptr[] = {mem, NULL, mem + 4000, mem + 20000, mem};
    const size_t bytes[] = {4000, 0, 9001, 7, 13001};
    const int32_t begin[] = {0, 3, 3, 4, 5};
    uint64_t sums[4] = {0, 0, 0, 0};
    rp_error err;
    ok(t->vt->checksum(t, ptr, bytes, begin, 4, sums, rp_now_s() + 5.0, &err) == RP_OK,
       "host callback: four experts in one call");
    is_int(sums[0], rp_checksum_expert(ptr, bytes, 3), "host callback: an expert of three parts");
    is_int(sums[1], (long long)0xEF46DB3751D8E999ULL, "host callback: an expert without parts");
    is_int(sums[2], rp_checksum_bytes(mem + 20000, 7), "host callback: an expert of one part");
    is_int(sums[3], sums[0], "host callback: gathered or in parts, the same checksum");
    ok(t->vt->checksum(t, NULL, NULL, NULL, 0, NULL, rp_now_s() + 5.0, &err) == RP_OK,
       "host callback: no experts");
    free(mem);
    rp_transport_free(t);
    rp_local_hub_free(hub);
    rp_context_free(ctx);
}

/* The commit's swap with its check (rp_transport_swap_sum_host): each side ends with
 * the other's bytes, and the checksum is the slot's new bytes', for every alignment of
 * either side (the streaming stores take 16-byte aligned staging) and lengths around
 * the 64-byte lines and 32 KiB chunks it works in. */
static void test_swap_sum(void)
{
    const size_t sizes[] = {0, 1, 15, 16, 63, 64, 65, 4096, 32767, 32768, 32769, 100003};
    bool swapped = true, summed = true;
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (size_t oa = 0; oa < 16; oa += 5)
            for (size_t ob = 0; ob < 16; ob += 3) {
                size_t n = sizes[si];
                unsigned char *a0 = random_bytes(n + 32), *b0 = random_bytes(n + 32);
                unsigned char *a = random_bytes(n + 32), *b = random_bytes(n + 32);
                memcpy(a, a0, n + 32);
                memcpy(b, b0, n + 32);
                rp_checksum_state st;
                rp_checksum_init(&st);
                rp_transport_swap_sum_host(a + oa, b + ob, n, &st);
                swapped = swapped && memcmp(a + oa, b0 + ob, n) == 0 && memcmp(b + ob, a0 + oa, n) == 0 &&
                          memcmp(a, a0, oa) == 0 && memcmp(a + oa + n, a0 + oa + n, 32 - oa) == 0 &&
                          memcmp(b, b0, ob) == 0 && memcmp(b + ob + n, b0 + ob + n, 32 - ob) == 0;
                summed = summed && rp_checksum_final(&st) == rp_checksum_bytes(b0 + ob, n);
                free(a0), free(b0), free(a), free(b);
            }
    ok(swapped, "swap with check: both sides swapped, nothing around them touched, at every alignment");
    ok(summed, "swap with check: the checksum of what the slot now holds");
}

int main(void)
{
    test_stream();
    test_host_callback();
    test_swap_sum();
    return tap_done();
}
