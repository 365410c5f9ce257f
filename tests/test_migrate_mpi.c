/* Runs the MPI migration tests (tests/mpi/test_migrate_mpi.c) under
 * `mpirun --allow-run-as-root --oversubscribe -np 4` and relays their TAP
 * (mpirun_relay, tests/test_util.h); skips when the library was built without MPI or
 * mpirun is missing. */
#include "tap.h"
#include "test_util.h"

#define PROGRAM RP_BINARY_DIR "/tests/mpi/test_migrate_mpi"

int main(void)
{
    int checks;
    bool skipped;
    int code = mpirun_relay(PROGRAM, "MPI transport not built (no MPI found at configure time)", "", &checks,
                            &skipped);
    if (code != -2 && !skipped)
        ok(code == 0 && checks > 0, "mpirun -np 4 ran %d checks and exited with 0 (got %d)", checks, code);
    return tap_done();
}
