/* `routepack stats --shift OLD.rpt NEW.rpt`: router shift between one step's replayed
 * routing and the training forward's own top-k ids for the same tokens (rp_shift_compute),
 * as text or JSON. */
#include "cli.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* The two steps must describe the same tokens of the same model. */
static bool same_batch(const char *old_path, const char *new_path, const rp_trace_step_info *a,
                       const rp_trace_step_info *b, const rp_batch *ba, const rp_batch *bb)
{
    if (a->num_layers != b->num_layers || a->top_k != b->top_k || a->num_experts != b->num_experts) {
        fprintf(stderr,
                "routepack: %s has %d layers x %d experts x top-%d but %s has %d x %d x top-%d; both must "
                "come from the same model\n",
                old_path, a->num_layers, a->num_experts, a->top_k, new_path, b->num_layers, b->num_experts,
                b->top_k);
        return false;
    }
    const int32_t n = rp_batch_num_seqs(ba);
    if (n != rp_batch_num_seqs(bb)) {
        fprintf(stderr, "routepack: %s has %d sequences but %s has %d; both must hold the same tokens\n",
                old_path, n, new_path, rp_batch_num_seqs(bb));
        return false;
    }
    for (int32_t s = 0; s < n; s++)
        if (rp_batch_seq_len(ba, s) != rp_batch_seq_len(bb, s)) {
            fprintf(stderr, "routepack: sequence %d has %d tokens in %s but %d in %s\n", s,
                    rp_batch_seq_len(ba, s), old_path, rp_batch_seq_len(bb, s), new_path);
            return false;
        }
    return true;
}

/* Worst (layer, expert) of one layer by lost / old; -1 when no expert had old choices. */
static int32_t worst_expert(const rp_shift *sh, int32_t l, double *fraction)
{
    const int32_t E = rp_shift_num_experts(sh);
    const int64_t *old = rp_shift_expert_old(sh) + (size_t)l * E, *lost = rp_shift_expert_lost(sh) + (size_t)l * E;
    int32_t worst = -1;
    *fraction = 0;
    for (int32_t e = 0; e < E; e++) {
        if (!old[e]) continue;
        double f = (double)lost[e] / (double)old[e];
        if (worst < 0 || f > *fraction) worst = e, *fraction = f;
    }
    return worst;
}

static void print_text(const char *old_path, const char *new_path, int32_t step, const rp_shift *sh)
{
    const rp_shift_summary m = rp_shift_summarize(sh);
    const int32_t layers = rp_shift_num_layers(sh);
    const int64_t per_layer = layers ? m.choices / layers : 0;
    printf("router shift, step %d: %s (old) -> %s (new)\n", step, old_path, new_path);
    printf("%d sequences, %d layers, top-%d, %d experts: %lld of %lld token-choices changed (%.4f)\n"
           "(a choice changed when its old expert is not in the token's new top-k)\n\n",
           rp_shift_num_seqs(sh), layers, rp_shift_top_k(sh), rp_shift_num_experts(sh), (long long)m.changed,
           (long long)m.choices, m.fraction);
    printf("%5s  %10s  %8s  %22s\n", "layer", "changed", "fraction", "worst expert (lost)");
    const int64_t *lc = rp_shift_layer_changed(sh);
    for (int32_t l = 0; l < layers; l++) {
        double wf;
        int32_t we = worst_expert(sh, l, &wf);
        char worst[48];
        if (we >= 0) snprintf(worst, sizeof worst, "%d (%.3f)", we, wf);
        else snprintf(worst, sizeof worst, "-");
        printf("%5d  %10lld  %8.4f  %22s\n", l, (long long)lc[l], per_layer ? (double)lc[l] / per_layer : 0.0,
               worst);
    }
    printf("\nworst layer %d (%.4f), worst sequence %d (%.4f), worst expert %d of layer %d (lost %.4f of its "
           "old choices)\n",
           m.max_layer, m.max_layer_fraction, m.max_seq, m.max_seq_fraction, m.max_expert, m.max_expert_layer,
           m.max_expert_lost_fraction);
}

static json_t *int_array(const int64_t *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer(v[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static bool print_json(const char *old_path, const char *new_path, int32_t step, const rp_shift *sh)
{
    const rp_shift_summary m = rp_shift_summarize(sh);
    const int32_t layers = rp_shift_num_layers(sh), E = rp_shift_num_experts(sh), n = rp_shift_num_seqs(sh);
    const int64_t per_layer = layers ? m.choices / layers : 0;
    json_t *arr = json_array();
    bool good = arr != NULL;
    for (int32_t l = 0; good && l < layers; l++) {
        const int64_t c = rp_shift_layer_changed(sh)[l];
        const size_t at = (size_t)l * E;
        json_t *o = json_pack("{s:i, s:I, s:I, s:f, s:o, s:o, s:o}", "layer", l, "changed", (json_int_t)c, "choices",
                              (json_int_t)per_layer, "fraction", per_layer ? (double)c / per_layer : 0.0, "expert_old",
                              int_array(rp_shift_expert_old(sh) + at, (size_t)E), "expert_lost",
                              int_array(rp_shift_expert_lost(sh) + at, (size_t)E), "expert_arrived",
                              int_array(rp_shift_expert_arrived(sh) + at, (size_t)E));
        if (!o || json_array_append_new(arr, o)) good = false;
    }
    json_t *summary = json_pack("{s:I, s:I, s:f, s:f, s:i, s:f, s:i, s:f, s:i, s:i}", "choices",
                                (json_int_t)m.choices, "changed", (json_int_t)m.changed, "fraction", m.fraction,
                                "max_layer_fraction", m.max_layer_fraction, "max_layer", m.max_layer,
                                "max_seq_fraction", m.max_seq_fraction, "max_seq", m.max_seq,
                                "max_expert_lost_fraction", m.max_expert_lost_fraction, "max_expert_layer",
                                m.max_expert_layer, "max_expert", m.max_expert);
    json_t *root = json_object();
    if (!root) {
        json_decref(arr);
        json_decref(summary);
        return false;
    }
    int failed = json_object_set_new(root, "old_trace", json_string(old_path)) |
                 json_object_set_new(root, "new_trace", json_string(new_path)) |
                 json_object_set_new(root, "step", json_integer(step)) |
                 json_object_set_new(root, "num_seqs", json_integer(n)) |
                 json_object_set_new(root, "num_layers", json_integer(layers)) |
                 json_object_set_new(root, "num_experts", json_integer(E)) |
                 json_object_set_new(root, "top_k", json_integer(rp_shift_top_k(sh))) |
                 json_object_set_new(root, "summary", summary) | json_object_set_new(root, "layers", arr) |
                 json_object_set_new(root, "seq_changed", int_array(rp_shift_seq_changed(sh), (size_t)n)) |
                 json_object_set_new(root, "seq_choices", int_array(rp_shift_seq_choices(sh), (size_t)n));
    if (!good || failed) {
        json_decref(root);
        return false;
    }
    return cli_print_json(root, 6);
}

int cmd_stats_shift(rp_context *ctx, const char *old_path, const char *new_path, int64_t step, int32_t threads,
                    bool json)
{
    rp_trace *traces[2] = {NULL, NULL};
    rp_batch *batches[2] = {NULL, NULL};
    rp_routing routings[2];
    const rp_trace_step_info *infos[2];
    const char *paths[2] = {old_path, new_path};
    rp_shift *sh = NULL;
    rp_error err;
    int rc = CLI_OK;
    for (int i = 0; i < 2; i++) {
        if (cli_trace_open(ctx, paths[i], 0, &traces[i], &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
        int32_t num_steps = rp_trace_num_steps(traces[i]);
        if (step < 0 || step >= num_steps) {
            rc = cli_usage("%s has %d step%s (0 to %d), --step %lld does not exist", paths[i], num_steps,
                           num_steps == 1 ? "" : "s", num_steps - 1, (long long)step);
            goto out;
        }
        infos[i] = rp_trace_step(traces[i], (int32_t)step);
        if (rp_trace_read_step(traces[i], (int32_t)step, &batches[i], &routings[i], &err) != RP_OK) {
            rc = cli_fail(&err);
            goto out;
        }
    }
    if (!same_batch(old_path, new_path, infos[0], infos[1], batches[0], batches[1])) {
        rc = CLI_FAIL;
        goto out;
    }
    if (rp_shift_compute(ctx, batches[0], &routings[0], &routings[1], infos[0]->num_experts, threads, &sh, &err) !=
        RP_OK) {
        fprintf(stderr, "routepack: step %lld: %s\n", (long long)step, err.text);
        rc = CLI_FAIL;
        goto out;
    }
    if (!json)
        print_text(old_path, new_path, (int32_t)step, sh);
    else if (!print_json(old_path, new_path, (int32_t)step, sh)) {
        fprintf(stderr, "routepack: could not write the JSON output\n");
        rc = CLI_FAIL;
    }
    if (fflush(stdout) != 0) rc = CLI_FAIL;
out:
    rp_shift_free(sh);
    for (int i = 0; i < 2; i++) {
        rp_batch_free(batches[i]);
        rp_trace_close(traces[i]);
    }
    return rc;
}
