/* The report's sections on time per step: the absolute step + migration time of every
 * step (what a trainer waits for), what the migrations moved, and the planning time
 * against the step time it plans. */
#include "report_internal.h"

#include <math.h>
#include <stdio.h>

static bool has_steps(const rp_report_policy *p)
{
    return report_charted(p) && p->step_s && p->migration_s && p->migration_bytes && p->plan_s &&
           p->migration_rounds && p->staging_bytes;
}

static void put_bytes(text_buf *b, double v)
{
    const char *unit = v >= 1e9 ? "GB" : v >= 1e6 ? "MB" : v >= 1e3 ? "KB" : "B";
    double scaled = v >= 1e9 ? v / 1e9 : v >= 1e6 ? v / 1e6 : v >= 1e3 ? v / 1e3 : v;
    text_put(b, "%.*f %s", unit[0] == 'B' ? 0 : 1, scaled, unit);
}

/* Step + migration time of every step, one line per policy, in milliseconds. */
static void put_time_chart(text_buf *b, const rp_report *r)
{
    const double W = 1120;
    double ymax = 0;
    int64_t smin = INT64_MAX, smax = INT64_MIN;
    int n = 0;
    bool any_migration = false;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!has_steps(p)) continue;
        n++;
        for (int32_t k = 0; k < p->num_steps; k++) {
            double t = p->step_s[k] + p->migration_s[k];
            if (isfinite(t)) ymax = fmax(ymax, t * 1e3);
            any_migration |= p->migration_s[k] > 0;
            smin = p->steps[k] < smin ? p->steps[k] : smin;
            smax = p->steps[k] > smax ? p->steps[k] : smax;
        }
    }
    if (n == 0) return;
    text_put(b, "<h2>Step time with migration, per step</h2>\n<p>The predicted time of every step, forward "
               "and backward, plus the expert migration that step started with (the cost model overlaps "
               "it with nothing)%s. This is what a trainer waits for; the table under it says what the "
               "migrations moved.</p>\n",
            any_migration ? "; a ring marks a step with a migration" : "; no policy migrated");
    double pad = smax > smin ? fmax(0.25, 0.5 * (double)(smax - smin) / 12) : 0;
    svg_frame f = {80, 20, W - 110, 280, (double)smin - pad, (double)smax + pad, svg_ticks_for(0, ymax * 1.05, 6)};
    double H = f.y0 + f.h + 64 + svg_legend_rows(f.w, n, report_longest_label(r)) * 22.0;
    text_put(b, "<svg width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
               "aria-label=\"step time with migration per step\">\n", W, H, W, H);
    svg_y_axis(b, &f, "step + migration (ms)");
    int64_t every = 1;
    while ((smax - smin) / every > 12) every = every == 1 ? 2 : every == 2 ? 5 : every * 2;
    for (int64_t s = smin; s <= smax; s += every)
        text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%lld</text>",
                svg_px_x(&f, (double)s), f.y0 + f.h + 18, (long long)s);
    svg_x_title(b, &f, "step");
    const char *labels[64], *colours[64], *dashes[64];
    int m = 0;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!has_steps(p)) continue;
        text_put(b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2.5\" stroke-linejoin=\"round\"%s%s%s "
                   "points=\"", svg_colour(i), svg_dash(i)[0] ? " stroke-dasharray=\"" : "", svg_dash(i),
                svg_dash(i)[0] ? "\"" : "");
        for (int32_t k = 0; k < p->num_steps; k++) {
            double t = (p->step_s[k] + p->migration_s[k]) * 1e3;
            if (isfinite(t)) text_put(b, "%s%.1f,%.1f", k ? " " : "", svg_px_x(&f, (double)p->steps[k]), svg_px_y(&f, t));
        }
        text_put(b, "\"/>\n");
        for (int32_t k = 0; k < p->num_steps; k++) {
            double t = (p->step_s[k] + p->migration_s[k]) * 1e3;
            if (!isfinite(t)) continue;
            bool moved = p->migration_s[k] > 0;
            text_put(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"%s\" stroke=\"%s\" stroke-width=\"2\">"
                       "<title>", svg_px_x(&f, (double)p->steps[k]), svg_px_y(&f, t), moved ? 5.0 : 3.5,
                    moved ? "#fff" : svg_colour(i), svg_colour(i));
            svg_text(b, p->label);
            text_put(b, ", step %lld: %.3f ms + migration %.3f ms</title></circle>", (long long)p->steps[k],
                    p->step_s[k] * 1e3, p->migration_s[k] * 1e3);
        }
        text_put(b, "\n");
        if (m < 64) labels[m] = p->label, colours[m] = svg_colour(i), dashes[m] = svg_dash(i), m++;
    }
    svg_legend(b, f.x0, f.y0 + f.h + 62, f.w, m, labels, colours, dashes, true);
    text_put(b, "</svg>\n");
}

static void put_migration_table(text_buf *b, const rp_report *r)
{
    text_put(b, "<h2>Migration</h2>\n<p>What each policy's placement changes moved, as the migration plan "
               "schedules them (docs/migration.md): rounds of transfers and the staging memory one GPU "
               "needs in a round. <i>Share</i> is migration time over step + migration time, over the "
               "whole run.</p>\n<table>\n<tr><th class=\"l\">policy</th><th>steps that moved</th>"
               "<th>moved in all</th><th>largest step</th><th>most rounds</th><th>most staging / GPU</th>"
               "<th>migration ms / step</th><th>largest (ms)</th><th>share</th></tr>\n");
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!has_steps(p)) continue;
        int moved = 0;
        int32_t rounds = 0;
        int64_t staging = 0;
        double bytes = 0, top_bytes = 0, mig = 0, top_mig = 0, step = 0;
        for (int32_t k = 0; k < p->num_steps; k++) {
            moved += p->migration_bytes[k] > 0;
            bytes += p->migration_bytes[k];
            top_bytes = fmax(top_bytes, p->migration_bytes[k]);
            rounds = p->migration_rounds[k] > rounds ? p->migration_rounds[k] : rounds;
            staging = p->staging_bytes[k] > staging ? p->staging_bytes[k] : staging;
            mig += p->migration_s[k];
            top_mig = fmax(top_mig, p->migration_s[k]);
            step += p->step_s[k];
        }
        text_put(b, "<tr><td class=\"l\"><span class=\"sw\" style=\"background:%s\"></span>", svg_colour(i));
        svg_text(b, p->label);
        text_put(b, "</td><td>%d of %d</td><td>", moved, p->num_steps);
        put_bytes(b, bytes);
        text_put(b, "</td><td>");
        put_bytes(b, top_bytes);
        text_put(b, "</td><td>%d</td><td>", rounds);
        put_bytes(b, (double)staging);
        text_put(b, "</td><td>%.3f</td><td>%.3f</td><td>%.1f%%</td></tr>\n", mig / p->num_steps * 1e3,
                top_mig * 1e3, step + mig > 0 ? 100.0 * mig / (step + mig) : 0.0);
    }
    text_put(b, "</table>\n");
}

static void put_plan_table(text_buf *b, const rp_report *r)
{
    text_put(b, "<h2>Planning time against step time</h2>\n<p>Plan time is measured on this machine "
               "(statistics of the step's routing, the policy, validation); step time is predicted for "
               "the configured GPUs. A planner that runs beside training must stay a small fraction of "
               "the step it plans.</p>\n<table>\n<tr><th class=\"l\">policy</th><th>plan ms (mean)</th>"
               "<th>plan ms (largest)</th><th>step ms (mean)</th><th>plan / step</th></tr>\n");
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!has_steps(p)) continue;
        double plan = 0, top = 0, step = 0;
        for (int32_t k = 0; k < p->num_steps; k++) {
            plan += p->plan_s[k];
            top = fmax(top, p->plan_s[k]);
            step += p->step_s[k];
        }
        text_put(b, "<tr><td class=\"l\"><span class=\"sw\" style=\"background:%s\"></span>", svg_colour(i));
        svg_text(b, p->label);
        text_put(b, "</td><td>%.2f</td><td>%.2f</td><td>%.3f</td><td>%.1f%%</td></tr>\n", plan / p->num_steps * 1e3,
                top * 1e3, step / p->num_steps * 1e3, step > 0 ? 100.0 * plan / step : 0.0);
    }
    text_put(b, "</table>\n");
}

void report_steps(text_buf *b, const rp_report *r)
{
    bool any = false;
    for (int i = 0; i < r->num_policies; i++) any |= has_steps(&r->policies[i]);
    if (!any) return;
    put_time_chart(b, r);
    put_migration_table(b, r);
    put_plan_table(b, r);
}
