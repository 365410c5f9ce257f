/* The configuration loader's private contract (core/config_load.c, and its topology
 * section in core/config_topology.c): the loader's state and its key readers, thin
 * wrappers of jsonx.h's on the loader's document, so that every section reads keys one
 * way. Not installed. */
#ifndef RP_CONFIG_LOAD_H
#define RP_CONFIG_LOAD_H

#include "config_internal.h"
#include "internal.h"
#include "jsonx.h"

/* Hard limits that keep every later size product inside int64 and memory sane. */
#define MAX_GPUS (1 << 20)
#define MAX_SLOTS_PER_GPU (1 << 20)

typedef struct loader {
    rp_context *ctx;
    rp_jdoc doc;
    rp_config *cfg;
    const char *dir; /* directory part of the source name, for search_path */
    size_t dir_len;
    rp_error *err;
} loader;

/* The key readers (jsonx.h's) on the loader's document. */
static inline rp_status get_i32(loader *ld, json_t *obj, const char *path, const char *key, bool required,
                                int64_t dflt, int64_t min, int64_t max, int32_t *out)
{
    return rp_jdoc_i32(&ld->doc, obj, path, key, required, dflt, min, max, out, ld->err);
}

/* A number > 0 (JSON cannot say "exclusive" in a min; this can). */
static inline rp_status check_positive(loader *ld, const char *path, double value)
{
    if (value > 0) return RP_OK;
    return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, path, "must be > 0, got %g", value);
}

static inline rp_status get_positive(loader *ld, json_t *obj, const char *path, const char *key,
                                     double dflt, double max, double *out)
{
    return rp_jdoc_positive(&ld->doc, obj, path, key, false, dflt, max, out, ld->err);
}

/* An efficiency: a fraction of peak in (0, 1]. */
static inline rp_status get_fraction(loader *ld, json_t *obj, const char *path, const char *key,
                                     double dflt, double *out)
{
    return get_positive(ld, obj, path, key, dflt, 1.0, out);
}

/* The optional free-text "comment" key, allowed in every section. */
static inline rp_status check_comment(loader *ld, json_t *obj, const char *path)
{
    const char *s;
    return rp_jdoc_str(&ld->doc, obj, path, "comment", false, NULL, &s, ld->err);
}

/* A string member that must be one of `names` (NULL-terminated); its index in *out. */
static inline rp_status get_choice(loader *ld, json_t *obj, const char *path, const char *key,
                                   const char *const *names, int dflt, int *out)
{
    return rp_jdoc_choice(&ld->doc, obj, path, key, names, dflt, out, ld->err);
}

/* config_topology.c: the topology section, in the order the loader calls them: the parts
 * that do not depend on the model, then (after the model) the slots and the stages'
 * layers. */
rp_status config_load_topology(loader *ld, json_t *obj);
rp_status config_load_slots(loader *ld, json_t *obj);
rp_status config_load_stage_layers(loader *ld, json_t *obj);

#endif
