/* Fuzzes the generator's CSV length reader (gen_read_csv_column: header, quoting, blank
 * lines, the integer column the settings name). */
#include "fuzz_util.h"
#include "gen_internal.h"
#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rp_context *ctx = fuzz_context();
    fuzz_file f;
    fuzz_file_open(&f, data, size);
    int32_t *values = NULL, count = 0;
    bool missing = false;
    rp_error err;
    if (gen_read_csv_column(ctx, f.path, "ContextTokens", &values, &count, &missing, &err) == RP_OK) {
        FUZZ_REQUIRE(!missing, "a CSV read with its column missing");
        FUZZ_REQUIRE(count >= 0 && (size_t)count <= size, "%d values from %zu bytes", count, size);
        for (int32_t i = 0; i < count; i++) FUZZ_REQUIRE(values[i] >= 0, "value %d is %d", i, values[i]);
        rp_free(ctx, values);
    }
    fuzz_file_close(&f);
    return 0;
}
