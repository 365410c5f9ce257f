/* Pipeline parallelism (topology.pipeline_parallel_size, virtual_pipeline_size,
 * pipeline_schedule, layers_per_stage): the topology a stage gives the planner, its config
 * errors and the memory of a stage's GPU. */
#include "internal.h"
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

#define MODEL                                                                                               \
    " \"model\": {\"num_layers\": 6, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 64,"              \
    "  \"expert_ffn_size\": 32, \"num_heads\": 4, \"head_dim\": 16},"                                     \
    " \"limits\": {\"max_tokens_per_microbatch\": 100000}"

static rp_config *config(const char *topology, const char *extra, rp_error *err)
{
    char json[2048];
    snprintf(json, sizeof json, "{\"topology\": {%s}," MODEL "%s}", topology, extra);
    rp_config *cfg = NULL;
    if (rp_config_parse(ctx, json, strlen(json), "t.json", &cfg, err) != RP_OK) return NULL;
    return cfg;
}

static bool close_to(double a, double b) { return fabs(a - b) <= 1e-12 * fabs(b) + 1e-21; }

static void test_config(void)
{
    rp_error err;
    rp_config *cfg = config("\"num_nodes\": 4, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2,"
                            " \"tensor_parallel_size\": 2",
                            "", &err);
    ok(cfg != NULL, "PP 2, TP 2 on 4 x 8 GPUs");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->pipeline_parallel_size == 2 && t->virtual_pipeline_size == 1 &&
               t->pipeline_schedule == RP_SCHEDULE_1F1B,
           "VPP defaults to 1 and the schedule to 1f1b");
        ok(t->num_gpus == 8 && t->num_nodes == 2 && t->gpus_per_node == 4 && t->physical_num_nodes == 4,
           "a stage is 2 nodes of 4 DP ranks: the planner sees 8 DP ranks (%d), 2 nodes (%d)", t->num_gpus,
           t->num_nodes);
        ok(t->ep_size == 4 && t->expert_parallel_size == 4 && t->num_ep_groups == 2,
           "EP defaults to one node's ETP groups, inside the stage");
        ok(t->layers_per_stage[0] == 3 && t->layers_per_stage[1] == 3 && t->stage_layer_begin[1] == 3,
           "6 layers split 3 + 3");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 4,"
                 " \"virtual_pipeline_size\": 2, \"layers_per_stage\": [1, 0, 1, 1, 1, 1, 0, 1]",
                 "", &err);
    ok(cfg != NULL, "PP 4 x VPP 2 on one node with an explicit layer split");
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        ok(t->pipeline_schedule == RP_SCHEDULE_INTERLEAVED && t->num_gpus == 2 && t->num_nodes == 1 &&
               t->gpus_per_node == 2 && t->ep_size == 2,
           "interleaved by default; a stage is 2 GPUs of the node, one EP group of 2");
        ok(t->stage_layer_begin[2] == 1 && t->stage_layer_begin[7] == 5, "virtual stage 2 starts at layer 1, 7 at 5");
        rp_config_free(cfg);
    }
    cfg = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 4, \"virtual_pipeline_size\": 4",
                 "", &err);
    if (cfg) {
        const rp_topology *t = rp_config_topology(cfg);
        int32_t sum = 0;
        for (int s = 0; s < 16; s++) sum += t->layers_per_stage[s];
        ok(t->layers_per_stage[0] == 1 && t->layers_per_stage[5] == 1 && t->layers_per_stage[6] == 0 && sum == 6,
           "6 layers over 16 virtual stages: the first 6 take one each");
        rp_config_free(cfg);
    } else {
        ok(0, "PP 4 x VPP 4: %s", err.text);
    }
    struct {
        const char *topology, *message;
        rp_status status;
    } bad[] = {
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 3",
         "topology.pipeline_parallel_size is 3, but the 8 GPUs (num_nodes 1 x gpus_per_node 8) do not split into 3 "
         "stages", RP_EINVAL},
        {"\"num_nodes\": 3, \"gpus_per_node\": 4, \"pipeline_parallel_size\": 2",
         "topology.pipeline_parallel_size is 2, but the 12 GPUs", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 16",
         "topology.pipeline_parallel_size", RP_ERANGE},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"virtual_pipeline_size\": 2",
         "topology.virtual_pipeline_size is 2, but pipeline_parallel_size is 1", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"pipeline_schedule\": \"interleaved\"",
         "topology.pipeline_schedule is \"interleaved\", but virtual_pipeline_size is 1", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"virtual_pipeline_size\": 3,"
         " \"pipeline_schedule\": \"1f1b\"",
         "topology.pipeline_schedule is \"1f1b\", but virtual_pipeline_size is 3", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"pipeline_schedule\": \"gpipe\"",
         "topology.pipeline_schedule must be one of \"1f1b\", \"interleaved\", got \"gpipe\"", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"layers_per_stage\": [4, 1]",
         "topology.layers_per_stage sums to 5 layers, but model.num_layers is 6", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"layers_per_stage\": [6]",
         "topology.layers_per_stage must be an array of 2 layer counts, one per virtual stage", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"layers_per_stage\": [7, -1]",
         "topology.layers_per_stage[0]", RP_ERANGE},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 8",
         "topology.ep_size", RP_ERANGE},
        {"\"num_nodes\": 2, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 16",
         "topology.ep_size", RP_ERANGE},
        {"\"num_nodes\": 2, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"ep_size\": 3",
         "topology.ep_size must give EP groups that divide one pipeline stage: 3 EP ranks x 1 GPUs "
         "(expert_tensor_parallel_size) = 3 GPUs, but a stage has 8", RP_EINVAL},
        {"\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 4, \"tensor_parallel_size\": 4",
         "topology.tensor_parallel_size", RP_ERANGE},
        {"\"num_nodes\": 2, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2, \"dp_size\": 16",
         "topology.dp_size must equal the GPUs over tensor_parallel_size x pipeline_parallel_size, 16 / (1 x 2) = 8, "
         "got 16", RP_EINVAL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&err, 0, sizeof err);
        rp_config *c = config(bad[i].topology, "", &err);
        ok(!c && err.status == bad[i].status && strstr(err.text, bad[i].message), "refused: %s", bad[i].message);
        if (!strstr(err.text, bad[i].message) || err.status != bad[i].status) diag("got %d: %s", err.status, err.text);
        rp_config_free(c);
    }
}

/* Memory: a GPU holds only its stage's layers; the busiest stage decides. */
static void test_memory(void)
{
    rp_error err;
    rp_config *one = config("\"num_nodes\": 1, \"gpus_per_node\": 4, \"slots_per_gpu\": 2", "", &err);
    rp_config *pp = config("\"num_nodes\": 1, \"gpus_per_node\": 8, \"pipeline_parallel_size\": 2,"
                           " \"slots_per_gpu\": 2, \"layers_per_stage\": [2, 4]",
                           "", &err);
    rp_gpu_memory a, b;
    if (!one || !pp || rp_memory_gpu(one, NULL, 0, &a, &err) != RP_OK || rp_memory_gpu(pp, NULL, 0, &b, &err) != RP_OK) {
        diag("%s", err.text);
        skip(3, "configs");
    } else {
        ok(a.pipeline_stage == 0 && a.stage_layers == 6, "PP 1: stage 0 holds all 6 layers");
        ok(b.pipeline_stage == 1 && b.stage_layers == 4, "PP 2 with [2, 4]: stage 1 is the busiest, 4 layers");
        ok(close_to(b.expert_weight_bytes, a.expert_weight_bytes * 4 / 6) &&
               close_to(b.staging_bytes, a.staging_bytes * 4 / 6) &&
               close_to(b.dense_weight_bytes, a.dense_weight_bytes * 4 / 6),
           "its expert, staging and dense bytes are 4/6 of PP 1's (%.0f of %.0f expert weight bytes)",
           b.expert_weight_bytes, a.expert_weight_bytes);
    }
    rp_config_free(one);
    rp_config_free(pp);
}

int main(void)
{
    rp_context_new(NULL, NULL, &ctx);
    test_config();
    test_memory();
    rp_context_free(ctx);
    return tap_done();
}
