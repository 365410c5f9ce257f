/* Fuzzes the .npz reader (rp_npz_open: the zip structure, zip64 records, CRC-32 and each
 * member's .npy header). An archive that opens must give each member's name and array,
 * every element readable, and find each member by its name. */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    fuzz_file f;
    fuzz_file_open(&f, data, size);
    rp_npz *npz = NULL;
    rp_error err;
    if (rp_npz_open(ctx, f.path, &npz, &err) == RP_OK) {
        int32_t n = rp_npz_count(npz);
        FUZZ_REQUIRE(n >= 0, "%d members", n);
        for (int32_t i = 0; i < n; i++) {
            const char *name = rp_npz_name(npz, i);
            const rp_npy *npy = rp_npz_array(npz, i);
            FUZZ_REQUIRE(name && npy, "member %d has no name or array", i);
            FUZZ_REQUIRE(rp_npz_find(npz, name) == npy, "member %d ('%s') is not found by its name", i, name);
            int64_t count = rp_npy_count(npy);
            FUZZ_REQUIRE(count >= 0 && count <= (int64_t)size, "member %d: %lld elements in %zu bytes", i,
                         (long long)count, size);
            int64_t sum = 0;
            for (int64_t e = 0; e < count; e++) sum ^= rp_npy_get(npy, e);
            (void)sum;
        }
        rp_npz_close(npz);
    }
    fuzz_file_close(&f);
    return 0;
}
