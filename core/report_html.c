/* The simulation report as one self-contained HTML page: a summary table and SVG charts
 * (step / lower bound per step, per-GPU time at the worst step's straggler layer, expert
 * load per GPU), inline CSS, no scripts, nothing fetched. */
#include "report_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static double layer_time(const rp_report_policy *p, int32_t G)
{
    double a = 0, d = 0, x = 0, c = 0;
    for (int32_t g = 0; g < G; g++) {
        a = fmax(a, p->attention[g]);
        d = fmax(d, p->dispatch[g]);
        x = fmax(x, p->expert[g]);
        c = fmax(c, p->combine[g]);
    }
    return a + d + x + c;
}

/* ---- the page's parts ---- */

static void put_head(text_buf *b, const rp_report *r)
{
    text_put(b, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>");
    svg_text(b, r->title);
    text_put(b, "</title>\n<style>\n"
           "body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#222;"
           "background:#fff;margin:0 auto;max-width:1160px;padding:16px 20px 40px;}\n"
           "h1{font-size:26px;margin:8px 0 4px;}h2{font-size:19px;margin:34px 0 6px;"
           "border-bottom:1px solid #ddd;padding-bottom:4px;}\n"
           "p{font-size:14px;line-height:1.45;margin:4px 0;}p.ctx{color:#555;}\n"
           "table{border-collapse:collapse;font-size:13.5px;margin-top:10px;}\n"
           "th,td{padding:5px 10px;border-bottom:1px solid #e4e4e4;text-align:right;}\n"
           "th{background:#f4f4f4;font-weight:600;}td.l,th.l{text-align:left;}\n"
           "td.best{font-weight:700;background:#eaf5ea;}td.err{color:#b00020;text-align:left;}\n"
           "span.sw{display:inline-block;width:11px;height:11px;margin-right:7px;vertical-align:-1px;}\n"
           "svg{display:block;max-width:100%%;height:auto;margin-top:8px;}\n"
           "svg text{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;fill:#222;}\n"
           "svg .tick{font-size:12px;fill:#444;}svg .axis{font-size:13px;}svg .legend{font-size:13px;}\n"
           "svg .title{font-size:14px;font-weight:600;}svg .note{font-size:12px;fill:#555;}\n"
           "svg .grid{stroke:#e6e6e6;stroke-width:1;}svg .frame{fill:none;stroke:#999;stroke-width:1;}\n"
           ".grid2{display:grid;grid-template-columns:1fr 1fr;gap:10px 20px;}\n"
           "footer{margin-top:36px;font-size:12px;color:#777;}\n"
           "p.verdict{font-size:16px;font-weight:600;background:#f3f7fb;border-left:4px solid #0072B2;"
           "padding:8px 12px;margin:12px 0;}\n"
           "</style>\n</head>\n<body>\n<h1>");
    svg_text(b, r->title);
    text_put(b, "</h1>\n");
    for (int i = 0; r->context && r->context[i]; i++) {
        text_put(b, "<p class=\"ctx\">");
        svg_text(b, r->context[i]);
        text_put(b, "</p>\n");
    }
}

/* Index of the best (smallest, or largest) value among charted policies; -1 if none. */
static int best_of(const rp_report *r, size_t offset, bool largest)
{
    int best = -1;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p)) continue;
        double v = *(const double *)((const char *)p + offset);
        if (isnan(v)) continue;
        double w = best < 0 ? 0 : *(const double *)((const char *)&r->policies[best] + offset);
        if (best < 0 || (largest ? v > w : v < w)) best = i;
    }
    return best;
}

static void put_summary(text_buf *b, const rp_report *r)
{
    text_put(b, "<h2>Summary</h2>\n<p>Means over the steps each policy ran. Step time is the cost "
           "model's prediction for forward and backward; the lower bound is the same work with every "
           "term perfectly balanced, so step / lower bound is 1.00 at best (the plan's own imbalance); "
           "the shared bound of a step is the least of all plans' own bounds for that step, so step / "
           "shared bound ranks plans as step time does. Imbalance is max / mean "
           "across GPUs. Best value in each column in bold.</p>\n");
    text_put(b, "<table>\n<tr><th class=\"l\">policy</th><th>step (ms)</th><th>step / lower bound</th>"
           "<th>step / shared bound</th><th>speedup vs ");
    svg_text(b, r->baseline ? r->baseline : "baseline");
    text_put(b, "</th><th>attention imbalance</th><th>expert imbalance</th><th>fallbacks</th>"
           "<th>migrated / step</th><th>plan time (ms)</th></tr>\n");
    int best_step = best_of(r, offsetof(rp_report_policy, mean_step_s), false);
    int best_ratio = best_of(r, offsetof(rp_report_policy, mean_ratio), false);
    int best_shared = best_of(r, offsetof(rp_report_policy, mean_shared_ratio), false);
    int best_speed = best_of(r, offsetof(rp_report_policy, speedup), true);
    int best_attn = best_of(r, offsetof(rp_report_policy, attention_imbalance), false);
    int best_exp = best_of(r, offsetof(rp_report_policy, expert_imbalance), false);
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        text_put(b, "<tr><td class=\"l\">");
        if (report_charted(p)) text_put(b, "<span class=\"sw\" style=\"background:%s\"></span>", svg_colour(i));
        svg_text(b, p->label);
        if (p->running) {
            text_put(b, " <span style=\"color:#777\">(");
            svg_text(b, p->running);
            text_put(b, ")</span>");
        }
        text_put(b, "</td>");
        if (!report_charted(p)) {
            text_put(b, "<td class=\"err\" colspan=\"9\">did not run: ");
            svg_text(b, p->error ? p->error : "unknown error");
            text_put(b, "</td></tr>\n");
            continue;
        }
        double mb = p->migrated_bytes_per_step;
        const char *unit = mb >= 1e9 ? "GB" : mb >= 1e6 ? "MB" : mb >= 1e3 ? "KB" : "B";
        double scaled = mb >= 1e9 ? mb / 1e9 : mb >= 1e6 ? mb / 1e6 : mb >= 1e3 ? mb / 1e3 : mb;
        text_put(b, "<td%s>%.3f</td><td%s>%.3f</td>", i == best_step ? " class=\"best\"" : "",
            p->mean_step_s * 1e3, i == best_ratio ? " class=\"best\"" : "", p->mean_ratio);
        if (isnan(p->mean_shared_ratio)) text_put(b, "<td>&ndash;</td>");
        else text_put(b, "<td%s>%.3f</td>", i == best_shared ? " class=\"best\"" : "", p->mean_shared_ratio);
        if (isnan(p->speedup)) text_put(b, "<td>&ndash;</td>");
        else text_put(b, "<td%s>%.3f&times;</td>", i == best_speed ? " class=\"best\"" : "", p->speedup);
        text_put(b, "<td%s>%.3f</td><td%s>%.3f</td><td>%d</td><td>%.*f %s</td><td>%.2f</td></tr>\n",
            i == best_attn ? " class=\"best\"" : "", p->attention_imbalance,
            i == best_exp ? " class=\"best\"" : "", p->expert_imbalance, p->fallbacks,
            unit[0] == 'B' ? 0 : 1, scaled, unit, p->mean_plan_s * 1e3);
        if (p->error) {
            text_put(b, "<tr><td></td><td class=\"err\" colspan=\"9\">stopped early: ");
            svg_text(b, p->error);
            text_put(b, "</td></tr>\n");
        }
        for (int32_t k = 0; p->fallback_reasons && k < p->num_fallback_reasons; k++) {
            const rp_report_reason *why = &p->fallback_reasons[k];
            text_put(b, "<tr><td></td><td class=\"err\" colspan=\"9\">step %lld%s", (long long)why->first_step,
                    why->count > 1 ? " first" : "");
            if (why->count > 1) text_put(b, " (%d steps)", (int)why->count);
            text_put(b, ": ");
            svg_text(b, why->text);
            text_put(b, "</td></tr>\n");
        }
    }
    text_put(b, "</table>\n");
}

/* How many charted policies after `i` have the same steps as `i` and ratios within
 * `tol` of its at every step: their lines would hide its line. */
static int coinciding_after(const rp_report *r, int i, double tol)
{
    const rp_report_policy *p = &r->policies[i];
    int count = 0;
    for (int j = i + 1; j < r->num_policies; j++) {
        const rp_report_policy *q = &r->policies[j];
        if (!report_charted(q) || q->num_steps != p->num_steps) continue;
        bool same = true;
        for (int32_t k = 0; same && k < p->num_steps; k++)
            same = q->steps[k] == p->steps[k] && fabs(q->ratio[k] - p->ratio[k]) <= tol;
        count += same;
    }
    return count;
}

static void put_ratio_chart(text_buf *b, const rp_report *r)
{
    const double W = 1120;
    int n = 0;
    double ymin = INFINITY, ymax = -INFINITY;
    int64_t smin = INT64_MAX, smax = INT64_MIN;
    bool any_fallback = false;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p)) continue;
        n++;
        for (int32_t k = 0; k < p->num_steps; k++) {
            if (isfinite(p->ratio[k])) {
                ymin = fmin(ymin, p->ratio[k]);
                ymax = fmax(ymax, p->ratio[k]);
            }
            smin = p->steps[k] < smin ? p->steps[k] : smin;
            smax = p->steps[k] > smax ? p->steps[k] : smax;
            any_fallback |= p->fallback && p->fallback[k];
        }
    }
    if (!(ymin <= ymax)) ymin = ymax = 1; /* no finite ratio */
    /* the axis starts at 1 (the bound) unless the data sit far above it: then it zooms
     * to the data, so the policies' differences stay visible, and says so */
    double yspan = ymax - ymin > 0 ? ymax - ymin : 0.05;
    bool from_one = ymin - 1 <= yspan * 1.5;
    double lo = from_one ? fmin(1, ymin) : ymin - 0.1 * yspan;
    /* half a step of room at each end, so the first and last markers clear the frame */
    double pad = smax > smin ? 0.5 * (double)(smax - smin) / 12 : 0;
    pad = pad < 0.25 && smax > smin ? 0.25 : pad;
    svg_frame f = {80, 20, W - 110, 300, (double)smin - pad, (double)smax + pad,
               svg_ticks_for(lo, ymax + (ymax - ymin) * 0.05, 6)};
    bool any_coincide = false;
    for (int i = 0; i < r->num_policies; i++)
        any_coincide |= report_charted(&r->policies[i]) && coinciding_after(r, i, (f.y.hi - f.y.lo) * 0.004) > 0;
    text_put(b, "<h2>Step time / lower bound, per step</h2>\n<p>How far each policy's predicted step "
           "time is from the lower bound at every step (1.00 = perfectly balanced).%s%s%s</p>\n",
           from_one ? "" : " The axis does not start at 1.00, so that the policies can be told apart.",
           any_fallback ? " A hollow marker is a step where the policy failed and the last good plan "
                          "was used." : "",
           any_coincide ? " Lines that coincide are drawn as nested outlines." : "");
    /* legend rows below the x axis title */
    double legend_h = svg_legend_rows(f.w, n, report_longest_label(r)) * 22.0;
    double H = f.y0 + f.h + 64 + legend_h;
    text_put(b, "<svg width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
           "aria-label=\"step time over lower bound per step\">\n", W, H, W, H);
    svg_y_axis(b, &f, "step time / lower bound");
    /* x ticks: integer steps, at most about 12 labels */
    int64_t span = smax - smin, every = 1;
    while (span / every > 12) every = every == 1 ? 2 : every == 2 ? 5 : every * 2;
    for (int64_t s = smin; s <= smax; s++) {
        if ((s - smin) % every) continue;
        double x = svg_px_x(&f, (double)s);
        text_put(b, "<line class=\"grid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>"
               "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%lld</text>\n",
            x, f.y0, x, f.y0 + f.h, x, f.y0 + f.h + 18, (long long)s);
    }
    svg_x_title(b, &f, "step");
    if (f.y.lo <= 1 && 1 <= f.y.hi) {
        double y = svg_px_y(&f, 1);
        text_put(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\" stroke-dasharray=\"4 4\"/>"
               "<text class=\"note\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">lower bound</text>\n",
            f.x0, y, f.x0 + f.w, y, f.x0 + f.w - 6, y - 6);
    }
    const char *labels[64], *colours[64], *dashes[64];
    int m = 0;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p)) continue;
        /* a line that coincides with lines drawn after it is widened by 2 px for each,
         * so it still shows as an outline around them */
        int under = coinciding_after(r, i, (f.y.hi - f.y.lo) * 0.004);
        double width = 2.5 + 2.0 * under;
        text_put(b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\" stroke-linejoin=\"round\"%s%s%s "
               "points=\"", svg_colour(i), width, svg_dash(i)[0] ? " stroke-dasharray=\"" : "", svg_dash(i),
            svg_dash(i)[0] ? "\"" : "");
        for (int32_t k = 0; k < p->num_steps; k++)
            if (isfinite(p->ratio[k]))
                text_put(b, "%s%.1f,%.1f", k ? " " : "", svg_px_x(&f, (double)p->steps[k]), svg_px_y(&f, p->ratio[k]));
        text_put(b, "\"/>\n");
        for (int32_t k = 0; k < p->num_steps; k++) {
            if (!isfinite(p->ratio[k])) continue;
            bool fb = p->fallback && p->fallback[k];
            text_put(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"%.1f\" fill=\"%s\" stroke=\"%s\" stroke-width=\"2\"/>",
                svg_px_x(&f, (double)p->steps[k]), svg_px_y(&f, p->ratio[k]), (fb ? 5 : 3.5) + under,
                fb ? "#fff" : svg_colour(i), svg_colour(i));
        }
        text_put(b, "\n");
        if (m < 64) {
            labels[m] = p->label;
            colours[m] = svg_colour(i);
            dashes[m] = svg_dash(i);
            m++;
        }
    }
    svg_legend(b, f.x0, f.y0 + f.h + 62, f.w, m, labels, colours, dashes, true);
    text_put(b, "</svg>\n");
}

/* One small chart: the forward time of each GPU at the straggler (microbatch, layer) of
 * step rp_report.load_step, stacked by side, on a shared scale. */
static void put_gpu_stack(text_buf *b, const rp_report *r, int i, double ymax)
{
    const rp_report_policy *p = &r->policies[i];
    const int32_t G = r->num_gpus;
    const double W = 560, H = 330;
    svg_frame f = {78, 46, W - 96, H - 46 - 58, -0.5, G - 0.5, svg_ticks_for(0, ymax, 5)};
    text_put(b, "<svg width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"",
        W, H, W, H);
    svg_text(b, p->label);
    text_put(b, ": per-GPU time at step %lld's straggler layer\">\n", (long long)r->load_step);
    text_put(b, "<rect x=\"0\" y=\"4\" width=\"10\" height=\"14\" fill=\"%s\"/><text class=\"title\" x=\"16\" y=\"16\">",
        svg_colour(i));
    svg_text(b, p->label);
    text_put(b, "</text>\n<text class=\"note\" x=\"16\" y=\"34\">step %lld (step / lower bound %.3f): "
           "microbatch %d, layer %d; straggler GPU %d (%s)</text>\n",
        (long long)r->load_step, p->load_ratio, p->straggler_mb, p->straggler_layer, p->straggler_gpu,
        svg_side_label[p->straggler_side >= 0 && p->straggler_side < 4 ? p->straggler_side : 0]);
    svg_y_axis(b, &f, "forward time (ms)");
    double slot = f.w / G, bw = slot * 0.72;
    int every = G <= 16 ? 1 : G <= 32 ? 2 : G <= 64 ? 4 : (G + 15) / 16;
    if (r->gpus_per_node > 0 && r->gpus_per_node < G)
        for (int32_t g = r->gpus_per_node; g < G; g += r->gpus_per_node) {
            double x = f.x0 + g * slot;
            text_put(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#bbb\" stroke-dasharray=\"2 3\"/>\n",
                x, f.y0, x, f.y0 + f.h);
        }
    for (int32_t g = 0; g < G; g++) {
        const double v[4] = {p->attention[g] * 1e3, p->dispatch[g] * 1e3, p->expert[g] * 1e3, p->combine[g] * 1e3};
        double x = f.x0 + g * slot + (slot - bw) / 2, base = 0;
        for (int s = 0; s < 4; s++) {
            if (!(v[s] > 0)) continue;
            double y1 = svg_px_y(&f, base + v[s]), y0 = svg_px_y(&f, base);
            text_put(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.2f\" fill=\"%s\"><title>GPU %d %s: %.4f ms</title></rect>",
                x, y1, bw, y0 - y1, svg_side_colour[s], g, svg_side_label[s], v[s]);
            base += v[s];
        }
        if (g % every == 0)
            text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                f.x0 + (g + 0.5) * slot, f.y0 + f.h + 16, g);
        if (g == p->straggler_gpu) /* a marker above the straggler's bar */
            text_put(b, "<path d=\"M%.1f %.1f l-5 -8 h10 z\" fill=\"#c00\"><title>straggler GPU %d</title></path>",
                f.x0 + (g + 0.5) * slot, svg_px_y(&f, base) - 3, g);
        text_put(b, "\n");
    }
    double lt = layer_time(p, G) * 1e3, y = svg_px_y(&f, lt);
    /* the shared scale leaves room above the tallest line for this label */
    text_put(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#222\" stroke-width=\"1.5\" "
           "stroke-dasharray=\"6 4\"/><text class=\"note\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">"
           "layer time %.3f ms</text>\n",
        f.x0, y, f.x0 + f.w, y, f.x0 + f.w - 4, y - 5, lt);
    text_put(b, "<text class=\"axis\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">GPU</text>\n", f.x0 + f.w / 2,
        f.y0 + f.h + 38);
    text_put(b, "</svg>\n");
}

static void put_gpu_stacks(text_buf *b, const rp_report *r)
{
    const int32_t G = r->num_gpus;
    double ymax = 0;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p) || !p->attention) continue;
        ymax = fmax(ymax, layer_time(p, G));
        for (int32_t g = 0; g < G; g++)
            ymax = fmax(ymax, p->attention[g] + p->dispatch[g] + p->expert[g] + p->combine[g]);
    }
    /* headroom, so the tallest layer-time line keeps its label inside the frame */
    ymax *= 1e3;
    svg_ticks t = svg_ticks_for(0, ymax, 5);
    if (t.hi - ymax < (t.hi - t.lo) * 0.1) ymax += (t.hi - t.lo) * 0.1;
    text_put(b, "<h2>Where step %lld's time goes, per GPU</h2>\n<p>For each policy at the same step, %lld "
           "(the worst step overall, the largest step / lower bound averaged over the policies, as "
           "in the expert load chart), at its <b>straggler microbatch and layer</b> "
           "(the one whose slowest term is the largest): the forward time of each GPU, stacked "
           "attention, dispatch, expert and combine. Every GPU waits for the slowest at each term "
           "(the all-to-all runs in lockstep), so the layer takes the dashed line: max attention + "
           "max dispatch + max expert + max combine. All charts share one scale; a red triangle marks "
           "the straggler GPU%s.</p>\n",
           (long long)r->load_step, (long long)r->load_step, r->gpus_per_node > 0 && r->gpus_per_node < G ? "; dotted lines separate nodes" : "");
    const char *colours[4] = {svg_side_colour[0], svg_side_colour[1], svg_side_colour[2], svg_side_colour[3]};
    text_put(b, "<svg width=\"1120\" height=\"30\" viewBox=\"0 0 1120 30\" role=\"img\" aria-label=\"legend\">\n");
    svg_legend(b, 10, 15, 1100, 4, svg_side_label, colours, NULL, false);
    text_put(b, "</svg>\n<div class=\"grid2\">\n");
    for (int i = 0; i < r->num_policies; i++)
        if (report_charted(&r->policies[i]) && r->policies[i].attention) put_gpu_stack(b, r, i, ymax);
    text_put(b, "</div>\n");
}

rp_status rp_report_html(rp_context *ctx, const rp_report *r, char **text, size_t *len, rp_error *err)
{
    if (!ctx || !r || !text) return rp_fail(err, RP_EINVAL, "report: NULL argument");
    if (r->num_gpus < 1) return rp_fail(err, RP_EINVAL, "report: %d GPUs; at least 1 is needed", r->num_gpus);
    if (r->num_policies < 1 || !r->policies)
        return rp_fail(err, RP_EINVAL, "report: no policies to report");
    int ran = 0;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!p->label) return rp_fail(err, RP_EINVAL, "report: policy %d has no label", i);
        if (p->num_steps < 0) return rp_fail(err, RP_EINVAL, "report: policy '%s' has %d steps", p->label, p->num_steps);
        if (!report_charted(p)) continue;
        if (!p->steps || !p->ratio || (p->attention && (!p->dispatch || !p->expert || !p->combine)))
            return rp_fail(err, RP_EINVAL, "report: policy '%s' ran %d steps but lacks its per-step or "
                           "per-GPU figures", p->label, p->num_steps);
        ran++;
    }
    text_buf b = {ctx, NULL, 0, 0, false};
    put_head(&b, r);
    if (r->verdict) {
        text_put(&b, "<p class=\"verdict\">");
        svg_text(&b, r->verdict);
        text_put(&b, "</p>\n");
    }
    put_summary(&b, r);
    if (ran > 0) {
        put_ratio_chart(&b, r);
        put_gpu_stacks(&b, r);
        report_steps(&b, r);
        report_expert_load(&b, r);
        report_memory(&b, r);
    } else {
        text_put(&b, "<p>No policy ran, so there is nothing to chart.</p>\n");
    }
    text_put(&b, "<footer>Written by RoutePack %s. Times are the cost model's predictions "
            "(docs/cost-model.md); the page holds no scripts and loads nothing.</footer>\n</body>\n</html>\n",
        RP_VERSION_STRING);
    if (b.failed) {
        rp_free(ctx, b.data);
        return rp_fail_nomem(err, "the HTML report");
    }
    *text = b.data;
    if (len) *len = b.len;
    return RP_OK;
}
