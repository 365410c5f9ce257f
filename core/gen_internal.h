/* Private pieces of the synthetic batch generator shared by core/gen*.c: the PRNG, the
 * parsed settings, the real data they name, and the calibrated routing model. */
#ifndef RP_GEN_INTERNAL_H
#define RP_GEN_INTERNAL_H

#include "internal.h"
#include "prng.h"
#include "routepack/gen.h"

#include <stdbool.h>

/* Hard limits that keep every size product in range and tables in memory. */
#define GEN_MAX_LAYERS 4096
#define GEN_MAX_EXPERTS 65536      /* alias entries are uint16 */
#define GEN_MAX_TOP_K 64
#define GEN_MAX_CORR_EXPERTS 1024  /* couplings are dense [E x E] tables */
#define GEN_MAX_PROMPTS (1 << 24)
#define GEN_MAX_GROUP 4096
#define GEN_MAX_SEQS (1 << 24)
#define GEN_MAX_LEN (1 << 28)      /* prompt + response stays below 2^31 */
#define GEN_MAX_STEPS 100000000
#define GEN_MAX_THREADS 256
#define GEN_MAX_DOMAINS 64

/* Stream tags: every random stream is keyed by (seed, tag, a, b), so each step,
 * prompt group and sequence can be generated alone, in any order, on any thread. */
enum {
    GEN_TAG_GROUP = 1,     /* (step, group): domain, prompt length */
    GEN_TAG_RESPONSE = 2,  /* (step, sequence): response length */
    GEN_TAG_PREF = 3,      /* (step, group): per-layer Dirichlet preferences */
    GEN_TAG_PROMPT = 4,    /* (step, group): routing of the shared prompt */
    GEN_TAG_TOKENS = 5,    /* (step, sequence): routing of a sequence's own tokens */
    GEN_TAG_DRIFT = 6,     /* (step, domain): the random walk's increments */
    GEN_TAG_JITTER = 7,    /* (source expert, piece): split jitter; not seeded */
    GEN_TAG_RELABEL = 8    /* (layer, 0): expert relabeling of mapped layers; not seeded */
};

/* ---- PRNG: xoshiro256** streams seeded through splitmix64 ---------------------------- */

typedef struct gen_rng {
    uint64_t s[4];
} gen_rng;

static inline uint64_t gen_key(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b)
{
    uint64_t h = rp_mix64(seed + 0x9e3779b97f4a7c15ULL);
    h = rp_mix64(h ^ (tag * 0xd1b54a32d192ed03ULL));
    h = rp_mix64(h ^ (a + 0x8cb92ba72f3d8dd7ULL));
    return rp_mix64(h ^ (b * 0xaef17502108ef2d9ULL + 0x632be59bd9b4e019ULL));
}

static inline void gen_rng_seed(gen_rng *r, uint64_t key)
{
    rp_xoshiro_seed(r->s, key);
}

static inline void gen_rng_stream(gen_rng *r, uint64_t seed, uint64_t tag, uint64_t a, uint64_t b)
{
    gen_rng_seed(r, gen_key(seed, tag, a, b));
}

static inline uint64_t gen_next(gen_rng *r)
{
    return rp_xoshiro_next(r->s);
}

/* Uniform in [0, 1) and in (0, 1]. */
static inline double gen_uniform(gen_rng *r)
{
    return (double)(gen_next(r) >> 11) * 0x1.0p-53;
}
static inline double gen_uniform_pos(gen_rng *r)
{
    return (double)((gen_next(r) >> 11) + 1) * 0x1.0p-53;
}

/* Uniform integer in [0, n) (Lemire's multiply-high; bias below n / 2^64). */
static inline uint32_t gen_below(gen_rng *r, uint32_t n)
{
    return (uint32_t)(((unsigned __int128)gen_next(r) * n) >> 64);
}

double gen_normal(gen_rng *r);
/* log of a Gamma(shape, 1) draw, shape > 0; in logs so that tiny shapes do not
 * underflow to zero. */
double gen_log_gamma(gen_rng *r, double shape);

/* Walker/Vose alias table over `n` weights (not all zero), one 64-bit entry a column:
 * bits 0-31 the acceptance threshold, 32-47 the column's own outcome, 48-63 its alias
 * (outcomes are ids[i], or i when ids is NULL), so a draw is one load and no branch.
 * `work` holds 2n int32 and n doubles of scratch. */
void gen_alias_build(const double *weights, uint32_t n, const uint16_t *ids, uint64_t *table,
                     void *work);
#define GEN_ALIAS_WORK_BYTES(n) ((size_t)(n) * (2 * sizeof(int32_t) + sizeof(double)))

/* One draw from an alias table with one 64-bit random: the high half picks the
 * column, the low half decides between it and its alias. */
static inline uint32_t gen_alias_draw(const uint64_t *table, uint32_t n, uint64_t r)
{
    uint64_t t = table[((r >> 32) * n) >> 32];
    uint32_t own = (uint32_t)(t >> 32) & 0xffff, other = (uint32_t)(t >> 48);
    /* a mask, not a branch: the test is a coin flip the predictor cannot learn */
    uint32_t take_own = -(uint32_t)((uint32_t)r < (uint32_t)t);
    return other ^ ((own ^ other) & take_own);
}

/* ---- length distributions (gen_lengths.c) ------------------------------------------ */

typedef enum gen_len_kind {
    GEN_LEN_CONSTANT = 0,
    GEN_LEN_LOGNORMAL = 1,
    GEN_LEN_EMPIRICAL = 2 /* a CSV column, drawn uniformly */
} gen_len_kind;

typedef struct gen_lengths {
    gen_len_kind kind;
    int32_t constant;
    double median, sigma;
    int32_t *values;   /* GEN_LEN_EMPIRICAL, owned */
    int32_t num_values;
    double scale;      /* multiplies every draw before rounding */
    int32_t cap;       /* lengths are clamped to [1, cap] */
} gen_lengths;

/* max(1, min(cap, round(scale * x))) for a draw x. */
int32_t gen_lengths_draw(const gen_lengths *d, gen_rng *rng);
/* Expected fraction of draws that land on the cap. */
double gen_lengths_clip_mass(const gen_lengths *d);
void gen_lengths_free(rp_context *ctx, gen_lengths *d);

/* ---- the real data (gen_data.c) ---------------------------------------------------- */

/* One domain of the counts file, for the chosen model. */
typedef struct gen_src_domain {
    char *name;
    double weight;     /* mixture weight from the settings, normalized to sum 1 */
    double *share;     /* [num_recorded][num_experts]: share of token-choices, rows sum 1 */
    double **pairs;    /* [num_recorded - 1]: [E_src x E_src] counts of recorded layer i ->
                        * i + 1, or NULL where the domain has none */
} gen_src_domain;

typedef struct gen_source {
    char *path;        /* resolved, for messages */
    int32_t num_layers, num_experts, top_k;
    int32_t num_recorded;
    int32_t *recorded; /* strictly increasing MoE layer indices */
    int32_t num_domains;
    gen_src_domain *domains;
} gen_source;

/* What the settings asked for that the counts file does not have; the settings parser
 * reports it at the settings' own line and column. */
typedef enum gen_counts_miss {
    GEN_MISS_NONE = 0,
    GEN_MISS_FILE,     /* the file cannot be read */
    GEN_MISS_MODEL,    /* no such model id (or none given and the file has several) */
    GEN_MISS_DOMAIN    /* no such domain; *miss_index says which */
} gen_counts_miss;

/* Read `path` and take model `model_id` (NULL: the only model in the file) and the
 * named domains (NULL names: all of the model's domains, weights ignored). Errors in
 * the file's content give the file's own line and column. */
rp_status gen_read_counts(rp_context *ctx, const char *path, const char *model_id,
                          const char *const *domain_names, const double *domain_weights,
                          int32_t num_domains, gen_source *out, gen_counts_miss *miss,
                          int32_t *miss_index, rp_error *err);
void gen_source_free(rp_context *ctx, gen_source *src);

/* Read one integer column of a CSV file with a header row. A missing column sets
 * *missing_column (the message lists the columns there are); bad values give the
 * file's line and column. */
rp_status gen_read_csv_column(rp_context *ctx, const char *path, const char *column,
                              int32_t **values, int32_t *count, bool *missing_column,
                              rp_error *err);

/* ---- settings (gen_settings.c) ----------------------------------------------------- */

typedef struct gen_settings {
    uint64_t seed;
    int32_t steps;
    int32_t num_prompts, group_size;
    int32_t threads;                 /* 0: online CPUs */
    int32_t num_layers, num_experts, top_k;
    rp_id_width width;
    double concentration;
    double locality;
    double layer_correlation;
    double drift, drift_reversion;
    double split_jitter;
    bool share_prompt_routing;
    gen_lengths prompt, response;
    gen_source source;
} gen_settings;

rp_status gen_settings_parse(rp_context *ctx, const char *text, size_t len, const char *name,
                             const char *base_dir, gen_settings *out, rp_error *err);
void gen_settings_free(rp_context *ctx, gen_settings *s);

/* ---- the calibrated routing model (gen_model.c) ------------------------------------- */

/* Rows of a cross-layer coupling as alias tables: row i (an expert of layer l - 1, in
 * the unrelabeled frame) gives the expert of layer l. */
typedef struct gen_coupling {
    uint64_t *table;   /* [E x E] */
} gen_coupling;

typedef struct gen_domain {
    double *target;    /* [L x E] inclusion probability per expert (rows sum top_k) */
    double *log_base;  /* [L x E] log of the calibrated Plackett-Luce weights (sum 1) */
    int32_t *coupling; /* [L] coupling used for layer l - 1 -> l, -1 for none */
    gen_coupling *couplings;
    int32_t num_couplings;
} gen_domain;

typedef struct gen_model {
    int32_t num_layers, num_experts, top_k;
    int32_t *src_layer;   /* [L] index into source.recorded */
    int32_t *perm;        /* [L x E] target expert id of unrelabeled index i */
    int32_t *inv;         /* [L x E] inverse of perm */
    int32_t num_domains;  /* as source.num_domains */
    gen_domain *domains;
    double calibration_error; /* largest |pi / target - 1| after calibration */
} gen_model;

rp_status gen_model_build(rp_context *ctx, const gen_settings *s, gen_model *m, rp_error *err);
void gen_model_free(rp_context *ctx, gen_model *m);

/* Inclusion probabilities of successive sampling (Plackett-Luce, k draws without
 * replacement proportional to w): pi[e] = P(e among the k). w has n > k positive
 * entries. Numerical quadrature of the exponential-race integral; see docs/gen.md. */
rp_status gen_pl_inclusion(rp_context *ctx, const double *w, int32_t n, int32_t k, double *pi,
                           rp_error *err);
/* The weights w (sum 1) whose Plackett-Luce inclusion matches `target` (sum k, each
 * < 1); *max_error gets the largest remaining |pi / target - 1|. */
rp_status gen_pl_calibrate(rp_context *ctx, const double *target, int32_t n, int32_t k,
                           double *w, double *max_error, rp_error *err);

/* ---- routing of one step (gen_routing.c) -------------------------------------------- */

typedef struct gen_step_job {
    const gen_settings *settings;
    const gen_model *model;
    uint64_t seed;
    int32_t step;
    const double *alpha;        /* [domains x L x E] Dirichlet parameters of this step */
    const int32_t *group_domain;/* [num_prompts] */
    const int64_t *cu_seqlens;  /* [num_seqs + 1] */
    const int32_t *prompt_len;  /* [num_seqs] */
    void *ids;                  /* packed [tokens, layers, k] in settings->width */
} gen_step_job;

rp_status gen_routing_run(rp_context *ctx, const gen_step_job *job, int32_t threads,
                          rp_error *err);

#endif
