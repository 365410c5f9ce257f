/* The 4-rank plan agreement test: runs tests/mpi/test_sched_mpi under
 * `mpirun --allow-run-as-root --oversubscribe -np 4` and relays each of its TAP lines
 * as a check here. Skips when the library was built without MPI or mpirun is missing.
 * Sanitizer builds pass tests/lsan.supp to the ranks, for Open MPI's own leaks. */
#include "tap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROGRAM RP_BINARY_DIR "/tests/mpi/test_sched_mpi"
#define SUPPRESSIONS RP_SOURCE_DIR "/tests/lsan.supp"
#define EXPECTED_CHECKS 13

int main(void)
{
    if (access(PROGRAM, X_OK) != 0) {
        skip(1, "the MPI scheduler test was not built (no MPI found at configure time)");
        return tap_done();
    }
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        skip(1, "mpirun not found");
        return tap_done();
    }
    char lsan[1024], asan[1024];
    const char *old = getenv("LSAN_OPTIONS");
    if (old && strstr(old, "suppressions=")) snprintf(lsan, sizeof lsan, "%s", old);
    else snprintf(lsan, sizeof lsan, "%s%ssuppressions=%s:print_suppressions=0", old ? old : "",
                  old && *old ? ":" : "", SUPPRESSIONS);
    setenv("LSAN_OPTIONS", lsan, 1);
    old = getenv("ASAN_OPTIONS");
    snprintf(asan, sizeof asan, "%s%sfast_unwind_on_malloc=0", old ? old : "", old && *old ? ":" : "");
    setenv("ASAN_OPTIONS", asan, 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "timeout -k 5 240 mpirun --allow-run-as-root --oversubscribe -np 4 -x LSAN_OPTIONS -x ASAN_OPTIONS "
             "%s %s 2>&1",
             getenv("UBSAN_OPTIONS") ? "-x UBSAN_OPTIONS" : "", PROGRAM);
    FILE *p = popen(cmd, "r");
    if (!p) {
        ok(0, "mpirun could not be started");
        return tap_done();
    }
    char line[4096];
    int checks = 0;
    while (fgets(line, sizeof line, p)) {
        line[strcspn(line, "\n")] = '\0';
        const char *text = NULL;
        int pass = 0;
        if (strncmp(line, "ok ", 3) == 0) pass = 1, text = line + 3;
        else if (strncmp(line, "not ok ", 7) == 0) text = line + 7;
        if (text) {
            while (*text >= '0' && *text <= '9') text++;
            if (strncmp(text, " - ", 3) == 0) text += 3;
            ok(pass, "4 ranks: %s", text);
            checks++;
        } else if (strncmp(line, "1..", 3) != 0) {
            printf("# %s\n", line[0] == '#' ? line + (line[1] == ' ' ? 2 : 1) : line);
        }
    }
    int status = pclose(p);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    ok(code == 0 && checks == EXPECTED_CHECKS, "mpirun -np 4 ran %d of %d checks and exited with 0 (got %d)", checks,
       EXPECTED_CHECKS, code);
    return tap_done();
}
