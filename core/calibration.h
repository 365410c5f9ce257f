/* Reading calibration.json, the hardware figures a device run measured per model shape
 * (python/routepack/calibrate.py writes it; docs/calibration.md). Private to the
 * config reader, which applies the figures to the hardware keys a config leaves out. */
#ifndef RP_CALIBRATION_H
#define RP_CALIBRATION_H
#include "internal.h"
#include "routepack/config.h"

#include <jansson.h>

#define RP_CALIBRATION_FORMAT "routepack-calibration"
#define RP_CALIBRATION_VERSION 1

/* One shape's figures; the curves are owned (calib_shape_free). */
typedef struct calib_shape {
    double peak_flops;           /* what the efficiencies are fractions of */
    rp_eff_point *gemm;          /* grouped expert GEMM, forward, by tokens per expert */
    int32_t num_gemm;
    rp_eff_point *attention;     /* varlen attention, forward, by sequence length */
    int32_t num_attention;
    double dense_efficiency;
    double backward_attention, backward_projections, backward_experts;
    double hbm_bytes_per_s;
    double layer_fixed_s;
    /* the grouped GEMM's figures (optional: files written before them load without) */
    int32_t gemm_tile_rows;      /* 0: not in the file */
    rp_eff_point *grouped;       /* by a GPU's total padded rows; NULL: not in the file */
    int32_t num_grouped;
    rp_eff_point *wgrad;         /* weight-gradient GEMMs by one expert's padded rows */
    int32_t num_wgrad;
    double backward_experts_dgrad; /* < 0: not in the file */
} calib_shape;

/* The file's links (top-level "links": what `routepack.calibrate --links N` measured
 * between N ranks of this machine, as GPUs of one node); present false when absent. */
typedef struct calib_links {
    bool present;
    double bytes_per_s; /* one rank's all-to-all bandwidth */
    double latency_s;   /* one message's */
} calib_links;

/* Where the config keeps the curves it owns (calib_apply moves the file's there). */
typedef struct calib_stores {
    rp_eff_point **gemm, **attention, **grouped, **wgrad;
} calib_stores;

/* "d<hidden>_f<ffn>_h<heads>_kv<kv heads>_dh<head dim>" of a model into buf. */
const char *calib_shape_key(char *buf, size_t size, const rp_model *model);

/* Read the calibration file at `path`, check all of it (format, version, every
 * entry's keys, types and ranges: the same rules as the config's hardware keys), and
 * return the entry whose key is `shape_key` in *out. Errors name the file (and
 * line:column of a bad value): RP_EIO when it cannot be read, RP_EFORMAT for bad JSON,
 * another format or version, RP_EINVAL/RP_ERANGE for an unknown key or a bad value, and
 * RP_EINVAL when no entry has `shape_key` (the message lists the shapes the file has).
 * The file's links, checked alike, go to *links (NULL: not wanted). On error *out and
 * *links are untouched. */
rp_status calib_read(rp_context *ctx, const char *path, const char *shape_key, calib_shape *out,
                     calib_links *links, rp_error *err);
void calib_shape_free(rp_context *ctx, calib_shape *shape);

/* Fill the fields of `h` whose keys the config's `hardware` object (NULL: none) does
 * not set from `shape` (read from `path`): gemm_efficiency, attention_efficiency,
 * dense_efficiency, hbm_bytes_per_s, layer_fixed_us, the grouped GEMM's gemm_tile_rows,
 * grouped_gemm_efficiency and wgrad_efficiency where the file has them, and
 * backward.attention / .projections / .experts (and .experts_dgrad where the file has
 * it) unless backward_multiplier (which sets every compute term) or that term in
 * `backward` is given. The curves move into `stores` (the config's storage; what was
 * there is freed) and out of `shape`. The entry's peak_flops must equal h->peak_flops, since its efficiencies
 * are fractions of it: RP_EINVAL naming both otherwise, and then nothing changes. */
rp_status calib_apply(rp_context *ctx, const char *path, const char *shape_key, calib_shape *shape,
                      json_t *hardware, rp_hardware *h, calib_stores stores, rp_error *err);

/* Set the topology's nvlink_bytes_per_s and nvlink_latency_us from the file's links
 * where the config's `topology` object does not give them. */
void calib_apply_links(const calib_links *links, json_t *topology, rp_topology *t);

#endif
