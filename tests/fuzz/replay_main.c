/* Runs one fuzz harness over its corpus without libFuzzer, with any compiler: the TAP
 * program test_fuzz_<harness>.t, so every seed and every kept crash input is replayed by
 * the ordinary suite (and its ASan build) too. One "ok" per input; a harness that finds
 * a broken promise aborts, which fails the test with the input named last.
 * Usage: test_fuzz_<harness>.t [DIR]   (default tests/fuzz/corpus/<harness>) */
#include "fuzz_util.h"
#include "tap.h"

#include <dirent.h>

static int by_name(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

static int regular(const struct dirent *d)
{
    return d->d_name[0] != '.';
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : RP_SOURCE_DIR "/tests/fuzz/corpus/" RP_FUZZ_HARNESS;
    struct dirent **names;
    int n = scandir(dir, &names, regular, by_name);
    ok(n > 0, "%s has inputs", dir);
    for (int i = 0; i < n; i++) {
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]->d_name);
        FILE *f = fopen(path, "rb");
        uint8_t *data = NULL;
        long len = -1;
        if (f && fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
            data = malloc((size_t)len + 1);
            if (data && fread(data, 1, (size_t)len, f) != (size_t)len) len = -1;
        }
        if (f) fclose(f);
        if (!data || len < 0) {
            ok(0, "%s reads", names[i]->d_name);
        } else {
            printf("# %s\n", names[i]->d_name);
            fflush(stdout);
            LLVMFuzzerTestOneInput(data, (size_t)len);
            ok(1, "%s", names[i]->d_name);
        }
        free(data);
        free(names[i]);
    }
    if (n > 0) free(names);
    return tap_done();
}
