/* routepack simulate estimates what a run will hold before it makes any scheduler and
 * refuses one over --max-memory, naming the estimate and the key to lower (a config
 * inside the documented ranges, limits.num_microbatches = 100000, made it allocate
 * gigabytes, with no warning). */
#include "tap.h"
#include "test_util.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static char tmpdir[64];
static char out[16384];

/* config-small.json with one key replaced, written to NAME in the temp folder. */
static const char *config_with(const char *name, const char *section, const char *key, json_t *value)
{
    json_error_t je;
    json_t *c = json_load_file(RP_SOURCE_DIR "/examples/config-small.json", 0, &je);
    json_object_set_new(json_object_get(c, section), key, value);
    const char *path = temp_path(tmpdir, name);
    json_dump_file(c, path, 0);
    json_decref(c);
    return path;
}

int main(void)
{
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "cli-memory")) {
        ok(0, "temp dir");
        return tap_done();
    }
    int rc = run_routepack(out, sizeof out, "simulate --policies token_kk+eplb --steps 1");
    is_int(rc, 0, "the bundled example runs under the default --max-memory");

    char mbs[512];
    snprintf(mbs, sizeof mbs, "%s", config_with("mbs.json", "limits", "num_microbatches", json_integer(100000)));
    rc = run_routepack(out, sizeof out, "simulate --config '%s' --policies token_kk+eplb --steps 1", mbs);
    ok(rc == 1, "100000 microbatches a step: refused before it starts (exit %d)", rc);
    like(out, "more than --max-memory 4.29 GB", "names the cap");
    like(out, "plans of 100000 microbatches x 16 layers x 8 GPUs x 64 experts", "names the shape it priced");
    like(out, "lower limits.num_microbatches, or raise --max-memory", "and the key to change: %s", out);

    rc = run_routepack(out, sizeof out, "simulate --policies token_kk+eplb --steps 1 --microbatches 100000");
    ok(rc == 1 && strstr(out, "lower --microbatches"), "--microbatches 100000: the option is named: %s", out);

    char slots[512];
    snprintf(slots, sizeof slots, "%s", config_with("slots.json", "topology", "slots_per_gpu", json_integer(200000)));
    rc = run_routepack(out, sizeof out,
                       "simulate --config '%s' --policies token_kk+eplb --steps 1 --max-memory 100000000", slots);
    ok(rc == 1 && strstr(out, "lower topology.slots_per_gpu"), "200000 slots a GPU: slots_per_gpu is named: %s",
       out);

    rc = run_routepack(out, sizeof out, "simulate --policies token_kk+eplb --steps 1 --max-memory 1000");
    ok(rc == 1 && strstr(out, "more than --max-memory 1.0 KB (1000 bytes)") && !strstr(out, "0.00 GB"),
       "a small --max-memory refuses the example, each figure in a unit that shows it: %s",
       out);
    rc = run_routepack(out, sizeof out, "simulate --steps 1 --max-memory 0");
    ok(rc == 2 && strstr(out, "--max-memory must be >= 1"), "--max-memory 0 is a usage error: %s", out);
    temp_dir_remove(tmpdir);
    return tap_done();
}
