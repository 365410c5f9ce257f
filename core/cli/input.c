/* Where a command's steps and config come from: a trace or generator settings, the
 * config with an optional micro-batch count, and the bundled example by default
 * (simulate, policy check, plan and memory share them). */
#include "cli.h"
#include "internal.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

rp_status cli_config_load(rp_context *ctx, const char *path, int64_t microbatches, rp_config **out,
                          rp_error *err)
{
    rp_config *cfg;
    rp_status st = rp_config_load(ctx, path, &cfg, err);
    if (st != RP_OK || microbatches <= 0) {
        if (st == RP_OK) *out = cfg;
        return st;
    }
    rp_config_free(cfg);
    /* The file is known to be valid: rewrite limits.num_microbatches and parse the
     * result under the file's name, so relative policy search paths still resolve
     * against the file's directory. */
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) return rp_fail(err, RP_EIO, "%s: %s", path, jerr.text);
    json_t *limits = json_object_get(root, "limits");
    if (!limits) {
        limits = json_object();
        json_object_set_new(root, "limits", limits);
    }
    char *text = NULL;
    if (!limits || json_object_set_new(limits, "num_microbatches", json_integer(microbatches)) != 0 ||
        !(text = json_dumps(root, JSON_PRESERVE_ORDER))) {
        json_decref(root);
        return rp_fail(err, RP_ENOMEM, "out of memory rewriting %s", path);
    }
    json_decref(root);
    st = rp_config_parse(ctx, text, strlen(text), path, out, err);
    free(text);
    return st;
}

rp_status cli_input_open(rp_context *ctx, const char *trace, const char *gen, cli_input *in,
                         rp_error *err)
{
    memset(in, 0, sizeof *in);
    rp_status st;
    if (trace) {
        /* payload checksums are verified at open: a simulation on corrupted data is no
         * simulation */
        if ((st = cli_trace_open(ctx, trace, 0, &in->trace, err)) != RP_OK) return st;
        const rp_trace_step_info *s = rp_trace_step(in->trace, 0);
        in->path = trace;
        in->num_steps = rp_trace_num_steps(in->trace);
        in->num_layers = s->num_layers;
        in->num_experts = s->num_experts;
        in->top_k = s->top_k;
        return RP_OK;
    }
    if ((st = rp_gen_load(ctx, gen, &in->gen, err)) != RP_OK) return st;
    const rp_gen_info *info = rp_gen_get_info(in->gen);
    in->path = gen;
    in->num_steps = info->num_steps;
    in->num_layers = info->num_layers;
    in->num_experts = info->num_experts;
    in->top_k = info->top_k;
    return RP_OK;
}

rp_status cli_input_check(const cli_input *in, const rp_config *cfg, rp_error *err)
{
    const rp_model *m = rp_config_model(cfg);
    if (in->num_layers != m->num_layers || in->num_experts != m->num_experts || in->top_k != m->top_k)
        return rp_fail(err, RP_EINVAL,
                         "%s has %d MoE layers x %d experts, top-%d, but the config %s describes "
                         "%d layers x %d experts, top-%d",
                         in->path, in->num_layers, in->num_experts, in->top_k, rp_config_source(cfg),
                         m->num_layers, m->num_experts, m->top_k);
    return RP_OK;
}

rp_status cli_input_read(cli_input *in, int32_t i, rp_batch **batch, rp_routing *routing,
                         int64_t *step_index, rp_error *err)
{
    if (in->trace) {
        rp_status st = rp_trace_read_step(in->trace, i, batch, routing, err);
        if (st == RP_OK) *step_index = rp_trace_step(in->trace, i)->step;
        return st;
    }
    *step_index = i;
    return rp_gen_step(in->gen, i, batch, routing, err);
}

void cli_input_close(cli_input *in)
{
    rp_trace_close(in->trace);
    rp_gen_free(in->gen);
    memset(in, 0, sizeof *in);
}

bool cli_default_example(const char **config, const char **trace, const char **gen)
{
    static char cfg_buf[4096], trace_buf[4096 + 16], gen_buf[4096 + 16];
    const char *p = cli_example_path("config-small.json");
    if (!p) return false;
    snprintf(cfg_buf, sizeof cfg_buf, "%s", p);
    *config = cfg_buf;
    *trace = *gen = NULL;
    /* the batch from the config's own directory, so RP_EXAMPLES_DIR replaces the whole
     * example and never mixes with the source tree's */
    const char *slash = strrchr(cfg_buf, '/');
    int dir_len = slash ? (int)(slash - cfg_buf) : 1;
    const char *dir = slash ? cfg_buf : ".";
    /* one example for every command that defaults to it (docs/cli.md): steps generated
     * at a batch size where a step outweighs a re-placement (gen-example.json); else the
     * bundled trace; else its generator settings */
    snprintf(gen_buf, sizeof gen_buf, "%.*s/gen-example.json", dir_len, dir);
    if (access(gen_buf, R_OK) == 0) {
        *gen = gen_buf;
        return true;
    }
    snprintf(trace_buf, sizeof trace_buf, "%.*s/small.rpt", dir_len, dir);
    snprintf(gen_buf, sizeof gen_buf, "%.*s/gen-small.json", dir_len, dir);
    if (access(trace_buf, R_OK) == 0) *trace = trace_buf;
    else if (access(gen_buf, R_OK) == 0) *gen = gen_buf;
    else return false;
    return true;
}
