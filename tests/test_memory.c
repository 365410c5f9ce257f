/* Memory per GPU (routepack/memory.h): hand-computed figures with and without the
 * distributed optimizer and a staging budget, extra replicas counted once per (layer,
 * expert) per step, a plan whose extra replicas tip a GPU over its memory is invalid with
 * the GPU, the bytes and the capacity named, the joint planner stays within memory, and
 * migrations move the receiver's shard of optimizer state. */
#include "routepack/routepack.h"
#include "tap.h"
#include "test_util.h"

#include <jansson.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static rp_context *ctx;

/* 2 nodes x 2 GPUs, EP 2 (2 EP groups), 3 slots per GPU; 2 layers of 4 experts, d 8,
 * f 4: 96 parameters per expert, 6 slots per GPU over the layers = 576 parameters;
 * 1000 dense parameters. `execution` is the execution object's text, `hbm` the HBM. */
static rp_config *tiny(const char *execution, double hbm)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 3},"
             " \"hardware\": {\"hbm_bytes\": %.17g},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 8,"
             "  \"expert_ffn_size\": 4, \"num_heads\": 2, \"num_kv_heads\": 1, \"head_dim\": 4,"
             "  \"bytes_per_param\": 2, \"bytes_per_optimizer_state\": 12, \"bytes_per_grad\": 4,"
             "  \"dense_params\": 1000},"
             " \"limits\": {\"max_tokens_per_microbatch\": 64}, \"execution\": %s}",
             hbm, execution);
    rp_config *cfg = NULL;
    rp_error err;
    if (rp_config_parse(ctx, json, strlen(json), "<tiny>", &cfg, &err) != RP_OK) diag("%s", err.text);
    return cfg;
}

static void test_hand_computed(void)
{
    rp_config *cfg = tiny("{}", 141e9);
    rp_gpu_memory m;
    rp_error err;
    ok(cfg && rp_memory_gpu(cfg, NULL, 3, &m, &err) == RP_OK, "memory of GPU 3");
    if (!cfg) return;
    is_int(m.gpu, 3, "names the GPU");
    is_double(m.expert_weight_bytes, 576 * 2, 0, "expert weights: 6 slots x 96 params x 2 bytes");
    is_double(m.expert_grad_bytes, 576 * 4, 0, "expert gradients: FP32, 4 bytes");
    is_double(m.expert_optimizer_bytes, 576 * 12, 0, "expert optimizer state unsharded: 12 bytes");
    is_double(m.dense_weight_bytes, 2000, 0, "dense weights");
    is_double(m.dense_grad_bytes, 4000, 0, "dense gradients");
    is_double(m.dense_optimizer_bytes, 12000, 0, "dense optimizer state unsharded");
    /* no budget: every slot restaged, 96 x (2 + 12) bytes each */
    is_double(m.staging_bytes, 6 * 96 * 14, 0, "staging without a budget: every slot of every layer");
    is_double(m.total_bytes, 36432, 0, "total 36432 bytes");
    is_int(rp_memory_expert_move_bytes(cfg), 96 * 14, "a migration moves weights and the whole optimizer state");
    rp_config_free(cfg);

    cfg = tiny("{\"optimizer_sharding\": \"dp\"}", 141e9);
    ok(cfg && rp_memory_gpu(cfg, NULL, 0, &m, &err) == RP_OK, "memory under the distributed optimizer");
    if (!cfg) return;
    is_int(m.expert_optimizer_shards, 2, "expert state sharded over the 2 EP groups");
    is_int(m.dense_optimizer_shards, 4, "dense state sharded over all 4 GPUs");
    is_double(m.expert_optimizer_bytes, 576 * 12 / 2, 0, "expert optimizer state halved");
    is_double(m.expert_grad_bytes, 576 * 4, 0, "gradients are not sharded (Megatron's table: 6 + 12/d)");
    is_double(m.dense_optimizer_bytes, 12000 / 4, 0, "dense optimizer state quartered");
    is_int(rp_memory_expert_move_bytes(cfg), 96 * 2 + 96 * 12 / 2,
           "a migration moves weights and the receiver's shard of the state");
    is_double(m.staging_bytes, 6 * 768, 0, "unbounded staging of sharded copies");
    is_double(m.total_bytes, 20520, 0, "total 20520 bytes");
    rp_config_free(cfg);

    cfg = tiny("{\"staging_budget_bytes\": 1000}", 141e9);
    ok(cfg && rp_memory_peak(cfg, NULL, &m, &err) == RP_OK, "peak with a staging budget");
    if (cfg) {
        is_double(m.staging_bytes, 1000, 0, "staging is the budget");
        is_double(m.total_bytes, 36432 - 8064 + 1000, 0, "total with the budget");
        is_int(m.gpu, 0, "ties: the lowest GPU");
    }
    char line[512];
    rp_memory_describe(&m, line, sizeof line);
    like(line, "GPU 0 needs 29.4 kB (expert weights 1.2, expert grads 2.3, expert optimizer 6.9, dense 18.0, "
               "staging 1.0 kB), within hardware.hbm_bytes of 141 GB", "one line, one unit");
    ok(rp_memory_gpu(cfg, NULL, 4, &m, &err) == RP_EINVAL, "GPU 4 of 4 is refused");
    like(err.text, "GPU 4 is out of range: the config has 4 GPUs", "and named");
    ok(rp_memory_gpu(NULL, NULL, 0, &m, &err) == RP_EINVAL, "no config is refused");
    rp_config_free(cfg);
}

/* A migration copy moves the weights and the receiver's shard of the optimizer state:
 * the migration planner's default expert bytes follow the sharding. */
static void test_migration_bytes(void)
{
    const char *execs[2] = {"{}", "{\"optimizer_sharding\": \"dp\"}"};
    const int64_t per_copy[2] = {96 * 14, 96 * 2 + 96 * 12 / 2};
    for (int i = 0; i < 2; i++) {
        rp_config *cfg = tiny(execs[i], 141e9);
        rp_plan *from = NULL, *to = NULL;
        rp_migration_plan *mp = NULL;
        rp_error err;
        /* contiguous (experts 0, 1 on EP rank 0; 2, 3 on rank 1), then experts 0 and 2
         * swap places at layer 0: two copies in each of the two EP groups */
        const int32_t rank0[] = {2, 1}, rank1[] = {0, 3};
        bool made = cfg && rp_plan_new(ctx, cfg, 1, &from, &err) == RP_OK &&
                    rp_plan_set_contiguous(from, &err) == RP_OK && rp_plan_copy(from, &to, &err) == RP_OK &&
                    rp_plan_set_gpu_experts(to, 0, 0, rank0, 2, &err) == RP_OK &&
                    rp_plan_set_gpu_experts(to, 0, 1, rank1, 2, &err) == RP_OK &&
                    rp_migration_plan_new(ctx, cfg, from, to, NULL, &mp, &err) == RP_OK;
        ok(made, "%s: a migration plan", i ? "dp" : "none");
        if (made) {
            rp_migration_summary sum;
            rp_migration_plan_summary(mp, &sum);
            is_int(sum.moved_bytes, 4 * per_copy[i], "%s: 4 copies of %lld bytes", i ? "dp" : "none",
                   (long long)per_copy[i]);
        }
        rp_migration_plan_free(mp);
        rp_plan_free(to);
        rp_plan_free(from);
        rp_config_free(cfg);
    }
}

/* Uneven slots: the busiest GPU is the one with the most slots. */
static void test_uneven_slots(void)
{
    const char *json =
        "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 4, \"ep_size\": 4, \"slots_per_gpu\": [2, 5, 2, 2]},"
        " \"model\": {\"num_layers\": 3, \"num_experts\": 8, \"top_k\": 2, \"hidden_size\": 16,"
        "  \"expert_ffn_size\": 8, \"num_heads\": 2, \"head_dim\": 8, \"dense_params\": 0},"
        " \"limits\": {\"max_tokens_per_microbatch\": 64}}";
    rp_config *cfg = NULL;
    rp_error err;
    ok(rp_config_parse(ctx, json, strlen(json), "<uneven>", &cfg, &err) == RP_OK, "uneven slots load");
    if (!cfg) return;
    rp_gpu_memory m;
    ok(rp_memory_peak(cfg, NULL, &m, &err) == RP_OK, "peak");
    is_int(m.gpu, 1, "GPU 1 holds 5 slots: the busiest");
    /* 5 slots x 3 layers x 384 params x (2 + 4 + 12) + unbounded staging 15 x 384 x 14 */
    is_double(m.total_bytes, 15.0 * 384 * 18 + 15.0 * 384 * 14, 0, "its total");
    rp_config_free(cfg);
}

/* The config itself must fit: refused at load, naming the keys to change. */
static void test_config_refused(void)
{
    /* total 36432 bytes unsharded without a budget; 20520 with "dp" */
    rp_config *cfg = tiny("{}", 36000);
    ok(cfg == NULL, "a config whose slots do not fit is refused");
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 2, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 3},"
             " \"hardware\": {\"hbm_bytes\": 36000},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 8,"
             "  \"expert_ffn_size\": 4, \"num_heads\": 2, \"num_kv_heads\": 1, \"head_dim\": 4, \"dense_params\": 1000},"
             " \"limits\": {\"max_tokens_per_microbatch\": 64}}");
    rp_error err;
    ok(rp_config_parse(ctx, json, strlen(json), "<big>", &cfg, &err) == RP_ERANGE, "RP_ERANGE");
    like(err.text,
         "<big>:1:82: topology.slots_per_gpu does not fit in GPU memory: GPU 0 needs 36.4 kB (expert weights 1.2, "
         "expert grads 2.3, expert optimizer 6.9, dense 18.0, staging 8.1 kB) but hardware.hbm_bytes is 36 kB; lower "
         "topology.slots_per_gpu, set execution.optimizer_sharding \"dp\", set execution.staging_budget_bytes or raise "
         "hardware.hbm_bytes",
         "the message names the GPU, the bytes, the capacity and the keys");
    /* one EP group and no dense parameters: sharding has nothing to share with */
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 2, \"ep_size\": 2, \"slots_per_gpu\": 3},"
             " \"hardware\": {\"hbm_bytes\": 1000},"
             " \"model\": {\"num_layers\": 2, \"num_experts\": 4, \"top_k\": 2, \"hidden_size\": 8,"
             "  \"expert_ffn_size\": 4, \"num_heads\": 2, \"num_kv_heads\": 1, \"head_dim\": 4, \"dense_params\": 0},"
             " \"limits\": {\"max_tokens_per_microbatch\": 64}}");
    ok(rp_config_parse(ctx, json, strlen(json), "<one-group>", &cfg, &err) == RP_ERANGE &&
           strstr(err.text, "lower topology.slots_per_gpu, set execution.staging_budget_bytes or raise") &&
           !strstr(err.text, "optimizer_sharding"),
       "in one EP group without dense parameters the message does not suggest optimizer_sharding \"dp\": %s",
       err.text);
    cfg = tiny("{\"optimizer_sharding\": \"dp\"}", 36000);
    ok(cfg != NULL, "the same machine fits under the distributed optimizer");
    rp_config_free(cfg);
    cfg = tiny("{\"optimizer_sharding\": \"dp\", \"staging_budget_bytes\": 1}", 20520 - 4608 + 1);
    ok(cfg != NULL, "and exactly at the capacity with a 1-byte budget");
    rp_config_free(cfg);
    cfg = tiny("{\"optimizer_sharding\": \"dp\", \"staging_budget_bytes\": 1}", 20520 - 4608);
    ok(cfg == NULL, "one byte less is refused");

    /* the bundled examples all fit; the former EP 8 layout of config-large-ep8.json does not */
    const char *examples[] = {"config-small.json", "config-reference.json", "config-large.json",
                              "config-large-ep8.json", "config-qwen3-30b-tp4.json", "config-qwen3-30b-pp2.json",
                              "config-qwen3-30b-cp2.json", "config-qwen3-30b-tp4-mb4.json",
                              "config-deepseek-v3-pp.json"};
    for (size_t i = 0; i < sizeof examples / sizeof examples[0]; i++) {
        char path[512];
        snprintf(path, sizeof path, RP_SOURCE_DIR "/examples/%s", examples[i]);
        rp_gpu_memory m;
        cfg = NULL;
        rp_status st = rp_config_load(ctx, path, &cfg, &err);
        if (st == RP_OK) st = rp_memory_peak(cfg, NULL, &m, &err); /* before ok() reads m for its message */
        ok(st == RP_OK && m.total_bytes <= m.capacity_bytes,
           "%s fits (%.1f GB of %.0f GB)", examples[i], st == RP_OK ? m.total_bytes / 1e9 : 0,
           st == RP_OK ? m.capacity_bytes / 1e9 : 0);
        rp_config_free(cfg);
    }
    cfg = NULL;
    ok(rp_config_load(ctx, RP_SOURCE_DIR "/tests/data/invalid/config/memory_large_ep8.json", &cfg, &err) ==
           RP_ERANGE,
       "the DeepSeek-V3-like EP 8 layout is refused");
    like(err.text, "GPU 0 needs 3434.9 GB (expert weights 183.9,", "with its figures");
    rp_config_free(cfg);
}

/* Extra replicas: held for the whole step, once per (layer, expert) and EP rank; a plan
 * whose extras tip a GPU over the capacity is invalid. */
static void test_extra_replicas(void)
{
    /* dp: 20520 bytes each GPU; each extra replica 96 x (2 + 4) = 576 bytes */
    rp_config *cfg = tiny("{\"optimizer_sharding\": \"dp\"}", 20520 + 576 + 100);
    rp_plan *plan = NULL;
    rp_error err;
    ok(cfg && rp_plan_new(ctx, cfg, 2, &plan, &err) == RP_OK && rp_plan_set_contiguous(plan, &err) == RP_OK,
       "a contiguous plan of 2 microbatches");
    if (!plan) {
        rp_config_free(cfg);
        return;
    }
    /* contiguous: experts 0, 1 on EP rank 0, experts 2, 3 on EP rank 1 */
    ok(rp_plan_add_extra_replica(plan, 0, 0, 2, 0, &err) == RP_OK &&
           rp_plan_add_extra_replica(plan, 1, 0, 2, 0, &err) == RP_OK,
       "expert 2 at layer 0 on EP rank 0 in both microbatches");
    rp_gpu_memory m;
    ok(rp_memory_gpu(cfg, plan, 2, &m, &err) == RP_OK, "memory of GPU 2 (EP rank 0 of group 1)");
    is_int(m.extra_replicas, 1, "one extra replica: the same (layer, expert) in two microbatches is fetched once");
    is_double(m.extra_replica_bytes, 576, 0, "weights and gradient: 96 x (2 + 4) bytes");
    ok(rp_plan_validate(plan, cfg, NULL, &err) == RP_OK, "fits: valid (%s)", err.text);
    ok(rp_memory_gpu(cfg, plan, 1, &m, &err) == RP_OK && m.extra_replicas == 0, "EP rank 1 holds none");

    ok(rp_plan_add_extra_replica(plan, 0, 1, 3, 0, &err) == RP_OK, "expert 3 at layer 1 on EP rank 0 too");
    ok(rp_memory_peak(cfg, plan, &m, &err) == RP_OK && m.gpu == 0 && m.extra_replicas == 2,
       "GPU 0 now holds 2 extra replicas");
    is_double(m.total_bytes, 20520 + 2 * 576, 0, "21672 bytes");
    ok(rp_plan_validate(plan, cfg, NULL, &err) == RP_EPLAN, "over the capacity: invalid");
    like(err.text,
         "plan: GPU 0 needs 21.7 kB (expert weights 1.2, expert grads 2.3, expert optimizer 3.5, "
         "dense 9.0, 2 extra replicas 1.2, staging 4.6 kB) but hardware.hbm_bytes is 21.2 kB (and the same EP rank "
         "in every EP group)",
         "names the GPU, its bytes broken down and the capacity");
    int32_t count = rp_plan_check(plan, cfg, NULL, NULL, NULL);
    is_int(count, 1, "one problem: EP rank 0 (GPUs 0 and 2); EP rank 1 fits");

    /* a plan of another shape */
    rp_config *other = tiny("{\"optimizer_sharding\": \"dp\", \"staging_budget_bytes\": 5}", 141e9);
    ok(other && rp_memory_gpu(other, plan, 0, &m, &err) == RP_OK, "a config of the same shape reads the plan");
    rp_config_free(other);
    rp_plan_free(plan);
    rp_config_free(cfg);
}

/* ---- the joint planner stays within memory ---- */

static char tmpdir[64];

/* config-small.json with hardware.hbm_bytes = hbm, written to NAME in the temp folder. */
static const char *small_with_hbm(const char *name, double hbm)
{
    json_error_t je;
    json_t *c = json_load_file(RP_SOURCE_DIR "/examples/config-small.json", 0, &je);
    json_t *hw = json_object();
    json_object_set_new(hw, "hbm_bytes", json_real(hbm));
    json_object_set_new(c, "hardware", hw);
    /* priced as the joint planner's extras were tuned: the "ideal" executor (under
     * routepack_torch's one all-reduce over the EP group a baseline without replicas wins
     * this batch, and no plan holds extras to gate) */
    json_t *x = json_object();
    json_object_set_new(x, "executor", json_string("ideal"));
    json_object_set_new(c, "execution", x);
    const char *path = temp_path(tmpdir, name);
    json_dump_file(c, path, 0);
    json_decref(c);
    return path;
}

/* The most extra replicas one EP rank holds over the step of plan file `path`, counted
 * as the memory check counts them; -1 when it does not load or is not valid. */
static int64_t most_extras(const char *config, const char *path)
{
    rp_config *cfg = NULL;
    rp_plan *plan = NULL;
    int64_t most = -1;
    if (rp_config_load(ctx, config, &cfg, NULL) == RP_OK && rp_plan_load(ctx, cfg, path, &plan, NULL) == RP_OK &&
        rp_plan_check(plan, cfg, NULL, NULL, NULL) == 0) { /* the memory check among the others */
        most = 0;
        for (int32_t j = 0; j < rp_config_topology(cfg)->ep_size; j++) {
            rp_gpu_memory m;
            if (rp_memory_gpu(cfg, plan, j, &m, NULL) != RP_OK) return -1;
            if (m.extra_replicas > most) most = m.extra_replicas;
        }
    }
    rp_plan_free(plan);
    rp_config_free(cfg);
    return most;
}

/* The joint policy on the bundled example's two steps: with room it takes several
 * extra replicas on some GPU; with room for one per GPU, never more (its plans are
 * checked by the scheduler too). */
static void test_joint_within_memory(void)
{
    if (!temp_dir_make(tmpdir, sizeof tmpdir, "memory")) {
        skip(4, "temp dir");
        return;
    }
    rp_config *small = NULL;
    rp_gpu_memory base;
    rp_error err;
    if (rp_config_load(ctx, RP_SOURCE_DIR "/examples/config-small.json", &small, &err) != RP_OK ||
        rp_memory_peak(small, NULL, &base, &err) != RP_OK) {
        skip(4, "config-small.json");
        rp_config_free(small);
        return;
    }
    rp_config_free(small);
    const double extra = 3.0 * 2048 * 1024 * (2 + 4); /* one extra replica: weights and gradient */
    char out[8192], roomy[256], tight[256], plans[256];
    snprintf(roomy, sizeof roomy, "%s", small_with_hbm("roomy.json", 141e9));
    snprintf(tight, sizeof tight, "%s", small_with_hbm("tight.json", base.total_bytes + 1.5 * extra));
    snprintf(plans, sizeof plans, "%s", tmpdir); /* the plan folders are made inside it */
    int rc = run_routepack(out, sizeof out, "simulate --config '%s' --trace " RP_SOURCE_DIR "/examples/small.rpt --policies routepack "
                           "--steps 2 --plans '%s/roomy'",
                           roomy, plans);
    is_int(rc, 0, "the joint policy plans the example with room");
    if (rc != 0) diag("%s", out);
    char path[512];
    snprintf(path, sizeof path, "%s/roomy/routepack/step-1.json", plans);
    int64_t most = most_extras(roomy, path);
    ok(most > 1, "with room, some EP rank holds %lld extra replicas in step 1", (long long)most);
    rc = run_routepack(out, sizeof out, "simulate --config '%s' --trace " RP_SOURCE_DIR "/examples/small.rpt --policies routepack "
                       "--steps 2 --plans '%s/tight'",
                       tight, plans);
    is_int(rc, 0, "and with room for one extra replica per GPU");
    int64_t most_tight = 0;
    for (int step = 0; step < 2; step++) {
        snprintf(path, sizeof path, "%s/tight/routepack/step-%d.json", plans, step);
        int64_t n = most_extras(tight, path);
        most_tight = n < 0 || most_tight < 0 ? -1 : n > most_tight ? n : most_tight;
    }
    is_int(most_tight, 1, "where no EP rank holds more than one");
    temp_dir_remove(tmpdir);
}

/* The scheduler plans migrations with the config's staging budget (what the memory check
 * counts) until the trainer sets its own. */
static void test_sched_budget(void)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"topology\": {\"num_nodes\": 1, \"gpus_per_node\": 8, \"ep_size\": 8, \"slots_per_gpu\": 10},"
             " \"model\": {\"num_layers\": 16, \"num_experts\": 64, \"top_k\": 8, \"hidden_size\": 2048,"
             "  \"expert_ffn_size\": 1024, \"num_heads\": 16, \"head_dim\": 128},"
             " \"limits\": {\"max_tokens_per_microbatch\": 16384}, \"execution\": {\"staging_budget_bytes\": 1}}");
    rp_config *cfg = NULL;
    rp_trace *trace = NULL;
    rp_sched *s = NULL;
    rp_batch *batch = NULL;
    rp_routing r;
    rp_error err;
    rp_sched_options o;
    rp_sched_options_default(&o);
    o.policy = "token_kk+eplb";
    o.num_threads = 1;
    if (rp_config_parse(ctx, json, strlen(json), "<budget>", &cfg, &err) != RP_OK ||
        rp_trace_open(ctx, RP_SOURCE_DIR "/examples/small.rpt", 0, &trace, &err) != RP_OK ||
        rp_trace_read_step(trace, 0, &batch, &r, &err) != RP_OK || rp_sched_new(ctx, cfg, &o, &s, &err) != RP_OK) {
        skip(4, "setup");
        diag("%s", err.text);
    } else {
        const rp_plan *plan;
        const rp_step_report *rep;
        ok(rp_sched_step(s, 0, batch, &r, &plan, &rep, &err) == RP_ERANGE, "a 1-byte budget from the config");
        like(err.text, "the staging budget of 1 bytes", "fails the step that migrates");
        ok(rp_sched_set_migration_options(s, NULL, &err) == RP_OK &&
               rp_sched_step(s, 0, batch, &r, &plan, &rep, &err) == RP_ERANGE,
           "NULL options: still the config's budget");
        rp_migration_options mo = {NULL, 0};
        ok(rp_sched_set_migration_options(s, &mo, &err) == RP_OK &&
               rp_sched_step(s, 0, batch, &r, &plan, &rep, &err) == RP_OK && rep->migration_bytes > 0,
           "the trainer's own budget (0: none) wins");
    }
    rp_sched_free(s);
    rp_batch_free(batch);
    rp_trace_close(trace);
    rp_config_free(cfg);
}

/* routepack memory: the figures of every example, the refusal of the old EP 8 layout. */
static void test_cli(void)
{
    char out[8192];
    int rc = run_routepack(out, sizeof out, "memory --config '%s/examples/config-reference.json'", RP_SOURCE_DIR);
    is_int(rc, 0, "routepack memory on the reference config");
    like(out, "the busiest GPU 0 needs 54.4 GB (expert weights 8.2, expert grads 16.3, expert optimizer 6.1, "
              "dense 9.5, staging 14.3 GB), within hardware.hbm_bytes of 141 GB", "prints the busiest GPU");
    rc = run_routepack(out, sizeof out, "memory --config '%s/tests/data/invalid/config/memory_large_ep8.json'",
                       RP_SOURCE_DIR);
    is_int(rc, 1, "the old EP 8 layout: exit 1");
    like(out, "GPU 0 needs 3434.9 GB", "with the config's error");
    rc = run_routepack(out, sizeof out, "memory --config '%s/examples/config-large-ep8.json' --json", RP_SOURCE_DIR);
    is_int(rc, 0, "--json");
    like(out, "\"fits\": true", "says it fits");
}

int main(void)
{
    if (rp_context_new(NULL, NULL, &ctx) != RP_OK) return 1;
    test_hand_computed();
    test_uneven_slots();
    test_migration_bytes();
    test_config_refused();
    test_extra_replicas();
    test_joint_within_memory();
    test_sched_budget();
    test_cli();
    rp_context_free(ctx);
    return tap_done();
}
