/* The configuration object: what a loaded config holds (config_internal.h) and its
 * read-only views, below everything that reads a config (docs/layers.md, floor 1). The
 * loader that fills it is config_load.c. */
#include "config_internal.h"

void rp_config_free(rp_config *cfg)
{
    if (!cfg) return;
    rp_context *ctx = cfg->ctx;
    if (cfg->search_path)
        for (size_t i = 0; cfg->search_path[i]; i++) rp_free(ctx, cfg->search_path[i]);
    rp_free(ctx, cfg->search_path);
    rp_free(ctx, cfg->params_json);
    rp_free(ctx, cfg->initial_placement);
    rp_free(ctx, cfg->policy_name);
    rp_free(ctx, cfg->gemm);
    rp_free(ctx, cfg->attention);
    rp_free(ctx, cfg->grouped_gemm);
    rp_free(ctx, cfg->wgrad);
    rp_free(ctx, cfg->speed);
    rp_free(ctx, cfg->slots);
    rp_free(ctx, cfg->stage_layers);
    rp_free(ctx, cfg->source);
    rp_free(ctx, cfg);
}

const rp_topology *rp_config_topology(const rp_config *cfg) { return &cfg->topology; }
const rp_hardware *rp_config_hardware(const rp_config *cfg) { return &cfg->hardware; }
const rp_model *rp_config_model(const rp_config *cfg) { return &cfg->model; }
const rp_limits *rp_config_limits(const rp_config *cfg) { return &cfg->limits; }
const rp_execution *rp_config_execution(const rp_config *cfg) { return &cfg->execution; }
const rp_trainer *rp_config_trainer(const rp_config *cfg) { return &cfg->trainer; }
const rp_policy_config *rp_config_policy(const rp_config *cfg) { return &cfg->policy; }
const char *rp_config_source(const rp_config *cfg) { return cfg->source; }
