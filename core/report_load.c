/* The report's expert load section: how even the placement left the experts' work at one
 * step. Up to 32 GPUs, bars of each GPU's forward expert time (the policies side by side);
 * above, one heatmap of GPU x layer per policy, each cell that GPU's expert time at that
 * layer against the layer's mean over the GPUs, since 64-256 bars per policy all look alike
 * and the hot spots are per layer anyway. */
#include "report_internal.h"

#include <math.h>
#include <stdio.h>

/* GPU g's forward expert time over all layers of the load step. */
static double gpu_total(const rp_report *r, const rp_report_policy *p, int32_t g)
{
    double t = 0;
    for (int32_t l = 0; l < r->num_layers; l++) t += p->expert_layer[(size_t)l * r->num_gpus + g];
    return t;
}

static void put_load_bars(text_buf *b, const rp_report *r)
{
    const int32_t G = r->num_gpus;
    const double W = 1120;
    int n = 0;
    double ymax = 0;
    for (int i = 0; i < r->num_policies; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p) || !p->expert_layer) continue;
        n++;
        for (int32_t g = 0; g < G; g++) ymax = fmax(ymax, gpu_total(r, p, g) * 1e3);
    }
    if (n == 0) return;
    text_put(b, "<h2>Expert load per GPU, step %lld</h2>\n<p>At step %lld, the worst step overall (the "
           "largest step / lower bound averaged over the policies), so that the bars compare: the "
           "forward expert time of each GPU (the grouped GEMMs of the experts in its slots), summed "
           "over the step's microbatches and layers, as the cost model prices it (replica splits, "
           "token shares and GPU speed included). Even bars mean the placement balanced the "
           "experts; the legend gives max / mean across GPUs.</p>\n",
           (long long)r->load_step, (long long)r->load_step);
    svg_frame f = {80, 20, W - 110, 300, -0.5, G - 0.5, svg_ticks_for(0, ymax * 1.04, 6)};
    /* the labels get " (max/mean 1.234)": 18 or 19 characters more */
    double H = f.y0 + f.h + 64 + svg_legend_rows(f.w, n, report_longest_label(r) + 19) * 22.0;
    text_put(b, "<svg width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" "
           "aria-label=\"expert load per GPU\">\n", W, H, W, H);
    svg_y_axis(b, &f, "expert time, forward (ms)");
    double slot = f.w / G, group = slot * 0.82, bw = n ? group / n : group;
    int every = G <= 32 ? 1 : G <= 64 ? 2 : (G + 31) / 32;
    if (r->gpus_per_node > 0 && r->gpus_per_node < G)
        for (int32_t g = r->gpus_per_node; g < G; g += r->gpus_per_node) {
            double x = f.x0 + g * slot;
            text_put(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#bbb\" stroke-dasharray=\"2 3\"/>\n",
                x, f.y0, x, f.y0 + f.h);
        }
    char (*labels)[300] = rp_calloc(b->ctx, (size_t)(n ? n : 1), sizeof *labels);
    const char **lp = rp_calloc(b->ctx, (size_t)(n ? n : 1), sizeof *lp);
    const char **cp = rp_calloc(b->ctx, (size_t)(n ? n : 1), sizeof *cp);
    if (!labels || !lp || !cp) b->failed = true;
    int k = 0;
    for (int i = 0; i < r->num_policies && !b->failed; i++) {
        const rp_report_policy *p = &r->policies[i];
        if (!report_charted(p) || !p->expert_layer) continue;
        double sum = 0, top = 0;
        for (int32_t g = 0; g < G; g++) {
            double v = gpu_total(r, p, g) * 1e3, x = f.x0 + g * slot + (slot - group) / 2 + k * bw;
            double y = svg_px_y(&f, v);
            sum += v;
            top = fmax(top, v);
            text_put(b, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"><title>",
                x, y, bw > 1.5 ? bw - 0.5 : bw, svg_px_y(&f, 0) - y, svg_colour(i));
            svg_text(b, p->label);
            text_put(b, ", GPU %d: %.4f ms</title></rect>\n", g, v);
        }
        double mean = sum / G;
        snprintf(labels[k], sizeof labels[k], "%s (max/mean %.3f)", p->label, mean > 0 ? top / mean : 1.0);
        lp[k] = labels[k];
        cp[k] = svg_colour(i);
        k++;
    }
    for (int32_t g = 0; g < G; g += every)
        text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
            f.x0 + (g + 0.5) * slot, f.y0 + f.h + 18, g);
    svg_x_title(b, &f, "GPU");
    if (!b->failed) svg_legend(b, f.x0, f.y0 + f.h + 62, f.w, k, lp, cp, NULL, false);
    text_put(b, "</svg>\n");
    rp_free(b->ctx, labels);
    rp_free(b->ctx, lp);
    rp_free(b->ctx, cp);
}

/* Diverging colour of a load relative to its layer's mean: white at the mean, blue below
 * (idle GPUs), red above (the GPUs every other one waits for), saturating at 0 and 2. */
static void heat_colour(double v, char out[8])
{
    double t = fmin(fmax(v - 1, -1), 1);
    /* from white to #2166AC (below) or #B2182B (above) */
    int r = 255, g = 255, b = 255;
    if (t < 0) r = (int)lround(255 + (0x21 - 255) * -t), g = (int)lround(255 + (0x66 - 255) * -t),
               b = (int)lround(255 + (0xAC - 255) * -t);
    else r = (int)lround(255 + (0xB2 - 255) * t), g = (int)lround(255 + (0x18 - 255) * t),
         b = (int)lround(255 + (0x2B - 255) * t);
    snprintf(out, 8, "#%02X%02X%02X", r, g, b);
}

static void put_heatmap(text_buf *b, const rp_report *r, int i)
{
    const rp_report_policy *p = &r->policies[i];
    const int32_t G = r->num_gpus, L = r->num_layers;
    const double W = 1120, x0 = 60, w = W - x0 - 20, cw = w / G;
    const double ch = fmin(8, fmax(2, 360.0 / L)), y0 = 44, h = ch * L;
    /* the policy's figure: the mean over layers of max / mean across GPUs */
    double imb = 0, hottest = 0;
    int32_t hot_g = 0, hot_l = 0;
    for (int32_t l = 0; l < L; l++) {
        const double *row = p->expert_layer + (size_t)l * G;
        double sum = 0, top = 0;
        for (int32_t g = 0; g < G; g++) sum += row[g], top = fmax(top, row[g]);
        double mean = sum / G;
        imb += mean > 0 ? top / mean : 1;
        for (int32_t g = 0; mean > 0 && g < G; g++)
            if (row[g] / mean > hottest) hottest = row[g] / mean, hot_g = g, hot_l = l;
    }
    imb /= L;
    const double H = y0 + h + 30;
    text_put(b, "<svg width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" role=\"img\" aria-label=\"", W, H,
            W, H);
    svg_text(b, p->label);
    text_put(b, ": expert load heatmap\">\n<rect x=\"0\" y=\"4\" width=\"10\" height=\"14\" fill=\"%s\"/>"
               "<text class=\"title\" x=\"16\" y=\"16\">", svg_colour(i));
    svg_text(b, p->label);
    text_put(b, "</text>\n<text class=\"note\" x=\"16\" y=\"34\">max / mean across GPUs %.3f (mean over layers); "
               "hottest cell GPU %d, layer %d at %.2f&times; its layer's mean</text>\n",
            imb, hot_g, hot_l, hottest);
    for (int32_t l = 0; l < L; l++) {
        const double *row = p->expert_layer + (size_t)l * G;
        double sum = 0;
        for (int32_t g = 0; g < G; g++) sum += row[g];
        double mean = sum / G;
        for (int32_t g = 0; g < G; g++) {
            char c[8];
            heat_colour(mean > 0 ? row[g] / mean : 1, c);
            text_put(b, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"/>", x0 + g * cw,
                    y0 + l * ch, cw + 0.05, ch + 0.05, c);
        }
        text_put(b, "\n");
    }
    /* EP groups (solid) and nodes (dotted) as column separators */
    for (int32_t g = 1; g < G; g++) {
        bool group = r->ep_size > 0 && r->ep_size < G && g % r->ep_size == 0;
        bool node = r->gpus_per_node > 0 && r->gpus_per_node < G && g % r->gpus_per_node == 0;
        if (group || node)
            text_put(b, "<line x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" stroke=\"#555\" stroke-width=\"%s\"%s/>",
                    x0 + g * cw, y0, x0 + g * cw, y0 + h, group ? "1" : "0.7",
                    group ? "" : " stroke-dasharray=\"2 2\"");
    }
    text_put(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>\n", x0, y0, w, h);
    int every = G <= 64 ? 8 : G <= 128 ? 16 : 32;
    for (int32_t g = 0; g < G; g += every)
        text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>",
                x0 + (g + 0.5) * cw, y0 + h + 16, g);
    int lev = L <= 16 ? 4 : L <= 64 ? 8 : 16;
    for (int32_t l = 0; l < L; l += lev)
        text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%d</text>", x0 - 6,
                y0 + (l + 0.5) * ch + 4, l);
    text_put(b, "\n<text class=\"axis\" transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">"
               "layer</text>\n</svg>\n", x0 - 40, y0 + h / 2);
}

static void put_heat_scale(text_buf *b)
{
    text_put(b, "<svg width=\"1120\" height=\"46\" viewBox=\"0 0 1120 46\" role=\"img\" "
               "aria-label=\"heatmap colour scale\">\n");
    const double x0 = 60, w = 400;
    for (int k = 0; k < 40; k++) {
        char c[8];
        heat_colour(2.0 * (k + 0.5) / 40, c);
        text_put(b, "<rect x=\"%.1f\" y=\"6\" width=\"%.2f\" height=\"14\" fill=\"%s\"/>", x0 + k * w / 40,
                w / 40 + 0.05, c);
    }
    const char *label[3] = {"0 (idle)", "1 = the layer's mean", "2 or more"};
    for (int k = 0; k < 3; k++)
        text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"36\" text-anchor=\"%s\">%s</text>", x0 + k * w / 2,
                k == 0 ? "start" : k == 1 ? "middle" : "end", label[k]);
    text_put(b, "\n<text class=\"legend\" x=\"%.1f\" y=\"18\">a GPU's expert time at a layer / the mean over "
               "the GPUs at that layer</text>\n</svg>\n", x0 + w + 20);
}

static void put_load_heatmaps(text_buf *b, const rp_report *r)
{
    int n = 0;
    for (int i = 0; i < r->num_policies; i++) n += report_charted(&r->policies[i]) && r->policies[i].expert_layer;
    if (n == 0) return;
    text_put(b, "<h2>Expert load per GPU and layer, step %lld</h2>\n<p>At step %lld, the worst step overall (the "
               "largest step / lower bound averaged over the policies): for each policy, the forward expert "
               "time of every GPU at every layer (summed over the step's microbatches, as the cost model "
               "prices it: replica splits, token shares and GPU speed included), against that layer's mean "
               "over the GPUs. A red cell is a GPU the others wait for at that layer; an even, pale map is "
               "a balanced placement. Solid lines separate EP groups, dotted lines nodes.</p>\n",
            (long long)r->load_step, (long long)r->load_step);
    put_heat_scale(b);
    for (int i = 0; i < r->num_policies; i++)
        if (report_charted(&r->policies[i]) && r->policies[i].expert_layer) put_heatmap(b, r, i);
}

void report_expert_load(text_buf *b, const rp_report *r)
{
    if (r->num_layers < 1) return;
    if (r->num_gpus <= 32) put_load_bars(b, r);
    else put_load_heatmaps(b, r);
}
