/* The report's memory section: for each policy, the GPU that needed the most memory at
 * any step (expert slots, dense parameters, their gradients and optimizer state, the
 * plan's extra replicas, migration staging; activations excluded), against the GPU's
 * capacity (docs/cost-model.md, "Memory per GPU"). */
#include "report_internal.h"

#include <math.h>

static void put_gb(text_buf *b, double bytes)
{
    text_put(b, "<td>%.1f</td>", bytes / 1e9);
}

void report_memory(text_buf *b, const rp_report *r)
{
    int n = 0;
    for (int i = 0; i < r->num_policies; i++) n += report_charted(&r->policies[i]) && r->policies[i].memory;
    if (n == 0) return;
    text_put(b, "<h2>Memory per GPU</h2>\n<p>For each policy, the GPU that needed the most memory at any step, "
               "in GB: expert weights, gradients and optimizer state of every slot, the dense parameters with "
               "theirs, the plan's extra replicas (weights and gradients, held for the step) and the migration "
               "staging, against hardware.hbm_bytes. Activations are not counted (the microbatch limits "
               "bound them).</p>\n<table>\n<tr><th class=\"l\">policy</th><th>GPU</th><th>expert weights</th>"
               "<th>expert grads</th><th>expert optimizer</th><th>dense (all)</th><th>extra replicas</th>"
               "<th>staging</th><th>total</th><th>capacity</th><th>headroom</th></tr>\n");
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p) || !p->memory) continue;
        const rp_gpu_memory *m = p->memory;
        text_put(b, "<tr><td class=\"l\"><span class=\"sw\" style=\"background:%s\"></span>", svg_colour(i));
        svg_text(b, p->label);
        text_put(b, "</td><td>%d</td>", m->gpu);
        put_gb(b, m->expert_weight_bytes);
        put_gb(b, m->expert_grad_bytes);
        put_gb(b, m->expert_optimizer_bytes);
        put_gb(b, m->dense_weight_bytes + m->dense_grad_bytes + m->dense_optimizer_bytes);
        text_put(b, "<td>%lld (%.1f)</td>", (long long)m->extra_replicas, m->extra_replica_bytes / 1e9);
        put_gb(b, m->staging_bytes);
        put_gb(b, m->total_bytes);
        put_gb(b, m->capacity_bytes);
        double room = m->capacity_bytes - m->total_bytes;
        text_put(b, "<td%s>%.1f (%.0f%%)</td></tr>\n", room < 0 ? " class=\"err\"" : "", room / 1e9,
                m->capacity_bytes > 0 ? 100.0 * room / m->capacity_bytes : 0.0);
    }
    text_put(b, "</table>\n");
}
