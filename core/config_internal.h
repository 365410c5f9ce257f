/* The config object's layout, shared by its accessors (config.c) and its loader
 * (config_load.c) alone. */
#ifndef ROUTEPACK_CONFIG_INTERNAL_H
#define ROUTEPACK_CONFIG_INTERNAL_H

#include "internal.h"
#include "routepack/config.h"

struct rp_config {
    rp_context *ctx;
    char *source;
    rp_topology topology;
    rp_hardware hardware;
    rp_model model;
    rp_limits limits;
    rp_execution execution;
    rp_trainer trainer;
    rp_policy_config policy;
    /* owned storage behind the const views above */
    int32_t *slots;
    double *speed;
    int32_t *stage_layers; /* [2 * PP * VPP]: layers of each virtual stage, then their first layer */
    rp_eff_point *gemm;
    rp_eff_point *attention;
    rp_eff_point *grouped_gemm; /* NULL where neither the config nor its calibration gives one */
    rp_eff_point *wgrad;
    char *policy_name;
    char *params_json;
    char **search_path; /* NULL-terminated */
    char *initial_placement;
};

#endif
