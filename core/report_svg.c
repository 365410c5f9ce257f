/* Drawing helpers of the HTML report: see report_svg.h. */
#include "report_svg.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Okabe-Ito colours (distinguishable with colour-vision deficiencies), then four of Paul
 * Tol's muted scheme and grey: the shipped default runs 9 policies, every one its own
 * colour. */
static const char *const policy_colour[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
                                            "#000000", "#882255", "#44AA99", "#999933", "#332288", "#999999"};
#define NUM_POLICY_COLOURS 12
/* Line dashes for the 13th policy on, so lines stay apart once colours repeat. */
static const char *const policy_dash[] = {"", "6 3", "2 3", "8 3 2 3"};

const char *const svg_side_label[4] = {"attention", "dispatch", "expert", "combine"};
const char *const svg_side_colour[4] = {"#4E79A7", "#F28E2B", "#59A14F", "#B07AA1"};

void svg_text(text_buf *b, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '&': text_put(b, "&amp;"); break;
        case '<': text_put(b, "&lt;"); break;
        case '>': text_put(b, "&gt;"); break;
        case '"': text_put(b, "&quot;"); break;
        default: text_put(b, "%c", *s);
        }
    }
}

const char *svg_colour(int i)
{
    return policy_colour[i % NUM_POLICY_COLOURS];
}

const char *svg_dash(int i)
{
    return policy_dash[(i / NUM_POLICY_COLOURS) % 4];
}

svg_ticks svg_ticks_for(double lo, double hi, int target)
{
    svg_ticks t;
    if (!(hi > lo)) hi = lo + (lo != 0 ? fabs(lo) * 0.1 : 1);
    double raw = (hi - lo) / target, mag = pow(10, floor(log10(raw))), f = raw / mag;
    t.step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
    t.lo = floor(lo / t.step + 1e-9) * t.step;
    t.hi = ceil(hi / t.step - 1e-9) * t.step;
    if (t.hi <= t.lo) t.hi = t.lo + t.step;
    int d = (int)-floor(log10(t.step) + 1e-9);
    t.decimals = d > 0 ? d : 0;
    return t;
}

double svg_px_y(const svg_frame *f, double v)
{
    return f->y0 + f->h - (v - f->y.lo) / (f->y.hi - f->y.lo) * f->h;
}

double svg_px_x(const svg_frame *f, double v)
{
    if (f->xhi == f->xlo) return f->x0 + f->w / 2;
    return f->x0 + (v - f->xlo) / (f->xhi - f->xlo) * f->w;
}

void svg_y_axis(text_buf *b, const svg_frame *f, const char *title)
{
    int n = (int)llround((f->y.hi - f->y.lo) / f->y.step);
    for (int i = 0; i <= n; i++) {
        double v = f->y.lo + i * f->y.step, y = svg_px_y(f, v);
        text_put(b, "<line class=\"grid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", f->x0, y,
            f->x0 + f->w, y);
        text_put(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.*f</text>\n",
            f->x0 - 6, y + 4, f->y.decimals, v);
    }
    text_put(b, "<text class=\"axis\" transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">",
        f->x0 - 52, f->y0 + f->h / 2);
    svg_text(b, title);
    text_put(b, "</text>\n");
    text_put(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>\n", f->x0, f->y0,
        f->w, f->h);
}

void svg_x_title(text_buf *b, const svg_frame *f, const char *title)
{
    text_put(b, "<text class=\"axis\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">", f->x0 + f->w / 2,
        f->y0 + f->h + 40);
    svg_text(b, title);
    text_put(b, "</text>\n");
}

/* 13 px legend text: about 7.5 px a character at most for these fonts (names are mostly
 * lower case, '_' and '+'), after the 34 px sample, and a gap before the next item. */
static double legend_item_width(size_t max_chars)
{
    double w = 34 + 7.5 * (double)max_chars + 20;
    return w > 270 ? w : 270;
}

int svg_legend_rows(double width, int n, size_t max_chars)
{
    int per_row = (int)(width / legend_item_width(max_chars));
    if (per_row < 1) per_row = 1;
    return (n + per_row - 1) / per_row;
}

double svg_legend(text_buf *b, double x, double y, double width, int n, const char *const *labels,
                         const char *const *colours, const char *const *dashes, bool lines)
{
    size_t longest = 0;
    for (int i = 0; i < n; i++) longest = strlen(labels[i]) > longest ? strlen(labels[i]) : longest;
    const double item_w = legend_item_width(longest), row_h = 22;
    int per_row = (int)(width / item_w);
    if (per_row < 1) per_row = 1;
    for (int i = 0; i < n; i++) {
        double ix = x + (i % per_row) * item_w, iy = y + (i / per_row) * row_h;
        if (lines)
            text_put(b, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2.5\"%s%s%s/>"
                   "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>",
                ix, iy, ix + 26, iy, colours[i], dashes && dashes[i][0] ? " stroke-dasharray=\"" : "",
                dashes && dashes[i][0] ? dashes[i] : "", dashes && dashes[i][0] ? "\"" : "", ix + 13, iy,
                colours[i]);
        else
            text_put(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"14\" height=\"14\" fill=\"%s\"/>", ix + 6, iy - 7,
                colours[i]);
        text_put(b, "<text class=\"legend\" x=\"%.1f\" y=\"%.1f\">", ix + 34, iy + 4);
        svg_text(b, labels[i]);
        text_put(b, "</text>\n");
    }
    return ((n + per_row - 1) / per_row) * row_h;
}
