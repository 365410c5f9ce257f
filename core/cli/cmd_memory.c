/* routepack memory: what each GPU holds under a config (and a plan's extra replicas),
 * against hardware.hbm_bytes (docs/cost-model.md, "Memory per GPU"). */
#include "cli.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

json_t *cli_memory_json(const rp_gpu_memory *m)
{
    return json_pack("{s:i, s:f, s:f, s:b, s:f, s:f, s:f, s:f, s:f, s:f, s:I, s:f, s:f, s:i, s:i, s:i, s:i, s:i, s:I, s:f}",
                     "gpu", m->gpu,
                     "total_bytes", m->total_bytes, "capacity_bytes", m->capacity_bytes, "fits",
                     m->total_bytes <= m->capacity_bytes, "expert_weight_bytes", m->expert_weight_bytes,
                     "expert_grad_bytes", m->expert_grad_bytes, "expert_optimizer_bytes", m->expert_optimizer_bytes,
                     "dense_weight_bytes", m->dense_weight_bytes, "dense_grad_bytes", m->dense_grad_bytes,
                     "dense_optimizer_bytes", m->dense_optimizer_bytes, "extra_replicas", (json_int_t)m->extra_replicas,
                     "extra_replica_bytes", m->extra_replica_bytes, "staging_bytes", m->staging_bytes,
                     "expert_optimizer_shards", m->expert_optimizer_shards, "dense_optimizer_shards",
                     m->dense_optimizer_shards, "pipeline_stage", m->pipeline_stage, "stage_layers", m->stage_layers,
                     "context_parallel_size", m->context_parallel_size, "activation_tokens",
                     (json_int_t)m->activation_tokens, "activation_bytes", m->activation_bytes);
}

int cmd_memory(rp_context *ctx, int argc, char **argv)
{
    const char *config = NULL, *plan_path = NULL;
    bool json = false, bad = false;
    for (int i = 0; i < argc && !bad; i++) {
        if (cli_opt(argc, argv, &i, "--config", &config, &bad)) continue;
        if (cli_opt(argc, argv, &i, "--plan", &plan_path, &bad)) continue;
        if (cli_flag(argv[i], "--json", &json)) continue;
        return cli_stray_arg("memory", argv[i], "");
    }
    if (bad) return CLI_USAGE;
    if (!config) {
        const char *trace, *gen;
        if (!cli_default_example(&config, &trace, &gen)) {
            fprintf(stderr, "routepack: cannot find the bundled example config; give --config\n");
            return CLI_FAIL;
        }
    }
    rp_config *cfg = NULL;
    rp_plan *plan = NULL;
    rp_gpu_memory *per_rank = NULL;
    rp_error err;
    rp_error_clear(&err);
    int rc = CLI_OK;
    if (rp_config_load(ctx, config, &cfg, &err) != RP_OK) return cli_fail(&err);
    if (plan_path && rp_plan_load(ctx, cfg, plan_path, &plan, &err) != RP_OK) {
        rc = cli_fail(&err);
        goto out;
    }
    /* EP rank j of every EP group holds the same: group 0's GPUs stand for all */
    const int32_t ep = rp_config_topology(cfg)->ep_size;
    per_rank = calloc((size_t)ep, sizeof *per_rank);
    if (!per_rank) {
        fprintf(stderr, "routepack: out of memory\n");
        rc = CLI_FAIL;
        goto out;
    }
    int32_t peak = 0;
    for (int32_t j = 0; j < ep; j++) {
        if (rp_memory_gpu(cfg, plan, j, &per_rank[j], &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        if (per_rank[j].total_bytes > per_rank[peak].total_bytes) peak = j;
    }
    bool fits = per_rank[peak].total_bytes <= per_rank[peak].capacity_bytes;
    if (json) {
        json_t *arr = json_array();
        bool good = arr != NULL;
        for (int32_t j = 0; good && j < ep; j++) good = json_array_append_new(arr, cli_memory_json(&per_rank[j])) == 0;
        json_t *root = good ? json_pack("{s:s, s:s?, s:b, s:o, s:o}", "config", config, "plan", plan_path, "fits", fits,
                                        "peak", cli_memory_json(&per_rank[peak]), "per_ep_rank", arr)
                            : NULL;
        if (!root) json_decref(arr);
        if (!cli_print_json(root, 0)) {
            fprintf(stderr, "routepack: could not write the JSON output\n");
            rc = CLI_FAIL;
        }
    } else {
        char line[RP_ERROR_TEXT];
        rp_memory_describe(&per_rank[peak], line, sizeof line);
        printf("%s: the busiest %s\n", config, line);
        printf("%-6s %9s %9s %9s %9s %9s %7s %9s %9s\n", "GPU", "total GB", "exp. w", "exp. grad", "exp. opt",
               "dense", "extras", "staging", "free GB");
        for (int32_t j = 0; j < ep; j++) {
            const rp_gpu_memory *m = &per_rank[j];
            printf("%-6d %9.2f %9.2f %9.2f %9.2f %9.2f %7lld %9.2f %9.2f\n", (int)j, m->total_bytes / 1e9,
                   m->expert_weight_bytes / 1e9, m->expert_grad_bytes / 1e9, m->expert_optimizer_bytes / 1e9,
                   (m->dense_weight_bytes + m->dense_grad_bytes + m->dense_optimizer_bytes) / 1e9,
                   (long long)m->extra_replicas, m->staging_bytes / 1e9, (m->capacity_bytes - m->total_bytes) / 1e9);
        }
        printf("(GPU j stands for EP rank j of every EP group; activations are not counted)\n");
        const rp_topology *t = rp_config_topology(cfg);
        if (t->pipeline_parallel_size > 1)
            printf("(pipeline parallel %d: the figures are for stage %d, which holds %d of the %d MoE layers)\n",
                   t->pipeline_parallel_size, per_rank[peak].pipeline_stage, per_rank[peak].stage_layers,
                   rp_config_model(cfg)->num_layers);
        const rp_gpu_memory *pm = &per_rank[peak];
        printf("(activations beside that: %.2f GB per GPU for a microbatch at the token cap, %lld tokens per "
               "GPU%s)\n",
               pm->activation_bytes / 1e9, (long long)pm->activation_tokens,
               t->context_parallel_size > 1 ? ", 1/context_parallel_size of each sequence" : "");
    }
    if (!fits) rc = CLI_FAIL;
out:
    free(per_rank);
    rp_plan_free(plan);
    rp_config_free(cfg);
    return rc;
}
