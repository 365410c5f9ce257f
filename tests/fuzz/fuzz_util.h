/* What the libFuzzer harnesses share: one context for the whole run, inputs handed to
 * path-based loaders as an in-memory file, and the repository's example files read once
 * at start-up. A harness aborts (a crash libFuzzer reports) only when the library breaks
 * a promise of its headers; an input the library refuses with an error is a pass. */
#ifndef RP_FUZZ_UTIL_H
#define RP_FUZZ_UTIL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "routepack/routepack.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A failed promise: print it and abort, so libFuzzer keeps the input as a crash. */
#define FUZZ_REQUIRE(cond, ...)                                   \
    do {                                                          \
        if (!(cond)) {                                            \
            fprintf(stderr, "fuzz: %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                         \
            fputc('\n', stderr);                                  \
            abort();                                              \
        }                                                         \
    } while (0)

/* One context for the whole run (freed by the process exit: not a leak, it stays
 * reachable). */
static inline rp_context *fuzz_context(void)
{
    static rp_context *ctx;
    if (!ctx) FUZZ_REQUIRE(rp_context_new(NULL, NULL, &ctx) == RP_OK, "rp_context_new failed");
    return ctx;
}

/* An input as a file for the loaders that take a path (they mmap or read it): a memfd,
 * named through /proc/self/fd, so nothing touches the disk. Close it with
 * fuzz_file_close. */
typedef struct fuzz_file {
    int fd;
    char path[64];
} fuzz_file;

static inline void fuzz_file_open(fuzz_file *f, const uint8_t *data, size_t size)
{
    f->fd = memfd_create("rp-fuzz", 0);
    FUZZ_REQUIRE(f->fd >= 0, "memfd_create failed");
    size_t done = 0;
    while (done < size) {
        ssize_t n = write(f->fd, data + done, size - done);
        FUZZ_REQUIRE(n > 0, "write to memfd failed");
        done += (size_t)n;
    }
    snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
}

static inline void fuzz_file_close(fuzz_file *f)
{
    close(f->fd);
}

/* A file of the source tree (RP_SOURCE_DIR/rel), NUL-terminated, malloc'd and kept for
 * the run; its length into *len. */
static inline char *fuzz_source_file(const char *rel, size_t *len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", RP_SOURCE_DIR, rel);
    FILE *f = fopen(path, "rb");
    FUZZ_REQUIRE(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    FUZZ_REQUIRE(text && fread(text, 1, (size_t)n, f) == (size_t)n, "cannot read %s", path);
    text[n] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return text;
}

/* The config the plan, scheduler and policy harnesses plan for: tests/data/plans/config.json
 * (2 nodes x 2 GPUs, 2 MoE layers of 6 experts, uneven slots), small so each input runs fast. */
static inline const rp_config *fuzz_small_config(void)
{
    static rp_config *cfg;
    if (!cfg) {
        size_t len;
        char *text = fuzz_source_file("tests/data/plans/config.json", &len);
        rp_error err;
        FUZZ_REQUIRE(rp_config_parse(fuzz_context(), text, len, "plans/config.json", &cfg, &err) == RP_OK,
                     "config: %s", err.text);
        free(text);
    }
    return cfg;
}

/* A batch for that config: 8 sequences (4 prompts x 2 responses) of 3..24 tokens, each
 * token routed to 2 distinct experts of 6 by a fixed formula; packed u8 ids. Kept for
 * the run. */
static inline void fuzz_small_batch(const rp_batch **batch, rp_routing *routing)
{
    static rp_batch *b;
    static uint8_t ids[8 * 24 * 2 * 2];
    if (!b) {
        int32_t prompt[8], response[8], group[8];
        for (int32_t s = 0; s < 8; s++) {
            prompt[s] = 3 + 2 * (s / 2);
            response[s] = 1 + (s * 5) % 13;
            group[s] = s / 2;
        }
        rp_error err;
        FUZZ_REQUIRE(rp_batch_new(fuzz_context(), 8, prompt, response, group, &b, &err) == RP_OK,
                     "batch: %s", err.text);
        int64_t tokens = rp_batch_num_tokens(b);
        for (int64_t t = 0; t < tokens; t++)
            for (int l = 0; l < 2; l++) {
                uint8_t first = (uint8_t)((t * 7 + l * 3) % 6);
                ids[(t * 2 + l) * 2] = first;
                ids[(t * 2 + l) * 2 + 1] = (uint8_t)((first + 1 + t % 5) % 6);
            }
    }
    *batch = b;
    rp_routing_packed(routing, RP_ID_U8, 2, 2, ids);
}

#endif
