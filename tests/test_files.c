/* Input files that are not regular files: a FIFO given as a config, plan, generator
 * settings, counts or lengths file, trace or .npy array is refused at once (before, open()
 * waited for a writer for ever), /dev/zero is refused before it is read (before, it was
 * read until memory ran out), a directory too; a text file over the cap is refused
 * before anything is allocated. An alarm turns a hang into a failure. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[64];
static const char *tmp(const char *name) { return temp_path(tmpdir, name); }

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "not ok - an open blocked for 20 s (a FIFO or device was waited on)\n";
    if (write(1, msg, sizeof msg - 1) < 0) _exit(2);
    _exit(1);
}

/* Each of the non-regular inputs, with the words its message must hold. */
typedef struct special {
    const char *path, *label, *kind;
} special;

static special specials[3];

static void refused(rp_status st, const rp_error *err, const char *what, const special *sp)
{
    is_int(st, RP_EIO, "%s: %s is refused", what, sp->label);
    like(err->text, sp->kind, "%s: %s: the message names the file type: %s", what, sp->label, err->text);
}

static void test_library(rp_context *ctx, const rp_config *cfg)
{
    for (int i = 0; i < 3; i++) {
        const special *sp = &specials[i];
        rp_error err;
        rp_config *c = NULL;
        refused(rp_config_load(ctx, sp->path, &c, &err), &err, "config", sp);
        rp_plan *plan = NULL;
        refused(rp_plan_load(ctx, cfg, sp->path, &plan, &err), &err, "plan", sp);
        rp_gen *gen = NULL;
        refused(rp_gen_load(ctx, sp->path, &gen, &err), &err, "generator settings", sp);
        rp_trace *t = NULL;
        refused(rp_trace_open(ctx, sp->path, 0, &t, &err), &err, "trace", sp);
        rp_npy *npy = NULL;
        refused(rp_npy_open(ctx, sp->path, &npy, &err), &err, ".npy array", sp);
        rp_trace_writer *w = NULL;
        refused(rp_trace_writer_open_append(ctx, sp->path, 64, &w, &err), &err, "trace to append to", sp);

        /* files named inside generator settings: the counts file and a lengths CSV */
        char settings[2048];
        snprintf(settings, sizeof settings,
                 "{\"seed\": 1, \"steps\": 1, \"num_prompts\": 2, \"group_size\": 2,\n"
                 " \"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8},\n"
                 " \"experts\": {\"counts_file\": \"%s\", \"model\": \"allenai/OLMoE-1B-7B-0924\",\n"
                 "             \"domains\": {\"c4\": 1.0}},\n"
                 " \"lengths\": {\"prompt\": {\"lognormal\": {\"median\": 40, \"sigma\": 1.0}},\n"
                 "             \"response\": {\"lognormal\": {\"median\": 40, \"sigma\": 1.0}, \"cap\": 320}}}\n",
                 sp->path);
        spit(tmp("gen-counts.json"), settings, strlen(settings));
        refused(rp_gen_load(ctx, tmp("gen-counts.json"), &gen, &err), &err, "a counts file", sp);
        snprintf(settings, sizeof settings,
                 "{\"seed\": 1, \"steps\": 1, \"num_prompts\": 2, \"group_size\": 2,\n"
                 " \"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8},\n"
                 " \"experts\": {\"counts_file\": \"%s/examples/data/olmoe_expert_counts.json\",\n"
                 "             \"model\": \"allenai/OLMoE-1B-7B-0924\", \"domains\": {\"c4\": 1.0}},\n"
                 " \"lengths\": {\"prompt\": {\"csv\": \"%s\", \"column\": \"ContextTokens\"},\n"
                 "             \"response\": {\"lognormal\": {\"median\": 40, \"sigma\": 1.0}, \"cap\": 320}}}\n",
                 RP_SOURCE_DIR, sp->path);
        spit(tmp("gen-csv.json"), settings, strlen(settings));
        refused(rp_gen_load(ctx, tmp("gen-csv.json"), &gen, &err), &err, "a lengths CSV", sp);
    }
}

/* The size cap is checked against the file's size before reading. */
static void test_cap(rp_context *ctx)
{
    spit(tmp("ten.json"), "0123456789", 10);
    char *text = NULL;
    size_t len = 0;
    rp_error err;
    is_int(rp_read_file_max(ctx, tmp("ten.json"), 9, &text, &len, &err), RP_ERANGE, "a file over the cap is refused");
    like(err.text, "is 10 bytes; a file read whole may be at most 9 bytes", "naming its size and the cap");
    ok(text == NULL, "nothing is returned");
    is_int(rp_read_file_max(ctx, tmp("ten.json"), 10, &text, &len, &err), RP_OK, "a file at the cap is read");
    ok(text && len == 10 && strcmp(text, "0123456789") == 0, "whole, NUL-terminated");
    rp_text_free(ctx, text);

    int fd = -1;
    int64_t size = -1;
    is_int(rp_file_open_regular(tmp("ten.json"), O_RDONLY, &fd, &size, &err), RP_OK, "a regular file opens");
    int fl = fd >= 0 ? fcntl(fd, F_GETFL) : -1;
    ok(fl >= 0 && !(fl & O_NONBLOCK) && size == 10, "blocking again, with its size");
    if (fd >= 0) close(fd);
    is_int(rp_file_open_regular(tmp("missing.json"), O_RDONLY, &fd, &size, &err), RP_EIO, "a missing file");
    like(err.text, "cannot open: No such file", "says so");
}

/* The command-line tool reads through the same functions. */
static void test_cli(void)
{
    static char out[8192];
    const special *fifo = &specials[0];
    int rc = run_routepack(out, sizeof out, "stats '%s'", fifo->path);
    ok(rc != 0 && strstr(out, "is a FIFO, not a regular file"), "routepack stats FIFO fails at once: %s", out);
    rc = run_routepack(out, sizeof out, "simulate --config '%s' --gen '%s/examples/gen-small.json' --steps 1",
                       fifo->path, RP_SOURCE_DIR);
    ok(rc != 0 && strstr(out, "is a FIFO, not a regular file"), "routepack simulate --config FIFO fails at once: %s",
       out);
    rc = run_routepack(out, sizeof out, "simulate --config '%s/examples/config-small.json' --gen /dev/zero --steps 1",
                       RP_SOURCE_DIR);
    ok(rc != 0 && strstr(out, "is a character device"), "routepack simulate --gen /dev/zero fails at once: %s", out);
}

int main(void)
{
    signal(SIGALRM, on_alarm);
    alarm(20);
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "files") || mkfifo(tmp("fifo"), 0600) != 0) {
        ok(0, "mkfifo");
        return tap_done();
    }
    specials[0] = (special){strdup(tmp("fifo")), "a FIFO without a writer", "is a FIFO, not a regular file"};
    specials[1] = (special){"/dev/zero", "/dev/zero", "is a character device, not a regular file"};
    specials[2] = (special){strdup(tmpdir), "a directory", "is a directory, not a regular file"};
    rp_context *ctx = NULL;
    rp_context_new(NULL, NULL, &ctx);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &cfg, &err) != RP_OK) {
        ok(0, "setup: %s", err.text);
        return tap_done();
    }
    test_library(ctx, cfg);
    test_cap(ctx);
    test_cli();
    rp_config_free(cfg);
    rp_context_free(ctx);
    temp_dir_remove(tmpdir);
    return tap_done();
}
