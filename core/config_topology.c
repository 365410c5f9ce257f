/* The configuration's topology section: nodes, GPUs and their speeds, the parallel sizes
 * (TP, ETP, CP, EP, DP, PP and its schedule), the links, the slots per GPU and the
 * stages' layers (docs/config.md, "topology"), validated key by key for the loader. */
#include "config_load.h"

#include <float.h>
#include <math.h>

/* ---- topology ------------------------------------------------------------------------ */

static const char *const topology_keys[] = {
    "num_nodes", "gpus_per_node", "tensor_parallel_size", "expert_tensor_parallel_size", "ep_size", "dp_size",
    "slots_per_gpu", "gpu_speed", "nvlink_bytes_per_s", "nvlink_latency_us", "net_bytes_per_s", "net_latency_us",
    "pipeline_parallel_size", "virtual_pipeline_size", "pipeline_schedule", "layers_per_stage",
    "context_parallel_size", "comment", NULL,
};

/* Parts of the topology that do not depend on the model. */
rp_status config_load_topology(loader *ld, json_t *obj)
{
    const char *P = "topology";
    rp_topology *t = &ld->cfg->topology;
    rp_context *ctx = ld->ctx;
    rp_status st;
    RP_CHECK_GOTO(rp_jdoc_check_keys(&ld->doc, obj, P, topology_keys, ld->err), st, out);
    RP_CHECK_GOTO(check_comment(ld, obj, P), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "num_nodes", true, 0, 1, MAX_GPUS, &t->num_nodes), st, out);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "gpus_per_node", true, 0, 1, MAX_GPUS, &t->gpus_per_node), st, out);
    int64_t num_gpus;
    if (rp_mul_overflow(t->num_nodes, t->gpus_per_node, &num_gpus) || num_gpus > MAX_GPUS)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, P,
                            "has %lld GPUs (num_nodes %d x gpus_per_node %d), more than the %d supported",
                            (long long)t->num_nodes * t->gpus_per_node, t->num_nodes, t->gpus_per_node,
                            MAX_GPUS);
    t->physical_gpus_per_node = t->gpus_per_node;
    t->physical_num_nodes = t->num_nodes;

    /* Pipeline parallelism is outermost (tp-cp-ep-dp-pp): stage s is the s-th block of
     * num_gpus / PP GPUs. A stage is whole nodes or a part of one node, so every stage has
     * the same layout and the planner sees one stage. */
    int32_t pp, vpp;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "pipeline_parallel_size", false, 1, 1, (int32_t)num_gpus, &pp), st, out);
    const int32_t gpn = t->gpus_per_node;
    const int64_t stage_gpus = num_gpus / pp;
    if (num_gpus % pp != 0 || (stage_gpus % gpn != 0 && gpn % stage_gpus != 0))
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.pipeline_parallel_size",
                            "is %d, but the %lld GPUs (num_nodes %d x gpus_per_node %d) do not split into %d "
                            "stages of whole nodes or of equal parts of one node",
                            pp, (long long)num_gpus, t->num_nodes, gpn, pp);
    RP_CHECK_GOTO(get_i32(ld, obj, P, "virtual_pipeline_size", false, 1, 1, 1024, &vpp), st, out);
    if (vpp > 1 && pp == 1)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.virtual_pipeline_size",
                            "is %d, but pipeline_parallel_size is 1: virtual stages interleave over a pipeline of "
                            "at least 2 stages", vpp);
    static const char *const schedule_names[] = {"1f1b", "interleaved", NULL};
    int schedule;
    RP_CHECK_GOTO(get_choice(ld, obj, P, "pipeline_schedule", schedule_names,
                             vpp > 1 ? RP_SCHEDULE_INTERLEAVED : RP_SCHEDULE_1F1B, &schedule),
                  st, out);
    if (schedule == RP_SCHEDULE_INTERLEAVED && vpp == 1)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.pipeline_schedule",
                            "is \"interleaved\", but virtual_pipeline_size is 1: interleaving needs at least 2 "
                            "virtual stages per pipeline stage");
    if (schedule == RP_SCHEDULE_1F1B && vpp > 1)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.pipeline_schedule",
                            "is \"1f1b\", but virtual_pipeline_size is %d: virtual stages run the \"interleaved\" "
                            "schedule (Megatron's interleaved 1F1B)", vpp);
    t->pipeline_parallel_size = pp;
    t->virtual_pipeline_size = vpp;
    t->pipeline_schedule = (rp_pipeline_schedule)schedule;
    /* the planner's node: one stage's share of it */
    if (stage_gpus < gpn) {
        t->num_nodes = 1;
        t->gpus_per_node = (int32_t)stage_gpus;
    } else {
        t->num_nodes = (int32_t)(stage_gpus / gpn);
    }
    num_gpus = stage_gpus;

    /* Megatron-Core's rank order tp-cp-ep-dp-pp (docs/config.md): a TP group is TP
     * consecutive GPUs inside a node and is one DP rank, the unit every plan indexes as a
     * "GPU"; an ETP group is ETP consecutive GPUs inside a TP group. */
    int32_t tp, etp;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "tensor_parallel_size", false, 1, 1, t->gpus_per_node, &tp), st, out);
    if (t->gpus_per_node % tp != 0) {
        if (pp > 1)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.tensor_parallel_size",
                                "must divide the GPUs of one pipeline stage in a node, %d, got %d: a TP group stays "
                                "inside a node and a stage", t->gpus_per_node, tp);
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.tensor_parallel_size",
                            "must divide gpus_per_node, %d, got %d: a TP group stays inside a node", t->gpus_per_node,
                            tp);
    }
    RP_CHECK_GOTO(get_i32(ld, obj, P, "expert_tensor_parallel_size", false, tp, 1, tp, &etp), st, out);
    if (tp % etp != 0)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.expert_tensor_parallel_size",
                            "must divide tensor_parallel_size, %d, got %d: an ETP group lies inside one DP rank "
                            "(a TP group)", tp, etp);
    /* Context parallelism (tp-cp-...): a DP rank is CP consecutive TP groups, TP x CP GPUs,
     * each holding 1/CP of every sequence. It lies inside a node, or spans whole nodes (a
     * CP ring across nodes); in the latter case the planner's "node" is one DP rank. */
    int32_t cp;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "context_parallel_size", false, 1, 1, (int32_t)(num_gpus / tp), &cp), st,
                  out);
    const int64_t rank_gpus = (int64_t)tp * cp;
    if (num_gpus % rank_gpus != 0 || (rank_gpus < t->gpus_per_node && t->gpus_per_node % rank_gpus != 0) ||
        (rank_gpus > t->gpus_per_node && rank_gpus % t->gpus_per_node != 0))
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.context_parallel_size",
                            "is %d, but a DP rank of tensor_parallel_size %d x context_parallel_size %d = %lld GPUs "
                            "must divide the GPUs of a node (%d%s) or be whole nodes, and divide the %lld GPUs%s",
                            cp, tp, cp, (long long)rank_gpus, t->gpus_per_node,
                            pp > 1 ? " of one pipeline stage" : "", (long long)num_gpus,
                            pp > 1 ? " of one pipeline stage" : "");
    t->tensor_parallel_size = tp;
    t->expert_tensor_parallel_size = etp;
    t->context_parallel_size = cp;
    if (rank_gpus <= t->gpus_per_node) {
        t->gpus_per_node = (int32_t)(t->gpus_per_node / rank_gpus);
    } else {
        t->gpus_per_node = 1;
        t->num_nodes = (int32_t)(num_gpus / rank_gpus);
    }
    t->num_gpus = (int32_t)(num_gpus / rank_gpus);

    /* ep_size is Megatron's expert_model_parallel_size: EP ranks, each an ETP group. An EP
     * group must hold whole DP ranks; the planner's EP group counts DP ranks. */
    int32_t ep;
    RP_CHECK_GOTO(get_i32(ld, obj, P, "ep_size", false, rank_gpus * t->gpus_per_node / etp, 1,
                          (int32_t)(num_gpus / etp), &ep),
                  st, out);
    t->expert_parallel_size = ep;
    if (cp > 1 && ((int64_t)ep * etp) % rank_gpus != 0)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.ep_size",
                            "is %d EP ranks x %d GPUs (expert_tensor_parallel_size) = %lld GPUs, not a multiple "
                            "of tensor_parallel_size %d x context_parallel_size %d = %lld: an EP group must hold "
                            "whole DP ranks (EP x ETP folds over TP x CP x DP)",
                            ep, etp, (long long)ep * etp, tp, cp, (long long)rank_gpus);
    if (tp > 1 && ((int64_t)ep * etp) % tp != 0)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.ep_size",
                            "is %d EP ranks x %d GPUs (expert_tensor_parallel_size) = %lld GPUs, not a multiple "
                            "of tensor_parallel_size %d: an EP group must hold whole DP ranks",
                            ep, etp, (long long)ep * etp, tp);
    t->ep_size = (int32_t)((int64_t)ep * etp / rank_gpus);
    if (t->num_gpus % t->ep_size != 0) {
        if (pp > 1)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.ep_size",
                                "must give EP groups that divide one pipeline stage: %d EP ranks x %d GPUs "
                                "(expert_tensor_parallel_size) = %lld GPUs, but a stage has %lld (num_nodes %d x "
                                "gpus_per_node %d / pipeline_parallel_size %d); an EP group lives inside one stage",
                                ep, etp, (long long)ep * etp, (long long)num_gpus, t->physical_num_nodes,
                                t->physical_gpus_per_node, pp);
        if (tp == 1 && etp == 1)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.ep_size",
                                "must divide the number of GPUs, %d (num_nodes %d x gpus_per_node %d), got %d",
                                t->num_gpus, t->num_nodes, t->physical_gpus_per_node, ep);
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.ep_size",
                            "must give EP groups that divide the GPUs: %d EP ranks x %d GPUs (expert_tensor_parallel_size) "
                            "= %lld GPUs, but the topology has %lld (num_nodes %d x gpus_per_node %d)",
                            ep, etp, (long long)ep * etp, (long long)num_gpus, t->num_nodes,
                            t->physical_gpus_per_node);
    }
    t->num_ep_groups = t->num_gpus / t->ep_size;

    int64_t dp;
    RP_CHECK_GOTO(rp_jdoc_int(&ld->doc, obj, P, "dp_size", false, t->num_gpus, 1, INT32_MAX, &dp, ld->err),
                  st, out);
    if (dp != t->num_gpus) {
        if (cp > 1)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.dp_size",
                                "must equal the GPUs over tensor_parallel_size x context_parallel_size x "
                                "pipeline_parallel_size, %lld / (%d x %d x %d) = %d, got %lld: each TP x CP group of "
                                "a stage is one data-parallel rank (omit dp_size)",
                                (long long)num_gpus * pp, tp, cp, pp, t->num_gpus, (long long)dp);
        if (pp > 1)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.dp_size",
                                "must equal the GPUs over tensor_parallel_size x pipeline_parallel_size, %lld / "
                                "(%d x %d) = %d, got %lld: each TP group of a stage is one data-parallel rank (omit "
                                "dp_size)",
                                (long long)num_gpus * pp, tp, pp, t->num_gpus, (long long)dp);
        if (tp == 1)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.dp_size",
                                "must equal the number of GPUs, %d, got %lld: each GPU is one data-parallel "
                                "rank when tensor_parallel_size is 1 (omit dp_size)",
                                t->num_gpus, (long long)dp);
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.dp_size",
                            "must equal the GPUs over tensor_parallel_size, %lld / %d = %d, got %lld: each TP "
                            "group is one data-parallel rank (omit dp_size)",
                            (long long)num_gpus, tp, t->num_gpus, (long long)dp);
    }
    t->dp_size = t->num_gpus;

    size_t n = (size_t)t->num_gpus;
    ld->cfg->slots = rp_calloc(ctx, n, sizeof(int32_t));
    ld->cfg->speed = rp_calloc(ctx, n, sizeof(double));
    if (!ld->cfg->slots || !ld->cfg->speed) return rp_fail_nomem(ld->err, "the topology");
    t->slots = ld->cfg->slots;
    t->speed = ld->cfg->speed;

    /* gpu_speed: one number for all GPUs, or one per GPU. */
    json_t *speed = json_object_get(obj, "gpu_speed");
    if (json_is_array(speed)) {
        if (json_array_size(speed) != n)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.gpu_speed",
                                "has %zu entries, but the topology has %d GPUs", json_array_size(speed),
                                t->num_gpus);
        for (size_t g = 0; g < n; g++) {
            char ip[64];
            rp_jpath_index(ip, sizeof ip, "topology.gpu_speed", g);
            double v;
            RP_CHECK_GOTO(rp_jdoc_num_value(&ld->doc, json_array_get(speed, g), ip, -DBL_MAX, DBL_MAX, &v,
                                            ld->err),
                          st, out);
            RP_CHECK_GOTO(check_positive(ld, ip, v), st, out);
            ld->cfg->speed[g] = v;
        }
    } else {
        double s;
        if (speed && !json_is_number(speed))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, "topology.gpu_speed",
                                "must be a number or an array of %d numbers, got %s", t->num_gpus,
                                rp_jdoc_type_name(speed));
        RP_CHECK_GOTO(get_positive(ld, obj, P, "gpu_speed", 1.0, DBL_MAX, &s), st, out);
        for (size_t g = 0; g < n; g++) ld->cfg->speed[g] = s;
    }

    double us;
    RP_CHECK_GOTO(get_positive(ld, obj, P, "nvlink_bytes_per_s", 450e9, DBL_MAX, &t->nvlink_bytes_per_s),
                  st, out);
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, obj, P, "nvlink_latency_us", false, 3.0, 0, 1e9, &us, ld->err),
                  st, out);
    t->nvlink_latency_s = us * 1e-6;
    RP_CHECK_GOTO(get_positive(ld, obj, P, "net_bytes_per_s", 50e9, DBL_MAX, &t->net_bytes_per_s), st, out);
    RP_CHECK_GOTO(rp_jdoc_num(&ld->doc, obj, P, "net_latency_us", false, 10.0, 0, 1e9, &us, ld->err),
                  st, out);
    t->net_latency_s = us * 1e-6;
out:
    return st;
}

/* slots_per_gpu needs the expert count: read after the model. */
rp_status config_load_slots(loader *ld, json_t *obj)
{
    rp_topology *t = &ld->cfg->topology;
    const rp_model *m = &ld->cfg->model;
    const char *path = "topology.slots_per_gpu";
    size_t n = (size_t)t->num_gpus;
    int32_t *slots = ld->cfg->slots;
    rp_status st = RP_OK;
    json_t *v = json_object_get(obj, "slots_per_gpu");
    if (json_is_array(v)) {
        if (json_array_size(v) != n)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path,
                                "has %zu entries, but the topology has %d GPUs (num_nodes %d x gpus_per_node %d)",
                                json_array_size(v), t->num_gpus, t->num_nodes, t->gpus_per_node);
        for (size_t g = 0; g < n; g++) {
            char ip[64];
            int64_t s;
            rp_jpath_index(ip, sizeof ip, path, g);
            RP_CHECK_GOTO(rp_jdoc_int_value(&ld->doc, json_array_get(v, g), ip, 1, MAX_SLOTS_PER_GPU, &s,
                                            ld->err),
                          st, out);
            slots[g] = (int32_t)s;
            int32_t sub = t->tensor_parallel_size * t->context_parallel_size / t->expert_tensor_parallel_size;
            if (s % sub != 0)
                return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, ip,
                                    "is %lld, but DP rank %zu holds %d EP ranks (tensor_parallel_size %d x "
                                    "context_parallel_size %d / expert_tensor_parallel_size %d): give it a multiple of "
                                    "%d, split evenly over them",
                                    (long long)s, g, sub, t->tensor_parallel_size, t->context_parallel_size,
                                    t->expert_tensor_parallel_size, sub);
        }
    } else {
        if (v && !json_is_number(v))
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path,
                                "must be an integer or an array of %d integers, got %s", t->num_gpus,
                                rp_jdoc_type_name(v));
        /* Default: exactly enough slots to hold every expert once, no spare. The number
         * is per EP rank; a DP rank holds TP / ETP of them. */
        int64_t dflt = (m->num_experts + t->expert_parallel_size - 1) / t->expert_parallel_size;
        if (dflt > MAX_SLOTS_PER_GPU) dflt = MAX_SLOTS_PER_GPU;
        int32_t s;
        RP_CHECK_GOTO(get_i32(ld, obj, "topology", "slots_per_gpu", false, dflt, 1, MAX_SLOTS_PER_GPU, &s),
                      st, out);
        const int32_t sub = t->tensor_parallel_size * t->context_parallel_size / t->expert_tensor_parallel_size;
        int64_t per_rank = (int64_t)s * sub;
        if (per_rank > MAX_SLOTS_PER_GPU)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_ERANGE, path,
                                "is %d per EP rank, %lld per DP rank (%d EP ranks of it), more than the %d supported",
                                s, (long long)per_rank, sub, MAX_SLOTS_PER_GPU);
        for (size_t g = 0; g < n; g++) slots[g] = (int32_t)per_rank;
    }
    /* One placement is shared by every EP group (the expert gradient reduction pairs the
     * same slot across groups), so EP rank j must have the same slot count in each. */
    for (int32_t g = t->ep_size; g < t->num_gpus; g++)
        if (slots[g] != slots[g % t->ep_size]) {
            char ip[64];
            rp_jpath_index(ip, sizeof ip, path, (size_t)g);
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, ip,
                                "is %d, but GPU %d (the same EP rank %d in EP group 0) has %d: every EP "
                                "group shares one placement, so slot counts must repeat per EP group",
                                slots[g], g % t->ep_size, g % t->ep_size, slots[g % t->ep_size]);
        }
    /* Every EP group must hold each expert at least once (all groups have group 0's slots). */
    int64_t total = 0;
    for (int32_t g = 0; g < t->ep_size; g++) total += slots[g];
    if (total < m->num_experts)
        return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path,
                            "gives each EP group %lld expert slots per layer, fewer than the model's %d "
                            "experts", (long long)total, m->num_experts);
out:
    return st;
}

/* layers_per_stage needs the layer count: read after the model. Default: the MoE layers
 * split as evenly as the count allows, the first virtual stages taking one more. */
rp_status config_load_stage_layers(loader *ld, json_t *obj)
{
    rp_topology *t = &ld->cfg->topology;
    const int32_t L = ld->cfg->model.num_layers;
    const int32_t V = t->pipeline_parallel_size * t->virtual_pipeline_size;
    const char *path = "topology.layers_per_stage";
    rp_status st = RP_OK;
    int32_t *n = ld->cfg->stage_layers = rp_calloc(ld->ctx, 2 * (size_t)V, sizeof(int32_t));
    if (!n) return rp_fail_nomem(ld->err, "the pipeline stages");
    json_t *v = json_object_get(obj, "layers_per_stage");
    if (v) {
        if (!json_is_array(v) || json_array_size(v) != (size_t)V)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path,
                                "must be an array of %d layer counts, one per virtual stage (pipeline_parallel_size "
                                "%d x virtual_pipeline_size %d), got %s of %zu",
                                V, t->pipeline_parallel_size, t->virtual_pipeline_size, rp_jdoc_type_name(v),
                                json_is_array(v) ? json_array_size(v) : (size_t)1);
        int64_t sum = 0;
        for (int32_t s = 0; s < V; s++) {
            char ip[64];
            int64_t k;
            rp_jpath_index(ip, sizeof ip, path, (size_t)s);
            RP_CHECK_GOTO(rp_jdoc_int_value(&ld->doc, json_array_get(v, (size_t)s), ip, 0, L, &k, ld->err), st,
                          out);
            n[s] = (int32_t)k;
            sum += k;
        }
        if (sum != L)
            return rp_jdoc_fail(&ld->doc, ld->err, RP_EINVAL, path,
                                "sums to %lld layers, but model.num_layers is %d: every MoE layer sits on exactly "
                                "one virtual stage", (long long)sum, L);
    } else {
        for (int32_t s = 0; s < V; s++) n[s] = L / V + (s < L % V ? 1 : 0);
    }
    int32_t *begin = n + V;
    for (int32_t s = 1; s < V; s++) begin[s] = begin[s - 1] + n[s - 1];
    t->layers_per_stage = n;
    t->stage_layer_begin = begin;
out:
    return st;
}
