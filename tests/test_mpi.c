/* The 4-rank plan agreement test: runs tests/mpi/test_sched_mpi under
 * `mpirun --allow-run-as-root --oversubscribe -np 4` and relays each of its TAP lines
 * as a check here (mpirun_relay, tests/test_util.h). Skips when the library was built
 * without MPI or mpirun is missing. */
#include "tap.h"
#include "test_util.h"

#define PROGRAM RP_BINARY_DIR "/tests/mpi/test_sched_mpi"
#define EXPECTED_CHECKS 13

int main(void)
{
    int checks;
    bool skipped;
    int code = mpirun_relay(PROGRAM, "the MPI scheduler test was not built (no MPI found at configure time)",
                            "4 ranks: ", &checks, &skipped);
    if (code != -2 && !skipped)
        ok(code == 0 && checks == EXPECTED_CHECKS, "mpirun -np 4 ran %d of %d checks and exited with 0 (got %d)",
           checks, EXPECTED_CHECKS, code);
    return tap_done();
}
