/* Helpers the test programs share: a counting allocator that fails the N-th call, a
 * step to plan (batch_fixture), a random placement, file slurp/spit, a scratch
 * directory, and running the routepack tool. */
#ifndef RP_TEST_UTIL_H
#define RP_TEST_UTIL_H

#include "routepack/routepack.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* State of counting_alloc, passed as the context's allocator userdata; zero it to start.
 * `live` is bytes held as the sizes passed in say, `blocks` the blocks held: count leaks in
 * blocks where the caller under-reports old_size on free (LuaJIT does when it frees a
 * half-built closure), in bytes elsewhere. `peak` is the most bytes held; reset it to
 * `live` to measure a stretch. */
typedef struct counting {
    long live;
    long calls;
    long fail_at; /* the call (1-based, counting from context creation) that fails; 0: none */
    long peak;
    long blocks;
} counting;

/* An rp_alloc_fn over malloc that counts what it hands out and refuses the fail_at-th
 * allocation or growth (frees never fail and are not counted as calls). */
static inline void *counting_alloc(void *ud, void *ptr, size_t old_size, size_t new_size)
{
    counting *c = ud;
    if (new_size == 0) {
        if (ptr) c->live -= (long)old_size, c->blocks--;
        free(ptr);
        return NULL;
    }
    if (++c->calls == c->fail_at) return NULL;
    void *p = realloc(ptr, new_size);
    if (p) {
        c->live += (long)new_size - (ptr ? (long)old_size : 0);
        if (!ptr) c->blocks++;
        if (c->live > c->peak) c->peak = c->live;
    }
    return p;
}

/* One xorshift64 step (Marsaglia 2003): the tests' reproducible random numbers. */
static inline uint64_t xorshift64(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* Step t of `gen` with its routing ids copied into a buffer the caller frees (packed view
 * over it in *routing), so that several generated steps can be alive at once; NULL, with
 * err set, on error. */
static inline void *gen_step_copy(rp_gen *gen, int32_t t, rp_batch **batch, rp_routing *routing, rp_error *err)
{
    rp_routing r;
    if (rp_gen_step(gen, t, batch, &r, err) != RP_OK) return NULL;
    size_t n = (size_t)rp_batch_num_tokens(*batch) * (size_t)r.num_layers * (size_t)r.top_k * (size_t)r.width;
    void *ids = malloc(n ? n : 1);
    if (!ids) {
        rp_batch_free(*batch);
        *batch = NULL;
        snprintf(err->text, sizeof err->text, "out of memory copying step %d's routing", t);
        return NULL;
    }
    memcpy(ids, r.base, n);
    rp_routing_packed(routing, r.width, r.num_layers, r.top_k, ids);
    return ids;
}

/* A step for the unit tests to plan: its config, batch, routing ids (u8, the config's
 * num_layers x top_k per token; NULL when a generator made the step, which then owns
 * the routing) and their statistics. Zero it to start; batch_fixture_free undoes any
 * part of it. */
typedef struct batch_fixture {
    rp_config *cfg;
    rp_batch *batch;
    uint8_t *ids;
    rp_gen *gen;
    rp_stats *stats;
} batch_fixture;

static inline void batch_fixture_free(batch_fixture *f)
{
    rp_stats_free(f->stats);
    free(f->ids);
    rp_batch_free(f->batch);
    rp_gen_free(f->gen);
    rp_config_free(f->cfg);
    memset(f, 0, sizeof *f);
}

/* f->batch under f->cfg (set it first): n sequences of lens[s] prompt tokens and no
 * response, group_ids[s] (NULL: each its own); and f->ids, room for the batch's routing,
 * copied from `ids` when not NULL, else zero for the caller to fill before
 * batch_fixture_stats. False with the reason in err->text. */
static inline bool batch_fixture_batch(rp_context *ctx, batch_fixture *f, int32_t n, const int32_t *lens,
                                       const int32_t *group_ids, const uint8_t *ids, rp_error *err)
{
    rp_error_clear(err);
    if (!f->cfg) {
        snprintf(err->text, sizeof err->text, "no config");
        return false;
    }
    int32_t *zero = calloc((size_t)n + 1, sizeof *zero);
    rp_status st = rp_batch_new(ctx, n, lens, zero, group_ids, &f->batch, err);
    free(zero);
    if (st != RP_OK) return false;
    const rp_model *m = rp_config_model(f->cfg);
    size_t bytes = (size_t)rp_batch_num_tokens(f->batch) * (size_t)m->num_layers * (size_t)m->top_k;
    f->ids = calloc(bytes + 1, 1);
    if (!f->ids) {
        snprintf(err->text, sizeof err->text, "out of memory for %zu routing ids", bytes);
        return false;
    }
    if (ids) memcpy(f->ids, ids, bytes);
    return true;
}

/* f->stats of f->ids (u8, the config's layers, top-k and experts; one thread). */
static inline bool batch_fixture_stats(rp_context *ctx, batch_fixture *f, rp_error *err)
{
    const rp_model *m = rp_config_model(f->cfg);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, m->num_layers, m->top_k, f->ids);
    return rp_stats_compute(ctx, f->batch, &r, m->num_experts, 1, &f->stats, err) == RP_OK;
}

/* The whole fixture from the config's JSON text, n prompt-only sequences (lens, group_ids
 * or NULL) and their u8 routing `ids` ([tokens][num_layers][top_k]; NULL: zero, filled
 * by the caller, who then calls batch_fixture_stats). False with the reason in err->text
 * (the fixture is then freed). */
static inline bool batch_fixture_make(rp_context *ctx, batch_fixture *f, const char *json, int32_t n,
                                      const int32_t *lens, const int32_t *group_ids, const uint8_t *ids,
                                      rp_error *err);

/* A config from JSON text ("<test>" in messages); NULL with the reason in err->text. */
static inline rp_config *test_config_parse(rp_context *ctx, const char *json, rp_error *err)
{
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "<test>", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

static inline bool batch_fixture_make(rp_context *ctx, batch_fixture *f, const char *json, int32_t n,
                                      const int32_t *lens, const int32_t *group_ids, const uint8_t *ids,
                                      rp_error *err)
{
    memset(f, 0, sizeof *f);
    bool good = (f->cfg = test_config_parse(ctx, json, err)) != NULL &&
                batch_fixture_batch(ctx, f, n, lens, group_ids, ids, err) && (!ids || batch_fixture_stats(ctx, f, err));
    if (!good) batch_fixture_free(f);
    return good;
}

/* A random placement of one layer's E experts over S slots (EP rank j holds slots
 * sb[j] .. sb[j + 1] - 1) into phy: the experts shuffled over the first E slots
 * (Fisher-Yates), then each later slot a random expert where its rank does not hold that
 * one yet (else left empty, -1). Draws from xorshift64(rng) only, in a fixed order, so a
 * test's sequence of plans stays as it was. */
static inline void random_placement(int32_t *phy, const int32_t *sb, int32_t S, int32_t E, uint64_t *rng)
{
    for (int32_t p = 0; p < S; p++) phy[p] = p < E ? p : -1;
    for (int32_t p = E - 1; p > 0; p--) {
        int32_t q = (int32_t)(xorshift64(rng) % (uint32_t)(p + 1)), tmp = phy[p];
        phy[p] = phy[q];
        phy[q] = tmp;
    }
    for (int32_t p = E; p < S; p++) {
        int32_t e = (int32_t)(xorshift64(rng) % (uint32_t)E), j = 0;
        while (sb[j + 1] <= p) j++;
        bool held = false;
        for (int32_t k = sb[j]; k < sb[j + 1]; k++) held |= phy[k] == e;
        if (!held) phy[p] = e;
    }
}

/* Random top-2 routing into ids[2 x choices] over E experts (E <= 256): each first choice
 * among experts 0-2 but one time in `skew` (then any expert), each second any other expert.
 * Draws from xorshift64(rng) only, in a fixed order, so the tests' figures over it stay. */
static inline void random_top2(uint8_t *ids, int64_t choices, uint32_t E, uint32_t skew, uint64_t *rng)
{
    for (int64_t k = 0; k < choices; k++) {
        uint8_t a = (uint8_t)(xorshift64(rng) % skew ? xorshift64(rng) % 3 : xorshift64(rng) % E);
        uint8_t b = (uint8_t)(xorshift64(rng) % E);
        ids[2 * k] = a;
        ids[2 * k + 1] = b == a ? (uint8_t)((a + 1) % E) : b;
    }
}

/* batch_fixture_make with random routing: random_top2's, the first choices skewed to
 * experts 0-2 two times in three, at every layer of the config (whose top_k must be 2). */
static inline bool batch_fixture_random(rp_context *ctx, batch_fixture *f, const char *json, int32_t n,
                                        const int32_t *lens, uint64_t *rng, rp_error *err)
{
    if (!batch_fixture_make(ctx, f, json, n, lens, NULL, NULL, err)) return false;
    const rp_model *m = rp_config_model(f->cfg);
    bool good = m->top_k == 2;
    if (!good) snprintf(err->text, sizeof err->text, "random routing is top-2, the config has top_k %d", m->top_k);
    if (good) random_top2(f->ids, rp_batch_num_tokens(f->batch) * m->num_layers, (uint32_t)m->num_experts, 3, rng);
    good = good && batch_fixture_stats(ctx, f, err);
    if (!good) batch_fixture_free(f);
    return good;
}

/* test_trainer's and test_minibatch's fixture: 4 GPUs on one node in EP groups of `ep`
 * (8 / ep + 1 slots each), 2 layers of 8 experts, top-2, microbatches of at most `cap`
 * tokens, `trainer` the trainer section's body ("" for the defaults); n prompt-only
 * sequences of lens[s] tokens with batch_fixture_random's routing. The "ideal" executor,
 * which runs every lever, so every baseline (the balancer's too) is one to check. */
static inline bool trainer_fixture_make(rp_context *ctx, batch_fixture *f, int ep, int cap, const char *trainer,
                                        int32_t n, const int32_t *lens, uint64_t *rng, rp_error *err)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": %d, \"slots_per_gpu\": %d},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"
             "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"
             " \"limits\": {\"max_tokens_per_microbatch\": %d}, \"trainer\": {%s},"
             " \"execution\": {\"executor\": \"ideal\"}}",
             ep, 8 / ep + 1, cap, trainer);
    return batch_fixture_random(ctx, f, json, n, lens, rng, err);
}

/* A random step to evaluate (test_cp, test_minibatch, test_pipeline): a batch, its routing
 * and statistics, and a plan of M microbatches packing it at random over a random
 * placement. random_scene_free frees it, also after a failure. */
typedef struct random_scene {
    rp_config *cfg;
    rp_batch *batch;
    rp_stats *stats;
    rp_plan *plan;
    uint8_t *ids;
    int32_t n, M; /* sequences, microbatches */
} random_scene;

/* Into s, taking `cfg` (NULL: fails, err as its parse left it; the model must have top_k 2):
 * min_seqs + 0..23 sequences of 1 + rnd(max_len) tokens, or when long_len > 0 one in five
 * of 1 + rnd(long_len); each token's 2 distinct experts at every layer, the first among
 * experts 0-2 three times in four (random_top2); each sequence on a random DP rank and microbatch; each
 * layer's placement random_placement's; the plan validated when `validate` (false when
 * the test's caps would refuse a random packing). Draws from xorshift64(rng) only, in a
 * fixed order, so a test's random plans (and test_cp's frozen hash over them) stay as they
 * were. False with the reason in err->text. */
static inline bool random_scene_make(rp_context *ctx, random_scene *s, rp_config *cfg, int32_t min_seqs,
                                     int32_t max_len, int32_t long_len, int32_t M, bool validate, uint64_t *rng,
                                     rp_error *err)
{
    memset(s, 0, sizeof *s);
    if (!(s->cfg = cfg)) return false;
    rp_error_clear(err);
    const rp_model *md = rp_config_model(cfg);
    const uint32_t E = (uint32_t)md->num_experts, G = (uint32_t)rp_config_topology(cfg)->num_gpus;
    const int32_t L = md->num_layers, n = s->n = min_seqs + (int32_t)(xorshift64(rng) % 24);
    s->M = M;
    int32_t *lens = calloc((size_t)n, sizeof *lens), *zero = calloc((size_t)n + 1, sizeof *zero);
    int32_t *rank = calloc((size_t)n, sizeof *rank), *mb = calloc((size_t)n, sizeof *mb), *phy = NULL;
    bool good = lens && zero && rank && mb && md->top_k == 2;
    for (int32_t i = 0; good && i < n; i++) {
        bool is_long = long_len > 0 && xorshift64(rng) % 5 == 0;
        lens[i] = 1 + (int32_t)(xorshift64(rng) % (uint32_t)(is_long ? long_len : max_len));
    }
    good = good && rp_batch_new(ctx, n, lens, zero, NULL, &s->batch, err) == RP_OK;
    int64_t choices = good ? rp_batch_num_tokens(s->batch) * L : 0;
    good = good && (s->ids = malloc((size_t)choices * 2 + 1)) != NULL;
    if (good) random_top2(s->ids, choices, E, 4, rng);
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, L, 2, s->ids);
    good = good && rp_stats_compute(ctx, s->batch, &r, (int32_t)E, 1, &s->stats, err) == RP_OK;
    for (int32_t i = 0; good && i < n; i++) {
        rank[i] = (int32_t)(xorshift64(rng) % G);
        mb[i] = (int32_t)(xorshift64(rng) % (uint32_t)M);
    }
    good = good && rp_plan_new(ctx, cfg, M, &s->plan, err) == RP_OK &&
           rp_plan_set_packing(s->plan, n, rank, mb, err) == RP_OK;
    const int32_t S = good ? rp_plan_total_slots(s->plan) : 0;
    good = good && (phy = calloc((size_t)S + 1, sizeof *phy)) != NULL;
    for (int32_t l = 0; good && l < L; l++) {
        random_placement(phy, rp_plan_slot_begin(s->plan), S, (int32_t)E, rng);
        good = rp_plan_set_phy2log(s->plan, l, phy, err) == RP_OK;
    }
    good = good && (!validate || rp_plan_validate(s->plan, cfg, s->batch, err) == RP_OK);
    if (!good && !err->text[0]) snprintf(err->text, sizeof err->text, "out of memory, or top_k is not 2");
    free(lens);
    free(zero);
    free(rank);
    free(mb);
    free(phy);
    return good;
}

static inline void random_scene_free(random_scene *s)
{
    rp_plan_free(s->plan);
    rp_stats_free(s->stats);
    free(s->ids);
    rp_batch_free(s->batch);
    rp_config_free(s->cfg);
}

/* The hand-computed toy of test_tp and test_cp: 4 sequences of 30, 20, 10 and 40 tokens,
 * 0 and 1 on DP rank 0 and 2 and 3 on DP rank 1 in one microbatch, the contiguous placement
 * (experts 0-3 on rank 0, 4-7 on rank 1 with 8 experts), every token picking experts 0 and 5
 * at both of the config's 2 layers: each rank sends its 50 tokens' choice of the other
 * rank's expert, and experts 0 and 5 each take all 100 tokens. Evaluated once into `sum`.
 * Takes `cfg` (NULL: fails); toy_scene_free frees it, also after a failure. */
typedef struct toy_scene {
    rp_config *cfg;
    rp_batch *batch;
    rp_stats *stats;
    rp_plan *plan;
    rp_cost *cost;
    uint8_t *ids;
    rp_cost_summary sum;
} toy_scene;

static inline bool toy_scene_make(rp_context *ctx, toy_scene *s, rp_config *cfg, rp_error *err)
{
    static const int32_t lens[4] = {30, 20, 10, 40};
    memset(s, 0, sizeof *s);
    if (!(s->cfg = cfg)) return false;
    int32_t zero[4] = {0};
    if (rp_batch_new(ctx, 4, lens, zero, NULL, &s->batch, err) != RP_OK) return false;
    s->ids = malloc(100 * 4);
    for (int t = 0; t < 100 * 2; t++) {
        s->ids[2 * t] = 0;
        s->ids[2 * t + 1] = 5;
    }
    rp_routing r;
    rp_routing_packed(&r, RP_ID_U8, 2, 2, s->ids);
    int32_t rank[4] = {0, 0, 1, 1}, mb[4] = {0};
    return rp_stats_compute(ctx, s->batch, &r, 8, 1, &s->stats, err) == RP_OK &&
           rp_plan_new(ctx, s->cfg, 1, &s->plan, err) == RP_OK &&
           rp_plan_set_packing(s->plan, 4, rank, mb, err) == RP_OK && rp_plan_set_contiguous(s->plan, err) == RP_OK &&
           rp_cost_new(ctx, s->cfg, s->batch, s->stats, RP_SPLIT_EVEN, &s->cost, err) == RP_OK &&
           rp_cost_evaluate(s->cost, s->plan, &s->sum, err) == RP_OK;
}

static inline void toy_scene_free(toy_scene *s)
{
    rp_cost_free(s->cost);
    rp_plan_free(s->plan);
    rp_stats_free(s->stats);
    free(s->ids);
    rp_batch_free(s->batch);
    rp_config_free(s->cfg);
}

/* The whole file, NUL-terminated (so text can be used as a string), malloc'd: free it.
 * Its length goes to *len when len is not NULL. NULL if it cannot be read. */
static inline void *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap + 1);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

/* Replace the file at path with the n bytes at buf (the tests' way to plant bad input). */
static inline void spit(const char *path, const void *buf, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f) {
        if (n) fwrite(buf, 1, n, f);
        fclose(f);
    }
}

/* The size of the file at path in bytes; -1 when there is none. */
static inline int64_t file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (int64_t)sb.st_size : -1;
}

/* Make a fresh directory /tmp/rp-NAME-XXXXXX into dir (size bytes; 64 is plenty for a
 * short name). False when it cannot be made. */
static inline bool temp_dir_make(char *dir, size_t size, const char *name)
{
    int n = snprintf(dir, size, "/tmp/rp-%s-XXXXXX", name);
    return n > 0 && (size_t)n < size && mkdtemp(dir) != NULL;
}

/* "DIR/NAME" in a ring of buffers: the 8 most recent stay valid (copy longer-lived ones). */
static inline const char *temp_path(const char *dir, const char *name)
{
    static char bufs[8][512];
    static int next;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof bufs[0], "%s/%s", dir, name);
    return b;
}

/* Remove the files in dir, then dir (the tests make no subdirectories in it). */
static inline void temp_dir_remove(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') unlink(temp_path(dir, e->d_name));
    if (d) closedir(d);
    rmdir(dir);
}

#ifdef RP_SOURCE_DIR
/* The scheduler tests' fixture: a context, examples/config-small.json, the first
 * `num_steps` steps of examples/gen-small.json (each step's routing copied, so all are
 * alive at once), a fresh scratch directory, and RP_POLICY_PATH unset (only the shipped
 * policies and the paths a test gives are found). gen_steps_free undoes all of it. */
typedef struct gen_steps {
    rp_context *ctx;
    rp_config *cfg;
    int32_t num_steps;
    rp_batch **batches;   /* [num_steps] */
    rp_routing *routings; /* [num_steps], packed views over ids */
    void **ids;           /* [num_steps] */
    char tmp[64];         /* the scratch directory, /tmp/rp-NAME-XXXXXX; "" before it is made */
} gen_steps;

static inline void gen_steps_free(gen_steps *g)
{
    for (int32_t t = 0; g->batches && t < g->num_steps; t++) {
        rp_batch_free(g->batches[t]);
        free(g->ids[t]);
    }
    free(g->batches);
    free(g->routings);
    free(g->ids);
    rp_config_free(g->cfg);
    rp_context_free(g->ctx);
    if (g->tmp[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g->tmp); /* tests may make folders in it */
        if (system(cmd) != 0) fprintf(stderr, "# could not remove %s\n", g->tmp);
    }
    memset(g, 0, sizeof *g);
}

/* A config file with `members` (JSON members and a trailing comma: `"trainer": {...},`)
 * put first; the file must not have those sections itself. */
static inline rp_status config_load_with(rp_context *ctx, const char *path, const char *members, rp_config **out,
                                         rp_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err->text, sizeof err->text, "cannot open %s", path);
        return RP_EIO;
    }
    static char text[1 << 16];
    const size_t k = strlen(members);
    size_t n = k < sizeof text / 2 ? fread(text, 1, sizeof text - k - 1, f) : 0;
    fclose(f);
    text[n] = '\0';
    char *brace = strchr(text, '{');
    if (!brace) return RP_EINVAL;
    memmove(brace + 1 + k, brace + 1, strlen(brace + 1) + 1);
    memcpy(brace + 1, members, k);
    return rp_config_parse(ctx, text, strlen(text), path, out, err);
}

/* The same config on a trainer that runs Megatron's per-forward balancer (the default
 * executor, routepack_torch, does not). */
#define TRAINER_WITH_BALANCER "\"trainer\": {\"per_forward_balancer\": true},"
/* The same config priced as before executor profiles (execution.executor "ideal": every
 * lever, the balancer included, no host costs), for the figures derived under it. */
#define EXECUTOR_IDEAL "\"execution\": {\"executor\": \"ideal\"},"

/* Set up the fixture (see gen_steps) for the test `name` from the generator settings
 * examples/GEN (with config-small.json, with `members` put first where not NULL:
 * config_load_with); false with the reason in err->text, having freed what it made. */
static inline bool gen_steps_load_cfg(gen_steps *g, const char *name, const char *gen_file, const char *members,
                                      int32_t num_steps, rp_error *err)
{
    memset(g, 0, sizeof *g);
    rp_gen *gen = NULL;
    rp_error_clear(err);
    char gen_path[1024];
    snprintf(gen_path, sizeof gen_path, "%s/examples/%s", RP_SOURCE_DIR, gen_file);
    const char *small = RP_SOURCE_DIR "/examples/config-small.json";
    bool good = rp_context_new(NULL, NULL, &g->ctx) == RP_OK &&
                (members ? config_load_with(g->ctx, small, members, &g->cfg, err)
                         : rp_config_load(g->ctx, small, &g->cfg, err)) == RP_OK &&
                rp_gen_load(g->ctx, gen_path, &gen, err) == RP_OK;
    if (good) {
        g->num_steps = num_steps;
        g->batches = calloc((size_t)num_steps, sizeof *g->batches);
        g->routings = calloc((size_t)num_steps, sizeof *g->routings);
        g->ids = calloc((size_t)num_steps, sizeof *g->ids);
        good = g->batches && g->routings && g->ids;
        if (!good) snprintf(err->text, sizeof err->text, "out of memory for %d steps", num_steps);
    }
    for (int32_t t = 0; good && t < num_steps; t++)
        good = (g->ids[t] = gen_step_copy(gen, t, &g->batches[t], &g->routings[t], err)) != NULL;
    rp_gen_free(gen);
    if (good && !temp_dir_make(g->tmp, sizeof g->tmp, name)) {
        g->tmp[0] = '\0';
        snprintf(err->text, sizeof err->text, "cannot make a scratch directory in /tmp");
        good = false;
    }
    if (!good) {
        gen_steps_free(g);
        return false;
    }
    unsetenv("RP_POLICY_PATH");
    return true;
}

/* gen_steps_load_cfg on the default trainer (no balancer). */
static inline bool gen_steps_load_from(gen_steps *g, const char *name, const char *gen_file, int32_t num_steps,
                                       rp_error *err)
{
    return gen_steps_load_cfg(g, name, gen_file, NULL, num_steps, err);
}

/* gen_steps_load_from with examples/gen-small.json. */
static inline bool gen_steps_load(gen_steps *g, const char *name, int32_t num_steps, rp_error *err)
{
    return gen_steps_load_from(g, name, "gen-small.json", num_steps, err);
}
#endif

#ifdef RP_BINARY_DIR
/* Run `routepack ARGS` (the tool in this build) with stderr joined to stdout, keeping the
 * first out_size - 1 bytes of what it prints in out; its exit status, -1 if it did not
 * run or exit normally. */
static inline int run_routepack(char *out, size_t out_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline int run_routepack(char *out, size_t out_size, const char *fmt, ...)
{
    char cmd[8192];
    int n = snprintf(cmd, sizeof cmd, "'%s/routepack' ", RP_BINARY_DIR);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(cmd + n, sizeof cmd - (size_t)n, fmt, ap);
    va_end(ap);
    out[0] = '\0';
    if ((size_t)n + 5 >= sizeof cmd) return -1; /* no room for the redirection */
    snprintf(cmd + n, sizeof cmd - (size_t)n, " 2>&1");
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t got = fread(out, 1, out_size - 1, p);
    out[got] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
#endif

/* A scheduler for `policy` over the fixture's config, one scan thread, from `base`
 * options (NULL: the defaults) with `params` (NULL: the options' own); NULL, with a
 * diagnostic on stderr, when rp_sched_new fails. The scheduler tests' constructor. */
static inline rp_sched *gen_steps_sched(const gen_steps *g, const char *policy, const char *params,
                                        const rp_sched_options *base)
{
    rp_sched_options o;
    if (base) o = *base;
    else rp_sched_options_default(&o);
    o.policy = policy;
    if (params) o.params_json = params;
    o.num_threads = 1;
    rp_sched *s = NULL;
    rp_error err;
    if (rp_sched_new(g->ctx, g->cfg, &o, &s, &err) != RP_OK)
        fprintf(stderr, "# rp_sched_new(%s): %s\n", policy, err.text);
    return s;
}

/* Write `source` as a policy file in the fixture's scratch folder; returns its path
 * (one of 8 static buffers, reused in turn). */
static inline const char *gen_steps_policy_file(const gen_steps *g, const char *source)
{
    static int files;
    static char paths[8][512];
    char *p = paths[files % 8];
    snprintf(p, 512, "%s/policy%d.lua", g->tmp, files++);
    FILE *f = fopen(p, "w");
    if (f) {
        fputs(source, f);
        fclose(f);
    }
    return p;
}

/* A probe policy whose plan(ctx) body is `body` (a chunk of Lua with `ctx` in scope),
 * written as gen_steps_policy_file does. */
static inline const char *gen_steps_body_policy(const gen_steps *g, const char *body)
{
    static char src[16384];
    snprintf(src, sizeof src,
             "return {name = 'probe', version = '1.0.0', api = 1, description = 'a test probe',\n"
             "plan = function(ctx)\n%s\nend}\n",
             body);
    return gen_steps_policy_file(g, src);
}

#ifdef RP_TAP_H
/* ---- checks shared by the TAP tests (tap.h included first) ---- */

/* One config the topology tests refuse: the topology's keys, a part of the message it
 * must give, and its status. */
typedef struct config_refusal {
    const char *topology, *message;
    rp_status status;
} config_refusal;

/* The refusal table of a config test: `make` builds a config from a topology's keys
 * (and extra top-level members, "" here); each entry must be refused with its status
 * and a message containing its part: one check each, "refused: MESSAGE". */
static inline void check_config_refusals(rp_config *(*make)(const char *topology, const char *extra, rp_error *err),
                                         const config_refusal *bad, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        rp_error err;
        memset(&err, 0, sizeof err);
        rp_config *c = make(bad[i].topology, "", &err);
        ok(!c && err.status == bad[i].status && strstr(err.text, bad[i].message), "refused: %s", bad[i].message);
        if (!strstr(err.text, bad[i].message) || err.status != bad[i].status)
            diag("got %d: %s", err.status, err.text);
        rp_config_free(c);
    }
}
/* Run `program` (a rank program of tests/mpi) under `mpirun --allow-run-as-root
 * --oversubscribe -np 4` and relay its TAP lines as checks here, each named `prefix`
 * and its own name; its other lines become diagnostics, and its "1..0 # SKIP why"
 * a skip (*skipped). For sanitizer builds (ignored otherwise) the ranks get
 * tests/lsan.supp, since Open MPI's allocations outlive MPI_Finalize, and the slow
 * unwinder, so that leak stacks reach Open MPI's libraries through its plugins.
 * Returns mpirun's exit code (-1 when it did not exit), *checks the checks relayed; -2
 * when nothing ran, a skip or failure recorded: `program` was not built (`unbuilt` says
 * why), mpirun is missing, or it could not be started. */
static inline int mpirun_relay(const char *program, const char *unbuilt, const char *prefix, int *checks,
                               bool *skipped)
{
    *checks = 0;
    *skipped = false;
    if (access(program, X_OK) != 0) {
        skip(1, unbuilt);
        return -2;
    }
    if (system("command -v mpirun >/dev/null 2>&1") != 0) {
        skip(1, "mpirun not found");
        return -2;
    }
    char lsan[1024], asan[1024];
    const char *old = getenv("LSAN_OPTIONS");
    if (old && strstr(old, "suppressions=")) snprintf(lsan, sizeof lsan, "%s", old);
    else snprintf(lsan, sizeof lsan, "%s%ssuppressions=%s:print_suppressions=0", old ? old : "",
                  old && *old ? ":" : "", RP_SOURCE_DIR "/tests/lsan.supp");
    setenv("LSAN_OPTIONS", lsan, 1);
    old = getenv("ASAN_OPTIONS");
    snprintf(asan, sizeof asan, "%s%sfast_unwind_on_malloc=0", old ? old : "", old && *old ? ":" : "");
    setenv("ASAN_OPTIONS", asan, 1);
    /* Containers often forbid the cross-memory attach Open MPI's shared-memory transport
     * tries first; copying through the shared segment always works. */
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "timeout -k 5 240 mpirun --allow-run-as-root --oversubscribe -np 4 -x LSAN_OPTIONS -x ASAN_OPTIONS "
             "%s %s 2>&1",
             getenv("UBSAN_OPTIONS") ? "-x UBSAN_OPTIONS" : "", program);
    FILE *p = popen(cmd, "r");
    if (!p) {
        ok(0, "mpirun could not be started");
        return -2;
    }
    char line[4096];
    while (fgets(line, sizeof line, p)) {
        line[strcspn(line, "\n")] = '\0';
        const char *text = NULL;
        int pass = 0;
        if (strncmp(line, "ok ", 3) == 0) pass = 1, text = line + 3;
        else if (strncmp(line, "not ok ", 7) == 0) text = line + 7;
        if (text) {
            while (*text >= '0' && *text <= '9') text++; /* renumbered here */
            if (strncmp(text, " - ", 3) == 0) text += 3;
            ok(pass, "%s%s", prefix, text);
            (*checks)++;
        } else if (strncmp(line, "1..0 # SKIP", 11) == 0) {
            skip(1, line + 12);
            *skipped = true;
        } else if (strncmp(line, "1..", 3) != 0) {
            printf("# %s\n", line[0] == '#' ? line + (line[1] == ' ' ? 2 : 1) : line);
        }
    }
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
#endif

#endif
