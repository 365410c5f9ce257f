/* Drawing helpers of the HTML report (core/report_*.c), which writes into a text_buf
 * (textbuf.h): escaped text, policy and side colours, axis ticks, plot frames, axes and
 * legends. Internal. */
#ifndef RP_REPORT_SVG_H
#define RP_REPORT_SVG_H

#include "internal.h"
#include "textbuf.h"

#include <stdbool.h>
#include <stddef.h>

/* Text with &, <, >, " escaped (for element content and attribute values). */
void svg_text(text_buf *b, const char *s);

extern const char *const svg_side_label[4];
extern const char *const svg_side_colour[4];
const char *svg_colour(int policy);
const char *svg_dash(int policy);

/* Axis ticks at 1, 2 or 5 times a power of ten, covering [lo, hi] with at most about
 * `target` intervals. */
typedef struct svg_ticks {
    double lo, hi, step;
    int decimals;
} svg_ticks;
svg_ticks svg_ticks_for(double lo, double hi, int target);

/* A plot area inside an SVG, with its value ranges. */
typedef struct svg_frame {
    double x0, y0, w, h; /* pixels: top-left corner and size */
    double xlo, xhi;     /* value range of x (bar charts: slots) */
    svg_ticks y;
} svg_frame;
double svg_px_y(const svg_frame *f, double v);
double svg_px_x(const svg_frame *f, double v);

/* Y grid lines with labels, the axis title (rotated), and the frame's border. */
void svg_y_axis(text_buf *b, const svg_frame *f, const char *title);
void svg_x_title(text_buf *b, const svg_frame *f, const char *title);
/* A legend of swatches (or line samples) laid out in rows from (x, y), each item as wide as
 * the longest label needs (no label runs into the next); returns the height used. */
double svg_legend(text_buf *b, double x, double y, double width, int n, const char *const *labels,
                  const char *const *colours, const char *const *dashes, bool lines);
/* The rows svg_legend takes for n labels of at most max_chars characters in `width`: what a
 * chart's height must leave room for. */
int svg_legend_rows(double width, int n, size_t max_chars);

#endif
