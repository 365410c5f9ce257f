/* Fuzzes the .npy reader (rp_npy_open: magic, versions 1-3, the header dict, dtype,
 * order, shape against the data size). An array that opens must hold count elements
 * of its dtype, every one readable. */
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    fuzz_file f;
    fuzz_file_open(&f, data, size);
    rp_npy *npy = NULL;
    rp_error err;
    if (rp_npy_open(ctx, f.path, &npy, &err) == RP_OK) {
        int32_t ndim = rp_npy_ndim(npy);
        const int64_t *shape = rp_npy_shape(npy);
        int64_t count = 1;
        for (int32_t d = 0; d < ndim; d++) {
            FUZZ_REQUIRE(shape[d] >= 0, "dimension %d is %lld", d, (long long)shape[d]);
            FUZZ_REQUIRE(!__builtin_mul_overflow(count, shape[d], &count), "shape overflows");
        }
        FUZZ_REQUIRE(count == rp_npy_count(npy), "count %lld, shape says %lld",
                     (long long)rp_npy_count(npy), (long long)count);
        FUZZ_REQUIRE(count <= (int64_t)size, "%lld elements in a %zu-byte file", (long long)count, size);
        FUZZ_REQUIRE(count == 0 || rp_npy_data(npy), "no data for %lld elements", (long long)count);
        int64_t sum = 0;
        for (int64_t i = 0; i < count; i++) sum ^= rp_npy_get(npy, i);
        (void)sum;
        rp_npy_close(npy);
    }
    fuzz_file_close(&f);
    return 0;
}
